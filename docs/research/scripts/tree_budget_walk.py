"""Which tree budget should a serving round verify? Fixed budgets and per-round budgets from the drafter's own path
probabilities, compared by the serving walk on held-out responses and priced with measured latencies.

    python docs/research/scripts/tree_budget_walk.py --drafter hf_chainflow/checkpoints/smollm2-135m-instruct \\
        --data runs/smollm2/data --shards 21-25 --responses 100 --out docs/research/results/tree-budget-walk

1. At every anchor of `--responses` held-out responses (seeded), draft the full `--tree` (8x4: 32 nodes) once and
   record, for the target's own path through it, each path node's rank by path probability.  Cutting the tree to
   its `b` most probable nodes keeps an ancestor-closed subtree, so the accepted length at budget `b` is the number
   of leading path nodes ranked below `b`: every budget and rule is read off the same drafts.
2. Walk each rule as the serving loop does (`hf_chainflow.training.evaluation.walk_rounds`: a round accepting `a` tokens
   moves `a + 1` tokens on): walk tau = tokens / rounds.
3. Price a round verifying `b` nodes as drafting (`--draft-ms`) + the target's forward over `b + 1` tokens,
   interpolated from `--latency` (the `target forward, N token(s)` lines of `docs/research/scripts/benchmark_drafting.py`'s
   output) + `--verify-extra-ms` (what a served verify costs beyond that forward: lm_head rows and inputs).
   Time per token = mean round cost / walk tau; rules are compared by it (prefill excluded).

Rules: `fixed b`; `logp >= T in [lo, hi]`, the nodes whose path log-probability is at least `T`, clamped to
`[lo, hi]` (EAGLE-2-style dynamic trees).  Writes `tree_budget_walk.json` and prints a Markdown table.
"""

import argparse
import json
import re
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from hf_chainflow import ChainFlowDrafter
from hf_chainflow.generation import drafting
from hf_chainflow.cli_train import parse_shards
from hf_chainflow.training.windows import ChainFlowWindowDataset
from hf_chainflow.training.evaluation import sequence_walks, tree_matching_path, walk_rounds
from hf_chainflow.targets import load_target

NO_RANK = 10**6  # a path node the tree does not hold


def forward_latency(path: str) -> tuple[np.ndarray, np.ndarray]:
    """`(tokens, ms)` of the `target forward, N token(s) ... MS` lines of a `benchmark_drafting.py` output."""
    rows = re.findall(r"target forward, (\d+) token\(s\).*?([\d.]+)\s*$", Path(path).read_text(), flags=re.M)
    if len(rows) < 2:
        raise ValueError(f"`--latency` {path} holds {len(rows)} `target forward, N token(s)` lines; need at least 2 "
                         "(the output of docs/research/scripts/benchmark_drafting.py).")
    n, ms = np.array([[int(a), float(b)] for a, b in rows]).T
    return n, ms


@torch.no_grad()
def path_ranks(drafter, window: dict, width: int, depth: int) -> tuple[np.ndarray, np.ndarray]:
    """Full-tree path log-probabilities, sorted `(N,)`, and the rank of each target path node `(depth,)`."""
    states = window["context_states"][window["context_mask"].bool()][None]  # (1, T<=C, D)
    committed = window["prev_tokens"][: drafter.config.path_order][None]  # (1, p), the last is the bonus token
    tree = drafting.draft(drafter, states, committed, mode="tree", tree_width=width, tree_depth=depth)
    cum = tree.cumulative_logprobs()  # (N,)
    order = torch.sort(cum, descending=True, stable=True).indices  # the order `DraftTree.top_nodes` keeps
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.numel())
    ranks = np.full(depth, NO_RANK)
    path = tree_matching_path(tree, window["target_tokens"], window["target_mask"])
    ranks[: len(path)] = rank[path].numpy()
    return cum[order].numpy(), ranks


