"""Reports of `hf-chainflow bench` (see `hf_chainflow.bench.run`): `results.json`, `results.md` and two PNG plots
(speedup per domain per arm as grouped bars; acceptance per draft depth per speculative arm as lines).

A saved run's report can be written again (e.g. after a report section was added) without rerunning it:

    python -m hf_chainflow.bench.report docs/research/results/bench
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from hf_chainflow.fileio import atomic_path, atomic_write_text, read_json


def _fmt(x, spec=".2f", none="–"):
    return none if x is None else format(x, spec)


def _pct(x, none="–"):
    return none if x is None else f"{100 * x:.0f} %"


def same_length_summary(results: dict) -> dict[str, dict]:
    """Speedups over same-dtype `ar` on the prompts where every arm of that dtype emitted as many tokens as `ar`.

    In bfloat16 a near-tie flip can change an arm's text and its length; tokens/s includes the prompt's prefill, so
    an arm whose text ends early (or runs into a long repetition) moves its domain's figure for reasons that are
    not its speed. On the same-length prompts every arm did the same amount of work, so the ratio of summed
    seconds compares speed alone. The set is fixed by a rule, not chosen per arm: all arms of a dtype share it.

    Returns `{dtype: {"prompts": n, "per_domain_prompts": {domain: n}, "speedup": {arm_key: {"all": x,
    domain: x}}}}`; a speedup is `None` where the set is empty.
    """
    out = {}
    for dtype in sorted({a["dtype"] for a in results["arms"].values()}):
        keys = [k for k, a in results["arms"].items() if a["dtype"] == dtype]
        ar_key = f"ar@{dtype}"
        if ar_key not in keys:
            continue
        same = [p for p in results["prompts"] if len({p["arms"][k]["new_tokens"] for k in keys}) == 1]
        groups = {"all": same, **{d: [p for p in same if p["domain"] == d] for d in results["domains"]}}

        def ratio(key, group):
            arm_seconds = sum(p["arms"][key]["seconds"] for p in group)
            return sum(p["arms"][ar_key]["seconds"] for p in group) / arm_seconds if group and arm_seconds else None

        out[dtype] = {"prompts": len(same),
                      "per_domain_prompts": {d: len(groups[d]) for d in results["domains"]},
                      "speedup": {k: {g: ratio(k, group) for g, group in groups.items()} for k in keys}}
    return out


def _mixed_cpu_note(settings: dict) -> list[str]:
    """The lines saying that a resumed run's parts ran on different kinds of CPU (none where they did not)."""
    kinds = settings.get("part_cpu_kinds")
    if not kinds:
        return []
    rows = ["| part | " + " | ".join(k for k in kinds[0] if k != "part") + " |",
            "|---" * len(kinds[0]) + "|"]
    rows += ["| " + " | ".join(json.dumps(v) if isinstance(v, dict) else str(v) for v in kind.values()) + " |"
             for kind in kinds]
    return ["**The parts ran on more than one kind of CPU.** Each prompt's arms ran side by side, but the pooled "
            "figures mix machines:", "", *rows, ""]


