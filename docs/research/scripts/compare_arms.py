"""Two arms of one bench run side by side, per domain, from its journal (`runs.jsonl`) alone: where one wins and why.

For each domain and pooled: each arm's speedup over the baseline arm (pooled time per token, as the bench reports
it), its τ (tokens per target forward after the prefill) and its seconds per round (a round: one target forward
and, for a drafter, the drafting before it); then arm A over arm B: the speed ratio with a paired bootstrap
interval over the domain's prompts (resampled together, so both arms see the same prompts), the prompts where A is
faster, and the ratio split into its two factors, τ_A / τ_B (acceptance) times seconds per round of B / of A (cost):

    speed_A / speed_B = (τ_A / τ_B) x (round_B / round_A)

    python docs/research/scripts/compare_arms.py runs/bench-trio-320/runs.jsonl --a tree --b dflash [--out FILE.md]

Arms are named as in the run (`tree`, `dflash`, `flashmap-tree`, ...), in `--dtype` (default bfloat16).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path


def load_journal(path: str | Path) -> tuple[dict, list[dict]]:
    """The journal's header and its finished prompts' records, in the run's order."""
    lines = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    header = next(line for line in lines if line["type"] == "header")
    done = {line["id"]: line["record"] for line in lines if line["type"] == "prompt"}
    return header, [done[pid] for pid in header["prompt_ids"] if pid in done]


def pooled(records: list[dict], key: str) -> dict:
    """An arm's pooled tokens, seconds, forwards (rounds), seconds per token and per round, and τ."""
    tokens = sum(r["arms"][key]["new_tokens"] for r in records)
    seconds = sum(r["arms"][key]["seconds"] for r in records)
    forwards = sum(r["arms"][key]["new_tokens"] / r["arms"][key]["tau"] for r in records)
    return {"tokens": tokens, "seconds": seconds, "per_token": seconds / tokens, "per_round": seconds / forwards,
            "tau": tokens / forwards}


def speed_ratio(records: list[dict], a: str, b: str) -> float:
    """Arm a's speed over arm b's: b's pooled seconds per token over a's."""
    return pooled(records, b)["per_token"] / pooled(records, a)["per_token"]


def bootstrap(records: list[dict], a: str, b: str, resamples: int, seed: int = 0) -> tuple[float, float]:
    """95 % interval of `speed_ratio` over the prompts, resampled with replacement (paired: one draw, both arms)."""
    rng = random.Random(seed)
    draws = sorted(speed_ratio([rng.choice(records) for _ in records], a, b) for _ in range(resamples))
    return draws[int(0.025 * resamples)], draws[int(0.975 * resamples) - 1]


def compare(records: list[dict], a: str, b: str, baseline: str, resamples: int) -> dict:
    """The row of one group of prompts."""
    pa, pb, base = pooled(records, a), pooled(records, b), pooled(records, baseline)
    per_token = {key: [r["arms"][key]["seconds"] / r["arms"][key]["new_tokens"] for r in records] for key in (a, b)}
    wins = sum(ta < tb for ta, tb in zip(per_token[a], per_token[b]))
    return {"prompts": len(records), "speedup_a": base["per_token"] / pa["per_token"],
            "speedup_b": base["per_token"] / pb["per_token"], "tau_a": pa["tau"], "tau_b": pb["tau"],
            "round_ms_a": 1e3 * pa["per_round"], "round_ms_b": 1e3 * pb["per_round"],
            "ratio": pb["per_token"] / pa["per_token"], "ci95": bootstrap(records, a, b, resamples), "wins": wins,
            "acceptance_factor": pa["tau"] / pb["tau"], "cost_factor": pb["per_round"] / pa["per_round"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("journal", help="a bench run's runs.jsonl")
    ap.add_argument("--a", required=True, help="arm A, e.g. tree")
    ap.add_argument("--b", required=True, help="arm B, e.g. dflash")
    ap.add_argument("--baseline", default="ar", help="the arm speedups are over (default: ar)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--resamples", type=int, default=2000)
    ap.add_argument("--out", help="also write the table to this Markdown file")
    args = ap.parse_args()
    header, records = load_journal(args.journal)
    a, b, base = (f"{name}@{args.dtype}" for name in (args.a, args.b, args.baseline))
    for key in (a, b, base):
        if key not in header["settings"]["arms"]:
            raise SystemExit(f"compare_arms: the run has no arm {key!r}; it has {sorted(header['settings']['arms'])}")
    if not records:
        raise SystemExit("compare_arms: the journal holds no finished prompt yet")
    domains = sorted({r["domain"] for r in records})
    groups = {d: [r for r in records if r["domain"] == d] for d in domains} | {"pooled": records}
    rows = {name: compare(group, a, b, base, args.resamples) for name, group in groups.items()}
    A, B = args.a, args.b
    lines = [f"{A} against {B}: {len(records)} of the run's {header['settings']['num_prompts']} prompts "
             f"({args.dtype}; speedups over {args.baseline}; {args.resamples} paired bootstrap draws)", "",
             f"| domain | prompts | {A} vs {args.baseline} (τ, ms/round) | {B} vs {args.baseline} (τ, ms/round) | "
             f"{A} / {B} speed (95 %) | prompts {A} faster | = τ ratio × round-cost ratio |",
             "|---|---|---|---|---|---|---|"]
    for name, r in rows.items():
        lo, hi = r["ci95"]
        label = f"**{name}**" if name == "pooled" else name
        lines.append(f"| {label} | {r['prompts']} | {r['speedup_a']:.2f}× ({r['tau_a']:.2f}, {r['round_ms_a']:.1f}) | "
                     f"{r['speedup_b']:.2f}× ({r['tau_b']:.2f}, {r['round_ms_b']:.1f}) | {r['ratio']:.2f}× "
                     f"[{lo:.2f}, {hi:.2f}] | {r['wins']} of {r['prompts']} | {r['acceptance_factor']:.2f} × "
                     f"{r['cost_factor']:.2f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
