"""The levers ablation table (issue 39, item 1): every arm's held-out serving walk against the control R.

Reads, from one runs folder, `walk632-ARM/offline_eval.json` (from `hf-chainflow eval-offline --walk-sequences`) and
`ARM/train_summary.json` (from `hf-chainflow train`) for each arm, and writes `ablation.md` (walk chain and tree tau,
the paired-bootstrap difference from R with its 95 % interval, training time) and `ablation.png` (the differences
with their intervals) to `--out`:

    python docs/research/scripts/levers_table.py --runs runs/levers --arms R,B,L,BL,P --reference S \
        --out docs/research/results/levers

`--subset 316` compares on the seeded half of the responses (`--walk-sequences 316`): arms walked on all 632 are cut
down to those, arms walked only on them are read from `walk316-ARM/`. `--drafting-cost` adds each arm's drafting ms
per round (tree / chain, compiled) from `levers_drafting_cost.py --out`'s `drafting_cost.json`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from hf_chainflow.training.evaluation import paired_walk_difference, walk_subset, walk_tau  # noqa: E402

MODES = ("chain", "tree")


def load_walk(runs: Path, arm: str, subset: int | None = None) -> dict:
    """`walk632-ARM`'s walk, or with `subset`, the walk of those `subset` responses that
    `--walk-sequences SUBSET` visits (from `walk632-ARM` cut down, else from `walkSUBSET-ARM`)."""
    path = runs / f"walk632-{arm}" / "offline_eval.json"
    if subset and not path.exists():
        path = runs / f"walk{subset}-{arm}" / "offline_eval.json"
    walk = json.loads(path.read_text()).get("walk")
    if not walk:
        raise SystemExit(f"{path} has no serving walk: run eval-offline with --walk-sequences")
    if subset:
        for mode in MODES:
            rec = walk[mode]["per_sequence"]
            if len(rec["seq"]) > subset:
                keep = walk_subset(len(rec["seq"]), subset, 0)
                walk[mode] = {"per_sequence": {key: [values[i] for i in keep] for key, values in rec.items()}}
    return walk


def verdict(tree: dict, chain: dict) -> str:
    """The plan's deciding rule, against R."""
    low, high = tree["ci95"]
    if low > 0 and chain["difference"] >= 0:
        return "helps"
    if high < 0:
        return "hurts"
    return "no measurable effect"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=Path, required=True, help="folder with ARM/ and walk632-ARM/ of every arm")
    parser.add_argument("--arms", default="R,B,L,BL,P", help="comma-separated arms; the first is the control")
    parser.add_argument("--reference", help="an untrained arm walked too (its walk only, e.g. S)")
    parser.add_argument("--resamples", type=int, default=10000)
    parser.add_argument("--subset", type=int, help="compare on the responses `--walk-sequences SUBSET` visits "
                        "(arms walked on 632 are cut down to them; the others read walkSUBSET-ARM)")
    parser.add_argument("--drafting-cost", type=Path, help="drafting_cost.json of levers_drafting_cost.py")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    arms = args.arms.split(",")
    control = arms[0]
    walks = {arm: load_walk(args.runs, arm, args.subset) for arm in arms + ([args.reference] if args.reference else [])}
    for arm, walk in walks.items():  # paired comparisons need the same responses in the same order
        for mode in MODES:
            if walk[mode]["per_sequence"]["seq"] != walks[control][mode]["per_sequence"]["seq"]:
                raise SystemExit(f"{arm}'s {mode} walk visited other responses than {control}'s")

    cost = json.loads(args.drafting_cost.read_text()) if args.drafting_cost else None
    rows, diffs = [], {}
    header = ("| arm | walk chain τ | walk tree τ | chain − R (95 %) | tree − R (95 %) | reading | training s |"
              + (" drafting ms, tree / chain |" if cost else "") + "\n|---|---|---|---|---|---|---|"
              + ("---|" if cost else ""))
    for arm, walk in walks.items():
        chain, tree = walk_tau(walk["chain"]), walk_tau(walk["tree"])
        summary = args.runs / arm / "train_summary.json"
        seconds = f"{json.loads(summary.read_text())['train_seconds']:.0f}" if summary.exists() else "–"
        if cost:
            ms = cost["arms"][arm]
            seconds += f" | {ms['tree']['compiled_ms']:.1f} / {ms['chain']['compiled_ms']:.1f}"
        if arm == control:
            rows.append(f"| {arm} (control) | {chain:.4f} | {tree:.4f} | – | – | – | {seconds} |")
            continue
        d = {mode: paired_walk_difference(walks[control][mode], walk[mode], num_resamples=args.resamples)
             for mode in MODES}
        diffs[arm] = d
        cells = [f"{d[m]['difference']:+.4f} [{d[m]['ci95'][0]:+.4f}, {d[m]['ci95'][1]:+.4f}]" for m in MODES]
        reading = verdict(d["tree"], d["chain"]) if arm in arms else "untrained reference"
        rows.append(f"| {arm} | {chain:.4f} | {tree:.4f} | {cells[0]} | {cells[1]} | {reading} | {seconds} |")
    num = len(walks[control]["tree"]["per_sequence"]["seq"])
    args.out.mkdir(parents=True, exist_ok=True)
    text = (f"Held-out serving walk on {num} responses; differences from {control}, paired bootstrap over the responses "
            f"({args.resamples} draws).\n\n" + header + "\n" + "\n".join(rows) + "\n")
    if cost:
        m = cost["machine"]
        text += (f"\nDrafting ms: one served round ({cost['rounds']['tree']} / {cost['rounds']['chain']}), compiled, "
                 f"median of {cost['timed_rounds']} interleaved rounds on {cost['windows']} windows of real target "
                 f"states ({cost['dtype']}, {cost['threads']} threads; {m['cpu']}, family {m['cpu_family']} model "
                 f"{m['cpu_model']}, torch capability {m['cpu_capability']}); the arm's architecture, not its weights "
                 f"(P and S have R's).\n")
    (args.out / "ablation.md").write_text(text)
    (args.out / "ablation.json").write_text(json.dumps(diffs, indent=1))
    print(text)

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.2), sharey=True)
    names = list(diffs)
    for ax, mode in zip(axes, MODES):
        for y, arm in enumerate(names):
            d = diffs[arm][mode]
            lo, hi = d["ci95"]
            ax.errorbar(d["difference"], y, xerr=[[d["difference"] - lo], [hi - d["difference"]]], fmt="o", capsize=4)
        ax.axvline(0, color="grey", lw=1)
        ax.set_title(f"walk {mode} τ − {control}")
        ax.set_yticks(range(len(names)), names)
        ax.set_xlabel("difference (95 % paired bootstrap)")
    fig.tight_layout()
    fig.savefig(args.out / "ablation.png", dpi=120)


if __name__ == "__main__":
    main()