def accepted(ranks: np.ndarray, budget: int) -> int:
    """Leading path nodes among the `budget` most probable nodes."""
    return int(np.cumprod(ranks < budget).sum())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drafter", required=True)
    ap.add_argument("--data", required=True, help="prepared data directory")
    ap.add_argument("--shards", type=parse_shards, help="held-out shards, e.g. 21-25")
    ap.add_argument("--responses", type=int, default=100, help="walk this many responses (seeded)")
    ap.add_argument("--tree", default="8x4")
    ap.add_argument("--latency", default="docs/research/results/latency/shipped.txt")
    ap.add_argument("--draft-ms", type=float, default=14.2, help="drafting per served round (served profile)")
    ap.add_argument("--verify-extra-ms", type=float, default=6.7,
                    help="served verify beyond the plain forward (served profile: 57.4 - 50.7 ms at 13 tokens)")
    ap.add_argument("--out", default="runs/tree-budget-walk")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    width, depth = (int(x) for x in args.tree.lower().split("x"))
    lat_n, lat_ms = forward_latency(args.latency)
    torch.set_num_threads(args.threads)

    target, _ = load_target("smollm2-135m-instruct")
    drafter = ChainFlowDrafter.from_pretrained(args.drafter, target=target, dtype=torch.float32).eval()
    data = ChainFlowWindowDataset.for_drafter(args.data, drafter.config, shards=args.shards)
    walks = sequence_walks(data)
    if args.responses < len(walks):
        keep = np.sort(np.random.default_rng(args.seed).choice(len(walks), size=args.responses, replace=False))
        walks = [walks[i] for i in keep]

    # 1. one full tree per anchor
    cums, ranks = [], []
    for idx in tqdm(walks, desc="full trees", unit="response"):
        per = [path_ranks(drafter, data[int(i)], width, depth) for i in idx]
        cums.append(np.stack([c for c, _ in per]))  # (anchors, N)
        ranks.append(np.stack([r for _, r in per]))  # (anchors, depth)
    nodes = width * depth

    # 2.-3. walk and price each rule
    def evaluate(rule) -> dict:
        tokens = rounds = cost = 0.0
        for c, r in zip(cums, ranks):
            def accepted_at(i):
                nonlocal cost
                b = rule(c[i])
                cost += args.draft_ms + float(np.interp(b + 1, lat_n, lat_ms)) + args.verify_extra_ms
                return accepted(r[i], b)

            visited = walk_rounds(accepted_at, len(r))
            tokens += sum(a + 1 for a in visited)
            rounds += len(visited)
        return {"walk_tau": tokens / rounds, "ms_per_round": cost / rounds, "ms_per_token": cost / tokens}

    fixed = (4, 8, 12, 16, 20, 24, nodes)
    rules = {f"fixed {b}": (lambda c, b=b: b) for b in fixed}
    for t in (-2.0, -3.0, -4.0, -5.0, -6.0):
        for lo, hi in ((1, 12), (4, 12), (4, 16), (4, 24)):
            rules[f"logp >= {t:g} in [{lo}, {hi}]"] = lambda c, t=t, lo=lo, hi=hi: int(np.clip((c >= t).sum(), lo, hi))
    results = {name: evaluate(rule) for name, rule in rules.items()}
    for b in fixed:  # the offline figure: every anchor counted, not only those the walk visits
        results[f"fixed {b}"]["anchor_mean_tau"] = float(np.mean([1 + accepted(x, b) for r in ranks for x in r]))
    best = min(results, key=lambda k: results[k]["ms_per_token"])

    print(f"{sum(len(r) for r in ranks)} anchors of {len(walks)} responses; tree {args.tree}\n")
    print("| rule | anchor-mean tau | walk tau | ms / round | ms / token |\n|---|---|---|---|---|")
    for name, r in results.items():
        mark = " (best)" if name == best else ""
        mean = f"{r['anchor_mean_tau']:.3f}" if "anchor_mean_tau" in r else "–"
        print(f"| {name}{mark} | {mean} | {r['walk_tau']:.3f} | {r['ms_per_round']:.1f} | {r['ms_per_token']:.2f} |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tree_budget_walk.json").write_text(json.dumps({
        "drafter": args.drafter, "data": args.data, "shards": args.shards, "responses": len(walks),
        "anchors": int(sum(len(r) for r in ranks)), "tree": args.tree, "latency": args.latency,
        "draft_ms": args.draft_ms, "verify_extra_ms": args.verify_extra_ms, "rules": results, "best": best},
        indent=1))


if __name__ == "__main__":
    main()
