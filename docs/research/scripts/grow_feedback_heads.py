"""Grow the feedback heads of a trained ChainFlow drafter and save the copy.

`--path-width` widens the path head (`hf_chainflow.training.resize.resize_path_head`), `--markov-rank` raises the
Markov head's rank (`resize_markov_head`). The copy computes exactly what the original does until it is trained (`hf-chainflow
train --init-from OUT`); this script checks that on random training windows before saving (the corrected states
and the logits must agree).

    python docs/research/scripts/grow_feedback_heads.py --drafter hf_chainflow/checkpoints/smollm2-135m-instruct \
        --path-width 512 --out runs/pathprobe/init
"""

import argparse

import torch

from hf_chainflow import ChainFlowDrafter
from hf_chainflow.targets import load_target
from hf_chainflow.training.resize import resize_markov_head, resize_path_head


def random_windows(drafter, batch: int = 4):
    """Training-forward inputs of the drafter's shapes, from a fixed seed: `(B, C, D)` states, `(B, K)` tokens."""
    cfg = drafter.config
    B, C, K, p, D = batch, cfg.context_size, cfg.num_draft_positions, cfg.path_order, cfg.target_hidden_size
    gen = torch.Generator().manual_seed(0)
    ids = drafter.shortlist_ids if cfg.shortlist is not None else torch.arange(cfg.vocab_size)

    def tokens(*shape):
        return ids[torch.randint(0, len(ids), shape, generator=gen)]

    return dict(context_states=torch.randn(B, C, D, generator=gen), target_states=torch.randn(B, K, D, generator=gen),
                target_tokens=tokens(B, K), prev_tokens=tokens(B, p - 1 + K))


def forward(drafter, batch):
    torch.manual_seed(0)  # the training forward samples flow times
    with torch.no_grad():
        return drafter(**batch)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--drafter", required=True, help="folder of the trained ChainFlow drafter")
    parser.add_argument("--path-width", type=int, help="new `path_hidden_size` (larger than the current)")
    parser.add_argument("--markov-rank", type=int, help="new `markov_rank` (larger than the current)")
    parser.add_argument("--out", required=True, help="folder for the grown copy")
    parser.add_argument("--target", default="smollm2-135m-instruct", help="target to bind for the check")
    args = parser.parse_args()
    if args.path_width is None and args.markov_rank is None:
        parser.error("give --path-width, --markov-rank or both")

    target, _ = load_target(args.target, dtype=torch.float32)
    drafter = ChainFlowDrafter.from_pretrained(args.drafter, target=target, dtype=torch.float32).eval()
    batch = random_windows(drafter)
    before = forward(drafter, batch)
    sizes = {"path_hidden_size": drafter.config.path_hidden_size, "markov_rank": drafter.config.markov_rank}
    if args.path_width is not None:
        resize_path_head(drafter, args.path_width)
    if args.markov_rank is not None:
        resize_markov_head(drafter, args.markov_rank)
    after = forward(drafter, batch)
    for field in ("corrected_states", "logits"):
        gap = (getattr(after, field) - getattr(before, field)).abs().max().item()
        print(f"{field}: largest difference after growing {gap:.3g}")
        torch.testing.assert_close(getattr(after, field), getattr(before, field), rtol=1e-5, atol=1e-5)
    drafter.save_pretrained(args.out)
    grown = {k: f"{v} -> {getattr(drafter.config, k)}" for k, v in sizes.items()}
    print(f"{grown}; saved to {args.out}")


if __name__ == "__main__":
    main()
