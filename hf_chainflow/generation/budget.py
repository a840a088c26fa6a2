"""Machine-sized drafting: how many draft nodes a round verifies, chosen from what verifying costs on this machine.

The maths are pure Python (no torch): the caller hands in the drafter's path probabilities, the round's extra
inputs and a cost function (a `hf_chainflow.generation.calibration.CostCurve`, or any callable `rows -> seconds`).
The wiring (`AutoBudget`) draws the curve once per call and cuts the drafter's trees with `DraftTree.top_nodes`.

A round verifies `[root] + nodes` in one target forward and emits the accepted nodes plus the target's bonus token.
Under the drafter's own probabilities, a node is accepted exactly when the target's greedy path runs through it, and
nodes of one depth exclude each other, so the expected number of tokens a round emits with the node set `K` is

    E[tokens] = 1 + sum_{i in K} p_i        (p_i: node i's path probability, root to node; the 1 is the bonus)

(siblings' probabilities summing to at most 1, as a drafter's softmax gives them; the test double's zero
log-probabilities do not), and keeping the `k` nodes of highest path probability (the budget cut,
`DraftTree.top_nodes`) maximises it for each `k`. The round costs `cost(rows) + draft_seconds`, so the rate to
maximise over `k` is

    rate(k) = (1 + sum of the k highest p_i) / (cost(1 + k + extra) + draft_seconds)

where `extra` counts the round's inputs the drafter did not choose (a merged lookup branch; an upper bound, since
the branch may share nodes with the tree). A batch verifies every row `n` inputs wide (shorter drafts padded with
inert nodes that cost as much), so a batch chooses one width: row b keeps `n - 1 - extra_b` of its nodes, and the
rate is the sum over rows of their expected tokens over `cost(B * n) + draft_seconds` (`choose_batch_budgets`; the
curve is measured on one row, `B * n` inputs are read on it: on a CPU the forward's cost is its linear layers, which
see `B * n` rows either way). Ties go to the smaller budget.

The drafter's probabilities need not be calibrated (a drafter trained with a distillation loss is often
over-confident on long paths). `acceptance_ratio` is the simple correction `AutoBudget` applies: the call's accepted
drafter nodes over the accepted nodes its probabilities predicted, shrunk towards 1 by a prior of `PRIOR_TOKENS`
tokens and clamped to `RATIO_RANGE`; `scaled_probabilities` multiplies every path probability by it (capped at 1).
It changes how many nodes are kept, never which (the order of the nodes is unchanged), and never what is emitted.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

PRIOR_TOKENS = 8.0  # the correction's prior: as if this many predicted tokens had been accepted as predicted
RATIO_RANGE = (0.25, 4.0)  # the correction never scales the drafter's probabilities beyond these factors
_TIE = 1e-12  # relative: rates this close count as equal (the smaller budget wins)


def _check_probabilities(probs: Sequence[float], name: str) -> list[float]:
    out = [float(p) for p in probs]
    bad = [p for p in out if not (0.0 <= p <= 1.0)]
    if bad:
        raise ValueError(f"`{name}` must hold path probabilities in [0, 1] (exp of the cumulative log-probabilities), "
                         f"got {bad[0]!r}.")
    return sorted(out, reverse=True)


def _cost(cost: Callable[[int], float], rows: int) -> float:
    seconds = float(cost(rows))
    if not (math.isfinite(seconds) and seconds >= 0.0):
        raise ValueError(f"`cost({rows})` must be a finite number of seconds >= 0, got {seconds!r}; pass a measured "
                         f"`CostCurve` (`hf_chainflow.generation.calibration.measure_cost_curve`).")
    return seconds


def choose_batch_budgets(path_probs: Sequence[Sequence[float]], cost: Callable[[int], float], *,
                         extra_rows: Sequence[int] | None = None, draft_seconds: float = 0.0) -> list[int]:
    """The nodes each row of a batch keeps, maximising the batch's expected tokens per second.

    Args:
        path_probs: per row, its drafter nodes' path probabilities (any order; empty for a row the drafter does not
            draft for this round, e.g. a trusted lookup branch verified alone).
        cost: `rows -> seconds` of one verification forward over `rows` inputs (a `CostCurve`).
        extra_rows: per row, its inputs besides the root and the kept nodes (a merged lookup branch; default 0).
        draft_seconds: the drafting round's cost, paid whatever is kept.

    Returns per row `k_b` in `[0, len(path_probs[b])]`: the row keeps its `k_b` most probable nodes. Every row is
    verified `n = 1 + max_b (k_b + extra_b)` inputs wide; the width maximises
    `sum_b (1 + P_b(k_b)) / (cost(B * n) + draft_seconds)` with `k_b = min(len_b, n - 1 - extra_b)`; ties go to
    the narrower width.
    """
    B = len(path_probs)
    if B == 0:
        return []
    extra = [0] * B if extra_rows is None else [int(e) for e in extra_rows]
    if len(extra) != B or any(e < 0 for e in extra):
        raise ValueError(f"`extra_rows` must hold one count >= 0 per row ({B} rows), got {list(extra_rows)!r}.")
    if not (math.isfinite(draft_seconds) and draft_seconds >= 0.0):
        raise ValueError(f"`draft_seconds` must be a finite number >= 0, got {draft_seconds!r}.")
    ranked = [_check_probabilities(p, f"path_probs[{b}]") for b, p in enumerate(path_probs)]
    prefix = []  # per row: prefix[b][k] = sum of its k most probable nodes
    for probs in ranked:
        sums = [0.0]
        for p in probs:
            sums.append(sums[-1] + p)
        prefix.append(sums)
    narrowest = 1 + max(extra)
    widest = 1 + max(len(p) + e for p, e in zip(ranked, extra))
    best_width, best_rate = narrowest, -1.0
    for n in range(narrowest, widest + 1):
        tokens = sum(1.0 + prefix[b][min(len(ranked[b]), n - 1 - extra[b])] for b in range(B))
        seconds = _cost(cost, B * n) + draft_seconds
        rate = math.inf if seconds == 0.0 else tokens / seconds
        if rate > best_rate * (1.0 + _TIE):
            best_width, best_rate = n, rate
    return [min(len(ranked[b]), best_width - 1 - extra[b]) for b in range(B)]


def choose_budget(path_probs: Sequence[float], cost: Callable[[int], float], *, extra_rows: int = 0,
                  draft_seconds: float = 0.0) -> int:
    """The number `k` of a round's drafter nodes to keep, maximising
    `(1 + sum of the k highest path_probs) / (cost(1 + k + extra_rows) + draft_seconds)` (one row; ties: the
    smaller `k`). See `choose_batch_budgets` for the arguments."""
    return choose_batch_budgets([path_probs], cost, extra_rows=[extra_rows], draft_seconds=draft_seconds)[0]


def acceptance_ratio(accepted: float, predicted: float, prior: float = PRIOR_TOKENS,
                     bounds: tuple[float, float] = RATIO_RANGE) -> float:
    """`(accepted + prior) / (predicted + prior)` clamped to `bounds`: how many drafter nodes were accepted for each
    one the drafter's path probabilities predicted, shrunk towards 1 while few rounds are counted."""
    if accepted < 0 or predicted < 0 or prior <= 0:
        raise ValueError(f"`accepted` ({accepted!r}) and `predicted` ({predicted!r}) must be >= 0 and `prior` "
                         f"({prior!r}) > 0.")
    low, high = bounds
    return min(high, max(low, (accepted + prior) / (predicted + prior)))


