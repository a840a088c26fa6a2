"""Tuning experiment (not a test): which tree budget pays for the shipped `tree+lookup` setting on this machine?

One bench run (`hf_chainflow.bench.run_bench`: arms interleaved prompt by prompt, outputs checked against plain
generation) in one dtype with plain generation, prompt lookup and the shipped drafter's `tree+lookup` setting cut to
each budget given (the 8x4 tree's most probable nodes; lookup settings from the drafter's generation config). Use
training prompts, not the evaluation set:

    python docs/research/scripts/tune_tree_budget.py --prompts docs/research/results/tuning/prompts.jsonl \
        --dtype float32 --budgets 4,6,8,12,16 --out runs/tune-tree-budget

Writes the bench's results.json / results.md / plots to --out.
"""

import argparse

import torch

from hf_chainflow import ChainFlowDrafter
from hf_chainflow.bench import (Arm, build_arms, choose_prompts, run_bench, tokenize_prompts, warm_up_arms,
                                write_results)
from hf_chainflow.checkpoints import default_drafter_path
from hf_chainflow.targets import load_model_and_tokenizer


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", required=True, help="JSONL with id, domain, prompt (training prompts)")
    parser.add_argument("--limit", type=int, help="that many prompts, round-robin over domains (default: all)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="target dtype")
    parser.add_argument("--budgets", default="6,8,12", help="comma-separated tree budgets (nodes kept)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", required=True, help="output directory")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    budgets = [int(b) for b in args.budgets.split(",")]

    model, tokenizer = load_model_and_tokenizer("smollm2-135m-instruct", getattr(torch, args.dtype))
    drafter = ChainFlowDrafter.from_pretrained(str(default_drafter_path()), target=model).eval()
    g = drafter.generation_config
    lookup = {"lookup_num_tokens": g.lookup_num_tokens, "lookup_trust_ngram": g.lookup_trust_ngram,
              "lookup_max_tokens": g.lookup_max_tokens}
    arms = build_arms([args.dtype], {}, only=["ar", "pld"])
    arms += [Arm(f"tree+lookup-b{b}", "tree", args.dtype, "chainflow",
                 {"tree_width": g.tree_width, "tree_depth": g.tree_depth, "tree_budget": b, **lookup}) for b in budgets]
    bench_variants(model, tokenizer, {"chainflow": drafter}, arms, args, {"budgets": budgets})


def bench_variants(model, tokenizer, drafters: dict, arms, args, settings: dict) -> dict:
    """One interleaved bench run of `arms` (the arms of `drafters`, name -> drafter, compiled and warmed up first) on
    `args.limit` prompts of `args.prompts` in `args.dtype`; writes to `args.out`, prints each arm's speedup and τ
    (also used by tune_corpus_lookup.py)."""
    drafters = {name: {args.dtype: d} for name, d in drafters.items()}
    drafting = warm_up_arms(arms, drafters, True)
    chosen, warm = choose_prompts(args.prompts, args.limit)
    gen = model.generation_config
    results = run_bench({args.dtype: model}, tokenize_prompts(tokenizer, chosen), arms, drafters,
                        max_new_tokens=args.max_new_tokens, warmup=tokenize_prompts(tokenizer, [warm])[0],
                        eos_token_id=gen.eos_token_id, pad_token_id=gen.pad_token_id, decode=tokenizer.decode,
                        settings={"prompts": args.prompts, "drafting": drafting, "threads": torch.get_num_threads(),
                                  **settings})
    write_results(results, args.out)
    for key, arm in results["arms"].items():
        print(f"{key:32s} {arm['speedup']:.2f}x  tau {arm['tau']:.2f}")
    return results


if __name__ == "__main__":
    main()