def markdown_table(results: dict) -> str:
    """`results.md`: the arms, speedup per domain, acceptance per depth, settings and machine."""
    arms, domains = results["arms"], results["domains"]
    part = results.get("partial")
    lines = ["# hf-chainflow bench" + (" (partial)" if part else ""), ""]
    if part:
        lines += [f"**Partial report: {part['prompts_done']} of {part['prompts_total']} prompts finished.** The run "
                  "goes on with `--resume`; pooled figures cover the finished prompts' domains only.", ""]
    count = part["prompts_done"] if part else results["settings"]["num_prompts"]
    lines += [f"{count} prompts, {results['settings']['max_new_tokens']} new tokens max, "
              f"greedy, batch 1, arms interleaved per prompt; wall time {results['wall_time']:.0f} s"
              + (f" in {results['settings']['parts']} parts (resumed, `runs.jsonl`)."
                 if results["settings"].get("parts", 1) > 1 else "."), "", *_mixed_cpu_note(results["settings"]),
              "| arm | dtype | tok/s | speedup | vs fastest ar | tau | draft ms/round | draft / ar step "
              "| verify ms/round | mismatches | near-ties | unexplained |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for key, a in arms.items():
        ms = lambda x: None if x is None else 1000 * x  # noqa: E731
        name = a["name"] + (" (not compiled)" if a.get("compiled") is False else "")
        lines.append(f"| {name} | {a['dtype']} | {a['tokens_per_second']:.1f} | {_fmt(a['speedup'])}x "
                     f"| {_fmt(a['speedup_vs_fastest_ar'])}x | {_fmt(a['tau'])} | {_fmt(ms(a['draft_time_per_round']), '.1f')} "
                     f"| {_pct(a.get('draft_ratio'))} | {_fmt(ms(a['verify_time_per_round']), '.1f')} | {a['mismatches']} | {a['near_ties']} "
                     f"| {a['unexplained_mismatches']} |")
    fastest = results.get("fastest_ar")
    if fastest is not None:
        lines += ["", f"`vs fastest ar`: against the fastest plain arm of the run, `{fastest}` (of "
                  + ", ".join(f"`{k}`" for k, a in arms.items() if a["kind"] == "ar") + ")."]
    compiled = results.get("plain_compile") or {}
    if compiled:
        lines += ["", "## Compiled plain arm", "",
                  "Static cache, the target's forward compiled by transformers' own compile path, warmed up (compiled) "
                  "before anything was timed; the warm-up is not in any timed figure.", "",
                  "| arm | compiled | warm-up s | static cache length | reason |", "|---|---|---|---|---|"]
        for key, c in compiled.items():
            done = {True: "yes", False: "**no**", None: "– (not run in this part)"}[c.get("compiled")]
            lines.append(f"| {key} | {done} | {_fmt(c.get('warmup_seconds'), '.1f')} | "
                         f"{_fmt(c.get('max_cache_len'), 'd')} | {c.get('reason') or ''} |")
    lines += ["", "## Speedup over same-dtype ar per domain (tau)", "",
              "| arm | " + " | ".join(domains) + " |", "|---|" + "---|" * len(domains)]
    for key, a in arms.items():
        cells = [f"{_fmt(a['per_domain'][d]['speedup'])}x ({_fmt(a['per_domain'][d]['tau'])})" for d in domains]
        lines.append(f"| {key} | " + " | ".join(cells) + " |")
    same = results.get("same_length") or {}
    if same:
        lines += ["", "## Same-length prompts: speedup over same-dtype ar (prompts)", "",
                  "Only the prompts where every arm of the dtype emitted as many new tokens as `ar` (bf16 near-tie "
                  "flips change texts and lengths; tokens/s includes the prefill).", "",
                  "| arm | all | " + " | ".join(domains) + " |", "|---|---|" + "---|" * len(domains)]
        for dtype, summary in same.items():
            counts = summary["per_domain_prompts"]
            for key, sp in summary["speedup"].items():
                times = lambda x: "–" if x is None else f"{x:.2f}x"  # noqa: E731
                cells = [f"{times(sp['all'])} ({summary['prompts']})"]
                cells += [f"{times(sp[d])} ({counts[d]})" for d in domains]
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
                  "| arm | prompt | domain | position | ar | arm | ref gap | top gap | kind |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for k, d in diffs:
            lines.append(f"| {k} | {d['id']} | {d['domain']} | {d['position']} | {d['ar_token']} | {d['arm_token']} "
                         f"| {_fmt(d['gap'], '+.3f')} | {_fmt(d.get('top_gap'), '.3f')} | {d['kind']} |")
    lines += ["", "## Settings", "", "```json", json.dumps(results["settings"], indent=1), "```", "",
              "## Machine", "", "```json", json.dumps(results["machine"], indent=1), "```", ""]
    return "\n".join(lines)


def write_report(output_dir: str | os.PathLike, results: dict, markdown: str) -> dict[str, Path]:
    """Write a run's `results.json` (`results`) and `results.md` (`markdown`) into `output_dir` (made if absent),
    each atomically (a kill leaves the old file or the new); the bench's and the vLLM bench's reports. Returns
    `{"json": path, "md": path}`."""
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "results.json", "md": out / "results.md"}
    atomic_write_text(paths["json"], json.dumps(results, indent=1))
    atomic_write_text(paths["md"], markdown)
    return paths


