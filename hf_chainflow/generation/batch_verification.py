"""Verification for a batch of rows, each with its own draft and its own committed length (ragged acceptance).

The cache is shared by `B` rows and laid out per row as

    [ left padding | prompt | committed tokens | holes ]      columns 0 .. T-1, T = committed_length(cache)
      0 .. start_b            start_b .. length_b        length_b .. T-1

`RaggedRows` keeps `start_b` (first valid column) and `length_b` (one past the last committed column); the cache
is as long as the longest row (`T = max_b length_b`). A round, with `n = 1 + max_b N_b` inputs per row (root + the
row's draft nodes, shorter drafts padded with inert nodes):

    out = verify_forward_batch(target, cache, rows, roots, trees)   # ONE forward (B, n); the cache grows to T + n
    ... accept per row (hf_chainflow.generation.verification.accept_*) on out.logits[b, : trees[b].num_nodes + 1] ...
    commit_batch(target, cache, rows, accepted, out.handle)          # each row keeps its root + accepted path

- every input sees its own row's valid columns `[start_b, length_b)` and its ancestors within the block (a 4-D
  mask `(B, 1, n, T + n)`); positions are `length_b - start_b + depth`, so each row is scored exactly as if it were
  alone (the masked columns get zero weight);
- `commit_batch` moves row b's root and accepted entries from `T + [0, i_1 + 1, ...]` down to `length_b + [0, 1,
  ...]` (one gather of the moved entries, written in place), sets `length_b += m_b + 1` and cuts the cache to the
  new longest row; hybrid (Gated DeltaNet) rows get the conv window and recurrent state of their own last accepted
  input (`hf_chainflow.generation.hybrid`, one tree per row);
- `select_rows` drops finished rows (and the left columns no remaining row uses).

Limits: those of `hf_chainflow.generation.verification` (dynamic caches of plain layers, sdpa or eager attention).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers.cache_utils import DynamicCache, DynamicLayer

from hf_chainflow.generation.hybrid import (TREE_KWARG, HybridTreeContext, commit_hybrid_states, committed_length, is_hybrid_target,
                     prepare_hybrid_target, sync_linear_lengths)
from hf_chainflow.generation.settings import SUPPORTED_ATTN_IMPLEMENTATIONS
from hf_chainflow.generation.tree import DraftTree
from hf_chainflow.generation.verification import (_attn_implementation, _cache_kwarg, _check_cache, _validate_path, _validate_tree,
                           hidden_state_selection, select_target_states)

__all__ = ["RaggedRows", "BatchVerifyInputs", "BatchVerifyOutput", "BatchCommitHandle", "build_batch_verify_inputs",
           "verify_forward_batch", "commit_batch", "select_rows"]


@dataclass
class RaggedRows:
    """Where each row's committed tokens sit in a batched cache: columns `[starts[b], lengths[b])`."""

    starts: list[int]
    lengths: list[int]

    @classmethod
    def from_attention_mask(cls, mask: torch.Tensor) -> "RaggedRows":
        """Rows of a left-padded batch `(B, L)` after its prefill: row b starts after its padding and ends at `L`."""
        pads = (mask == 0).sum(1).tolist()
        return cls(starts=[int(p) for p in pads], lengths=[int(mask.shape[1])] * int(mask.shape[0]))

    @property
    def cache_length(self) -> int:
        return max(self.lengths)

    def positions(self) -> list[int]:
        """Each row's next position id: its committed tokens (padding not counted)."""
        return [length - start for start, length in zip(self.starts, self.lengths)]


@dataclass
class BatchVerifyInputs:
    """One batched verify forward's inputs; `n = 1 + max_b N_b`."""

    input_ids: torch.LongTensor  # (B, n): root, the row's nodes, then inert padding nodes
    position_ids: torch.LongTensor  # (B, n): committed length of the row + depth
    attention_mask: torch.Tensor  # (B, 1, n, T + n): bool (sdpa) or additive float (eager)
    parents: torch.LongTensor  # (B, n): flattened parents, root -1, padding nodes hang under the root
    ancestors: torch.BoolTensor  # (B, n, n)


