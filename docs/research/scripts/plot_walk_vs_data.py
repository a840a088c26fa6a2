"""Held-out serving-walk tau against the number of target responses a drafter was trained on, with a log-linear fit
extended to a bar per drafting mode (the walk tau a speed target needs).  Prints each fit and where it crosses.

    python docs/research/scripts/plot_walk_vs_data.py 896=docs/research/results/offline-chainflow-stage1/offline_eval.json \\
        2688=docs/research/results/offline-chainflow-stage2/offline_eval.json \\
        4224=docs/research/results/offline-chainflow/offline_eval.json \\
        --bar tree=2.43 --bar chain=2.01 --available 37065 --out docs/research/results/walk-vs-data.png

Each JSON is an `hf-chainflow eval-offline ... --walk-sequences N` report (key `walk`).  The fit is a least-squares
line of walk tau on ln(responses); three points from stages that also differ in training steps make it a rough
guide, not a prediction.
"""

import argparse
import json
import math

import numpy as np


def parse_point(text: str) -> tuple[int, str]:
    count, sep, path = text.partition("=")
    if not sep or not count.isdigit() or int(count) < 1:
        raise SystemExit(f"plot_walk_vs_data: a point must look like RESPONSES=PATH (e.g. 896=run/offline_eval.json), "
                         f"got {text!r}.")
    return int(count), path


def parse_bar(text: str) -> tuple[str, float]:
    mode, sep, tau = text.partition("=")
    try:
        value = float(tau)
    except ValueError:
        value = None
    if not sep or mode not in ("tree", "chain") or value is None:
        raise SystemExit(f"plot_walk_vs_data: --bar must look like tree=2.43 or chain=2.01, got {text!r}.")
    return mode, value


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("points", nargs="+", type=parse_point, help="RESPONSES=offline_eval.json, at least two")
    ap.add_argument("--bar", type=parse_bar, action="append", required=True,
                    help="MODE=TAU: the walk tau the speed target needs in that mode (repeatable)")
    ap.add_argument("--available", type=int, help="prompts available to answer (a vertical line)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if len(args.points) < 2:
        raise SystemExit("plot_walk_vs_data: give at least two RESPONSES=PATH points to fit a line.")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    counts = np.array([c for c, _ in args.points], dtype=float)
    walks = [json.load(open(path))["walk"] for _, path in args.points]
    bars = dict(args.bar)
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for mode, color in (("tree", "tab:blue"), ("chain", "tab:orange")):
        if mode not in bars or not all(mode in w for w in walks):
            continue
        bar = bars[mode]
        tau = np.array([w[mode]["tau"] for w in walks])
        slope, intercept = np.polyfit(np.log(counts), tau, 1)
        cross = math.exp((bar - intercept) / slope) if slope > 0 else float("inf")
        print(f"{mode}: walk tau {', '.join(f'{t:.3f}' for t in tau)} at {', '.join(str(int(c)) for c in counts)} "
              f"responses; fit {intercept:.3f} + {slope:.3f} ln(responses); reaches {bar} at ~{cross:,.0f}")
        ax.plot(counts, tau, "o-", color=color, label=f"{mode} (walk τ)")
        xs = np.geomspace(counts.min(), max(cross, counts.max()) * 1.2 if math.isfinite(cross) else counts.max() * 30)
        ax.plot(xs, intercept + slope * np.log(xs), "--", color=color, alpha=0.6,
                label=f"{mode}: fit, {slope:.3f} per e-fold, reaches the bar at ~{cross:,.0f}")
        ax.axhline(bar, color=color, linewidth=1, label=f"{mode} bar: walk τ {bar}")
    if args.available:
        ax.axvline(args.available, color="grey", linestyle=":", label=f"prompts available ({args.available:,})")
    ax.set_xscale("log")
    ax.set_xlabel("target responses trained on")
    ax.set_ylabel("held-out serving-walk τ")
    ax.set_title("Serving-walk τ against training responses (log-linear fit)")
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
