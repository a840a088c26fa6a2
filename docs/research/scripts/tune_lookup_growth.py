"""Tuning experiment (not a test): does letting a trusted prompt-lookup branch grow pay, and up to how long?

Runs plain greedy generation, transformers' prompt lookup and the `tree+lookup` setting of a drafter with
`lookup_max_tokens` = each value given (`none` = fixed length), interleaved prompt by prompt in one process, in
bfloat16, and prints tokens/s per prompt and the speedup over plain generation per domain. Use training prompts, not
the evaluation set:

    python docs/research/scripts/tune_lookup_growth.py --prompts docs/research/results/tuning/prompts.jsonl --max-tokens none,20,32,48

Outputs differ between arms where bf16 near-ties flip (see docs/bench.md), so a prompt's figure can move with its
text; the round counts printed next to each ChainFlow figure show when they did.
"""

import argparse
import collections
import json
import time

import torch

import hf_chainflow  # noqa: F401  (installs the generate hook)
from hf_chainflow import ChainFlowDrafter
from hf_chainflow.checkpoints import default_drafter_path
from hf_chainflow.targets import load_target


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", required=True, help="JSONL with domain and prompt")
    parser.add_argument("--drafter", default=None, help="drafter directory (default: the shipped one)")
    parser.add_argument("--max-tokens", default="none,20,32", help="comma-separated lookup_max_tokens values")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    variants = [None if v.strip() == "none" else int(v) for v in args.max_tokens.split(",")]

    model, tok = load_target("smollm2-135m-instruct", dtype=torch.bfloat16)
    drafter = ChainFlowDrafter.from_pretrained(args.drafter or str(default_drafter_path()), target=model).eval()
    g = drafter.generation_config
    rows = [json.loads(line) for line in open(args.prompts)]

    def encode(text):
        ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                      return_tensors="pt")
        return ids if torch.is_tensor(ids) else ids["input_ids"]

    arms = ["ar", "pld"] + [f"max={v}" for v in variants]
    warm = encode(rows[0]["prompt"])
    model.generate(warm, max_new_tokens=16, do_sample=False)
    model.generate(warm, max_new_tokens=16, do_sample=False, assistant_model=drafter)
    totals = {arm: collections.defaultdict(lambda: [0, 0.0]) for arm in arms}  # arm -> domain -> [tokens, s]
    for row in rows:
        ids = encode(row["prompt"])
        line = f"{row['domain']:7s} L={ids.shape[1]:5d}"
        for arm, variant in zip(arms, [None, None] + variants):
            kwargs = {"max_new_tokens": args.max_new_tokens, "do_sample": False}
            if arm == "pld":
                kwargs["prompt_lookup_num_tokens"] = 10
            elif arm != "ar":
                g.lookup_max_tokens = variant
                kwargs["assistant_model"] = drafter
            start = time.perf_counter()
            out = model.generate(ids, **kwargs)
            seconds = time.perf_counter() - start
            new = out.shape[1] - ids.shape[1]
            for key in (row["domain"], "ALL"):
                totals[arm][key][0] += new
                totals[arm][key][1] += seconds
            line += f" | {arm} {new / seconds:5.1f}" + (f" ({drafter.last_stats.rounds} rounds)" if arm.startswith("max") else "")
        print(line, flush=True)
    domains = sorted(totals["ar"])
    print("\nspeedup over ar (tokens/s ratio), per domain")
    for arm in arms:
        ratios = " ".join(f"{d}:{(totals[arm][d][0] / totals[arm][d][1]) / (totals['ar'][d][0] / totals['ar'][d][1]):.2f}"
                          for d in domains)
        print(f"{arm:10s} {ratios}")


if __name__ == "__main__":
    main()
