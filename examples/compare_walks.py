"""Compare two drafters' serving walks on the same held-out responses, with the walk's sampling noise.

Each `offline_eval.json` comes from `hf-chainflow eval-offline ... --walk-sequences N` with the same data, shards and
N (so both walked the same responses).  Prints, per walk mode, both `tau`, their difference and a paired-bootstrap
95 % interval over the responses (`hf_chainflow.evaluation.paired_walk_difference`):

    python examples/compare_walks.py runs/eval-A/offline_eval.json runs/eval-B/offline_eval.json
"""

import argparse
import json

from hf_chainflow.evaluation import paired_walk_difference


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("a", help="offline_eval.json of the reference drafter")
    parser.add_argument("b", help="offline_eval.json of the drafter compared with it")
    parser.add_argument("--resamples", type=int, default=10000, help="bootstrap draws (default 10000)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    a, b = (json.load(open(path)).get("walk") for path in (args.a, args.b))
    if not a or not b:
        raise SystemExit("both files need a serving walk: run eval-offline with --walk-sequences")
    print(f"{a['num_sequences']} responses; B - A, paired bootstrap over responses ({args.resamples} draws)")
    for mode in ("chain", "tree"):
        if mode in a and mode in b:
            d = paired_walk_difference(a[mode], b[mode], num_resamples=args.resamples, seed=args.seed)
            print(f"walk {mode}: A {d['tau_a']:.4f}  B {d['tau_b']:.4f}  B - A {d['difference']:+.4f}  "
                  f"95 % [{d['ci95'][0]:+.4f}, {d['ci95'][1]:+.4f}]  P(B <= A) {d['p_not_above']:.3f}")


if __name__ == "__main__":
    main()
