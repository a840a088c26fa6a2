"""Tokens per target forward when sampling: a sampled chain, a tree, and a tree plus a prompt-lookup branch.

Greedy acceptance asks whether a draft token is the target's argmax; sampling (`do_sample=True`) accepts a sampled
chain token with probability min(1, p/q) and a tree child with the target's own probability of its token
(`hf_chainflow.generation.verification.accept_sampling_tree`), so tau falls as the temperature rises. This measures it on the
shipped drafter and the real target, on the bench's stratified evaluation prompts, every arm from the same seed per
prompt, and prints tau and acceptance per depth per arm (Markdown), next to each arm's greedy tau on the same
prompts. Speed is the bench's business, not this script's.

    python docs/research/scripts/sampling_tau.py --limit 8 --temperature 0.7 --top-p 0.9 --threads 2 [--drafter PATH]
"""

import argparse
import json

import torch
from tqdm.auto import tqdm

from hf_chainflow import ChainFlowDrafter
from hf_chainflow.bench import load_prompts, stratified_selection
from hf_chainflow.bench_journal import weights_digest
from hf_chainflow.checkpoints import default_drafter_path
from hf_chainflow.targets import load_target

ARMS = {  # name: (draft_mode, lookup_num_tokens or None); the tree shape and lookup rules are the shipped ones
    "chain": ("chain", None),
    "tree": ("tree", None),
    "tree+lookup": ("tree", "shipped"),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--limit", type=int, default=8, help="evaluation prompts, round-robin over the domains")
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--top-p", type=float, default=0.9)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--drafter", default=None, help="drafter directory (default: the shipped one)")
    parser.add_argument("--out", default=None, help="write the figures as JSON here")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    target, tokenizer = load_target("smollm2-135m-instruct", dtype=dtype)
    drafter_path = args.drafter or str(default_drafter_path())
    drafter = ChainFlowDrafter.from_pretrained(drafter_path, target=target)
    g = drafter.generation_config
    shipped_lookup = g.lookup_num_tokens
    rows = stratified_selection(load_prompts(), args.limit)
    totals = {arm: {"tokens": 0, "rounds": 0, "accepted": [], "depths": [], "greedy_tokens": 0, "greedy_rounds": 0}
              for arm in ARMS}
    for n, row in enumerate(tqdm(rows, desc="prompts")):
        enc = tokenizer.apply_chat_template([{"role": "user", "content": row["prompt"]}], add_generation_prompt=True,
                                            return_tensors="pt", return_dict=True)
        for arm, (mode, lookup) in ARMS.items():
            g.draft_mode, g.lookup_num_tokens = mode, shipped_lookup if lookup else None
            torch.manual_seed(args.seed + n)
            target.generate(**enc, assistant_model=drafter, do_sample=True, temperature=args.temperature,
                            top_p=args.top_p, top_k=0, max_new_tokens=args.max_new_tokens)
            stats = drafter.last_stats
            t = totals[arm]
            t["tokens"] += sum(stats.accepted) + stats.rounds
            t["rounds"] += stats.rounds
            t["accepted"] += stats.accepted
            t["depths"] += stats.drafted_depth
            target.generate(**enc, assistant_model=drafter, do_sample=False, max_new_tokens=args.max_new_tokens)
            t["greedy_tokens"] += sum(drafter.last_stats.accepted) + drafter.last_stats.rounds
            t["greedy_rounds"] += drafter.last_stats.rounds
    print(f"\n{len(rows)} prompts, temperature {args.temperature}, top-p {args.top_p}, {args.dtype}, "
          f"at most {args.max_new_tokens} new tokens\n")
    print("| arm | tau sampling | tau greedy | acceptance at depth 1 / 2 / 3 / 4, sampling |\n|---|---|---|---|")
    result = {"settings": {**vars(args), "drafter": drafter_path}, "drafter_weights_sha256": weights_digest(drafter),
              "arms": {}}
    for arm, t in totals.items():
        acc = []
        for d in range(4):
            tried = [a for a, depth in zip(t["accepted"], t["depths"]) if depth > d]
            acc.append(sum(a > d for a in tried) / len(tried) if tried else float("nan"))
        tau, greedy = t["tokens"] / t["rounds"], t["greedy_tokens"] / t["greedy_rounds"]
        result["arms"][arm] = {"tau": tau, "acceptance_per_depth": acc, "rounds": t["rounds"], "tau_greedy": greedy}
        print(f"| {arm} | {tau:.2f} | {greedy:.2f} | {' / '.join(f'{a:.2f}' for a in acc)} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
