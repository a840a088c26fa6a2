"""Candidate search: a drafter pass's predicted states -> draft chains or trees, for a batch of windows at once.

Serving (`hf_chainflow.generation.drafting.draft` / `search`, a batch of one) and the offline evaluation
(`hf_chainflow.training.evaluation`, batches of cached windows) both call `candidate_search`. With `B` windows, `K`
predicted states of size `D` each, `p = path_order` parents, the draft vocabulary of `S` rows and
`M = candidate_budget`:

1. candidates: the head scores `W_S ĥ_d` of the drafted positions `(B, d, S)`; per window the `M` rows with the best
   score at any drafted position are its candidates (every row when `S <= M`) -- the two-pass head.
2. levels `d = 1..depth`: every beam (`n_d` of them per window, `n_0 = 1`: the root, the bonus token) scores the
   candidates with Eq. 3 (head + path feedback + Markov bias, the feedback heads folded through the head rows, see
   `hf_chainflow.generation.serving.serving_feedback_weight`), keeps its `b` best tokens (chains 1, trees
   `min(tree_branching, tree_width)`), and the `w` best paths by cumulative log-probability (chains 1, trees
   `tree_width`) become the level's nodes: batched top-k and gathers, no loop over windows, beams or nodes.
3. budget (trees with `tree_budget`): the `tree_budget` nodes of highest path log-probability, ties breadth-first
   (`DraftTree.top_nodes`'s ranking); every kept node's ancestors are kept.

Level sizes `n_{d+1} = min(w, n_d * b)` depend only on the settings (`level_sizes`), so every tensor's shape is known
before the search runs. Sampled chains draw each token from `q = softmax(logits / temperature)` instead of taking the
best and return `q`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hf_chainflow.generation.packed_linear import PackedLinear
from hf_chainflow.generation.serving import ServingTables, serving_tables
from hf_chainflow.generation.settings import SearchSettings
from hf_chainflow.generation.tree import DraftTree, keep_most_probable, take_parents


@dataclass
class DraftBatch:
    """The drafts of `B` windows, `N` nodes each, breadth-first per window (`B = 1` when serving).

    Attributes:
        tokens (`(B, N)`): draft token ids. parents (`(B, N)`): each node's parent within its window, `-1` for the
        root. depths (`(B, N)`): 1 for children of the root. logprobs (`(B, N)`): log-probability of each node's
        token given its root-to-parent path. draft_probs (`(B, N, V)`, sampled chains only): the distribution `q`
        each token was drawn from (zero outside the candidates).
    """

    tokens: torch.LongTensor
    parents: torch.LongTensor
    depths: torch.LongTensor
    logprobs: torch.FloatTensor
    draft_probs: torch.FloatTensor | None = None

    def tree(self, i: int = 0) -> DraftTree:
        """Window `i`'s draft as a `DraftTree`."""
        return DraftTree(tokens=self.tokens[i], parents=self.parents[i], depths=self.depths[i], logprobs=self.logprobs[i],
                         draft_probs=None if self.draft_probs is None else self.draft_probs[i])


def level_sizes(settings: SearchSettings, branching: int) -> list[int]:
    """Nodes per level of a search with `settings` and the drafter's `config.tree_branching`."""
    width = settings.width
    b = 1 if settings.mode == "chain" else min(branching, width)
    sizes, n = [], 1
    for _ in range(settings.depth):
        n = min(width, n * b)
        sizes.append(n)
    return sizes


def committed_tails(committed: torch.LongTensor, p: int, pad: int) -> torch.LongTensor:
    """The last `p` committed tokens `(B, L) -> (B, p)`, left-padded with `pad` when `L < p`."""
    tail = committed[:, -p:]
    if tail.shape[1] < p:
        tail = torch.cat([tail.new_full((tail.shape[0], p - tail.shape[1]), pad), tail], 1)
    return tail


def _linear(x: torch.Tensor, weight: torch.Tensor | PackedLinear) -> torch.Tensor:
    """`F.linear(x, weight)` in `weight`'s dtype, the weight a tensor or a `PackedLinear`."""
    x = x.to(weight.dtype)
    return weight(x) if isinstance(weight, PackedLinear) else F.linear(x, weight)


