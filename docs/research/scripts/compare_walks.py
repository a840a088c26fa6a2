"""Compare two drafters' serving walks on the same held-out responses, with the walk's sampling noise.

Each `offline_eval.json` comes from `hf-chainflow eval-offline ... --walk-sequences N` with the same data, shards and
N (so both walked the same responses).  Prints, per walk mode, both `tau`, their difference and a paired-bootstrap
95 % interval over the responses (`hf_chainflow.training.evaluation.paired_walk_difference`):

    python docs/research/scripts/compare_walks.py runs/eval-A/offline_eval.json runs/eval-B/offline_eval.json

`--subset 100` compares on the 100 responses `--walk-sequences 100` would have walked (the same seeded draw of
`evaluate_walk`, `--subset-seed`, default 0), from walks over more responses, and prints how much A's `tau` varies
between random draws of that many responses (with replacement) from all the responses A walked.
"""

import argparse
import json

from hf_chainflow.training.evaluation import paired_walk_difference, resampled_walk_taus, walk_subset


def subset(walk: dict, size: int, seed: int) -> dict:
    """`walk` restricted to the responses `evaluate_walk(max_sequences=size, seed=seed)` draws from the same data."""
    rec = walk["per_sequence"]
    if size > len(rec["seq"]):
        raise SystemExit(f"--subset {size} is more than the {len(rec['seq'])} responses walked")
    keep = walk_subset(len(rec["seq"]), size, seed)
    return {"per_sequence": {key: [values[i] for i in keep] for key, values in rec.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("a", help="offline_eval.json of the reference drafter")
    parser.add_argument("b", help="offline_eval.json of the drafter compared with it")
    parser.add_argument("--resamples", type=int, default=10000, help="bootstrap draws (default 10000)")
    parser.add_argument("--seed", type=int, default=0, help="bootstrap seed")
    parser.add_argument("--subset", type=int, help="compare on this many responses, drawn as the walk draws them")
    parser.add_argument("--subset-seed", type=int, default=0, help="the walk's seed (eval-offline's, default 0)")
    args = parser.parse_args()
    a, b = (json.load(open(path)).get("walk") for path in (args.a, args.b))
    if not a or not b:
        raise SystemExit("both files need a serving walk: run eval-offline with --walk-sequences")
    n = args.subset or a["num_sequences"]
    print(f"{n} responses; B - A, paired bootstrap over responses ({args.resamples} draws)")
    for mode in ("chain", "tree"):
        if mode in a and mode in b:
            wa, wb = a[mode], b[mode]
            if args.subset:
                wa, wb = subset(wa, args.subset, args.subset_seed), subset(wb, args.subset, args.subset_seed)
            d = paired_walk_difference(wa, wb, num_resamples=args.resamples, seed=args.seed)
            print(f"walk {mode}: A {d['tau_a']:.4f}  B {d['tau_b']:.4f}  B - A {d['difference']:+.4f}  "
                  f"95 % [{d['ci95'][0]:+.4f}, {d['ci95'][1]:+.4f}]  P(B <= A) {d['p_not_above']:.3f}")
            if args.subset:  # how far one draw of that many responses moves A's tau (drawn from all A walked)
                spread = resampled_walk_taus([a[mode]], num_resamples=args.resamples, size=args.subset,
                                             seed=args.seed)[:, 0]
                print(f"  A's walk {mode} tau over random {args.subset}-response draws: SD {spread.std():.4f}")


if __name__ == "__main__":
    main()
