"""Training windows built directly from a tiny target's own forward pass (no data pipeline), for unit tests.

Same alignment as `hf_chainflow.training.prepared_data`: anchor `t`, context `h[t-C+1..t]` (zero-left-padded), targets `h[t+1..t+K]`,
tokens `x[t+2..t+K+1]`, parents `prev_tokens = x[t+2-p..t+K]` (pad outside the sequence).
"""

import torch
from hf_chainflow import ChainFlowConfig


# A drafter small enough to train in seconds on 2 CPU cores.
TINY_DRAFTER = {"num_blocks": 1, "num_heads": 2, "ffn_multiplier": 2, "vae_num_layers": 1, "vae_num_heads": 2,
                "path_hidden_size": 16, "markov_rank": 8}


def tiny_drafter_config(target, **overrides) -> ChainFlowConfig:
    """`TINY_DRAFTER` for `target`, with `overrides`."""
    return ChainFlowConfig.for_target(target.config, **{**TINY_DRAFTER, **overrides})


def greedy_sequences(target, num_seqs=4, length=32, prompt_len=4, seed=0):
    """Random prompts continued greedily by the target: `(num_seqs, length)` token ids."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, target.config.vocab_size, (num_seqs, prompt_len), generator=g)
    with torch.no_grad():
        for _ in range(length - prompt_len):
            ids = torch.cat([ids, target(ids).logits[:, -1:].argmax(-1)], 1)
    return ids


def make_windows(target, ids, C=8, K=8, p=8, pad=0):
    """All windows of the sequences `ids` `(S, L)`: a list of dicts of tensors (with a `domain` index)."""
    with torch.no_grad():
        h = target(ids, output_hidden_states=True).hidden_states[-1]  # (S, L, D)
    S, L, D = h.shape
    out = []
    for s in range(S):
        x = ids[s]
        for t in range(0, L - 2):
            lo = max(0, t - C + 1)
            ctx = torch.zeros(C, D)
            ctx[C - (t - lo + 1):] = h[s, lo:t + 1]
            cmask = torch.zeros(C, dtype=torch.bool)
            cmask[C - (t - lo + 1):] = True
            n = min(K, L - 2 - t)
            tgt = torch.zeros(K, D)
            tgt[:n] = h[s, t + 1:t + 1 + n]
            tok = torch.full((K,), pad)
            tok[:n] = x[t + 2:t + 2 + n]
            tmask = torch.arange(K) < n
            prev = torch.tensor([int(x[j]) if 0 <= j < L else pad for j in range(t + 2 - p, t + K + 1)])
            out.append({"context_states": ctx, "context_mask": cmask, "target_states": tgt, "target_tokens": tok,
                        "target_mask": tmask, "prev_tokens": prev, "domain": torch.tensor(s % 2)})
    return out


def one_thread():
    """Context for tiny-model tests: one intra-op thread (the shared 2-core machine thrashes with two)."""
    import contextlib

    @contextlib.contextmanager
    def ctx():
        old = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            yield
        finally:
            torch.set_num_threads(old)

    return ctx()
