"""Growing a trained drafter: widen its path head or raise its Markov head's rank without changing what it computes.

Like transformers' `resize_token_embeddings`, for warm-starting a larger head from a trained drafter
(`docs/training.md`, "Growing a trained drafter"). Each function changes the drafter in place and returns it.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from hf_chainflow.models.chainflow.layers_chainflow import ChainFlowMarkovHead, ChainFlowPathHead
from hf_chainflow.models.chainflow.modeling_chainflow import ChainFlowDrafter


def _check_resize(drafter, method: str, head: nn.Module | None, what: str, arg: str, value, field: str,
                  plain: dict[str, type]) -> None:
    """Checks shared by the `resize_*_head` functions; `ValueError` before anything changes.

    `head` must exist, `value` must be an int larger than `config.<field>`, and each submodule of `head` named
    in `plain` must still be of its plain type (not wrapped by an adapter).
    """
    if head is None:
        raise ValueError(
            f"`{method}` needs a {what}, but this drafter has `feedback={drafter.config.feedback!r}`: 'markov+path' "
            f"has both feedback heads, 'markov' only the Markov head, 'none' neither. Grow a head it has."
        )
    current = getattr(drafter.config, field)
    if not isinstance(value, int) or isinstance(value, bool) or value <= current:
        raise ValueError(
            f"`{arg}` must be an int larger than the current `{field}` ({current}), got {value!r}. Only growing "
            f"a head keeps the drafter's outputs; for a smaller one, train a new drafter."
        )
    found = {name: type(head.get_submodule(name)) for name in plain}
    wrapped = {name: kind.__name__ for name, kind in found.items() if kind is not plain[name]}
    if wrapped:
        raise ValueError(
            f"The {what}'s layers {wrapped} are wrapped, e.g. by a LoRA adapter. Merge the adapter "
            f"(`merge_and_unload()`) before `{method}`."
        )


@torch.no_grad()
def resize_path_head(drafter: ChainFlowDrafter, new_width: int) -> ChainFlowDrafter:
    """Widen `drafter`'s path head `r` to `new_width` hidden units without changing what the drafter computes.

    Like `resize_token_embeddings`, for warm-starting a larger head from a trained drafter. The old units keep
    their weights; the new ones are initialised as in `post_init` (normal, std `initializer_range`) and reach
    the output through zero columns of `out`, and no old unit reads a new one, so every output is unchanged
    until training moves those columns. Sets `config.path_hidden_size`. Raises a `ValueError` (and changes
    nothing) without a path head, when `new_width` is not larger than the current width, or when a LoRA
    adapter wraps the head's layers (merge it first).
    """
    head = drafter.path_head
    _check_resize(drafter, "resize_path_head", head, "path head", "new_width", new_width, "path_hidden_size",
                  {"state_proj": nn.Linear, "mlp.1": nn.Linear, "out": nn.Linear})
    R, std = drafter.config.path_hidden_size, drafter.config.initializer_range
    ref = head.offset_proj
    new_cfg = copy.copy(drafter.config)  # a shallow copy: only the width differs, the head reads no list
    new_cfg.path_hidden_size = new_width
    new = ChainFlowPathHead(new_cfg).to(device=ref.device, dtype=ref.dtype)
    new.offset_proj.normal_(std=std)
    new.offset_proj[:, :, :R] = head.offset_proj  # (p, D, R') ← old units first
    new.state_proj.weight.normal_(std=std)
    new.state_proj.weight[:R] = head.state_proj.weight  # (R', D)
    new.state_proj.bias.zero_()
    new.state_proj.bias[:R] = head.state_proj.bias
    hidden, old_hidden = new.mlp[1], head.mlp[1]
    hidden.weight.normal_(std=std)  # (R', R'): rows are outputs, columns inputs
    hidden.weight[:R, :R] = old_hidden.weight
    hidden.weight[:R, R:] = 0.0  # old units do not read new ones
    hidden.bias.zero_()
    hidden.bias[:R] = old_hidden.bias
    new.out.weight.zero_()
    new.out.weight[:, :R] = head.out.weight  # (D, R'): new columns zero, so `r` is unchanged
    new.out.bias.copy_(head.out.bias)
    for p_new, p_old in zip(new.parameters(), head.parameters()):
        p_new.requires_grad_(p_old.requires_grad)
    drafter.path_head = new
    drafter.config.path_hidden_size = new_width
    drafter._runtime.pop("weights", None)  # the serving caches derived from the old heads
    return drafter

@torch.no_grad()
def resize_markov_head(drafter: ChainFlowDrafter, new_rank: int) -> ChainFlowDrafter:
    """Raise `drafter`'s Markov head's rank to `new_rank` without changing what the drafter computes.

    The bias is `U2·U1[x]`: the new columns of `U1` are initialised as in `post_init` (normal, std
    `initializer_range`) and those of `U2` are zero, so every output is unchanged until training moves them.
    Sets `config.markov_rank`. Raises a `ValueError` (and changes nothing) without a Markov head, when
    `new_rank` is not larger than the current rank, or when a LoRA adapter wraps `U1` (merge it first).
    """
    head = drafter.markov_head
    _check_resize(drafter, "resize_markov_head", head, "Markov head", "new_rank", new_rank, "markov_rank",
                  {"u1": nn.Embedding})
    old = drafter.config.markov_rank
    ref = head.u2
    new = ChainFlowMarkovHead(head.u1.num_embeddings, ref.shape[0], new_rank).to(device=ref.device, dtype=ref.dtype)
    new.u1.weight.normal_(std=drafter.config.initializer_range)
    new.u1.weight[:, :old] = head.u1.weight  # (S + 1, r') ← old columns first
    new.u2.zero_()
    new.u2[:, :old] = head.u2  # (S, r'): new columns zero, so `U2·U1[x]` is unchanged
    new.u1.weight.requires_grad_(head.u1.weight.requires_grad)
    new.u2.requires_grad_(head.u2.requires_grad)
    drafter.markov_head = new
    drafter.config.markov_rank = new_rank
    drafter._runtime.pop("weights", None)  # the serving caches derived from the old heads
    return drafter


__all__ = ["resize_markov_head", "resize_path_head"]
