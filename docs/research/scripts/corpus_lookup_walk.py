"""Analysis (not a test): how far would looked-up branches alone carry the target's held-out responses?

Builds the continuation table of the corpus's training responses (`hf_chainflow.training.corpus_lookup.table_from_corpus`)
and walks every held-out response as a serving loop would without a drafter: at each position propose prompt
lookup's branch (`hf_chainflow.generation.prompt_lookup.prompt_lookup`, K tokens, n-grams 3..1), the table's branch (K tokens), or
both (the longer accepted prefix counts), accept the matching prefix a, jump a + 1 tokens. Prints tau (tokens per
round) for each. No model is loaded: the responses are the target's greedy tokens.

    python docs/research/scripts/corpus_lookup_walk.py --corpus corpus/smollm2-135m-instruct --tokens 10
"""

import argparse
import time

import torch

from hf_chainflow.training.corpus import ResponseCorpus
from hf_chainflow.training.corpus_lookup import table_from_corpus
from hf_chainflow.generation.prompt_lookup import prompt_lookup


def accepted(proposal, truth) -> int:
    n = 0
    for p, t in zip(proposal.tolist() if proposal is not None else [], truth):
        if p != t:
            break
        n += 1
    return n


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus", default="corpus/smollm2-135m-instruct")
    parser.add_argument("--tokens", type=int, default=10, help="branch length K")
    parser.add_argument("--prompt-tail", type=int, default=4)
    parser.add_argument("--min-count", type=int, default=2)
    args = parser.parse_args()
    start = time.perf_counter()
    table = table_from_corpus(args.corpus, prompt_tail=args.prompt_tail, min_count=args.min_count)
    print(f"table: {len(table):,} n-grams ({table.min_ngram}-{table.max_ngram}) in {time.perf_counter() - start:.1f} s")
    rows = ResponseCorpus(args.corpus).table("heldout", ["prompt_ids", "response_ids"]).to_pylist()
    rounds = {"prompt lookup": 0, "corpus lookup": 0, "both": 0}
    tokens = 0
    for row in rows:
        prompt, response = row["prompt_ids"], row["response_ids"]
        full = torch.tensor(prompt + response)
        for name in rounds:
            i = 0
            while i < len(response):
                committed, truth = full[: len(prompt) + i], response[i:]
                a = 0
                if name != "corpus lookup":
                    a = accepted(prompt_lookup(committed, args.tokens, 3)[0], truth)
                if name != "prompt lookup":
                    a = max(a, accepted(table.propose(committed, args.tokens), truth))
                i += a + 1
                rounds[name] += 1
        tokens += len(response)
    for name, n in rounds.items():
        print(f"{name:14s} tau {tokens / n:.3f} ({len(rows)} held-out responses, {tokens:,} tokens)")


if __name__ == "__main__":
    main()
