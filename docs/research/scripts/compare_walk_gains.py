"""Did a drafter's walk gain slow down?  Compare the gain of stage B over A with that of C over B, on one draw.

Three `offline_eval.json` files whose serving walks covered the same responses (e.g. three training stages walked
with the same `eval-offline --walk-sequences N`).  Resamples the responses (one draw for all three drafters,
`hf_chainflow.training.evaluation.resampled_walk_taus`) and prints, per walk mode, `(tau_B - tau_A) - (tau_C - tau_B)` with
its 95 % interval:

    python docs/research/scripts/compare_walk_gains.py A/offline_eval.json B/offline_eval.json C/offline_eval.json
"""

import argparse
import json

import numpy as np

from hf_chainflow.training.evaluation import resampled_walk_taus, walk_tau


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs=3, metavar="FILE", help="offline_eval.json of stages A, B and C")
    parser.add_argument("--resamples", type=int, default=10000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    walks = [json.load(open(path))["walk"] for path in args.files]
    for mode in ("chain", "tree"):
        stages = [w[mode] for w in walks]
        taus = resampled_walk_taus(stages, num_resamples=args.resamples, seed=args.seed)  # (R, 3)
        slowdown = (taus[:, 1] - taus[:, 0]) - (taus[:, 2] - taus[:, 1])  # (R,)
        low, high = np.percentile(slowdown, [2.5, 97.5])
        a, b, c = (walk_tau(w) for w in stages)
        print(f"walk {mode} ({len(stages[0]['per_sequence']['seq'])} responses): B - A {b - a:+.4f}, "
              f"C - B {c - b:+.4f}, (B - A) - (C - B) {(b - a) - (c - b):+.4f}  95 % [{low:+.4f}, {high:+.4f}]")


if __name__ == "__main__":
    main()
