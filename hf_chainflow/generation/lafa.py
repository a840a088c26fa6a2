"""Lafa's fused forward: one target forward verifies a row's previous draft and drafts its next block.

A round of a row holding `past` committed tokens, with block size `B` and a chain draft `d_1 .. d_N` (`N <= B - 1`;
the root `r` is the row's last committed token, not yet in the cache):

    inputs            positions (offsets from `past`)     sees (besides the committed prefix)
    verify  r, d_1 .. d_N          0 .. N                  verify rows up to itself (causal)
    block a (a in 0..N) B noise rows  a + 1 .. a + B       verify rows 0 .. a, and its own block both ways

Block `a` is the candidate for "the first `a` draft tokens are accepted": its rows sit where the bonus token and the
next `B - 1` tokens will be if that happens. A noise row predicts the token at its own position, so block `a`'s
row 0 is the bonus (which verify row `a` gives exactly) and rows `1 .. B - 1` are the next draft: a round commits at
most `B` tokens. The verify rows never see a noise row, and the drafter's weights act only on the noise rows
(`LafaDrafter.noise_rows`), so the verify rows' logits are those of plain verification.

    out = fused_verify_forward(target, lafa, cache, rows, roots, trees)    # ONE forward; the cache grows
    a = ...                                                                 # accepted length, from out.verify_logits
    draft = out.next_draft(row, a)                                          # block a's rows 1 .. B - 1
    commit_fused(target, cache, rows, [a, ...], out)                        # keeps root + d_1 .. d_a per row

The rows and the cache are those of `hf_chainflow.generation.verification` (`RaggedRows`, a `DynamicCache`); the
noise rows are its `ExtraInputs`, scored after each row's draft and dropped by the commit. Attention-only targets
(a hybrid target is refused when the drafter binds: `models.lafa.binding_lafa.LafaTargetError`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers.cache_utils import DynamicCache

from hf_chainflow.checks import is_int
from hf_chainflow.generation import verification
from hf_chainflow.generation.tree import DraftTree
from hf_chainflow.generation.verification import ExtraInputs, RaggedRows, VerifyOutput
from hf_chainflow.models.lafa.binding_lafa import check_attention_only

__all__ = ["FusedVerifyOutput", "commit_fused", "extra_row_mask", "fused_verify_forward", "lafa_extra_inputs",
           "noise_rows_around"]


def _check_block_size(block_size) -> None:
    if not is_int(block_size) or block_size < 2:
        raise ValueError(f"`block_size` must be an integer >= 2 (a block's first row is the bonus token), got "
                         f"{block_size!r}; use the drafter's `config.block_size`.")


def _check_lengths(accepted_lengths, num_nodes: int, where: str = "") -> list[int]:
    """The accepted lengths a round drafts a block for: distinct, increasing, each in `0 .. num_nodes`."""
    if accepted_lengths is None:
        return list(range(num_nodes + 1))
    lengths = list(accepted_lengths)
    if not lengths or any(not is_int(a) or not 0 <= a <= num_nodes for a in lengths) or lengths != sorted(set(lengths)):
        raise ValueError(f"`accepted_lengths`{where} must be distinct increasing integers in 0 .. {num_nodes} (the "
                         f"draft's {num_nodes} nodes: one candidate block per accepted length), got {lengths!r}; "
                         f"None: all of them.")
    return lengths


def lafa_extra_inputs(block_size: int, num_nodes: int, *, accepted_lengths: Sequence[int] | None = None,
                      noise_token_id: int = 0) -> ExtraInputs:
    """The noise rows of one row's fused round as `verification.ExtraInputs`: a block of `block_size` rows for
    each accepted length `a` of `accepted_lengths` (default `0 .. num_nodes`), in that order. Block `a` sits at
    position offsets `a + 1 .. a + block_size`, sees the root and the draft's nodes `1 .. a` (a chain of
    `num_nodes` nodes) and its own rows in both directions. The token ids are `noise_token_id` (the drafter replaces
    the noise rows' inputs; the id is what a forward without the drafter would read)."""
    _check_block_size(block_size)
    if not is_int(num_nodes) or not 0 <= num_nodes < block_size:
        raise ValueError(f"`num_nodes` must be an integer in 0 .. block_size - 1 = {block_size - 1} (a chain draft: "
                         f"the previous block's rows 1 .. B - 1, or fewer), got {num_nodes!r}.")
    lengths = _check_lengths(accepted_lengths, num_nodes)
    B, k = block_size, len(lengths)
    offsets = torch.arange(B)
    positions = torch.cat([a + 1 + offsets for a in lengths])  # (k B,)
    sees_draft = torch.zeros(k * B, num_nodes + 1, dtype=torch.bool)
    for j, a in enumerate(lengths):
        sees_draft[j * B : (j + 1) * B, : a + 1] = True  # root + the first a nodes
    sees_extra = torch.block_diag(*[torch.ones(B, B, dtype=torch.bool)] * k)  # each block, bidirectionally
    return ExtraInputs(input_ids=torch.full((k * B,), int(noise_token_id), dtype=torch.long), positions=positions,
                       sees_draft=sees_draft, sees_extra=sees_extra)


def extra_row_mask(extra: Sequence[ExtraInputs | None], extra_start: int, width: int, device=None) -> torch.BoolTensor:
    """The noise rows of one verify forward `(B, width)`, exactly: row b's extra inputs `[extra_start, extra_start +
    E_b)`; the draft's inputs, a shorter row's padding extra inputs and any bucket padding after them are not."""
    mask = torch.zeros(len(extra), width, dtype=torch.bool, device=device)
    for b, e in enumerate(extra):
        if e is not None:
            if extra_start + e.num_inputs > width:
                raise ValueError(f"Row {b}'s {e.num_inputs} extra inputs from column {extra_start} do not fit a "
                                 f"forward of {width} inputs.")
            mask[b, extra_start : extra_start + e.num_inputs] = True
    return mask


def noise_rows_around(lafa, extra: Sequence[ExtraInputs | None], *, tau: float = 0.0,
                      generator: torch.Generator | None = None):
    """`verification.verify_forward_batch(..., around_forward=...)` for a Lafa round: the drafter's noise-row
    context (`LafaDrafter.noise_rows`) over exactly the rows' extra inputs (`extra_row_mask`) of the forward."""
    extra = list(extra)

    def around(inputs, extra_start: int):
        ids = inputs.input_ids
        if ids.shape[0] != len(extra):
            raise ValueError(f"The forward has {ids.shape[0]} rows but {len(extra)} rows' extra inputs were given.")
        return lafa.noise_rows(extra_row_mask(extra, extra_start, int(ids.shape[1]), ids.device), tau=tau,
                               generator=generator)

    return around


@dataclass
class FusedVerifyOutput:
    """One fused round: `verify` holds every input's logits `(R, n + E, V)` and hidden states, and the commit handle;
    inputs `[0, n)` are the verify rows (row r's root at 0, its node i at i + 1), inputs `[n, n + E)` the noise
    rows, block by block in the order of `accepted_lengths[r]` (`R` rows of the batch)."""

    verify: VerifyOutput
    num_verify_inputs: int  # n
    block_size: int  # B
    accepted_lengths: list[list[int]]  # per row: the accepted length each candidate block stands for

    @property
    def verify_logits(self) -> torch.Tensor:
        """`(R, n, V)`: the verify rows' logits (plain verification's)."""
        return self.verify.logits[:, : self.num_verify_inputs]

    def block_logits(self, row: int, accepted: int) -> torch.Tensor:
        """`(B, V)`: the logits of row `row`'s candidate block for accepted length `accepted`; row 0 predicts the
        bonus token, rows 1 .. B - 1 the next draft. `ValueError` when the round drafted no block for it (a round
        that keeps only some blocks: the loop falls back to a draft-less round)."""
        lengths = self.accepted_lengths[row]
        if accepted not in lengths:
            raise ValueError(f"Row {row} drafted candidate blocks for accepted lengths {lengths}, not {accepted!r}.")
        start = self.num_verify_inputs + lengths.index(accepted) * self.block_size
        return self.verify.logits[row, start : start + self.block_size]

    def next_draft(self, row: int, accepted: int) -> torch.LongTensor:
        """`(B - 1,)`: the greedy next draft of row `row` after accepting `accepted` draft tokens."""
        return self.block_logits(row, accepted)[1:].argmax(-1)


def _check_chain(tree: DraftTree, block_size: int, row: int) -> None:
    N = tree.num_nodes
    if N >= block_size:
        raise ValueError(f"Row {row}: the draft has {N} nodes, but a Lafa round verifies at most block_size - 1 = "
                         f"{block_size - 1} (the previous block's rows 1 .. B - 1).")
    if N and (tree.parents.tolist() != list(range(-1, N - 1))):
        raise ValueError(f"Row {row}: a Lafa draft is a chain (`DraftTree.chain(tokens)`: parents -1, 0, 1, ...), "
                         f"got parents {tree.parents.tolist()}.")


def fused_verify_forward(target, lafa, cache: DynamicCache, rows: RaggedRows, roots: list[int],
                         trees: list[DraftTree], *,
                         accepted_lengths: Sequence[int] | Sequence[Sequence[int] | None] | None = None,
                         tau: float = 0.0, generator: torch.Generator | None = None,
                         state_layers: Sequence[int] = ()) -> FusedVerifyOutput:
    """Verify each row's chain draft and draft its candidate blocks in ONE forward of `target` (see the module
    docstring); the cache grows by `n + E` columns, which `commit_fused` cuts back to each row's accepted prefix.

    Args:
        target: a dense attention causal LM (Llama, Qwen3, ...); lafa: a `LafaDrafter` bound to it.
        cache, rows, roots: as `verification.verify_forward_batch`; trees: each row's draft, a chain of at most
            `block_size - 1` nodes (`DraftTree.chain(tokens)`; empty on the first round).
        accepted_lengths: the accepted lengths to draft a block for, the same for every row (a list of ints) or per
            row (a list of lists or None); default all of them, `0 .. N_b`.
        tau: the noise rows' flow time (0: one step from noise); generator: the noise's, with `noise_std > 0`.
        state_layers: decoder layers whose outputs the hidden states carry (`verify_forward_batch`).

    Everything is checked before the forward runs (a drafter not bound to `target`, a hybrid target, a draft that
    is not a short enough chain, bad lengths); the drafter's hooks exist only during the forward.
    """
    if not getattr(lafa, "is_lafa_drafter", False):
        raise ValueError(f"`lafa` must be a `LafaDrafter`, got {type(lafa).__name__}.")
    lafa.check_target(target)
    check_attention_only(target.config)
    B = lafa.config.block_size
    if not len(trees) == len(roots) == len(rows.lengths):
        raise ValueError(f"One root and one tree per row: {len(rows.lengths)} rows, {len(roots)} roots, "
                         f"{len(trees)} trees.")
    for r, tree in enumerate(trees):
        _check_chain(tree, B, r)
    if accepted_lengths is None or all(is_int(a) for a in accepted_lengths):
        per_row = [accepted_lengths] * len(trees)
    else:
        per_row = list(accepted_lengths)
        if len(per_row) != len(trees):
            raise ValueError(f"`accepted_lengths` per row must hold one entry per row ({len(trees)}), got "
                             f"{len(per_row)}.")
    lengths = [_check_lengths(a, t.num_nodes, f" (row {r})") for r, (a, t) in enumerate(zip(per_row, trees))]
    pad = lafa.config.pad_token_id
    extra = [lafa_extra_inputs(B, t.num_nodes, accepted_lengths=a, noise_token_id=pad or 0)
             for t, a in zip(trees, lengths)]
    out = verification.verify_forward_batch(target, cache, rows, roots, trees, state_layers=state_layers,
                                            extra=extra,
                                            around_forward=noise_rows_around(lafa, extra, tau=tau,
                                                                             generator=generator))
    return FusedVerifyOutput(verify=out, num_verify_inputs=1 + max(t.num_nodes for t in trees), block_size=B,
                             accepted_lengths=lengths)


def commit_fused(target, cache: DynamicCache, rows: RaggedRows, accepted: Sequence[int],
                 output: FusedVerifyOutput) -> None:
    """Row r keeps its root and its first `accepted[r]` draft tokens (`verification.commit_batch` on the chain
    path `0 .. accepted[r] - 1`); every noise row is dropped. Call it once, right after `fused_verify_forward`."""
    counts = list(accepted)
    if len(counts) != len(rows.lengths) or any(not is_int(a) or a < 0 for a in counts):
        raise ValueError(f"`accepted` must hold one non-negative int per row ({len(rows.lengths)}), got {counts!r}.")
    verification.commit_batch(target, cache, rows, [list(range(a)) for a in counts], output.verify.handle)
