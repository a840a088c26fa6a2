"""Serving-time ablations of a trained drafter, measured as offline acceptance length on held-out windows.

    python docs/research/scripts/ablations.py --drafter DIR --data DATA_DIR --shards 7-9 --out runs/ablations [--max-windows 3000]

Rows (one trained drafter, only what it is served with changes; training-time ablations, i.e. a drafter trained
per source / expert count / feedback setting, are beyond this CPU budget and not claimed here):
- source at serving: extrapolate (trained) / repeat / noise;
- serving flow steps: 1 / 2 / 4;
- token feedback: markov+path (trained) / markov only / none (heads switched off);
- tree shapes: offline tree tau for several `W x D`, and the 8x4 tree cut to its N most probable nodes.
Writes `ablations.json` and prints a Markdown table.
"""

import argparse
import copy
import json
from pathlib import Path

import torch

import hf_chainflow  # noqa: F401
from hf_chainflow import ChainFlowDrafter
from hf_chainflow.cli_train import parse_shards
from hf_chainflow.training.windows import ChainFlowWindowDataset
from hf_chainflow.training.evaluation import evaluate_offline
from hf_chainflow.targets import load_target


def variant(drafter, *, source=None, feedback=None):
    d = copy.deepcopy(drafter)
    d._bound = drafter._bound  # deepcopy of the borrowed target modules is not wanted
    d._draft_head_cache = None
    if source is not None:
        d.config.source = source
    if feedback in ("markov", "none"):
        d.path_head = None
    if feedback == "none":
        d.markov_head = None
    return d.eval()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drafter", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--shards", type=parse_shards, help="held-out shards")
    ap.add_argument("--out", default="runs/ablations")
    ap.add_argument("--max-windows", type=int, default=3000)
    ap.add_argument("--max-tree-windows", type=int, default=300)
    ap.add_argument("--num-tokens", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target, _ = load_target("smollm2-135m-instruct")
    drafter = ChainFlowDrafter.from_pretrained(args.drafter, target=target, dtype=torch.float32).eval()
    data = ChainFlowWindowDataset.for_drafter(args.data, drafter.config, shards=args.shards)
    common = dict(num_tokens=args.num_tokens, max_windows=args.max_windows, progress=False, seed=0)
    rows = []

    def run(group, name, d, **kw):
        torch.manual_seed(0)
        res = evaluate_offline(d, data, **{**common, **kw})
        row = {"group": group, "setting": name, "tau": res["tau"], "acceptance": res["acceptance"]}
        if "tree" in res:
            row["tree_tau"] = res["tree"]["tau"]
        rows.append(row)
        print(f"| {group} | {name} | {row.get('tree_tau', row['tau']):.3f} | "
              f"{', '.join(f'{a:.2f}' for a in res['acceptance'])} |", flush=True)

    print(f"| ablation | setting | offline tau (chain {args.num_tokens}, or tree) | acc@i |\n|---|---|---|---|")
    for source in ("extrapolate", "repeat", "noise"):
        run("source (serving)", source + (" (trained)" if source == drafter.config.source else ""), variant(drafter, source=source))
    for steps in (1, 2, 4):
        run("flow steps (serving)", str(steps), drafter, num_flow_steps=steps)
    for fb in ("markov+path", "markov", "none"):
        run("token feedback", fb, variant(drafter, feedback=fb))
    for shape in ((1, 4), (4, 4), (8, 4), (16, 4), (8, 6)):
        run("tree shape", f"{shape[0]}x{shape[1]}", drafter, tree=shape, max_tree_windows=args.max_tree_windows)
    for budget in (4, 8, 12, 16, 24):  # the `budget` most probable nodes of the 8x4 tree (verify budget + 1 tokens)
        run("tree budget (8x4)", f"{budget} nodes", drafter, tree=(8, 4), tree_budget=budget,
            max_tree_windows=args.max_tree_windows)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "ablations.json").write_text(json.dumps({"drafter": args.drafter, "shards": args.shards,
                                                    "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
