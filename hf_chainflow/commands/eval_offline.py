"""`hf-chainflow eval-offline`: the offline acceptance length tau of a drafter on prepared windows.

    hf-chainflow eval-offline --drafter DRAFTER_DIR --data HELD_OUT_DIR --out REPORT_DIR [--tree 8x4]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from hf_chainflow.cli_args import check_model_source, check_output_dir, parse_shards, positive_int, usage_error


def add_eval_offline_parser(sub) -> None:
    p = sub.add_parser("eval-offline", help="Offline acceptance length tau of a drafter on prepared windows.",
                       description="Greedy chain (and optionally tree) drafts from exactly what the serving loop "
                                   "gives the drafter, compared with the target's own next tokens.")
    a = p.add_argument
    a("--drafter", required=True, help="drafter directory (save_pretrained)")
    a("--adapter", help="LoRA adapter directory to apply on the drafter")
    a("--target", default="smollm2-135m-instruct", help="known target name or local model directory")
    a("--data", required=True, help="prepared data directory (held-out prompts)")
    a("--out", help="report directory (offline_eval.json, acceptance.png)")
    a("--num-tokens", type=positive_int, default=3, help="chain length k (serving num_assistant_tokens)")
    a("--tree", help="also evaluate trees WIDTHxDEPTH, e.g. 8x4 (per window, slower)")
    a("--tree-budget", type=positive_int, help="keep this many nodes of each tree (highest path probability; default: all)")
    a("--max-tree-windows", type=positive_int, default=512, help="evaluate trees on at most this many windows")
    a("--num-flow-steps", type=positive_int, help="Euler steps (default: the drafter's serving setting)")
    a("--batch-size", type=positive_int, default=64, help="windows per batched drafter pass")
    a("--max-windows", type=positive_int, help="evaluate a seeded random subset of this many windows")
    a("--shards", type=parse_shards, help="evaluate only these finished shards, e.g. a held-out `7-25`")
    a("--reference", action="store_true", help="one drafting.draft call per window instead of the batched path")
    a("--walk-sequences", type=positive_int, help="also replay the serving walk on this many responses (seeded): the tau a "
                                         "serving loop would measure on them (draft, accept a, jump a + 1 tokens)")
    a("--dtype", choices=("float32", "bfloat16"), default="float32")
    a("--threads", type=positive_int, help="torch.set_num_threads")
    a("--seed", type=int, default=0, help="seed of the window subsets and the walk's responses")
    p.set_defaults(func=run_eval_offline)


def _tree_shape(text: str) -> tuple[int, int]:
    try:
        width, depth = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise usage_error("eval-offline", f"--tree must look like WIDTHxDEPTH (e.g. 8x4), got {text!r}.") from None
    if width < 1 or depth < 1:
        raise usage_error("eval-offline", f"--tree needs a positive width and depth (e.g. 8x4), got {text!r}.")
    return width, depth


def run_eval_offline(args: argparse.Namespace) -> int:
    tree = _tree_shape(args.tree) if args.tree else None
    if args.tree_budget is not None and tree is None:
        raise usage_error("eval-offline", f"--tree-budget {args.tree_budget} cuts the trees of --tree; give --tree too "
                          f"(e.g. --tree 8x4).")
    check_model_source("--drafter", args.drafter)
    if args.adapter is not None and not Path(args.adapter).is_dir():
        raise ValueError(f"`--adapter` must be a LoRA adapter directory, got {args.adapter!r}, which does not exist.")
    check_output_dir("--out", args.out)
    import torch

    from hf_chainflow.training.prepared_data import check_prepared_data
    from hf_chainflow.training.workflows import evaluate_drafter

    check_prepared_data(args.data, shards=args.shards)  # its manifest, shortlist and shards, before any model loads

    if args.threads:
        torch.set_num_threads(args.threads)
    result = evaluate_drafter(args.drafter, args.data, target=args.target, adapter=args.adapter, dtype=args.dtype,
                              shards=args.shards, out=args.out, num_tokens=args.num_tokens,
                              batch_size=args.batch_size, max_windows=args.max_windows, tree=tree,
                              tree_budget=args.tree_budget, max_tree_windows=args.max_tree_windows,
                              num_flow_steps=args.num_flow_steps, batched=not args.reference,
                              walk_sequences=args.walk_sequences, seed=args.seed)
    acc = " ".join(f"{a:.3f}" if a == a else "-" for a in result["acceptance"])  # NaN: no window reached it
    print(f"tau {result['tau']:.3f} over {result['num_windows']} windows (chain k={args.num_tokens}); acc@i {acc}")
    for name, stats in result["per_domain"].items():
        print(f"  {name:>12}: tau {stats['tau']:.3f} ({stats['num_windows']} windows)")
    if "tree" in result:
        budget = f" (budget {args.tree_budget} nodes)" if args.tree_budget else ""
        print(f"tree {args.tree}{budget}: tau {result['tree']['tau']:.3f} over {result['tree']['num_windows']} windows")
    for mode, walk in ((m, result["walk"][m]) for m in ("chain", "tree") if m in result.get("walk", {})):
        domains = ", ".join(f"{name} {stats['tau']:.3f}" for name, stats in walk["per_domain"].items())
        print(f"serving walk, {mode}: tau {walk['tau']:.3f} over {walk['rounds']} rounds of "
              f"{result['walk']['num_sequences']} responses ({domains})")
    return 0


__all__ = ["add_eval_offline_parser", "run_eval_offline"]
