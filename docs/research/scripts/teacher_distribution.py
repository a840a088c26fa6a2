"""How much the target's next-token distribution says beyond its greedy token, on prepared windows.

The `kd` loss term (docs/training.md) distils the target's logits `W h_{t+k}`, computed from the cached true
states, where `L_CE` uses only the greedy label. This prints, over the valid draft positions of `--windows` random
windows: how often the argmax of those logits is the stored label (near 1 on greedy responses: the check that the
states and labels line up), the mean probability of the label, and the mean entropy in nats.

    python docs/research/scripts/teacher_distribution.py --data runs/heldout632/data --shards 0 --windows 256
"""

import argparse

import torch

from hf_chainflow import ChainFlowDrafter
from hf_chainflow.training.windows import ChainFlowWindowDataset, collate
from hf_chainflow.targets import load_target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", required=True, help="a prepared data directory (`hf-chainflow prepare`)")
    parser.add_argument("--shards", type=int, nargs="+", default=[0], help="shard numbers to read")
    parser.add_argument("--windows", type=int, default=256, help="random windows to read")
    parser.add_argument("--drafter", default="hf_chainflow/checkpoints/smollm2-135m-instruct",
                        help="a drafter whose draft vocabulary and window shape to use")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target = load_target()
    target = target[0] if isinstance(target, tuple) else target
    drafter = ChainFlowDrafter.from_pretrained(args.drafter, target=target)
    cfg = drafter.config
    data = ChainFlowWindowDataset(args.data, context_len=cfg.context_size, num_draft=cfg.num_draft_positions,
                                  num_parents=cfg.path_order, shards=args.shards, max_windows=args.windows, seed=0)
    batch = collate([data[i] for i in range(len(data))])
    with torch.no_grad():  # the training forward, as the `kd` term sees it
        out = drafter(**{k: v for k, v in batch.items() if k != "domain"}, return_teacher_logits=True)
    teacher, labels = out.teacher_logits.float(), out.labels  # (B, K, S), (B, K)
    valid = labels != -100  # masked positions and tokens outside the draft vocabulary are ignored
    probs = teacher.softmax(-1)
    p_label = probs.gather(-1, labels.clamp(min=0)[..., None])[..., 0]  # (B, K)
    entropy = -(probs * probs.clamp_min(1e-12).log()).sum(-1)  # (B, K)
    print(f"windows {len(data)}, valid draft positions {int(valid.sum())}")
    print(f"argmax of the target's logits = label: {(teacher.argmax(-1) == labels)[valid].float().mean():.4f}")
    print(f"mean probability of the label:         {p_label[valid].mean():.4f}")
    print(f"mean entropy (nats):                   {entropy[valid].mean():.4f}")


if __name__ == "__main__":
    main()
