"""Verification: one target forward scores every row's draft, then the cache keeps each row's accepted path.

A round over a batch of `B` rows (a single prompt is a batch of one), each with its own committed length and draft
(`DraftTree`, `N_b` nodes; `n = 1 + max_b N_b` inputs per row, the root first, shorter drafts padded with inert nodes):

    out = verify_forward_batch(target, cache, rows, roots, trees)   # ONE forward (B, n); the cache grows to T + n
    acc = accept_round(tree_b, rows_b, do_sample)                     # per row (`hf_chainflow.generation.acceptance`)
    commit_batch(target, cache, rows, accepted, out.handle)          # each row keeps its root + accepted path

The cache is shared by the rows and laid out per row as

    [ left padding | prompt | committed tokens | holes ]      columns 0 .. T-1, T = committed_length(cache)
      0 .. start_b            start_b .. length_b        length_b .. T-1

`RaggedRows` keeps `start_b` (first valid column) and `length_b` (one past the last committed one). Every input sees
its own row's valid columns and its ancestors within the block (a 4-D mask `(B, 1, n, T + n)`; bool for sdpa,
additive 0 / finfo.min for eager); positions are `length_b - start_b + depth`, so each row is scored exactly as if it
were alone. `commit_batch` moves row b's root and accepted entries from `T + [0, i_1 + 1, ...]` down to `length_b +
[0, 1, ...]` (nothing moves when they are already in place, as for an accepted chain prefix of a single row), sets
`length_b += m_b + 1` and cuts the cache to the new longest row; hybrid (Gated DeltaNet) rows get the conv window
and recurrent state of their own last accepted input (`hf_chainflow.generation.hybrid`). `select_rows` drops
finished rows. `verify_forward`, `commit` and `build_verify_inputs` are the same for one unpadded row, with the
root token, tree and `past_len` as arguments.

`.logits` `(B, n, V)`: row r predicts the token after input r; `.hidden_states` `(B, n, D)` (the last layer after the
final norm; `(B, n, (1 + m) D)` with the `m` decoder layers `state_layers` after it, `select_target_states`).

Compiled verification (`hf_chainflow.generation.compiled_verification`) runs the same rounds on a `StaticCache`: the
mask is the cache's `max_cache_len` columns wide (columns past `T + n` unseen), the inputs are padded to a bucket
with inert nodes (after any extra inputs), and the commit moves entries in place and resets the layers' length.

Limits: a `DynamicCache` whose layers are plain `DynamicLayer` (and `LinearAttentionLayer` for hybrid targets), or
a `StaticCache` of plain `StaticLayer`s for dense targets (no sliding-window, quantized or offloaded caches); attention implementations "sdpa" and "eager" only (flash
attention cannot take an arbitrary mask, flex attention needs a `BlockMask`).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ContextManager

import torch
from torch import nn
from transformers.cache_utils import DynamicCache, DynamicLayer, LinearAttentionLayer, StaticCache, StaticLayer

from hf_chainflow.generation.hybrid import (GDN_METHODS, TREE_KWARG, HybridTreeContext, commit_hybrid_states,
                                            committed_length, is_hybrid_target, prepare_hybrid_target,
                                            sync_linear_lengths)
from hf_chainflow.generation.settings import SUPPORTED_ATTN_IMPLEMENTATIONS
from hf_chainflow.generation.tree import DraftTree

__all__ = ["RaggedRows", "VerifyInputs", "ExtraInputs", "VerifyOutput", "CommitHandle", "SUPPORTED_ATTN_IMPLEMENTATIONS",
           "is_static", "ancestor_mask", "build_batch_verify_inputs", "build_verify_inputs", "verify_forward_batch",
           "verify_forward", "commit_batch", "commit", "select_rows", "select_target_states",
           "hidden_state_selection"]


# --------------------------------------------------------------------------------------------------------------
# Rows and inputs
# --------------------------------------------------------------------------------------------------------------
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
class VerifyInputs:
    """One verify forward's inputs; `n = 1 + max_b N_b`."""

    input_ids: torch.LongTensor  # (B, n): root, the row's nodes, then inert padding nodes
    position_ids: torch.LongTensor  # (B, n): committed length of the row + depth
    attention_mask: torch.Tensor  # (B, 1, n, T + n): bool (sdpa) or additive float (eager)
    parents: torch.LongTensor  # (B, n): flattened parents, root -1, padding nodes hang under the root
    ancestors: torch.BoolTensor  # (B, n, n): ancestors[b, r, c] = input c is r or one of r's ancestors