def build_batch_verify_inputs(rows: RaggedRows, roots: list[int], trees: list[DraftTree], *,
                              attn_implementation: str = "sdpa", dtype: torch.dtype = torch.float32,
                              device=None) -> BatchVerifyInputs:
    """Flatten each row's `[root] + nodes` into the inputs of one forward over the batch (see `BatchVerifyInputs`)."""
    if attn_implementation not in SUPPORTED_ATTN_IMPLEMENTATIONS:
        raise ValueError(f"Batched verification needs a 4-D attention mask; attention implementation "
                         f"{attn_implementation!r} is not supported. Supported: {SUPPORTED_ATTN_IMPLEMENTATIONS}.")
    B = len(trees)
    if not B == len(roots) == len(rows.lengths):
        raise ValueError(f"One root and one tree per row: {len(rows.lengths)} rows, {len(roots)} roots, {B} trees.")
    for tree in trees:
        _validate_tree(tree)
    n = 1 + max(tree.num_nodes for tree in trees)
    T = rows.cache_length
    ids = torch.zeros(B, n, dtype=torch.long)
    depths = torch.ones(B, n, dtype=torch.long)
    parents = torch.zeros(B, n, dtype=torch.long)  # padding nodes: children of the root, nobody's ancestor
    ancestors = torch.eye(n, dtype=torch.bool).repeat(B, 1, 1)
    ancestors[:, :, 0] = True  # the root is everyone's ancestor
    depths[:, 0], parents[:, 0] = 0, -1
    for b, (root, tree) in enumerate(zip(roots, trees)):
        m = tree.num_nodes
        ids[b, 0] = int(root)
        if m:
            ids[b, 1 : m + 1] = tree.tokens.cpu()
            depths[b, 1 : m + 1] = tree.depths.cpu()
            parents[b, 1 : m + 1] = tree.parents.cpu() + 1
            ancestors[b, 1 : m + 1, 1 : m + 1] = tree.ancestor_matrix().cpu()
    col = torch.arange(T)
    starts, lengths = torch.tensor(rows.starts), torch.tensor(rows.lengths)
    prefix = (col[None] >= starts[:, None]) & (col[None] < lengths[:, None])  # (B, T): the row's valid columns
    allowed = torch.cat([prefix[:, None, :].expand(B, n, T), ancestors], -1)[:, None]  # (B, 1, n, T + n)
    if attn_implementation == "eager":  # eager adds the mask to the scores: additive 0 / finfo.min
        allowed = torch.where(allowed, torch.zeros((), dtype=dtype), torch.finfo(dtype).min)
    positions = torch.tensor(rows.positions())[:, None] + depths
    return BatchVerifyInputs(input_ids=ids.to(device), position_ids=positions.to(device),
                             attention_mask=allowed.to(device), parents=parents.to(device),
                             ancestors=ancestors.to(device))


@dataclass
class BatchCommitHandle:
    """What `commit_batch` needs from the verify forward."""

    cache_length: int  # T before the verify
    num_inputs: int  # n
    node_parents: list[list[int]]  # each row's tree parents
    hybrid: HybridTreeContext | None = None


@dataclass
class BatchVerifyOutput:
    """Row b's root is `logits[b, 0]`, its node `i` is `logits[b, i + 1]`; rows past `N_b + 1` are padding."""

    logits: torch.Tensor  # (B, n, V)
    hidden_states: torch.Tensor  # (B, n, D): last layer, after the final norm ((B, n, (1 + m) D) with `state_layers`)
    handle: BatchCommitHandle


