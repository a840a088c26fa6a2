"""Shared helpers of the generation tests: draft shapes, a tiny random drafter, the exact distribution of two sampled
tokens."""

import torch

from hf_chainflow import ChainFlowConfig, ChainFlowDrafter


def set_shape(drafter, mode, shape):
    g = drafter.generation_config
    g.draft_mode = mode
    if mode == "chain":
        g.num_assistant_tokens = shape
    else:
        g.tree_width, g.tree_depth = shape[:2]
        g.tree_budget = shape[2] if len(shape) > 2 else None


def random_drafter(target, **overrides):
    cfg = ChainFlowConfig.for_target(target.config, num_blocks=1, num_heads=4, path_hidden_size=32, markov_rank=16,
                                     **overrides)
    torch.manual_seed(0)
    return ChainFlowDrafter(cfg).eval().bind_target(target)


def exact_pair_distribution(target, prompt, temperature, top_p, vocab):
    """Exact distribution of generated tokens 2 and 3 under temperature + top-p sampling (batch 1)."""
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopPLogitsWarper

    warp = [TemperatureLogitsWarper(temperature), TopPLogitsWarper(top_p)]

    def probs(ids):
        logits = target(ids).logits[:, -1].float()
        for w in warp:
            logits = w(ids, logits)
        return torch.softmax(logits, -1)[0]

    joint = torch.zeros(vocab, vocab, dtype=torch.float64)
    with torch.no_grad():
        p1 = probs(prompt)
        for a in p1.nonzero()[:, 0].tolist():
            ids_a = torch.cat([prompt, torch.tensor([[a]])], 1)
            p2 = probs(ids_a)
            for b in p2.nonzero()[:, 0].tolist():
                p3 = probs(torch.cat([ids_a, torch.tensor([[b]])], 1))
                joint[b] += p1[a].double() * p2[b].double() * p3.double()
    return joint / joint.sum()  # (vocab, vocab)