@dataclass
class ExtraInputs:
    """A row's extra inputs of a verify forward, scored beside its draft and dropped at commit (a fused-forward
    proposer's own rows, e.g. Lafa's candidate blocks drafted in the verification forward). `E` inputs:

    - `input_ids` `(E,)`; `positions` `(E,)`: position offsets from the row's next position (the root's is 0);
    - `sees_draft` `(E, N + 1)` bool: which of the row's `[root] + nodes` each extra input attends to (besides the
      row's committed prefix, which it always sees);
    - `sees_extra` `(E, E)` bool: which extra inputs each attends to (e.g. all of its own block, bidirectionally).

    The draft's inputs never see extra inputs, so their logits are those of a forward without them."""

    input_ids: torch.LongTensor
    positions: torch.LongTensor
    sees_draft: torch.BoolTensor
    sees_extra: torch.BoolTensor

    def __post_init__(self):
        E = int(self.input_ids.shape[0]) if self.input_ids.dim() == 1 else -1
        shapes = {"input_ids": (E,), "positions": (E,), "sees_extra": (E, E)}
        for name, shape in shapes.items():
            if tuple(getattr(self, name).shape) != shape:
                raise ValueError(f"`ExtraInputs.{name}` must have shape {shape} (E = len(input_ids)), got "
                                 f"{tuple(getattr(self, name).shape)}.")
        if self.sees_draft.dim() != 2 or self.sees_draft.shape[0] != E:
            raise ValueError(f"`ExtraInputs.sees_draft` must have shape ({E}, N + 1), got "
                             f"{tuple(self.sees_draft.shape)}.")

    @property
    def num_inputs(self) -> int:
        return int(self.input_ids.shape[0])


def _validate_tree(tree: DraftTree) -> None:
    n = tree.num_nodes
    for name in ("tokens", "parents", "depths"):
        value = getattr(tree, name)
        if value.ndim != 1 or value.shape[0] != n:
            raise ValueError(
                f"`tree.{name}` must be 1-D with one entry per node ({n}), got shape {tuple(value.shape)}."
            )
    parents, depths = tree.parents.tolist(), tree.depths.tolist()
    for i, (p, d) in enumerate(zip(parents, depths)):
        if not -1 <= p < i:
            raise ValueError(
                f"`tree.parents[{i}]` is {p}; parents must satisfy -1 <= parents[i] < i (nodes in topological, "
                "e.g. breadth-first, order, -1 for children of the root)."
            )
        expected = 1 if p < 0 else depths[p] + 1
        if d != expected:
            raise ValueError(
                f"`tree.depths[{i}]` is {d} but its parent {p} implies depth {expected} (children of the root have "
                "depth 1)."
            )


def _check_attn(attn_implementation: str) -> None:
    if attn_implementation not in SUPPORTED_ATTN_IMPLEMENTATIONS:
        raise ValueError(
            f"Tree verification needs an arbitrary 4-D attention mask; attention implementation "
            f"{attn_implementation!r} is not supported (flash attention cannot take one, flex attention needs a "
            f"BlockMask). Supported: {SUPPORTED_ATTN_IMPLEMENTATIONS}; load the target with "
            "`attn_implementation=\"sdpa\"` or call `target.set_attn_implementation(\"sdpa\")`."
        )