@torch.no_grad()
def verify_forward_batch(target: nn.Module, cache: DynamicCache, rows: RaggedRows, roots: list[int],
                         trees: list[DraftTree], *, method: str = "chunk",
                         state_layers: tuple[int, ...] = ()) -> BatchVerifyOutput:
    """Score every row's `[root] + nodes` in one forward of `target`, appending `n` columns to `cache`
    (`state_layers`: as for `verify_forward`)."""
    hybrid = is_hybrid_target(target)
    _check_cache(cache, hybrid)
    T = committed_length(cache)
    if T != rows.cache_length:
        raise ValueError(f"The cache holds {T} columns but the rows' longest committed length is "
                         f"{rows.cache_length}; `RaggedRows` must describe this very cache.")
    device = target.get_input_embeddings().weight.device
    inputs = build_batch_verify_inputs(rows, roots, trees, attn_implementation=_attn_implementation(target),
                                       dtype=target.dtype, device=device)
    extra, ctx = {}, None
    if hybrid:
        prepare_hybrid_target(target)
        ctx = HybridTreeContext(parents=inputs.parents, ancestors=inputs.ancestors, method=method)
        extra[TREE_KWARG] = ctx
    out = target(input_ids=inputs.input_ids, position_ids=inputs.position_ids, attention_mask=inputs.attention_mask,
                 use_cache=True, output_hidden_states=hidden_state_selection(state_layers),
                 **{_cache_kwarg(target): cache}, **extra)
    handle = BatchCommitHandle(cache_length=T, num_inputs=inputs.input_ids.shape[1],
                               node_parents=[tree.parents.tolist() for tree in trees], hybrid=ctx)
    return BatchVerifyOutput(logits=out.logits, hidden_states=select_target_states(out.hidden_states, state_layers),
                             handle=handle)


@torch.no_grad()
def commit_batch(target: nn.Module, cache: DynamicCache, rows: RaggedRows, accepted: list[list[int]],
                 handle: BatchCommitHandle) -> None:
    """Row b keeps its root and `accepted[b]` (a root-to-node path of its tree) at `[length_b, length_b + m_b + 1)`;
    `rows.lengths` grow by `m_b + 1` and the cache is cut to the new longest row."""
    if not isinstance(handle, BatchCommitHandle):
        raise ValueError(f"`handle` must be the `BatchVerifyOutput.handle` of this round, got {type(handle).__name__}.")
    if len(accepted) != len(rows.lengths):
        raise ValueError(f"One accepted path per row: {len(rows.lengths)} rows, got {len(accepted)}.")
    for path, parents in zip(accepted, handle.node_parents):
        _validate_path(path, parents)
    T = handle.cache_length
    if committed_length(cache) != T + handle.num_inputs:
        raise ValueError(f"The cache holds {committed_length(cache)} columns but the verify forward left "
                         f"{T + handle.num_inputs}; commit exactly once, right after `verify_forward_batch`.")
    keep = [[0] + [a + 1 for a in path] for path in accepted]  # flattened inputs kept, per row
    if handle.hybrid is not None:  # first: it validates its records before writing anything
        last = torch.tensor([k[-1] for k in keep], device=handle.hybrid.parents.device)
        commit_hybrid_states(cache, handle.hybrid, last=last)
    batch = [b for b, k in enumerate(keep) for _ in k]
    dst = [rows.lengths[b] + j for b, k in enumerate(keep) for j in range(len(k))]
    src = [T + r for k in keep for r in k]
    rows.lengths = [length + len(k) for length, k in zip(rows.lengths, keep)]
    new_length = rows.cache_length
    for layer in cache.layers:
        if not isinstance(layer, DynamicLayer) or not layer.is_initialized:
            continue
        device = layer.keys.device
        bi, di, si = (torch.tensor(x, device=device) for x in (batch, dst, src))
        for name in ("keys", "values"):
            kv = getattr(layer, name)  # (B, H_kv, T + n, D)
            kv[bi, :, di] = kv[bi, :, si]  # gathered first, then written (sources lie at or after their targets)
            setattr(layer, name, kv[..., :new_length, :])
    if handle.hybrid is not None:
        sync_linear_lengths(cache)


def select_rows(cache: DynamicCache, rows: RaggedRows, keep: list[int]) -> None:
    """Keep only the rows `keep` (in that order) in `cache` and `rows`, and cut the columns no kept row uses (left
    padding common to all of them, holes past the longest)."""
    index = torch.tensor(keep, dtype=torch.long)
    cache.reorder_cache(index)
    rows.starts = [rows.starts[b] for b in keep]
    rows.lengths = [rows.lengths[b] for b in keep]
    left, right = min(rows.starts), rows.cache_length
    for layer in cache.layers:
        if isinstance(layer, DynamicLayer) and layer.is_initialized:
            layer.keys = layer.keys[..., left:right, :]
            layer.values = layer.values[..., left:right, :]
    sync_linear_lengths(cache)
    rows.starts = [s - left for s in rows.starts]
    rows.lengths = [n - left for n in rows.lengths]
