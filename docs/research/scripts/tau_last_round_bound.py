"""Bound the tau bias of bench runs made before drafter arms counted their last one-token round.

Until the change that made `SpeculativeStats` count a last round with no room to draft (one token before
`max_new_tokens`), the drafter arms' tau left that target forward out. Which prompts ended that way is not in a
saved `results.json`, but only a prompt that stopped at `max_new_tokens` can have; adding one forward to each of
them gives the lowest tau the run can have had. Prints, per drafter arm, the pooled tau (tokens after the first /
target forwards) as recorded and with that extra forward.

    python docs/research/scripts/tau_last_round_bound.py docs/research/results/bench-defaults/results.json
"""

import argparse
import json


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", nargs="+", help="results.json of `hf-chainflow bench` runs")
    args = parser.parse_args()
    for path in args.results:
        run = json.load(open(path))
        cap = run["settings"].get("max_new_tokens", 128)
        print(path)
        for arm in run["arms"]:
            if arm.split("@")[0] in ("ar", "pld"):
                continue  # ar: tau 1; pld: counted from a forward hook, every forward included
            tokens = forwards = capped = 0
            for prompt in run["prompts"]:
                result = prompt["arms"].get(arm)
                if not result or not result.get("tau"):
                    continue
                tokens += result["new_tokens"] - 1
                forwards += (result["new_tokens"] - 1) / result["tau"]
                capped += result["new_tokens"] == cap
            low = tokens / (forwards + capped)
            print(f"  {arm:24s} tau {tokens / forwards:.3f}, at least {low:.3f} "
                  f"({capped} prompts stopped at {cap} tokens; at most {100 * (1 - low * forwards / tokens):.2f} % high)")


if __name__ == "__main__":
    main()
