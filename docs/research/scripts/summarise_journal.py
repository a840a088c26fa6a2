"""Summarise the first N prompts of a bench journal (`runs.jsonl`) without loading a model.

`hf-chainflow bench --resume --partial-report` summarises a journaled run too, but it loads the target and the
drafters and compiles the drafting rounds first, which would disturb a run still going beside it. This reads the
journal alone and pools its first `--first` prompts (in the run's order: with `--limit`, round-robin over the
domains, so a prefix keeps the domains balanced) through the bench's own `summarise`, then writes the usual
`results.json` / `results.md` / plots into `--out`:

    python docs/research/scripts/summarise_journal.py runs/bench-320/runs.jsonl --first 64 --out runs/bench-320-first64
"""

import argparse
import json
from pathlib import Path

import torch

from hf_chainflow.bench.arms import Arm
from hf_chainflow.bench.journal import run_from_dict
from hf_chainflow.bench.prompts import BenchPrompt
from hf_chainflow.bench.report import write_results
from hf_chainflow.bench.run import summarise


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("journal", help="a bench run's runs.jsonl")
    ap.add_argument("--first", type=int, help="pool only the first N prompts of the run's order (default: all done)")
    ap.add_argument("--out", required=True, help="directory for results.json, results.md and the plots")
    args = ap.parse_args()
    lines = [json.loads(line) for line in Path(args.journal).read_text().splitlines() if line.strip()]
    header = next(line for line in lines if line["type"] == "header")
    parts = [line for line in lines if line["type"] == "part"]
    done = {line["id"]: line for line in lines if line["type"] == "prompt"}
    order = [pid for pid in header["prompt_ids"] if pid in done]
    if args.first is not None:
        if args.first < 1:
            raise SystemExit(f"summarise_journal: --first must be a positive integer, got {args.first}.")
        missing = [pid for pid in header["prompt_ids"][:args.first] if pid not in done]
        if missing:
            raise SystemExit(f"summarise_journal: the journal has not finished {len(missing)} of the first "
                             f"{args.first} prompts (e.g. {missing[0]!r}); wait for the run or lower --first.")
        order = header["prompt_ids"][:args.first]
    settings = header["settings"]
    arms = []
    for key, spec in settings["arms"].items():
        name = key.rsplit("@", 1)[0]
        extra = {k: v for k, v in spec.items() if k not in ("kind", "dtype", "drafter")}
        arms.append(Arm(name, spec["kind"], spec["dtype"], spec["drafter"], extra))
    keys = [a.key for a in arms]
    runs = {k: [] for k in keys}
    details = {k: [] for k in keys}
    per_prompt, prompts, wall = [], [], 0.0
    for pid in order:
        line = done[pid]
        for k in keys:
            runs[k].append(run_from_dict(line["runs"][k]))
            if line["details"].get(k) is not None:
                details[k].append(line["details"][k])
        per_prompt.append(line["record"])
        prompts.append(BenchPrompt(pid, line["record"]["domain"], torch.zeros(1, 1, dtype=torch.long)))
        wall += line["wall"]
    machine = parts[0]["machine"] if parts else {}
    total = settings["num_prompts"]
    settings = {**settings, "num_prompts": len(order), "parts": len(parts),
                "summarised": {"journal": Path(args.journal).name, "first": len(order), "of": total}}
    results = summarise(arms, runs, details, per_prompt, prompts, settings=settings, machine=machine, wall_time=wall)
    results["machine"].pop("load_average_end", None)  # summarise reads it now, not at the run's end
    if args.first is None and len(order) < total:  # a run still going (a chosen prefix is not)
        results["partial"] = {"prompts_done": len(order), "prompts_total": total}
    for name, path in write_results(results, args.out).items():
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
