"""Acceptance: which draft nodes a verification round keeps, on the target's processed logits (pure functions).

Row 0 of `logits` / `target_probs` is the root (the last committed token), row `i + 1` is tree node `i`.

- `accept_greedy(tree, logits) -> Acceptance(nodes, bonus)`: the longest root-to-node path whose every token is the
  target's argmax at its parent; `bonus` = the argmax at the last accepted input.
- `accept_sampling(tree, target_probs)`: speculative rejection sampling for CHAINS drawn from the drafter's `q`
  (accept with min(1, p/q), else resample from norm(max(0, p - q)); the bonus from p after a full accept).
- `accept_sampling_tree(tree, target_probs)`: lossless sampling over ANY tree (top-k drafts, lookup branches): the
  children of each input tried in order as fixed proposals; needs no draft distribution.
- `accept_round(tree, rows, do_sample)`: the one a loop calls (greedy, or sampling by the tree's kind).
- `process_row` / `processed_rows`: a call's logits processors on each verified row with its own prefix.
  Randomness: `torch.rand` / `torch.multinomial` on the default generator (seed with `torch.manual_seed`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from hf_chainflow.generation.tree import DraftTree

__all__ = ["Acceptance", "accept_greedy", "accept_round", "accept_sampling", "accept_sampling_tree", "choose_token",
           "process_row", "processed_rows"]


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