def write_results(results: dict, output_dir: str | os.PathLike) -> dict[str, Path]:
    """Write `results.json`, `results.md` (`write_report`), `speedup_per_domain.png` and `acceptance_per_depth.png`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    out = Path(output_dir)
    paths = {**write_report(out, results, markdown_table(results)), "speedup_png": out / "speedup_per_domain.png",
             "acceptance_png": out / "acceptance_per_depth.png"}

    arms = {k: a for k, a in results["arms"].items() if not (a["kind"] == "ar" and a["name"] == "ar")}
    groups = results["domains"] + ["all"]
    dtypes = list(dict.fromkeys(a["dtype"] for a in arms.values())) or [None]  # one panel per dtype, run order
    per_panel = max([sum(a["dtype"] == dt for a in arms.values()) for dt in dtypes] + [1])
    fig, axes = plt.subplots(len(dtypes), 1, squeeze=False, sharex=True,
                             figsize=(max(6.0, 0.3 * len(groups) * per_panel + 2.5), 1.0 + 2.6 * len(dtypes)))
    width = 0.8 / per_panel
    x = np.arange(len(groups))
    for ax, dt in zip(axes[:, 0], dtypes):
        panel = {k: a for k, a in arms.items() if a["dtype"] == dt}
        for i, a in enumerate(panel.values()):
            vals = [a["per_domain"][d]["speedup"] or 0.0 for d in results["domains"]] + [a["speedup"] or 0.0]
            ax.bar(x + (i - (len(panel) - 1) / 2) * width, vals, width, label=a["name"])
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_ylabel(f"vs {dt} ar" if dt else "speedup")
        ax.set_title(f"{dt}" if dt else "no speculative arm", fontsize=9)
        if panel:
            ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))  # outside: never hides a bar
    axes[-1, 0].set_xticks(x, groups)
    fig.suptitle("Speedup per domain over same-dtype ar (pooled time per token)")
    fig.tight_layout()
    _save_png(fig, paths["speedup_png"])

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
    _save_png(fig, paths["acceptance_png"])
    return paths


def _save_png(fig, path: Path) -> None:
    """Save `fig` to `path` atomically and close it."""
    import matplotlib.pyplot as plt

    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=120, format="png")
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    """Write a saved run's report again from its `results.json` (the same-length section recomputed)."""
    import argparse

    parser = argparse.ArgumentParser(description="Write the report of a saved `hf-chainflow bench` run again.")
    parser.add_argument("output_dir", help="a directory holding the run's results.json")
    args = parser.parse_args(argv)
    path = Path(args.output_dir) / "results.json"
    if not path.is_file():
        raise ValueError(f"`output_dir` ({args.output_dir!r}) holds no results.json; give the directory that "
                         "`hf-chainflow bench --output-dir` wrote.")
    results = read_json(path, what="bench results", fix="Rerun the bench, or restore the file from its copy.")
    results["same_length"] = same_length_summary(results)
    for name, written in write_results(results, args.output_dir).items():
        print(f"wrote {written}")
    return 0


__all__ = ["markdown_table", "same_length_summary", "write_report", "write_results"]


if __name__ == "__main__":
    raise SystemExit(main())
