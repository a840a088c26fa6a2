"""Did a drafter's walk gain slow down?  Compare the gain of stage B over A with that of C over B, on one draw.

Three `offline_eval.json` files whose serving walks covered the same responses (e.g. three training stages walked
with the same `eval-offline --walk-sequences N`).  Resamples the responses (one draw for all three drafters) and
prints, per walk mode, `(tau_B - tau_A) - (tau_C - tau_B)` with its 95 % interval:

    python examples/compare_walk_gains.py A/offline_eval.json B/offline_eval.json C/offline_eval.json
"""

import argparse
import json

import numpy as np


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs=3, metavar="FILE", help="offline_eval.json of stages A, B and C")
    parser.add_argument("--resamples", type=int, default=10000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    walks = [json.load(open(path))["walk"] for path in args.files]
    for mode in ("chain", "tree"):
        records = [w[mode]["per_sequence"] for w in walks]
        if any(rec["seq"] != records[0]["seq"] for rec in records):
            raise SystemExit(f"the three {mode} walks did not cover the same responses")
        n = len(records[0]["seq"])
        draws = np.random.default_rng(args.seed).integers(0, n, size=(args.resamples, n))  # (R, N)
        taus, points = [], []
        for rec in records:
            rounds, tokens = np.asarray(rec["rounds"], float), np.asarray(rec["tokens"], float)  # (N,)
            taus.append(tokens[draws].sum(1) / rounds[draws].sum(1))  # (R,)
            points.append(tokens.sum() / rounds.sum())
        slowdown = (taus[1] - taus[0]) - (taus[2] - taus[1])  # (R,)
        low, high = np.percentile(slowdown, [2.5, 97.5])
        print(f"walk {mode} ({n} responses): B - A {points[1] - points[0]:+.4f}, C - B {points[2] - points[1]:+.4f}, "
              f"(B - A) - (C - B) {(points[1] - points[0]) - (points[2] - points[1]):+.4f}  "
              f"95 % [{low:+.4f}, {high:+.4f}]")


if __name__ == "__main__":
    main()