def candidate_rows(states: torch.Tensor, weight: torch.Tensor | PackedLinear, budget: int):
    """Two-pass head, pass 1: head scores of the drafted positions `states` `(B, d, D)` against `weight` `(S, D)`
    (a tensor or a `PackedLinear`; products in its dtype) -> candidate rows `(B, M)` (`None` when `S <= budget`:
    every row) and their scores `(B, d, M or S)`, float32."""
    B, d, D = states.shape
    scores = _linear(states.reshape(B * d, D), weight).float().reshape(B, d, -1)  # (B, d, S)
    if scores.shape[2] <= budget:
        return None, scores
    rows = scores.max(1).values.topk(budget, -1).indices  # (B, M)
    return rows, scores.gather(2, rows[:, None, :].expand(B, d, budget))  # (B, M), (B, d, M)


def folded_feedback_logits(drafter, tables: ServingTables, states: torch.Tensor, parents: torch.LongTensor,
                           fused: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """The feedback terms of Eq. 3 with the folded heads (`serving_feedback_weight`): `states` `(n, D)` (one per
    parents row, may be an expanded view), `parents` `(n, p)`, `fused` `(S, R + r)` (a tensor or a `PackedLinear`)
    -> `(n, S)`, float32."""
    feats = []
    if drafter.path_head is not None:
        feats.append(drafter.path_head.hidden(tables.embed_tokens(parents), states))  # (n, R)
    if drafter.markov_head is not None:
        feats.append(drafter.markov_head.u1(tables.draft_index(parents[:, -1])))  # (n, r)
    x = torch.cat(feats, -1)  # (n, R + r)
    return _linear(x, fused).float() + bias  # (n, S)


def _rows_product(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`x` `(B, n, X)` against each window's own rows `weight` `(B, M, X)` -> `(B, n, M)`, float32.

    One `F.linear` per window, not one `bmm`: a batched product of these small shapes rounds apart from the
    per-window product (this path serves LoRA-adapted drafters, whose drafts must not depend on the batch)."""
    x = x.to(weight.dtype)
    return torch.stack([F.linear(x[i], weight[i]) for i in range(x.shape[0])]).float()


def _termwise_logits(drafter, tables, states, parents, head, full, rows):
    """Eq. 3 term by term (the feedback heads not folded: a LoRA adapter wraps `path_head.out`, or no feedback):
    `states` `(B*n, D)`, `parents` `(B*n, p)`, `head` `(B, n, M or S)` -> `(B, n, M or S)`."""
    B, n = head.shape[:2]
    if rows is None:  # every row a candidate: one weight for all windows
        return drafter.feedback_logits(states, parents, full, head_logits=head.reshape(B * n, -1)).reshape(B, n, -1)
    logits = head
    if drafter.path_head is not None:
        r = drafter.path_head(tables.embed_tokens(parents), states).reshape(B, n, -1)  # (B, n, D)
        logits = logits + _rows_product(r, full[rows])  # (B, n, M)
    if drafter.markov_head is not None:
        u1 = drafter.markov_head.u1(tables.draft_index(parents[:, -1])).reshape(B, n, -1)  # (B, n, r)
        logits = logits + _rows_product(u1, drafter.markov_head.u2[rows])
    return logits


@torch.no_grad()
def candidate_search(drafter, states: torch.Tensor, committed: torch.LongTensor,
                     settings: SearchSettings) -> DraftBatch:
    """Draft for `B` windows: predicted states `(B, >=depth, D)` and committed tokens `(B, L)` (the last is the bonus
    token, the root) -> `DraftBatch`. `drafter` is a bound `ChainFlowDrafter`."""
    cfg = drafter.config
    tails = committed_tails(committed, cfg.path_order, cfg.pad_token_id or 0)  # (B, p)
    return DraftBatch(*search_levels(drafter, serving_tables(drafter), states, tails, settings))


def search_levels(drafter, tables: ServingTables, states: torch.Tensor, tails: torch.LongTensor,
                  settings: SearchSettings) -> tuple:
    """`candidate_search` on the committed tails `(B, p)` with the round's `tables`, as a pure tensor function
    (every shape fixed by the settings; `hf_chainflow.generation.drafting_round` compiles it) -> the `DraftBatch` fields
    `(tokens, parents, depths, logprobs, draft_probs)`."""
    cfg = drafter.config
    B, D, p = states.shape[0], states.shape[-1], cfg.path_order
    depth, width = settings.depth, settings.width
    branching = 1 if settings.mode == "chain" else min(cfg.tree_branching, width)
    device = states.device
    full = tables.head  # (S, D)
    rows, head = candidate_rows(states[:, :depth], full if tables.head_linear is None else tables.head_linear,
                                cfg.candidate_budget)  # (B, M) | None, (B, d, M)
    folded = tables.folded  # (S, R + r), (S,) | None: scored whole, then restricted to the rows
    # (cheaper on CPU than gathering M rows of the matrix every round)
    if folded is not None and tables.folded_linear is not None:
        folded = (tables.folded_linear, folded[1])
    budget = settings.budget
    cut = budget is not None and budget < sum(level_sizes(settings, cfg.tree_branching))

    beams = tails[:, None]  # (B, n=1, p)
    score = states.new_zeros(B, 1, dtype=torch.float32)  # (B, n) cumulative log-probability of each beam
    score64 = score.double()  # the same in float64, for the budget cut (ranked as `DraftTree.cumulative_logprobs`)
    node = torch.full((B, 1), -1, dtype=torch.long, device=device)  # (B, n) each beam's node index, -1 = root
    tokens, parents, logps, cums, qs, depths = [], [], [], [], [], []
    n_nodes = 0
    for d in range(depth):
        n = beams.shape[1]
        flat, state = beams.reshape(B * n, p), states[:, d, None].expand(B, n, D).reshape(B * n, D)
        if folded is not None:
            logits = folded_feedback_logits(drafter, tables, state, flat, *folded).reshape(B, n, -1)  # (B, n, S)
            if rows is not None:
                logits = logits.gather(2, rows[:, None, :].expand(B, n, rows.shape[1]))  # (B, n, M)
            logits = logits + head[:, d, None]
        else:
            logits = _termwise_logits(drafter, tables, state, flat, head[:, d, None].expand(B, n, -1), full, rows)
        if settings.do_sample:  # chains: n = 1
            q = torch.softmax(logits.float() / settings.temperature, -1)  # (B, 1, M)
            choice = torch.multinomial(q.reshape(B, -1), 1)[:, None]  # (B, 1, 1)
            logp = q.gather(2, choice).log()
            qs.append(q[:, 0])
        else:
            logp, choice = torch.log_softmax(logits.float(), -1).topk(branching, -1)  # (B, n, b)
        cum = (score[:, :, None] + logp).reshape(B, -1)  # (B, n*b)
        keep = cum.topk(min(width, cum.shape[1]), -1).indices  # (B, w)
        src = keep // choice.shape[2]  # (B, w) the beam each kept path extends
        idx = choice.reshape(B, -1).gather(1, keep)  # (B, w) candidate index
        tok = tables.token(idx if rows is None else rows.gather(1, idx))  # (B, w) vocabulary ids
        w = tok.shape[1]
        logp = logp.reshape(B, -1).gather(1, keep)  # (B, w)
        tokens.append(tok)
        parents.append(node.gather(1, src))
        depths.append(torch.full_like(tok, d + 1))
        logps.append(logp)
        if cut:
            score64 = score64.gather(1, src) + logp.double()  # (B, w)
            cums.append(score64)
        node = torch.arange(n_nodes, n_nodes + w, device=device).expand(B, w)
        n_nodes += w
        beams = torch.cat([beams.gather(1, src[:, :, None].expand(B, w, p))[:, :, 1:], tok[:, :, None]], 2)
        score = cum.gather(1, keep)

    out = [torch.cat(tokens, 1), torch.cat(parents, 1), torch.cat(depths, 1), torch.cat(logps, 1), None]  # (B, N)
    if settings.do_sample:
        q = torch.stack(qs, 1)  # (B, N, M or S)
        ids = tables.token(rows if rows is not None else torch.arange(q.shape[2], device=device))
        ids = ids.expand(B, -1)[:, None, :].expand_as(q)  # (B, N, M or S) vocabulary id of each column
        out[4] = q.new_zeros(B, q.shape[1], cfg.vocab_size).scatter_(2, ids, q)  # (B, N, V)
    if cut:
        index = keep_most_probable(torch.cat(cums, 1).float(), budget)  # (B, budget), breadth-first
        out = [out[0].gather(1, index), take_parents(out[1], index), out[2].gather(1, index),
               out[3].gather(1, index), None]
    return tuple(out)

__all__ = ["DraftBatch", "ServingTables", "candidate_rows", "candidate_search", "committed_tails",
           "folded_feedback_logits", "level_sizes", "search_levels"]
