"""Tuning experiment (not a test): does a corpus-lookup branch (`hf_chainflow.generation.corpus_lookup`) pay beside the shipped
`tree+lookup` setting, and in which rounds?

One bench run (`hf_chainflow.bench.run_bench`: arms interleaved prompt by prompt, outputs checked against plain
generation) in one dtype: plain generation, prompt lookup, the shipped drafter's `tree+lookup` setting, and the same
with a branch of up to K tokens read from a continuation table of the corpus's training responses (each K given;
`BUDGET:K` also cuts the tree to BUDGET nodes). Use prompts whose responses are not in
the table (the corpus's held-out prompts), not the evaluation set:

    python docs/research/scripts/tune_corpus_lookup.py --prompts heldout_prompts.jsonl --limit 40 \
        --dtype float32 --variants 6,8:6 --out runs/tune-corpus-lookup

Writes the bench's results.json / results.md / plots to --out.
"""

import argparse
import time

import torch

from hf_chainflow import ChainFlowDrafter
from hf_chainflow.bench import Arm, build_arms
from hf_chainflow.checkpoints import default_drafter_path
from hf_chainflow.generation import drafting
from hf_chainflow.training.corpus import ResponseCorpus
from hf_chainflow.generation.corpus_lookup import ContinuationTable
from hf_chainflow.targets import load_model_and_tokenizer
from tune_tree_budget import bench_variants  # this folder: the interleaved run and its report


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", required=True, help="JSONL with id, domain, prompt (held-out prompts)")
    parser.add_argument("--corpus", default="corpus/smollm2-135m-instruct", help="the corpus whose train split "
                        "fills the table")
    parser.add_argument("--limit", type=int, help="that many prompts, round-robin over domains (default: all)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="target dtype")
    parser.add_argument("--variants", default="10", help="comma-separated [BUDGET:]K: branch length K, the tree "
                        "cut to BUDGET nodes")
    parser.add_argument("--prompt-tail", type=int, default=4, help="prompt tokens kept before each response")
    parser.add_argument("--min-count", type=int, default=2)
    parser.add_argument("--min-ngram", default="2", help="shortest n-gram the table holds; several (e.g. 2,3): "
                        "one table each, every variant run with each")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", required=True, help="output directory")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    model, tokenizer = load_model_and_tokenizer("smollm2-135m-instruct", getattr(torch, args.dtype))
    start = time.perf_counter()
    rows = ResponseCorpus(args.corpus).table("train", ["prompt_ids", "response_ids"]).to_pylist()
    shortest = [int(n) for n in args.min_ngram.split(",")]
    drafters = {}  # one drafter a table: "chainflow" holds the first, "minN" the others
    for n in shortest:
        drafter = ChainFlowDrafter.from_pretrained(str(default_drafter_path()), target=model).eval()
        drafting.set_continuation_table(drafter, ContinuationTable.build(
            (r["prompt_ids"][-args.prompt_tail:] + r["response_ids"] for r in rows),
            vocab_size=model.config.vocab_size, min_count=args.min_count, min_ngram=n))
        drafters["chainflow" if not drafters else f"min{n}"] = drafter
        print(f"table {n}-4: {len(drafting.continuation_table(drafter)):,} n-grams from {len(rows):,} responses "
              f"({time.perf_counter() - start:.1f} s)", flush=True)
    g = drafter.generation_config
    tree_lookup = {"tree_width": g.tree_width, "tree_depth": g.tree_depth, "tree_budget": g.tree_budget,
                   "lookup_num_tokens": g.lookup_num_tokens, "lookup_trust_ngram": g.lookup_trust_ngram,
                   "lookup_max_tokens": g.lookup_max_tokens}
    arms = build_arms([args.dtype], {}, only=["ar", "pld"])
    arms.append(Arm("tree+lookup", "tree", args.dtype, "chainflow", dict(tree_lookup)))
    for name, n in zip(drafters, shortest):
        suffix = f"-min{n}" if len(shortest) > 1 else ""
        for v in args.variants.split(","):
            budget, _, k = v.rpartition(":")  # [BUDGET:]K
            arms.append(Arm(f"tree{budget}+lookup+corpus{k}{suffix}", "tree", args.dtype, name,
                            {**tree_lookup, "tree_budget": int(budget) if budget else g.tree_budget,
                             "corpus_lookup_num_tokens": int(k)}))
    bench_variants(model, tokenizer, drafters, arms, args,
                   {"variants": args.variants, "prompt_tail": args.prompt_tail, "min_count": args.min_count,
                    "min_ngram": shortest})

if __name__ == "__main__":
    main()
