"""Throughput of forward-only data: the target's forward over text it did not write, with and without its labels.

Takes `--sequences` training prompts (not the corpus's held-out ones), formats each as `hf-chainflow prepare
--prompt-text chat` does (`hf_chainflow.training.prompts.text_ids`), and times, on the same sequences and batches:

- `forward`: `hf_chainflow.training.hidden_states.target_hidden_states` (the prepare pass: every hidden state, no logits);
- `forward+labels`: the same plus the target's argmax at every position (`target_argmax`, what `--target-labels`
  adds);

in each of `--dtypes`, `--repeats` times in interleaved order (on a shared machine the load drifts), and prints
tokens forwarded per second, each run and the median. A warm-up batch runs first in each dtype, untimed.

    python docs/research/scripts/forward_only_throughput.py --prompts ../shared/data/prompts/train.jsonl \\
        --exclude-heldout corpus/smollm2-135m-instruct --sequences 128 --repeats 3 --threads 1
"""

import argparse
import copy
import json
import random
import statistics
import time

import torch

from hf_chainflow.training.prompts import load_prompts, text_ids
from hf_chainflow.training.hidden_states import target_argmax, target_hidden_states
from hf_chainflow.targets import load_target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", required=True, help="JSONL of prompts (id, prompt)")
    parser.add_argument("--exclude-heldout", metavar="CORPUS", help="leave out this corpus's held-out prompt ids")
    parser.add_argument("--sequences", type=int, default=256, help="prompts to time (a seeded sample)")
    parser.add_argument("--dtypes", default="bfloat16,float32", help="comma-separated dtypes of the forward")
    parser.add_argument("--max-batch-tokens", type=int, default=4096, help="padded tokens per forward (prepare's)")
    parser.add_argument("--repeats", type=int, default=2, help="timed runs of each measurement")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="write the figures to this JSON file too")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = load_prompts(args.prompts)
    if args.exclude_heldout:
        from hf_chainflow.training.corpus import ResponseCorpus

        held = ResponseCorpus(args.exclude_heldout).ids("heldout")
        rows = [r for r in rows if r["id"] not in held]
    rows = random.Random(args.seed).sample(rows, args.sequences)
    target, tok = load_target()
    sequences = [sum(text_ids(tok, r["prompt"], "chat"), []) for r in rows]
    tokens = sum(len(s) for s in sequences)
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    result = {"sequences": len(sequences), "tokens": tokens, "threads": args.threads,
              "max_batch_tokens": args.max_batch_tokens, "tokens_per_second": {}}
    print(f"{len(sequences)} sequences, {tokens} tokens (mean {tokens / len(sequences):.1f}), "
          f"{args.threads} thread(s)")
    models = {dtype: copy.deepcopy(target).to(getattr(torch, dtype)) for dtype in args.dtypes.split(",")}
    runs = {f"{kind} {dtype}": [] for dtype in models for kind in ("forward", "forward+labels")}
    for _ in range(args.repeats):
        for name in runs:
            kind, dtype = name.split()
            model = models[dtype]
            target_hidden_states(model, sequences[:4], pad_token_id=pad)  # warm-up
            start = time.perf_counter()
            hidden = target_hidden_states(model, sequences, pad_token_id=pad, max_batch_tokens=args.max_batch_tokens)
            if kind == "forward+labels":
                for h in hidden:
                    target_argmax(model, h[0])
            seconds = time.perf_counter() - start
            runs[name].append(round(tokens / seconds, 1))
            print(f"{name}: {seconds:.1f} s, {tokens / seconds:.0f} tokens/s", flush=True)
    for name, values in runs.items():
        result["tokens_per_second"][name] = {"runs": values, "median": float(statistics.median(values))}
        print(f"{name}: median {statistics.median(values):.0f} tokens/s over {values}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
