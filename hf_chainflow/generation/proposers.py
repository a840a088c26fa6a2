"""Proposers: where the drafts of hf_chainflow's loop come from (`hf_chainflow.generation.loop`).

Each round the loop asks its proposer for one draft per active row, verifies every row's draft in one target
forward, accepts per row and tells the proposer what each row kept. A proposer implements `Proposer`:

    begin(hidden, starts)        after the prefill: the target's states `(B, L, D')` of the prompt, row b's from
                                 column `starts[b]` (its left padding before)
    propose(rows) -> [Draft]     one draft per active row (`Row`: its index, committed tokens, room left)
    accepted(rows, drafts, n, extra_out)  after acceptance: row r accepted `n[r]` nodes of `drafts[r].tree`;
                                 `extra_out[r]`: the verify forward's `(logits, hidden)` of the row's extra inputs
    commit(rows, kept)           the verified states `(m_r + 1, D')` of each row's root + accepted nodes that the
                                 cache keeps (the inputs it drops are gone)
    select(keep)                 rows leaving the batch: the proposer keeps the rows `keep` (indices into the
                                 active rows), in that order

`state_layers` names the decoder layers whose outputs the forwards return beside the final states (`D' = (1 + m) D`).

- `ChainFlowProposer`: a ChainFlow drafter's pass over each row's last `C` committed states (the drafter
  `hf_chainflow.testing.OracleDrafter` too), a chain or a tree (`drafter.generation_config`).
- `LookupProposer`: the prompt-lookup branch (`hf_chainflow.generation.prompt_lookup`) and the corpus-lookup branch
  (`hf_chainflow.generation.corpus_lookup`) of each row; a trusted prompt-lookup match (`lookup_trust_ngram`) is
  verified without a drafter pass, and its length grows while it holds (`lookup_max_tokens`).
- `BranchedProposer`: a drafter's proposer plus the lookup branches, merged into one tree per row (the shipped
  setting: an 8x4 tree cut to 12 nodes plus a prompt-lookup branch).
- `LafaProposer`: a `LafaDrafter`'s self-speculative rounds; the target drafts each row's next block in the verify
  forward itself.

A fused-forward proposer (the Lafa issue: the target drafts its next block in the verification forward) implements
the same five calls and adds its own rows to a round: `Draft.extra` (`verification.ExtraInputs`: tokens, positions,
what they see) are scored in the same target forward after the row's draft, never seen by the draft's inputs, their
outputs handed back in `accepted`, and dropped at commit (attention-only targets). `forward_context(drafts)` gives
the context the loop enters around that forward (`verify_forward_batch(..., around_forward=...)`: Lafa's noise-row
hooks); None for the other proposers.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch

from hf_chainflow.generation import drafting
from hf_chainflow.generation.budget import AutoBudget
from hf_chainflow.generation.lafa import lafa_extra_inputs, noise_rows_around
from hf_chainflow.generation.prompt_lookup import RoundBranches, next_lookup_length, round_branches
from hf_chainflow.generation.tree import DraftTree
from hf_chainflow.generation.verification import ExtraInputs

__all__ = ["Row", "Draft", "Proposer", "ChainFlowProposer", "LookupProposer", "BranchedProposer", "LafaProposer",
           "make_proposer"]


@dataclass
class Row:
    """One active row of a round: `index` (its place among the call's rows), `committed` `(L_b,)` (its tokens
    without padding; the last one is the round's root), `room` (tokens left before `max_length`, minus the bonus)."""

    index: int
    committed: torch.LongTensor
    room: int


@dataclass
class Draft:
    """One row's draft: the `tree` to verify (empty when the row has no room), the looked-up `branches` it holds
    (for the statistics) and a fused-forward proposer's `extra` inputs (scored beside the draft, dropped at
    commit)."""

    tree: DraftTree
    branches: RoundBranches = field(default_factory=RoundBranches)
    extra: ExtraInputs | None = None


class Proposer(ABC):
    """The interface of a source of drafts in hf_chainflow's loop (see the module docstring)."""

    state_layers: tuple[int, ...] = ()

    def begin(self, hidden: torch.Tensor, starts: list[int]) -> None:
        """After the prefill (`hidden` `(B, L, D')`, row b valid from `starts[b]`)."""

    @abstractmethod
    def propose(self, rows: list[Row]) -> list[Draft]:
        """One draft per row, each within its row's `room` (an empty tree when `room < 1`)."""

    def accepted(self, rows: list[Row], drafts: list[Draft], counts: list[int],
                 extra_out: list | None = None) -> None:
        """After acceptance: row `rows[r]` accepted `counts[r]` nodes of `drafts[r].tree`; `extra_out[r]` is the
        verify forward's `(logits (E, V), hidden (E, D'))` of the row's extra inputs (None without; `extra_out` is
        None when no row had any)."""

    def commit(self, rows: list[Row], kept: list[torch.Tensor]) -> None:
        """The verified states `(m + 1, D')` of each row's root + accepted nodes, as the cache keeps them."""

    def forward_context(self, drafts: list[Draft]):
        """The context to run this round's verify forward in, as `verify_forward_batch`'s `around_forward`
        (`(inputs, extra_start) -> context manager`), or None (a plain forward): a fused-forward proposer's."""
        return None

    def select(self, keep: list[int]) -> None:
        """Keep only the active rows `keep` (indices into the current active rows), in that order."""

    def chosen_budgets(self) -> list[int]:
        """The tree budgets chosen per drafted tree (`tree_budget="auto"`; `SpeculativeStats.auto_budgets`)."""
        return []


def _context(states: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rows' committed states `(T_b, D)` -> left-padded `(R, T, D)` and mask `(R, T)` (`None` when none is padded)."""
    T = max(s.shape[0] for s in states)
    if all(s.shape[0] == T for s in states):
        return torch.stack(states), None
    out = states[0].new_zeros(len(states), T, states[0].shape[-1])
    mask = torch.zeros(len(states), T, dtype=torch.bool, device=states[0].device)
    for i, s in enumerate(states):
        out[i, T - s.shape[0]:] = s
        mask[i, T - s.shape[0]:] = True
    return out, mask


def _cut_to_depth(tree: DraftTree, depth: int) -> DraftTree:
    """The nodes of `tree` at depth <= `depth` (a node's ancestors are shallower, so it stays a tree)."""
    if tree.max_depth <= depth:
        return tree
    return tree.take(torch.nonzero(tree.depths <= depth).flatten())


class ChainFlowProposer(Proposer):
    """A ChainFlow drafter's pass for every row that drafts, from each row's last `C` committed target states.

    Args:
        drafter: a `ChainFlowDrafter` bound to the target (or the test double `OracleDrafter`).
        settings: the call's `SpeculativeSettings`.
        single: the call is one unpadded prompt: its rows draft through `drafting.draft` (the compiled round when
            `compile_drafting` is on), a batch through `drafting.draft_batch` (one pass for every drafting row).

    With `tree_budget="auto"` each round's trees are drafted whole and cut to the budgets `AutoBudget` chooses from
    the machine's cost curve (`hf_chainflow.generation.budget`); `propose(rows, extra_rows)` takes each row's inputs
    besides its drafted nodes (the lookup branches `BranchedProposer` merges in, or verifies alone).
    """

    def __init__(self, drafter, settings, single: bool):
        self.drafter, self.settings, self.single = drafter, settings, single
        self.state_layers = tuple(getattr(drafter, "state_layers", ()))  # fused target layers; none: final states
        self.context_size = drafter.context_size
        self.states: list[torch.Tensor] = []  # per active row: its last <= C committed states (T_b, D')
        self.auto = AutoBudget(drafter, settings) if settings.auto_budget else None

    def begin(self, hidden, starts):
        self.states = [hidden[b, start:][-self.context_size:] for b, start in enumerate(starts)]

    def propose(self, rows, extra_rows: list[int] | None = None):
        drafts = [Draft(DraftTree.empty(r.committed.device)) for r in rows]
        drafting_rows = [i for i, r in enumerate(rows) if r.room >= 1]
        if not drafting_rows:
            return drafts
        if self.single:
            (i,) = drafting_rows
            tree = drafting.draft(self.drafter, self.states[i][None], rows[i].committed[None],
                                  **self.settings.draft_kwargs(rows[i].room))
            drafts[i] = Draft(tree)
        else:
            context, mask = _context([self.states[i] for i in drafting_rows])
            trees = drafting.draft_batch(self.drafter, context, [rows[i].committed for i in drafting_rows], mask,
                                         **self.settings.draft_kwargs(max(rows[i].room for i in drafting_rows)))
            for i, tree in zip(drafting_rows, trees):
                drafts[i] = Draft(_cut_to_depth(tree, rows[i].room))
        if self.auto is not None:  # one budget per row, from the cost of the whole batch's verify forward
            trees = [drafts[i].tree if i in drafting_rows else None for i in range(len(rows))]
            cut = self.auto.cut(trees, list(extra_rows) if extra_rows is not None else [0] * len(rows))
            for i in drafting_rows:
                drafts[i] = Draft(cut[i])
        return drafts

    def accepted(self, rows, drafts, counts, extra_out=None):
        if self.auto is not None:  # the correction counts the rounds whose draft is the drafter's tree alone
            self.auto.accepted(counts, [d.branches.lookup is None and d.branches.recalled is None for d in drafts])

    def commit(self, rows, kept):
        self.states = [torch.cat([s, k.to(s.dtype)])[-self.context_size:] for s, k in zip(self.states, kept)]

    def chosen_budgets(self) -> list[int]:
        """With `tree_budget="auto"`: the budget chosen for each drafted tree so far (else empty)."""
        return [k for round_budgets in self.auto.budgets for k in round_budgets] if self.auto is not None else []

    def select(self, keep):
        self.states = [self.states[i] for i in keep]


class LookupProposer(Proposer):
    """Each row's prompt-lookup branch (and corpus-lookup branch with a `ContinuationTable`), as chains; a trusted
    prompt-lookup match grows after a round that accepted it whole (`next_lookup_length`)."""

    def __init__(self, settings, table=None):
        self.settings, self.table = settings, table
        self.lengths: list[int | None] = []  # per active row: the next prompt-lookup length

    def begin(self, hidden, starts):
        self.lengths = [self.settings.lookup_num_tokens] * len(starts)

    def branches(self, rows: list[Row]) -> list[RoundBranches]:
        return [round_branches(r.committed, r.room, self.lengths[i], self.settings, self.table)
                for i, r in enumerate(rows)]

    def propose(self, rows):
        drafts = []
        for r, b in zip(rows, self.branches(rows)):
            tree = DraftTree.empty(r.committed.device) if b.lookup is None else DraftTree.chain(b.lookup)
            drafts.append(Draft(tree if b.recalled is None else tree.with_chain(b.recalled), b))
        return drafts

    def accepted(self, rows, drafts, counts, extra_out=None):
        s = self.settings
        for i, (draft, n) in enumerate(zip(drafts, counts)):
            if draft.branches.trusted and s.lookup_max_tokens is not None:  # a copy that held: try a longer one
                self.lengths[i] = next_lookup_length(self.lengths[i], n, draft.tree.num_nodes, s.lookup_num_tokens,
                                                     s.lookup_max_tokens)

    def select(self, keep):
        self.lengths = [self.lengths[i] for i in keep]


class BranchedProposer(Proposer):
    """A drafter's proposer plus the lookup branches, one tree per row: a row with a trusted prompt-lookup match
    verifies that branch without a drafter pass; the others get the drafter's tree with the prompt-lookup branch
    merged in; the corpus-lookup branch joins every row's tree."""

    def __init__(self, drafter: Proposer, lookup: LookupProposer):
        self.drafter, self.lookup = drafter, lookup
        self.state_layers = drafter.state_layers

    def begin(self, hidden, starts):
        self.drafter.begin(hidden, starts)
        self.lookup.begin(hidden, starts)

    def propose(self, rows):
        branches = self.lookup.branches(rows)
        drafts: list[Draft | None] = [None] * len(rows)
        for i, (r, b) in enumerate(zip(rows, branches)):
            if r.room < 1:
                drafts[i] = Draft(DraftTree.empty(r.committed.device), b)
            elif b.trusted:  # a long match: verify the looked-up branch alone, no drafter pass
                drafts[i] = Draft(DraftTree.chain(b.lookup), b)
        # the drafter drafts for the other rows (rows without room or with a trusted branch get room 0: no pass)
        own_rows = [Row(r.index, r.committed, r.room if d is None else 0) for r, d in zip(rows, drafts)]
        if isinstance(self.drafter, ChainFlowProposer) and self.drafter.auto is not None:
            # the inputs the budget does not choose: each row's looked-up branches (an upper bound: merged, they
            # may share nodes with the tree)
            extra = [sum(0 if t is None else int(t.shape[0]) for t in (b.lookup, b.recalled)) for b in branches]
            own = self.drafter.propose(own_rows, extra_rows=extra)
        else:
            own = self.drafter.propose(own_rows)
        for i, (b, d) in enumerate(zip(branches, own)):
            if drafts[i] is None:
                drafts[i] = Draft(d.tree if b.lookup is None else d.tree.with_chain(b.lookup), b)
            if b.recalled is not None:
                drafts[i] = Draft(drafts[i].tree.with_chain(b.recalled), b)
        return drafts

    def accepted(self, rows, drafts, counts, extra_out=None):
        self.drafter.accepted(rows, drafts, counts, extra_out)
        self.lookup.accepted(rows, drafts, counts, extra_out)

    def commit(self, rows, kept):
        self.drafter.commit(rows, kept)
        self.lookup.commit(rows, kept)

    def select(self, keep):
        self.drafter.select(keep)
        self.lookup.select(keep)

    def chosen_budgets(self):
        return self.drafter.chosen_budgets()


class LafaProposer(Proposer):
    """A `LafaDrafter`'s rounds (`hf_chainflow.generation.lafa`): each round's verify forward also drafts, on the
    noise rows, a candidate block for every accepted length `a = 0 .. N` of the row's chain draft; after acceptance
    the block of the accepted length gives the next draft (the greedy tokens of its rows `1 .. B - 1`, cut to
    `num_assistant_tokens` and to the row's room). The first round after the prefill verifies an empty draft and
    drafts block 0. Drafts are fixed proposals (no draft distribution), so sampling accepts them child by child
    (`accept_sampling_tree`) and keeps the target's distribution.

    Args:
        drafter: a `LafaDrafter` bound to the target.
        settings: the call's `SpeculativeSettings` (`num_tokens`: the longest draft, at most `block_size - 1`).
    """

    def __init__(self, drafter, settings):
        self.drafter, self.settings = drafter, settings
        self.block_size = drafter.config.block_size
        self.noise_token_id = drafter.config.pad_token_id or 0
        self.next: list[torch.LongTensor] = []  # per active row: its next draft (empty before the first block)

    def begin(self, hidden, starts):
        self.next = [torch.zeros(0, dtype=torch.long, device=hidden.device) for _ in starts]

    def propose(self, rows):
        drafts = []
        for i, r in enumerate(rows):
            if r.room < 1:  # the row's last token: no draft, and no block to draft (no round follows)
                drafts.append(Draft(DraftTree.empty(r.committed.device)))
                continue
            tokens = self.next[i][: min(self.settings.num_tokens, r.room)].to(r.committed.device)
            tree = DraftTree.chain(tokens) if tokens.numel() else DraftTree.empty(r.committed.device)
            drafts.append(Draft(tree, extra=lafa_extra_inputs(self.block_size, tree.num_nodes,
                                                              noise_token_id=self.noise_token_id)))
        return drafts

    def forward_context(self, drafts):
        extra = [d.extra for d in drafts]
        return None if all(e is None for e in extra) else noise_rows_around(self.drafter, extra)

    def accepted(self, rows, drafts, counts, extra_out=None):
        B = self.block_size
        for i, (draft, a) in enumerate(zip(drafts, counts)):
            if draft.extra is None or extra_out is None or extra_out[i] is None:
                self.next[i] = self.next[i][:0]
                continue
            logits = extra_out[i][0]  # (E, V): block 0 .. N, B rows each; block a's row 0 predicts the bonus
            self.next[i] = logits[a * B + 1 : (a + 1) * B].argmax(-1)

    def select(self, keep):
        self.next = [self.next[i] for i in keep]


def make_proposer(drafter, settings, single: bool) -> Proposer:
    """The proposer of a call: the drafter's, with the lookup branches when the settings ask for one; the lookup
    branches alone for a drafter without a model (`PromptLookupDrafter`, `lookup_only`); a `LafaDrafter`'s rounds
    (`settings.fused_forward`)."""
    if settings.fused_forward:
        return LafaProposer(drafter, settings)
    if getattr(drafter, "lookup_only", False):
        return LookupProposer(settings)
    own = ChainFlowProposer(drafter, settings, single)
    if not settings.has_lookup:
        return own
    table = drafting.continuation_table(drafter) if settings.corpus_lookup_num_tokens is not None else None
    return BranchedProposer(own, LookupProposer(settings, table))