def scaled_probabilities(path_probs: Sequence[float], ratio: float) -> list[float]:
    """Each path probability times `ratio`, capped at 1 (the order of the nodes is unchanged)."""
    return [min(1.0, float(p) * ratio) for p in path_probs]


# ----------------------------------------------------------------------------------------------------- the wiring
class AutoBudget:
    """`tree_budget="auto"` for one `generate` call: the cost curve (drawn on the first round,
    `hf_chainflow.generation.calibration.cost_curve_for_call`), each round's cut of the drafter's trees, and the
    acceptance correction counted over the call.

    `cut(trees, extra_rows)` keeps in each tree (None: a row the drafter does not draft for) the nodes
    `choose_batch_budgets` chooses, by `DraftTree.top_nodes` (an empty tree for 0); `accepted(counts, plain)` counts
    the nodes accepted in the rounds whose drafts were the drafter's trees alone (`plain[r]`: no lookup branch merged,
    whose nodes the drafter did not score). `budgets` lists the chosen budgets, one list per round. The call's
    `AutoBudget` stays in `drafter._runtime["last_auto_budget"]` (what was chosen, the correction) until the next."""

    def __init__(self, drafter, settings):
        from hf_chainflow.generation.calibration import runtime_of

        self.drafter, self.settings = drafter, settings
        runtime_of(drafter)["last_auto_budget"] = self
        self.curve = None
        self.accepted_nodes = self.predicted_nodes = 0.0
        self.budgets: list[list[int]] = []
        self._predicted: list[float | None] = []  # per row of the last cut: the sum of its kept raw probabilities

    @property
    def ratio(self) -> float:
        """The correction applied to the drafter's path probabilities (`acceptance_ratio` of the call so far)."""
        return acceptance_ratio(self.accepted_nodes, self.predicted_nodes)

    def cut(self, trees: list, extra_rows: list[int]) -> list:
        if self.curve is None:
            from hf_chainflow.generation.calibration import cost_curve_for_call

            self.curve = cost_curve_for_call(self.drafter, self.settings)
        raw = [[] if t is None else t.cumulative_logprobs().double().exp().clamp(max=1.0).tolist() for t in trees]
        ratio = self.ratio
        ks = choose_batch_budgets([scaled_probabilities(p, ratio) for p in raw], self.curve, extra_rows=extra_rows,
                                  draft_seconds=self.curve.draft_seconds)
        self.budgets.append([k for k, t in zip(ks, trees) if t is not None])
        out, self._predicted = [], []
        for tree, probs, k in zip(trees, raw, ks):
            if tree is None:
                out.append(None)
                self._predicted.append(None)
                continue
            self._predicted.append(sum(sorted(probs, reverse=True)[:k]))
            out.append(tree if k >= tree.num_nodes else tree.top_nodes(k) if k > 0 else tree.take(tree.depths[:0]))
        return out

    def accepted(self, counts: list[int], plain: list[bool]) -> None:
        for predicted, n, alone in zip(self._predicted, counts, plain):
            if predicted is not None and alone:
                self.accepted_nodes += n
                self.predicted_nodes += predicted
        self._predicted = []


__all__ = ["PRIOR_TOKENS", "RATIO_RANGE", "AutoBudget", "acceptance_ratio", "choose_batch_budgets", "choose_budget",
           "scaled_probabilities"]
