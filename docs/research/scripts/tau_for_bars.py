"""The served τ each speculative arm of a bench run would need to reach a speed bar, at the run's own round cost.

An arm's time per round (its pooled `generate` seconds / its rounds: drafting, verification, bookkeeping and the
prefill spread over the rounds) is taken as fixed; its speed is then τ / (seconds per round), so reaching a bar of
`S` tokens/s needs τ = S × (seconds per round). The bars are the next-drafter issue's: 2.0× and 1.4× the fastest
plain arm, 1.3× prompt lookup. It assumes a round costs the same whatever τ is: a round verifies a fixed draft
whatever is accepted; only the prefill, spread over fewer rounds when τ grows, moves it, and slightly.

    python docs/research/scripts/tau_for_bars.py docs/research/results/bench-round14-320-zen4/results.json
"""

import argparse
import json


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", help="a bench run's results.json")
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    arms = json.load(open(args.results))["arms"]
    plain = max((a for a in arms.values() if a["kind"] == "ar"), key=lambda a: a["tokens_per_second"])
    lookup = arms.get(f"pld@{args.dtype}")
    bars = [("2.0x plain", 2.0 * plain["tokens_per_second"]), ("1.4x plain", 1.4 * plain["tokens_per_second"])]
    if lookup is not None:
        bars.append(("1.3x prompt lookup", 1.3 * lookup["tokens_per_second"]))
    print("| arm | τ served | ms per round | vs fastest plain | " + " | ".join(f"τ for {n}" for n, _ in bars) + " |")
    print("|---" * (4 + len(bars)) + "|")
    for key, arm in arms.items():
        if not key.endswith(f"@{args.dtype}") or not arm.get("rounds"):
            continue
        per_round = arm["seconds"] / arm["rounds"]
        needed = " | ".join(f"{speed * per_round:.2f}" for _, speed in bars)
        print(f"| {key} | {arm['tau']:.2f} | {1000 * per_round:.1f} | {arm['speedup_vs_fastest_ar']:.2f}x | {needed} |")


if __name__ == "__main__":
    main()
