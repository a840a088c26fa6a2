"""Per-round verification maths for chain and tree drafts (batch size 1), kept apart from any decoding loop.

One round, given a target whose cache holds the committed prefix (`past_len` tokens) and the last committed token
`root` (the target's own "bonus" token, not yet in the cache), and a `DraftTree` of `N` nodes:

    out = verify_forward(target, cache, root, tree)          # one forward over [root] + nodes; cache grows by N+1
    acc = accept_greedy(tree, out.logits)                     # sampling: accept_sampling / accept_sampling_tree
    commit(target, cache, past_len, acc.nodes, out.handle)    # cache = prefix + root + accepted nodes
    root = acc.bonus                                          # next root; emitted: tree.tokens[acc.nodes] + [bonus]

Public API
----------
- `build_verify_inputs(root_token, tree, past_len, *, attn_implementation="sdpa", dtype=torch.float32, device=None)
  -> VerifyInputs`: flattened `[root] + nodes` ids `(1, n)`, positions `past_len + depth` `(1, n)`, the 4-D ancestor
  mask `(1, 1, n, past_len + n)` (bool for sdpa, additive 0/finfo.min for eager), flattened parents and ancestors.
- `ancestor_mask(ancestors, past_len, attn_implementation, dtype) -> Tensor`: just the 4-D mask.
- `verify_forward(target, cache, root_token, tree, *, method="chunk", state_layers=()) -> VerifyOutput`: scores root
  and every node in one forward. `.logits` `(n, V)` (row 0 = root, row `i + 1` = node `i`; row r predicts the token
  after input r), `.hidden_states` `(n, D)` (last layer, after the final norm; `(n, (1 + m) D)` with the outputs of
  the `m` decoder layers `state_layers` after it, `select_target_states`), `.handle` for `commit`. Works on a `DynamicCache`
  (dense targets) and on Qwen3.5 / Qwen3-Next hybrid `DynamicCache(config=...)`; `method` ("chunk" | "fork") picks
  the GDN back-end (see `hf_chainflow.generation.hybrid`).
- `accept_greedy(tree, logits) -> Acceptance(nodes, bonus)`: longest root-to-node path whose every token is the
  target's argmax at its parent; `bonus` = argmax at the last accepted input.
- `accept_sampling(tree, target_probs) -> Acceptance(nodes, bonus)`: speculative rejection sampling for CHAINS
  (accept with min(1, p/q), else resample from norm(max(0, p - q)); bonus from p after a full accept).
  `target_probs` is `(n, V)` processed probabilities or a callable `i -> (V,)` (called lazily, in order).
- `accept_sampling_tree(tree, target_probs) -> Acceptance(nodes, bonus)`: lossless sampling over ANY tree (top-k
  drafts, prompt-lookup branches): at each input the children are tried in order as fixed proposals, child `x`
  accepted with probability `p[x] / sum(p)`, a rejected child's token removed from `p`; the bonus is drawn from
  what is left. Needs no draft distribution.
  Randomness (both): `torch.rand` / `torch.multinomial` on the default generator (seed with `torch.manual_seed`).
- `processed_rows(logits_processor, committed, tree, logits) -> (n, V)`: a call's logits processors applied to each
  verified row with its own prefix (committed tokens + the node's ancestor path); `process_row` for one row.
- `commit(target, cache, past_len, accepted, handle) -> None`: cache := prefix + root + accepted nodes. Attention
  KV is gathered on the sequence dim; GDN conv window / recurrent state become those after the last accepted node
  (copied in place). Call it right after `verify_forward`, before any other forward on the cache.

Limits: batch size 1; `DynamicCache` whose layers are plain `DynamicLayer` (and `LinearAttentionLayer` for hybrid
targets) only (no static, sliding-window, quantized or offloaded caches); attention implementations "sdpa" and
"eager" only (flash attention cannot take an arbitrary mask, flex attention needs a `BlockMask`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn
from transformers.cache_utils import DynamicCache, DynamicLayer, LinearAttentionLayer

from hf_chainflow.generation.hybrid import (
    GDN_METHODS,
    TREE_KWARG,
    HybridTreeContext,
    commit_hybrid_states,
    committed_length,
    is_hybrid_target,
    prepare_hybrid_target,
    sync_linear_lengths,
)
from hf_chainflow.generation.settings import SUPPORTED_ATTN_IMPLEMENTATIONS
from hf_chainflow.generation.tree import DraftTree

__all__ = [
    "VerifyInputs",
    "VerifyOutput",
    "CommitHandle",
    "Acceptance",
    "accept_round",
    "choose_token",
    "SUPPORTED_ATTN_IMPLEMENTATIONS",
    "build_verify_inputs",
    "ancestor_mask",
    "verify_forward",
    "accept_greedy",
    "accept_sampling",
    "accept_sampling_tree",
    "process_row",
    "processed_rows",
    "commit",
]


# --------------------------------------------------------------------------------------------------------------
# Inputs: flattened tree, positions, ancestor mask
# --------------------------------------------------------------------------------------------------------------
@dataclass
class VerifyInputs:
    """The verify forward's inputs for one round; `n = N + 1` (root + nodes)."""

    input_ids: torch.LongTensor  # (1, n)
    position_ids: torch.LongTensor  # (1, n): past_len + depth, root depth 0
    attention_mask: torch.Tensor  # (1, 1, n, past_len + n): bool (sdpa) or additive float (eager)
    parents: torch.LongTensor  # (n,): flattened parents, root -1, node i -> parents[i] + 1
    ancestors: torch.BoolTensor  # (n, n): ancestors[r, c] = input c is r or one of r's ancestors
    past_len: int


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


