"""Reports of `hf-chainflow bench` (see `hf_chainflow.bench`): `results.json`, `results.md` and two PNG plots
(speedup per domain per arm as grouped bars; acceptance per draft depth per speculative arm as lines)."""

from __future__ import annotations

import json
import os
from pathlib import Path


def _fmt(x, spec=".2f", none="–"):
    return none if x is None else format(x, spec)


def markdown_table(results: dict) -> str:
    """`results.md`: the arms, speedup per domain, acceptance per depth, settings and machine."""
    arms, domains = results["arms"], results["domains"]
    lines = ["# hf-chainflow bench", "",
             f"{results['settings']['num_prompts']} prompts, {results['settings']['max_new_tokens']} new tokens max, "
             f"greedy, batch 1, arms interleaved per prompt; wall time {results['wall_time']:.0f} s.", "",
             "| arm | dtype | tok/s | speedup | vs fastest ar | tau | draft ms/round | verify ms/round "
             "| mismatches | near-ties | unexplained |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for key, a in arms.items():
        ms = lambda x: None if x is None else 1000 * x  # noqa: E731
        lines.append(f"| {a['name']} | {a['dtype']} | {a['tokens_per_second']:.1f} | {_fmt(a['speedup'])}x "
                     f"| {_fmt(a['speedup_vs_fastest_ar'])}x | {_fmt(a['tau'])} | {_fmt(ms(a['draft_time_per_round']), '.1f')} "
                     f"| {_fmt(ms(a['verify_time_per_round']), '.1f')} | {a['mismatches']} | {a['near_ties']} "
                     f"| {a['unexplained_mismatches']} |")
    lines += ["", "## Speedup over same-dtype ar per domain (tau)", "",
              "| arm | " + " | ".join(domains) + " |", "|---|" + "---|" * len(domains)]
    for key, a in arms.items():
        cells = [f"{_fmt(a['per_domain'][d]['speedup'])}x ({_fmt(a['per_domain'][d]['tau'])})" for d in domains]
        lines.append(f"| {key} | " + " | ".join(cells) + " |")
    spec = {k: a for k, a in arms.items() if a["acceptance_per_depth"]}
    if spec:
        depth = max(len(a["acceptance_per_depth"]) for a in spec.values())
        lines += ["", "## Acceptance per draft depth", "", "| arm | " + " | ".join(f"d{i + 1}" for i in range(depth))
                  + " |", "|---|" + "---|" * depth]
        for key, a in spec.items():
            acc = a["acceptance_per_depth"] + [None] * (depth - len(a["acceptance_per_depth"]))
            lines.append(f"| {key} | " + " | ".join(_fmt(x) for x in acc) + " |")
    diffs = [(k, d) for k, a in arms.items() for d in a["mismatch_details"]]
    if diffs:
        lines += ["", "## Differences from same-dtype ar (first diverging new token)", "",
                  "| arm | prompt | domain | position | ar | arm | ref gap | kind |", "|---|---|---|---|---|---|---|---|"]
        for k, d in diffs:
            lines.append(f"| {k} | {d['id']} | {d['domain']} | {d['position']} | {d['ar_token']} | {d['arm_token']} "
                         f"| {_fmt(d['gap'], '+.3f')} | {d['kind']} |")
    lines += ["", "## Settings", "", "```json", json.dumps(results["settings"], indent=1), "```", "",
              "## Machine", "", "```json", json.dumps(results["machine"], indent=1), "```", ""]
    return "\n".join(lines)


def write_results(results: dict, output_dir: str | os.PathLike) -> dict[str, Path]:
    """Write `results.json`, `results.md`, `speedup_per_domain.png` and `acceptance_per_depth.png`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "results.json", "md": out / "results.md", "speedup_png": out / "speedup_per_domain.png",
             "acceptance_png": out / "acceptance_per_depth.png"}
    paths["json"].write_text(json.dumps(results, indent=1))
    paths["md"].write_text(markdown_table(results))

    arms = {k: a for k, a in results["arms"].items() if a["kind"] != "ar"}
    groups = results["domains"] + ["all"]
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(groups) * max(1, len(arms)) / 3), 4))
    width = 0.8 / max(1, len(arms))
    x = np.arange(len(groups))
    for i, (key, a) in enumerate(arms.items()):
        vals = [a["per_domain"][d]["speedup"] or 0.0 for d in results["domains"]] + [a["speedup"] or 0.0]
        ax.bar(x + (i - (len(arms) - 1) / 2) * width, vals, width, label=key)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(x, groups)
    ax.set_ylabel("speedup over same-dtype ar")
    ax.set_title("Speedup per domain (pooled time per token)")
    if arms:
        ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(paths["speedup_png"], dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    depth = max((len(a["acceptance_per_depth"] or []) for a in results["arms"].values()), default=0)
    ax.set_xticks(np.arange(1, depth + 1))
    for key, a in results["arms"].items():
        acc = a["acceptance_per_depth"]
        if acc:
            ax.plot(np.arange(1, len(acc) + 1), acc, marker="o", label=f"{key} (tau {_fmt(a['tau'])})")
    ax.set_xlabel("draft depth d")
    ax.set_ylabel("P(accepted to depth >= d)")
    ax.set_ylim(0, 1)
    ax.set_title("Acceptance per draft depth")
    if any(a["acceptance_per_depth"] for a in results["arms"].values()):
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(paths["acceptance_png"], dpi=120)
    plt.close(fig)
    return paths


__all__ = ["markdown_table", "write_results"]
