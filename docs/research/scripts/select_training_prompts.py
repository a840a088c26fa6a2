"""Pick more training prompts for the target to answer: N per domain, none already answered, none too long.

The shipped drafters' third data round (docs/training.md) came from this selection: 192 prompts for each of the
evaluation set's 8 domains, drawn from `train.jsonl` among the prompts not in the shared responses and shorter
than 4,000 characters, seed 2026 (one `random.Random` shuffles each domain's candidates in turn, domains in sorted
order). The evaluation prompts themselves are never drawn: only their domain names are read.

    python docs/research/scripts/select_training_prompts.py --prompts ../shared/data/prompts/train.jsonl \\
        --exclude ../shared/data/responses/smollm2-135m-instruct.jsonl \\
        --domains-from ../shared/data/prompts/eval.jsonl --per-domain 192 --seed 2026 --out runs/more/prompts.jsonl
    hf-chainflow prepare --prompts runs/more/prompts.jsonl --out runs/more/data --shard-size 128 --shuffle-seed 0
"""

import argparse
import json
import random
from pathlib import Path


def read_jsonl(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def select(rows: list[dict], domains: list[str], per_domain: int, seed: int, exclude: set[str],
           max_chars: int) -> list[dict]:
    """`per_domain` rows of each domain (sorted order), shuffled with one seeded generator; raises if too few."""
    rng = random.Random(seed)
    out = []
    for domain in sorted(domains):
        pool = [r for r in rows if r["domain"] == domain and r["id"] not in exclude and len(r["prompt"]) < max_chars]
        if len(pool) < per_domain:
            raise ValueError(f"`--per-domain` is {per_domain}, but domain {domain!r} has only {len(pool)} eligible "
                             "prompts: lower `--per-domain` or raise `--max-chars`.")
        rng.shuffle(pool)
        out += pool[:per_domain]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", required=True, help="JSONL of training prompts (id, domain, prompt)")
    parser.add_argument("--exclude", action="append", default=[],
                        help="JSONL whose ids are skipped, e.g. the responses already generated (repeatable)")
    parser.add_argument("--domains-from", required=True, help="JSONL whose `domain` values are the domains to draw")
    parser.add_argument("--per-domain", type=int, default=192)
    parser.add_argument("--seed", type=int, default=2026)
    parser.add_argument("--max-chars", type=int, default=4000, help="skip prompts of this many characters or more")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    if args.per_domain < 1:
        parser.error(f"`--per-domain` must be a positive integer, got {args.per_domain!r}.")
    exclude = {r["id"] for path in args.exclude for r in read_jsonl(path)}
    domains = sorted({r["domain"] for r in read_jsonl(args.domains_from)})
    try:
        chosen = select(read_jsonl(args.prompts), domains, args.per_domain, args.seed, exclude, args.max_chars)
    except ValueError as err:  # too few prompts left in a domain: a usage error, not a crash
        parser.error(str(err))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w") as f:
        for row in chosen:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    print(f"wrote {len(chosen)} prompts ({args.per_domain} x {len(domains)} domains) to {args.out}")


if __name__ == "__main__":
    main()
