"""Recheck a saved bench run's bfloat16 differences under the near-tie rule of today's classifier.

`hf_chainflow.bench.classify_divergence` now also asks that both tokens lie within the tolerance of the reference's
top logit (`top_gap`). Runs saved before kept no `top_gap`; where their reference argmax was ar's or the arm's
token it is 0 by definition, so only the differences whose reference argmax was a third token need the plain model
again. This scores those (the prompt and ar's tokens come from the run's journal, `runs.jsonl`) and prints each
one's classification now.

    python docs/research/scripts/recheck_near_ties.py docs/research/results/bench-defaults --out docs/research/results/near-tie-recheck/recheck.json
"""

import argparse
import json
from pathlib import Path

import torch

from hf_chainflow.bench import DEFAULT_TIE_TOLERANCE, explain_mismatch, load_prompts, tokenize_prompts
from hf_chainflow.targets import load_target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", help="a bench output directory with results.json and runs.jsonl")
    parser.add_argument("--prompts", default=None, help="the run's prompts JSONL (default: the shipped evaluation set)")
    parser.add_argument("--tie-tolerance", type=float, default=DEFAULT_TIE_TOLERANCE)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    run = Path(args.run_dir)
    results = json.loads((run / "results.json").read_text())
    cases = [(p["id"], arm, a["mismatch"]) for p in results["prompts"] for arm, a in p["arms"].items()
             if a.get("mismatch") and arm.endswith("@bfloat16")
             and a["mismatch"]["reference_top"] not in (a["mismatch"]["ar_token"], a["mismatch"]["arm_token"])]
    tokens = {}
    with open(run / "runs.jsonl") as f:
        for line in f:
            row = json.loads(line)
            if row.get("type") == "prompt":
                tokens[row["id"]] = {arm: r["tokens"] for arm, r in row["runs"].items()}
    model, tokenizer = load_target("smollm2-135m-instruct", dtype=torch.bfloat16)
    rows = {str(r["id"]): r for r in load_prompts(args.prompts)}
    scored, out = {}, []
    for pid, arm, recorded in cases:
        ar, other = tokens[pid]["ar@bfloat16"], tokens[pid][arm]
        key = (pid, tuple(ar), tuple(other))
        if key not in scored:
            prompt = tokenize_prompts(tokenizer, [rows[pid]])[0]
            scored[key] = explain_mismatch(model, prompt.input_ids, ar, other, "bfloat16", args.tie_tolerance)
        now = scored[key]
        out.append({"id": pid, "arm": arm, "position": now["position"], "recorded": recorded["kind"],
                    "now": now["kind"], "gap": now["gap"], "top_gap": now["top_gap"]})
    print(f"{len(out)} differences whose reference argmax was a third token\n")
    print("| prompt | arm | position | recorded | now | gap | top gap |\n|---|---|---|---|---|---|---|")
    for o in out:
        print(f"| {o['id']} | {o['arm']} | {o['position']} | {o['recorded']} | {o['now']} | {o['gap']:+.4f} "
              f"| {o['top_gap']:.4f} |")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