def _mask(prefix: torch.BoolTensor, ancestors: torch.BoolTensor, attn_implementation: str,
          dtype: torch.dtype, width: int | None = None) -> torch.Tensor:
    """`prefix` `(B, T)` (the columns each row sees), `ancestors` `(B, n, n)` -> the 4-D mask `(B, 1, n, T + n)`
    (`(B, 1, n, width)` with `width`, a static cache's columns: those past `T + n` unseen): bool for sdpa; an
    additive float mask (0 / `finfo(dtype).min`) in `dtype` for eager, which adds the mask to the scores (a bool
    mask would be silently wrong)."""
    _check_attn(attn_implementation)
    B, n = ancestors.shape[:2]
    parts = [prefix[:, None, :].expand(B, n, prefix.shape[1]), ancestors]
    if width is not None:
        parts.append(torch.zeros(B, n, width - prefix.shape[1] - n, dtype=torch.bool, device=ancestors.device))
    allowed = torch.cat(parts, -1)[:, None]
    if attn_implementation == "sdpa":
        return allowed
    zero = torch.zeros((), dtype=dtype, device=allowed.device)
    return torch.where(allowed, zero, torch.finfo(dtype).min)


def ancestor_mask(ancestors: torch.BoolTensor, past_len: int, attn_implementation: str,
                  dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The mask `(1, 1, n, past_len + n)` of one unpadded row: every input sees the whole prefix and its own
    ancestors (`ancestors` `(n, n)`)."""
    prefix = torch.ones(1, past_len, dtype=torch.bool, device=ancestors.device)
    return _mask(prefix, ancestors[None], attn_implementation, dtype)


def build_batch_verify_inputs(rows: RaggedRows, roots: list[int], trees: list[DraftTree], *,
                              attn_implementation: str = "sdpa", dtype: torch.dtype = torch.float32,
                              device=None, extra: list[ExtraInputs | None] | None = None,
                              pad_to: int | None = None, mask_width: int | None = None) -> VerifyInputs:
    """Flatten each row's `[root] + nodes` into the inputs of one forward over the batch (see `VerifyInputs`); with
    `extra`, each row's `ExtraInputs` follow at `[n, n + E)` (`E` the most of any row; fewer padded inertly).
    `pad_to` pads every row with inert nodes (children of the root that no input sees) to that many inputs;
    `mask_width` is a static cache's width (the mask's last dimension; default `T + inputs`)."""
    _check_attn(attn_implementation)
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
    if extra is not None and any(e is not None for e in extra):
        ids, depths, parents, ancestors = _with_extra(trees, extra, ids, depths, parents, ancestors)
    if pad_to is not None and pad_to > ids.shape[1]:
        ids, depths, parents, ancestors = _padded(pad_to, ids, depths, parents, ancestors)
    if mask_width is not None and T + ids.shape[1] > mask_width:
        raise ValueError(f"A verify forward of {ids.shape[1]} inputs after {T} committed columns needs "
                         f"{T + ids.shape[1]} cache columns; the static cache holds {mask_width}.")
    positions = torch.tensor(rows.positions())[:, None] + depths
    mask = _mask(prefix, ancestors, attn_implementation, dtype, mask_width)
    return VerifyInputs(input_ids=ids.to(device), position_ids=positions.to(device), attention_mask=mask.to(device),
                        parents=parents.to(device), ancestors=ancestors.to(device))


def _padded(width, ids, depths, parents, ancestors):
    """The block inputs `(B, w)` grown to `(B, width)` by inert nodes: children of the root at depth 1 that see
    the root and themselves and that no other input sees."""
    B, w = ids.shape
    P = width - w
    grown = torch.zeros(B, width, width, dtype=torch.bool)
    grown[:, :w, :w] = ancestors
    grown[:, w:, w:] = torch.eye(P, dtype=torch.bool)
    grown[:, w:, 0] = True
    return (torch.cat([ids, ids.new_zeros(B, P)], 1), torch.cat([depths, depths.new_ones(B, P)], 1),
            torch.cat([parents, parents.new_zeros(B, P)], 1), grown)


def _with_extra(trees, extra, ids, depths, parents, ancestors):
    """The block inputs `(B, n)` (`(B, n, n)`) grown by each row's extra inputs to `(B, n + E)`: extra input `e` of
    row b sees the draft inputs its `sees_draft` names and the extra inputs its `sees_extra` names; the draft's
    inputs see no extra input; padding extra inputs see only themselves."""
    if len(extra) != len(trees):
        raise ValueError(f"One `ExtraInputs` (or None) per row: {len(trees)} rows, got {len(extra)}.")
    B, n = ids.shape
    E = max(0 if e is None else e.num_inputs for e in extra)
    ids = torch.cat([ids, ids.new_zeros(B, E)], 1)
    depths = torch.cat([depths, depths.new_zeros(B, E)], 1)
    parents = torch.cat([parents, parents.new_zeros(B, E)], 1)  # (GDN layers refuse extra inputs)
    grown = torch.zeros(B, n + E, n + E, dtype=torch.bool)
    grown[:, :n, :n] = ancestors
    grown[:, n:, n:] = torch.eye(E, dtype=torch.bool)
    for b, (tree, e) in enumerate(zip(trees, extra)):
        if e is None:
            continue
        m, k = tree.num_nodes + 1, e.num_inputs
        if e.sees_draft.shape[1] != m:
            raise ValueError(f"Row {b}: `ExtraInputs.sees_draft` must have one column per input of its draft "
                             f"([root] + {tree.num_nodes} nodes = {m}), got {e.sees_draft.shape[1]}.")
        ids[b, n : n + k] = e.input_ids.cpu()
        depths[b, n : n + k] = e.positions.cpu()
        grown[b, n : n + k, :m] = e.sees_draft.cpu()
        grown[b, n : n + k, n : n + k] = e.sees_extra.cpu()
    return ids, depths, parents, grown


def build_verify_inputs(root_token: int | torch.Tensor, tree: DraftTree, past_len: int, *,
                        attn_implementation: str = "sdpa", dtype: torch.dtype = torch.float32,
                        device: torch.device | str | None = None) -> VerifyInputs:
    """`build_batch_verify_inputs` for one unpadded row holding `past_len` committed tokens (a batch of one)."""
    if past_len < 0:
        raise ValueError(f"`past_len` must be >= 0, got {past_len}.")
    root = torch.as_tensor(root_token).reshape(-1)
    if root.numel() != 1:
        raise ValueError(f"`root_token` must be a single token id (batch size 1), got {root.numel()} values.")
    device = tree.tokens.device if device is None else torch.device(device)
    return build_batch_verify_inputs(RaggedRows([0], [past_len]), [int(root)], [tree],
                                     attn_implementation=attn_implementation, dtype=dtype, device=device)


# --------------------------------------------------------------------------------------------------------------
# Verify forward
# --------------------------------------------------------------------------------------------------------------
@dataclass
class CommitHandle:
    """What `commit_batch` needs from the verify forward."""

    cache_length: int  # T before the verify
    num_inputs: int  # n (after any bucket padding)
    node_parents: list[list[int]]  # each row's tree parents
    hybrid: HybridTreeContext | None = None  # GDN layer records (hybrid targets only)
    extra_start: int = 0  # where the rows' extra inputs start (after the largest draft's [root] + nodes)


@dataclass
class VerifyOutput:
    """Row b's root is `logits[b, 0]`, its node `i` is `logits[b, i + 1]`; inputs past `N_b + 1` are padding (for
    `verify_forward`, one row: `(n, V)` and `(n, D)`)."""

    logits: torch.Tensor  # (B, n, V)
    hidden_states: torch.Tensor  # (B, n, D): last layer, after the final norm ((B, n, (1 + m) D) with `state_layers`)
    handle: CommitHandle


def select_target_states(hidden_states: tuple, state_layers: Sequence[int] = ()) -> torch.Tensor:
    """What a drafter reads from a target forward's `hidden_states` (transformers' tuple: the embeddings, then each
    decoder layer's output, the last one after the final norm): the final states `(..., T, D)`, or with
    `state_layers` (a drafter's `state_layers`: 0-based decoder layers) the final states followed by those layers'
    outputs, `(..., T, (1 + m) D)`."""
    if not state_layers:
        return hidden_states[-1]
    return torch.cat([hidden_states[-1], *(hidden_states[i + 1] for i in state_layers)], -1)


def hidden_state_selection(state_layers: Sequence[int] = ()) -> int | list[int]:
    """`output_hidden_states=` for a forward whose hidden states only `select_target_states(..., state_layers)`
    reads (transformers keeps only the selected ones)."""
    return -1 if not state_layers else [i + 1 for i in state_layers] + [-1]


_CACHE_KWARG: dict[type, str] = {}


def _cache_kwarg(target: nn.Module) -> str:
    """`cache` when the model's forward takes it (transformers >= 5.x), else the deprecated `past_key_values`."""
    cls = type(target)
    if cls not in _CACHE_KWARG:
        params = inspect.signature(target.forward).parameters
        _CACHE_KWARG[cls] = "cache" if "cache" in params else "past_key_values"
    return _CACHE_KWARG[cls]


def is_static(cache) -> bool:
    """A `StaticCache` (compiled verification's cache: fixed-width layers, written in place)."""
    return isinstance(cache, StaticCache)


def _check_cache(cache, hybrid: bool) -> None:
    supported = "a `DynamicCache` of `DynamicLayer`s" + (
        " and `LinearAttentionLayer`s (build it with `DynamicCache(config=target.config)`)" if hybrid else
        " or a `StaticCache` of `StaticLayer`s"
    )
    if is_static(cache) and not hybrid and not getattr(cache, "offloading", False):
        for i, layer in enumerate(cache.layers):
            if type(layer) is not StaticLayer:
                raise ValueError(f"Layer {i} of the StaticCache is a {type(layer).__name__}; verification supports "
                                 f"{supported} only (no sliding-window layers).")
        return
    if not isinstance(cache, DynamicCache):
        raise ValueError(
            f"`cache` is a {type(cache).__name__}; tree verification supports {supported} only (static, quantized "
            "and encoder-decoder caches are not supported)."
        )
    if getattr(cache, "offloading", False):
        raise ValueError(f"`cache` is an offloaded {type(cache).__name__}; supported: {supported}, not offloaded.")
    allowed = (DynamicLayer, LinearAttentionLayer) if hybrid else (DynamicLayer,)
    for i, layer in enumerate(cache.layers):
        if type(layer) not in allowed:  # exact types: sliding-window / quantized subclasses are not supported
            raise ValueError(
                f"Layer {i} of the {type(cache).__name__} is a {type(layer).__name__}; tree verification supports "
                f"{supported} only (no sliding-window, quantized or combined layers)."
            )
        if isinstance(layer, LinearAttentionLayer) and layer.record_past:
            raise ValueError(
                f"Layer {i} of the cache records past conv states (`activate_past_recording()`); tree verification "
                "rolls back by itself: use a cache without past recording."
            )


def _attn_implementation(target: nn.Module) -> str:
    return getattr(target.config, "_attn_implementation", None) or "eager"


@torch.no_grad()
def verify_forward_batch(target: nn.Module, cache: DynamicCache, rows: RaggedRows, roots: list[int],
                         trees: list[DraftTree], *, method: str = "chunk", state_layers: Sequence[int] = (),
                         extra: list[ExtraInputs | None] | None = None, compiled=None,
                         around_forward: Callable[[VerifyInputs, int], ContextManager] | None = None
                         ) -> VerifyOutput:
    """Score every row's `[root] + nodes` in one forward of `target`, appending `n` columns to `cache`.

    Args:
        target: a causal LM (Llama/Qwen3-style dense, or Qwen3.5 / Qwen3.5-MoE / Qwen3-Next hybrid; the latter get
            the tree-aware GDN layers installed on first use, see `hf_chainflow.generation.hybrid.prepare_hybrid_target`).
        cache: the target's `DynamicCache`, described by `rows`; roots: each row's last committed token, not yet in
            the cache; trees: each row's draft (`DraftTree.chain(tokens)` for a chain).
        method: GDN back-end for hybrid targets, `"chunk"` (default) or `"fork"` (reference); ignored otherwise.
        state_layers: decoder layers whose outputs `hidden_states` carries after the final states (the drafter's
            `state_layers`; default: the final states only).
        extra: per row, `ExtraInputs` scored after its draft (`logits[b, n:]`) and dropped by `commit_batch`;
            attention-only targets (a Gated DeltaNet layer runs its inputs along tree paths, with no block to see
            bidirectionally).
        compiled: a `compiled_verification.CompiledVerifier` (with a `StaticCache`): the inputs are padded to its
            bucket and the forward runs compiled where it can (counted by the verifier).
        around_forward: a fused-forward proposer's context (`Proposer.forward_context`): called as
            `around_forward(inputs, extra_start)` with this forward's `VerifyInputs` and the first column of the
            extra inputs, and entered around the one `target(...)` call (e.g. Lafa's noise-row hooks). Eager
            forwards only: a context that hooks the target's modules would be traced into a compiled graph.

    Returns a `VerifyOutput`; the GDN states are untouched until `commit_batch`.
    """
    if method not in GDN_METHODS:
        raise ValueError(f"`method` must be one of {GDN_METHODS}, got {method!r}.")
    if cache is None:
        raise ValueError("`cache` is None; pass the target's cache holding the committed prefix.")
    hybrid = is_hybrid_target(target)
    if hybrid and extra is not None and any(e is not None for e in extra):
        raise ValueError("Extra verify inputs (a fused-forward proposer's rows) need an attention-only target: "
                         "a Gated DeltaNet layer runs its inputs in order along tree paths, so a block that sees "
                         "itself bidirectionally cannot be scored in it. Use a dense target, or a proposer without "
                         "extra inputs.")
    _check_cache(cache, hybrid)
    T = committed_length(cache)
    if T != rows.cache_length:
        raise ValueError(f"The cache holds {T} columns but the rows' longest committed length is "
                         f"{rows.cache_length}; `RaggedRows` must describe this very cache.")
    if around_forward is not None and compiled is not None:
        raise ValueError("`around_forward` (a fused-forward proposer's context, e.g. Lafa's noise-row hooks) cannot "
                         "be combined with `compiled` verification: the hooks it installs on the target's modules "
                         "would be traced into the compiled graph and kept there after the context ends. Verify "
                         "eagerly (`compiled=None`).")
    device = target.get_input_embeddings().weight.device
    static = is_static(cache)
    pad_to = None
    if compiled is not None:
        if not static:
            raise ValueError("`compiled` verification needs the `StaticCache` it was built for, got a "
                             f"{type(cache).__name__}.")
        width = 1 + max(tree.num_nodes for tree in trees) + max(
            (e.num_inputs for e in extra or () if e is not None), default=0)
        pad_to = compiled.pad_to(width)
    inputs = build_batch_verify_inputs(rows, roots, trees, attn_implementation=_attn_implementation(target),
                                       dtype=target.dtype, device=device, extra=extra, pad_to=pad_to,
                                       mask_width=cache.layers[0].max_cache_len if static else None)
    kwargs, ctx = {}, None
    if hybrid:
        prepare_hybrid_target(target)
        ctx = HybridTreeContext(parents=inputs.parents, ancestors=inputs.ancestors, method=method)
        kwargs[TREE_KWARG] = ctx
    forward_kwargs = dict(input_ids=inputs.input_ids, position_ids=inputs.position_ids,
                          attention_mask=inputs.attention_mask, use_cache=True,
                          output_hidden_states=hidden_state_selection(state_layers),  # only what is read
                          **{_cache_kwarg(target): cache}, **kwargs)
    extra_start = 1 + max(tree.num_nodes for tree in trees)
    if compiled is None:
        with contextlib.nullcontext() if around_forward is None else around_forward(inputs, extra_start):
            out = target(**forward_kwargs)
    else:
        out = compiled.forward(target, pad_to is not None, lambda: _set_length(cache, T), **forward_kwargs)
    handle = CommitHandle(cache_length=T, num_inputs=inputs.input_ids.shape[1],
                          node_parents=[tree.parents.tolist() for tree in trees], hybrid=ctx,
                          extra_start=extra_start)
    return VerifyOutput(logits=out.logits, hidden_states=select_target_states(out.hidden_states, state_layers),
                        handle=handle)


@torch.no_grad()
def verify_forward(target: nn.Module, cache: DynamicCache, root_token: int | torch.Tensor, tree: DraftTree, *,
                   method: str = "chunk", state_layers: Sequence[int] = ()) -> VerifyOutput:
    """`verify_forward_batch` for one unpadded row whose cache holds exactly its committed prefix (without the
    root): `.logits` `(n, V)`, `.hidden_states` `(n, D)`; after it the cache holds `past_len + n` entries."""
    if cache is None:
        raise ValueError("`cache` is None; pass the target's cache holding the committed prefix.")
    root = torch.as_tensor(root_token).reshape(-1)
    if root.numel() != 1:
        raise ValueError(f"`root_token` must be a single token id (batch size 1), got {root.numel()} values.")
    _check_cache(cache, is_hybrid_target(target))
    rows = RaggedRows([0], [committed_length(cache)])
    out = verify_forward_batch(target, cache, rows, [int(root)], [tree], method=method, state_layers=state_layers)
    return VerifyOutput(logits=out.logits[0], hidden_states=out.hidden_states[0], handle=out.handle)


# --------------------------------------------------------------------------------------------------------------
# Commit
# --------------------------------------------------------------------------------------------------------------
def _validate_path(accepted: list[int], parents: list[int]) -> None:
    expected_parent = -1
    for node in accepted:
        if not 0 <= node < len(parents) or parents[node] != expected_parent:
            raise ValueError(
                f"`accepted` = {accepted} is not a root-to-node path of the tree (node {node} does not hang under "
                f"{'the root' if expected_parent < 0 else f'node {expected_parent}'}); pass `Acceptance.nodes`."
            )
        expected_parent = node


@torch.no_grad()
def commit_batch(target: nn.Module, cache: DynamicCache, rows: RaggedRows, accepted: list[list[int]],
                 handle: CommitHandle) -> None:
    """Row b keeps its root and `accepted[b]` (a root-to-node path of its tree) at `[length_b, length_b + m_b + 1)`;
    `rows.lengths` grow by `m_b + 1` and the cache is cut to the new longest row. Entries already in place are not
    copied (a contiguous accepted prefix of the longest row); the others are gathered first, then written over the
    rejected ones. Hybrid GDN rows get the conv window and recurrent state after their own last accepted input.
    Call it once, right after `verify_forward_batch`, before any other forward on the cache."""
    if not isinstance(handle, CommitHandle):
        raise ValueError(f"`handle` must be the `VerifyOutput.handle` of this round, got {type(handle).__name__}.")
    if len(accepted) != len(rows.lengths):
        raise ValueError(f"One accepted path per row: {len(rows.lengths)} rows, got {len(accepted)}.")
    hybrid = is_hybrid_target(target)
    if hybrid and handle.hybrid is None:
        raise ValueError("`target` is a hybrid model but `handle` carries no GDN records; verify with this target.")
    _check_cache(cache, hybrid)
    accepted = [[int(a) for a in (p.tolist() if isinstance(p, torch.Tensor) else p)] for p in accepted]
    for path, parents in zip(accepted, handle.node_parents):
        _validate_path(path, parents)
    T = handle.cache_length
    if committed_length(cache) != T + handle.num_inputs:
        raise ValueError(f"The cache holds {committed_length(cache)} tokens but the verify forward left "
                         f"{T + handle.num_inputs}; commit exactly once, right after the verify forward.")
    keep = [[0] + [a + 1 for a in path] for path in accepted]  # flattened inputs kept, per row
    if handle.hybrid is not None:  # first: it validates its records before writing anything
        last = torch.tensor([k[-1] for k in keep], device=handle.hybrid.parents.device)
        commit_hybrid_states(cache, handle.hybrid, last=last)
    moves = [(b, rows.lengths[b] + j, T + r) for b, k in enumerate(keep) for j, r in enumerate(k)
             if rows.lengths[b] + j != T + r]  # (row, destination, source); sources lie after their destinations
    rows.lengths = [length + len(k) for length, k in zip(rows.lengths, keep)]
    new_length = rows.cache_length
    for layer in cache.layers:
        if not isinstance(layer, (DynamicLayer, StaticLayer)) or not layer.is_initialized:
            continue
        if moves:
            bi, di, si = (torch.tensor(x, device=layer.keys.device) for x in zip(*moves))
            for name in ("keys", "values"):
                kv = getattr(layer, name)  # (B, H_kv, T + n, D); a static layer's (B, H_kv, max_cache_len, D)
                kv[bi, :, di] = kv[bi, :, si]  # gathered first, then written (in place)
        if isinstance(layer, StaticLayer):  # in place: the columns past the length are unseen, then overwritten
            layer.cumulative_length.fill_(new_length)
        else:
            layer.keys = layer.keys[..., :new_length, :]
            layer.values = layer.values[..., :new_length, :]
    if handle.hybrid is not None:
        sync_linear_lengths(cache)


@torch.no_grad()
def commit(target: nn.Module, cache: DynamicCache, past_len: int, accepted: Sequence[int] | torch.Tensor,
           handle: CommitHandle) -> None:
    """`commit_batch` for one unpadded row (`verify_forward`): the cache := prefix + root + `accepted` nodes."""
    if not isinstance(handle, CommitHandle):
        raise ValueError(f"`handle` must be the `VerifyOutput.handle` of this round, got {type(handle).__name__}.")
    if past_len != handle.cache_length:
        raise ValueError(f"`past_len` is {past_len} but the verify forward ran at past_len {handle.cache_length}.")
    commit_batch(target, cache, RaggedRows([0], [past_len]), [accepted], handle)


def _set_length(cache, length: int) -> None:
    """A static cache's layers hold `length` columns (in place; the entries past it are unseen)."""
    for layer in cache.layers:
        if isinstance(layer, StaticLayer):
            layer.cumulative_length.fill_(length)


def select_rows(cache: DynamicCache, rows: RaggedRows, keep: list[int]) -> None:
    """Keep only the rows `keep` (in that order) in `cache` and `rows`, and cut the columns no kept row uses (left
    padding common to all of them, holes past the longest; a static cache keeps its width and only its length
    shrinks)."""
    index = torch.tensor(keep, dtype=torch.long)
    cache.reorder_cache(index)
    rows.starts = [rows.starts[b] for b in keep]
    rows.lengths = [rows.lengths[b] for b in keep]
    if is_static(cache):
        _set_length(cache, rows.cache_length)
        return
    left, right = min(rows.starts), rows.cache_length
    for layer in cache.layers:
        if isinstance(layer, DynamicLayer) and layer.is_initialized:
            layer.keys = layer.keys[..., left:right, :]
            layer.values = layer.values[..., left:right, :]
    sync_linear_lengths(cache)
    rows.starts = [s - left for s in rows.starts]
    rows.lengths = [n - left for n in rows.lengths]