def ancestor_mask(
    ancestors: torch.BoolTensor, past_len: int, attn_implementation: str, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """4-D attention mask `(1, 1, n, past_len + n)`: every input sees the whole prefix and its own ancestors.

    sdpa gets a bool mask (True = attend); eager gets an additive float mask (0 / `finfo(dtype).min`) in `dtype`,
    because eager adds the mask to the scores and a bool mask would be silently wrong.
    """
    if attn_implementation not in SUPPORTED_ATTN_IMPLEMENTATIONS:
        raise ValueError(
            f"Tree verification needs an arbitrary 4-D attention mask; attention implementation "
            f"{attn_implementation!r} is not supported (flash attention cannot take one, flex attention needs a "
            f"BlockMask). Supported: {SUPPORTED_ATTN_IMPLEMENTATIONS}; load the target with "
            "`attn_implementation=\"sdpa\"` or call `target.set_attn_implementation(\"sdpa\")`."
        )
    n = ancestors.shape[0]
    prefix = torch.ones(n, past_len, dtype=torch.bool, device=ancestors.device)
    allowed = torch.cat([prefix, ancestors], dim=1)[None, None]  # (1, 1, n, past_len + n)
    if attn_implementation == "sdpa":
        return allowed
    zero = torch.zeros((), dtype=dtype, device=ancestors.device)
    return torch.where(allowed, zero, torch.finfo(dtype).min)


def build_verify_inputs(
    root_token: int | torch.Tensor,
    tree: DraftTree,
    past_len: int,
    *,
    attn_implementation: str = "sdpa",
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> VerifyInputs:
    """Flatten `[root] + tree nodes` into the inputs of one verify forward (see `VerifyInputs`)."""
    _validate_tree(tree)
    if past_len < 0:
        raise ValueError(f"`past_len` must be >= 0, got {past_len}.")
    device = tree.tokens.device if device is None else torch.device(device)
    root = torch.as_tensor(root_token, dtype=torch.long, device=device).reshape(-1)
    if root.numel() != 1:
        raise ValueError(f"`root_token` must be a single token id (batch size 1), got {root.numel()} values.")
    tokens = tree.tokens.to(device=device, dtype=torch.long)
    n = tree.num_nodes + 1
    parents = torch.cat([torch.tensor([-1], device=device), tree.parents.to(device) + 1])  # (n,), root -1
    depths = torch.cat([torch.zeros(1, dtype=torch.long, device=device), tree.depths.to(device)])  # (n,)
    ancestors = torch.zeros(n, n, dtype=torch.bool, device=device)
    ancestors[:, 0] = True  # the root is everyone's ancestor
    ancestors[1:, 1:] = tree.ancestor_matrix().to(device)
    return VerifyInputs(
        input_ids=torch.cat([root, tokens])[None],
        position_ids=(past_len + depths)[None],
        attention_mask=ancestor_mask(ancestors, past_len, attn_implementation, dtype),
        parents=parents,
        ancestors=ancestors,
        past_len=past_len,
    )


# --------------------------------------------------------------------------------------------------------------
# Verify forward
# --------------------------------------------------------------------------------------------------------------
@dataclass
class CommitHandle:
    """What `commit` needs from the verify forward."""

    past_len: int
    num_inputs: int  # n = N + 1
    node_parents: list[int]  # the tree's parents (node indices, -1 = root)
    hybrid: HybridTreeContext | None = None  # GDN layer records (hybrid targets only)


@dataclass
class VerifyOutput:
    """Result of `verify_forward`. Row 0 is the root, row `i + 1` is tree node `i`."""

    logits: torch.Tensor  # (n, V)
    hidden_states: torch.Tensor  # (n, D): last layer, after the final norm (lm_head(hidden_states) == logits);
    # (n, (1 + m) D) with `state_layers`: each row followed by those m layers' outputs
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


def _check_cache(cache, hybrid: bool) -> None:
    supported = "a `DynamicCache` of `DynamicLayer`s" + (
        " and `LinearAttentionLayer`s (build it with `DynamicCache(config=target.config)`)" if hybrid else ""
    )
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
def verify_forward(
    target: nn.Module,
    cache: DynamicCache,
    root_token: int | torch.Tensor,
    tree: DraftTree,
    *,
    method: str = "chunk",
    state_layers: Sequence[int] = (),
) -> VerifyOutput:
    """Score `[root] + tree nodes` in one forward of `target` (batch size 1), appending them to `cache`.

    Args:
        target: a causal LM (Llama/Qwen3-style dense, or Qwen3.5 / Qwen3.5-MoE / Qwen3-Next hybrid; the latter get
            the tree-aware GDN layers installed on first use, see `hf_chainflow.generation.hybrid.prepare_hybrid_target`).
        cache: the target's `DynamicCache` holding exactly the committed prefix (without the root).
        root_token: the last committed token, not yet in the cache.
        tree: the draft (`DraftTree.chain(tokens)` for a chain).
        method: GDN back-end for hybrid targets, `"chunk"` (default) or `"fork"` (reference); ignored otherwise.
        state_layers: decoder layers whose outputs `hidden_states` carries after the final states (the drafter's
            `state_layers`; default: the final states only).

    Returns a `VerifyOutput`; after it the cache holds `past_len + n` KV entries (rejected ones included) and the GDN
    states are untouched until `commit`.
    """
    if method not in GDN_METHODS:
        raise ValueError(f"`method` must be one of {GDN_METHODS}, got {method!r}.")
    if cache is None:
        raise ValueError("`cache` is None; pass the target's cache holding the committed prefix.")
    hybrid = is_hybrid_target(target)
    _check_cache(cache, hybrid)
    attn = _attn_implementation(target)
    past_len = committed_length(cache)
    device = target.get_input_embeddings().weight.device
    inputs = build_verify_inputs(root_token, tree, past_len, attn_implementation=attn, dtype=target.dtype,
                                 device=device)
    extra = {}
    ctx = None
    if hybrid:
        prepare_hybrid_target(target)
        ctx = HybridTreeContext(parents=inputs.parents, ancestors=inputs.ancestors, method=method)
        extra[TREE_KWARG] = ctx
    out = target(
        input_ids=inputs.input_ids,
        position_ids=inputs.position_ids,
        attention_mask=inputs.attention_mask,
        use_cache=True,
        output_hidden_states=hidden_state_selection(state_layers),  # only the states the drafter reads are kept
        **{_cache_kwarg(target): cache},
        **extra,
    )
    handle = CommitHandle(past_len=past_len, num_inputs=inputs.input_ids.shape[1],
                          node_parents=tree.parents.tolist(), hybrid=ctx)
    return VerifyOutput(logits=out.logits[0], hidden_states=select_target_states(out.hidden_states, state_layers)[0],
                        handle=handle)


# --------------------------------------------------------------------------------------------------------------
# Acceptance
# --------------------------------------------------------------------------------------------------------------
class Acceptance(NamedTuple):
    """`nodes`: accepted tree-node indices, root-to-node order (may be empty). `bonus`: the target's own next token
    after the last accepted node (the next round's root)."""

    nodes: list[int]
    bonus: int


def _children(parents: list[int]) -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for i, p in enumerate(parents):
        children.setdefault(p, []).append(i)
    return children


def accept_greedy(tree: DraftTree, logits: torch.Tensor) -> Acceptance:
    """Greedy acceptance: walk from the root, each time taking the child whose token is the target's argmax at the
    current input (the first such child if siblings repeat a token). `logits` `(N + 1, V)`, row 0 = root."""
    n = tree.num_nodes + 1
    if logits.ndim != 2 or logits.shape[0] != n:
        raise ValueError(f"`logits` must have shape (num_nodes + 1, V) = ({n}, V), got {tuple(logits.shape)}.")
    top = logits.argmax(dim=-1).tolist()  # (n,)
    tokens = tree.tokens.tolist()
    children = _children(tree.parents.tolist())
    accepted: list[int] = []
    node, row = -1, 0
    while True:
        match = next((c for c in children.get(node, ()) if tokens[c] == top[row]), None)
        if match is None:
            return Acceptance(accepted, int(top[row]))
        accepted.append(match)
        node, row = match, match + 1


def accept_sampling(
    tree: DraftTree, target_probs: torch.Tensor | Callable[[int], torch.Tensor]
) -> Acceptance:
    """Speculative rejection sampling for a CHAIN draft: the emitted tokens are distributed as the target's `p`.

    Node `i` (token `x`, drawn from `q = tree.draft_probs[i]`) is accepted with probability `min(1, p_i[x] / q[x])`,
    where `p_i` is the target's processed distribution at input `i` (row 0 = root). On the first rejection the bonus
    is drawn from `norm(max(0, p_i - q))`; when all nodes are accepted it is drawn from `p_N`.

    Args:
        tree: a chain (`DraftTree.chain(tokens, draft_probs=q)`) with `draft_probs` `(N, V)`.
        target_probs: `(N + 1, V)` probabilities after the logits processors / temperature, or a callable
            `i -> (V,)` returning them for input `i` (called in order, only as far as needed).
    """
    if not tree.is_chain:
        raise ValueError(
            "`accept_sampling` implements rejection sampling for chains only (parents [-1, 0, 1, ...]); got a "
            "branching tree. Use `accept_sampling_tree` (or `accept_greedy`) for trees."
        )
    q_all = tree.draft_probs
    if q_all is None:
        raise ValueError("`tree.draft_probs` is None; rejection sampling needs the draft distribution q of each node.")
    n_nodes = tree.num_nodes
    if q_all.ndim != 2 or q_all.shape[0] != n_nodes:
        raise ValueError(
            f"`tree.draft_probs` must have shape (num_nodes, V) = ({n_nodes}, V), got {tuple(q_all.shape)}."
        )
    probs_at = _probs_at(target_probs, n_nodes)

    tokens = tree.tokens.tolist()
    accepted: list[int] = []
    for i in range(n_nodes):
        p = probs_at(i).float()  # (V,)
        q = q_all[i].to(p)  # (V,)
        x = tokens[i]
        if not q[x] > 0:
            raise ValueError(
                f"`tree.draft_probs[{i}, {x}]` is {float(q[x])}: node {i}'s token must have been drawn from its "
                "draft distribution."
            )
        ratio = p[x] / q[x]
        if torch.rand((), device=p.device) < ratio:  # accept with min(1, p/q)
            accepted.append(i)
            continue
        residual = (p - q).clamp_min(0)  # (V,)
        total = residual.sum()
        dist = residual / total if total > 0 else p
        return Acceptance(accepted, int(torch.multinomial(dist, 1)))
    p = probs_at(n_nodes).float()
    return Acceptance(accepted, int(torch.multinomial(p, 1)))


def accept_sampling_tree(
    tree: DraftTree, target_probs: torch.Tensor | Callable[[int], torch.Tensor]
) -> Acceptance:
    """Lossless sampling over any tree: each node's token is tried as a fixed proposal (recursive rejection).

    Walk from the root. At input `r` (row 0 = root, row `i + 1` = node `i`) keep a residual `p`, first the target's
    processed distribution `p_r`, and try the children of `r` in order: child `c` (token `x`) is accepted with
    probability `p[x] / sum(p)`; on rejection `p[x] = 0` and the next child is tried. After an accepted child the
    walk goes on from it; when every child is rejected, or `r` has none, the bonus is drawn from `p / sum(p)`.

    Why the output is the target's: at each input the emitted token is `x_1` with probability `p_r[x_1]`, else
    (probability `1 - p_r[x_1]`) a draw from `p_r` without `x_1`, and so on, which is exactly one draw from `p_r`.
    This holds for any choice of the children's tokens made before the target's coins are tossed, so it covers
    top-k tree drafts and prompt-lookup branches, which carry no draft distribution. At each input a child is
    accepted with probability `sum_c p_r[x_c]`: the target's mass that the children cover.

    Args:
        tree: any `DraftTree` (`draft_probs` is not read).
        target_probs: `(N + 1, V)` probabilities after the logits processors / temperature, or a callable
            `i -> (V,)` returning them for input `i` (called only for the inputs the walk reaches).
    """
    probs_at = _probs_at(target_probs, tree.num_nodes)
    tokens = tree.tokens.tolist()
    children = _children(tree.parents.tolist())
    accepted: list[int] = []
    node, row = -1, 0
    while True:
        residual = probs_at(row).float().clone()  # (V,)
        match = None
        for c in children.get(node, ()):
            mass = residual[tokens[c]]
            if mass > 0 and torch.rand((), device=residual.device) * residual.sum() < mass:
                match = c
                break
            residual[tokens[c]] = 0  # rejected (or impossible): the draw continues from the rest
        if match is None:  # the residual keeps mass: a rejected child never held all of it (u < 1)
            return Acceptance(accepted, int(torch.multinomial(residual, 1)))
        accepted.append(match)
        node, row = match, match + 1


def choose_token(row: torch.Tensor, do_sample: bool) -> int:
    """One token from the processed logits `row` `(V,)`: a draw from its softmax when sampling, else its argmax."""
    return int(torch.multinomial(torch.softmax(row, -1), 1)) if do_sample else int(row.argmax())


def accept_round(tree: DraftTree, rows: torch.Tensor, do_sample: bool) -> Acceptance:
    """One round's acceptance on the target's processed logits `rows` `(N + 1, V)` (row 0 = root): the greedy walk
    (`accept_greedy`), or lossless sampling: a chain with its draft distributions by `accept_sampling`, any other
    tree by `accept_sampling_tree`, an empty draft by one draw of the bonus from the root row."""
    if not do_sample:
        return accept_greedy(tree, rows)
    if not tree.num_nodes:
        return Acceptance([], choose_token(rows[0], do_sample))
    probs = torch.softmax(rows, -1)  # (N + 1, V)
    return accept_sampling(tree, probs) if tree.draft_probs is not None else accept_sampling_tree(tree, probs)


def _probs_at(target_probs: torch.Tensor | Callable[[int], torch.Tensor],
              n_nodes: int) -> Callable[[int], torch.Tensor]:
    """`target_probs` as a callable `row -> (V,)`, shape-checked when it is a tensor `(n_nodes + 1, V)`."""
    if callable(target_probs):
        return target_probs
    if target_probs.ndim != 2 or target_probs.shape[0] != n_nodes + 1:
        raise ValueError(
            f"`target_probs` must have shape (num_nodes + 1, V) = ({n_nodes + 1}, V), got "
            f"{tuple(target_probs.shape)}."
        )
    return target_probs.__getitem__


def process_row(logits_processor, prefix: torch.LongTensor, logits: torch.Tensor) -> torch.Tensor:
    """Apply a call's logits processors to one row `(V,)` given its full prefix `(L,)` -> float32 `(V,)`."""
    row = logits.float()[None]
    if logits_processor is not None and len(logits_processor) > 0:
        row = logits_processor(prefix[None], row)
    return row[0]


def processed_rows(logits_processor, committed: torch.LongTensor, tree: DraftTree, logits: torch.Tensor):
    """Processed logits `(n, V)` of root + nodes, each with its own prefix (committed + ancestor path)."""
    if logits_processor is None or len(logits_processor) == 0:
        return logits.float()
    rows = [process_row(logits_processor, committed, logits[0])]
    for i in range(tree.num_nodes):
        path = tree.tokens[tree.path_to(i)].to(committed.device)
        rows.append(process_row(logits_processor, torch.cat([committed, path]), logits[i + 1]))
    return torch.stack(rows)


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
def commit(
    target: nn.Module,
    cache: DynamicCache,
    past_len: int,
    accepted: Sequence[int] | torch.Tensor,
    handle: CommitHandle,
) -> None:
    """Make `cache` hold exactly the committed prefix + root + `accepted` nodes (in path order).

    Attention layers keep KV entries `[0, past_len)` and `past_len + [0] + [i + 1 for i in accepted]`: a slice when
    contiguous; otherwise the path's entries are moved down in place, then sliced, so the prefix is not copied.
    Hybrid GDN layers get the conv window and recurrent state after the last accepted node (or the root) copied in
    place. `handle` is `VerifyOutput.handle` of this round's verify.
    """
    if not isinstance(handle, CommitHandle):
        raise ValueError(f"`handle` must be the `VerifyOutput.handle` of this round, got {type(handle).__name__}.")
    if past_len != handle.past_len:
        raise ValueError(f"`past_len` is {past_len} but the verify forward ran at past_len {handle.past_len}.")
    hybrid = is_hybrid_target(target)
    if hybrid and handle.hybrid is None:
        raise ValueError("`target` is a hybrid model but `handle` carries no GDN records; verify with this target.")
    _check_cache(cache, hybrid)
    accepted = [int(a) for a in (accepted.tolist() if isinstance(accepted, torch.Tensor) else accepted)]
    _validate_path(accepted, handle.node_parents)
    seq_len = committed_length(cache)
    if seq_len != past_len + handle.num_inputs:
        raise ValueError(
            f"The cache holds {seq_len} tokens but the verify forward left past_len + n = "
            f"{past_len + handle.num_inputs}; commit exactly once, right after `verify_forward`."
        )

    rows = [0] + [a + 1 for a in accepted]  # flattened inputs to keep
    if handle.hybrid is not None:  # first: it validates its records before writing anything
        commit_hybrid_states(cache, handle.hybrid, last=rows[-1])
    keep_len = past_len + len(rows)
    contiguous = rows == list(range(len(rows)))
    for layer in cache.layers:
        if not isinstance(layer, DynamicLayer) or not layer.is_initialized:
            continue
        if contiguous:
            layer.keys = layer.keys[..., :keep_len, :]
            layer.values = layer.values[..., :keep_len, :]
        else:  # move the accepted path's entries down over the rejected ones; the prefix is not copied
            src = past_len + torch.tensor(rows, device=layer.keys.device)  # (m + 1,) ascending, src[j] >= past_len + j
            for name in ("keys", "values"):
                kv = getattr(layer, name)  # (B, H_kv, T, D)
                kv[..., past_len:keep_len, :] = kv.index_select(-2, src)  # gathered first, then written
                setattr(layer, name, kv[..., :keep_len, :])
    if handle.hybrid is not None:
        sync_linear_lengths(cache)
