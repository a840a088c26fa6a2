"""The common tester of speculative generation (after PEFT's `tests/testing_common.py`): one grid of cells, one way
to build, run and check each, used by `tests/test_equivalence_grid.py` instead of per-file copies of shapes and
loops.

The grid: drafter kind (`KINDS`) x target family (tiny random Llama, Qwen3, Qwen3.5 hybrid) x draft mode (a chain, a
tree, a tree plus a prompt-lookup branch) x batch (one prompt, a ragged left-padded batch) x decoding (greedy,
sampling). `check_cell(cell)` runs one cell:

- greedy: every call's output equals plain `target.generate` token for token: each row its own batch-1 plain greedy
  continuation (cut after the call's EOS), then the pad token up to the batch's width (transformers' shape). A cell
  makes one call per prompt (batch 1, 6 prompts) or per batch (ragged, 2 batches of 2-8 prompts of 1-40 tokens) for
  every (drafter variant, draft setting) pair: the kind's variants (`OracleDrafter` at error rates 0, 0.3 and 1)
  times the mode's shapes (chains of 1, 3, 8; trees 4x3, 5x7, 16x4, 1x1, 8x4 cut to 10 nodes) or lookup settings
  (merged, verified alone from a 1- or 2-token match, growing to 16). A third of the batch-1 calls and half the
  ragged ones stop on an EOS token (inside a draft; in a batch, one row early); the statistics must say which loop
  ran, that it drafted, how many tokens each row got, and whether the lookup branch was used and verified alone.
- sampling: the empirical joint distribution of generated tokens 2 and 3, over a 12-token vocabulary at
  temperature 0.8 and top-p 0.9, against the exact one computed from the target (`exact_pair_distribution`): its
  total variation must stay under 1.5x the largest of 30 simulated exact samplers of the same size (`tv_test`).
  Batch 1: 1,200 calls on a moderately peaked target (several tokens matter). Ragged: 64 rows per call (48 copies
  of a short prompt, 16 of a longer one, left-padded) on a peaked target, 50 to 300 calls: the fewest at which the
  same test, on three quarters of the short prompt's sample, rejects 20 of 20 samplers distorted by 5 %
  (`distorted`); each prompt's rows pass, and the test at the short prompt's full sample rejects 10 of 10. Draft
  tokens must have been accepted (rejection sampling exercised) and the lookup branch used exactly when the cell has
  one.

A cell a kind does not support asserts the kind's named refusal (`DrafterKind.refusal`: the exception and the
message that `generate` raises) instead of being skipped. A new kind is one more `KINDS` entry.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Callable

import pytest
import torch

from hf_chainflow.testing import TINY_FAMILIES, OracleDrafter, tiny_target

from _speculative import exact_pair_distribution, random_drafter, set_shape

PAD = 0
MAX_NEW = 20  # greedy calls
FAMILIES = TINY_FAMILIES
MODES = ("chain", "tree", "tree+lookup")
BATCHES = ("batch1", "ragged")
DECODINGS = ("greedy", "sampling")

# ---------------------------------------------------------------------------------------------- draft settings
CHAINS = (1, 3, 8)
TREES = ((4, 3), (5, 7), (16, 4), (1, 1), (8, 4, 10))  # (width, depth[, budget])
LOOKUP_OFF = dict(lookup_num_tokens=None, lookup_ngram=3, lookup_trust_ngram=None, lookup_max_tokens=None)
LOOKUPS = (  # merged into the tree; verified alone from a 1- or 2-token match; alone and growing to 16 tokens
    dict(LOOKUP_OFF, lookup_num_tokens=6),
    dict(LOOKUP_OFF, lookup_num_tokens=6, lookup_trust_ngram=1),
    dict(LOOKUP_OFF, lookup_num_tokens=3, lookup_trust_ngram=2),
    dict(LOOKUP_OFF, lookup_num_tokens=6, lookup_trust_ngram=1, lookup_max_tokens=16),
)


@dataclasses.dataclass(frozen=True)
class Setting:
    """One drafting setting of a greedy cell: the draft mode and shape (`_speculative.set_shape`), the lookup fields."""

    mode: str
    shape: int | tuple
    lookup: dict = dataclasses.field(default_factory=lambda: dict(LOOKUP_OFF))

    def apply(self, drafter) -> None:
        set_shape(drafter, self.mode, self.shape)
        for name, value in self.lookup.items():
            setattr(drafter.generation_config, name, value)


def settings(mode: str) -> list[Setting]:
    if mode == "chain":
        return [Setting("chain", n) for n in CHAINS]
    if mode == "tree":
        return [Setting("tree", shape) for shape in TREES]
    return [Setting("tree", (4, 3), lookup) for lookup in LOOKUPS]


# ---------------------------------------------------------------------------------------------- drafter kinds
@dataclasses.dataclass(frozen=True)
class Refusal:
    """What `generate` raises for a cell a kind does not support: `pytest.raises(error, match=match)`."""

    error: type[Exception]
    match: str


@dataclasses.dataclass(frozen=True)
class DrafterKind:
    """A row of the grid.

    make(target, variant): a drafter bound to `target`, one per variant (`variants`: e.g. error rates).
    make_sampling(target): the drafter of the sampling cells.
    refusal(cell): the named refusal of a cell this kind does not support, or None.
    """

    name: str
    variants: tuple
    make: Callable
    make_sampling: Callable
    refusal: Callable = lambda cell: None


KINDS: dict[str, DrafterKind] = {
    # a tiny random ChainFlowDrafter: low acceptance, short accepted paths, every rejection path
    "chainflow": DrafterKind(
        "chainflow", ("random",), make=lambda target, variant: random_drafter(target),
        make_sampling=lambda target: random_drafter(target, candidate_budget=8)),
    # the test double: the target's own continuation, corrupted at a rate: long accepted paths
    "oracle": DrafterKind(
        "oracle", (0.0, 0.3, 1.0), make=lambda target, rate: OracleDrafter(target, error_rate=rate, seed=7),
        make_sampling=lambda target: OracleDrafter(target, error_rate=0.5, seed=1)),
}


@dataclasses.dataclass(frozen=True)
class Cell:
    kind: str
    family: str
    mode: str
    batch: str
    decoding: str

    def __str__(self) -> str:
        return "-".join(dataclasses.astuple(self))

    @property
    def loop(self) -> str:
        """The loop `generate` routes the cell to: transformers' assisted loop for one prompt drafting chains on a
        dense target, hf_chainflow's own loop for everything else (a Lafa drafter always)."""
        if self.kind == "lafa":
            return "chainflow"
        dense_chain = self.mode == "chain" and self.family != "qwen3_5"
        return "transformers" if dense_chain and self.batch == "batch1" else "chainflow"


def grid(kinds=None) -> list[Cell]:
    """Every cell of the grid, for the given kinds (all of `KINDS` by default)."""
    return [Cell(*axes) for axes in itertools.product(kinds or list(KINDS), FAMILIES, MODES, BATCHES, DECODINGS)]


def check_cell(cell: Cell, kinds: dict[str, DrafterKind] | None = None, **overrides) -> None:
    """Run one cell: its checks, or the kind's named refusal. `overrides` go to the greedy / sampling check."""
    kind = (kinds or KINDS)[cell.kind]
    refusal = kind.refusal(cell)
    run = check_greedy if cell.decoding == "greedy" else check_sampling
    if refusal is None:
        run(cell, kind, **overrides)
        return
    with pytest.raises(refusal.error, match=refusal.match):
        run(cell, kind, **overrides)


# ---------------------------------------------------------------------------------------------- greedy
NUM_PROMPTS = 24
PROMPTS_PER_RUN = 6  # batch 1: calls per (variant, setting)
BATCHES_PER_RUN = 2  # ragged: calls per (variant, setting)
BATCH_SIZES = (2, 3, 4, 5, 6, 7, 8, 5)  # rotated: mean 5 rows


@functools.lru_cache(maxsize=None)
def greedy_setup(family: str):
    """A tiny target of the family (vocabulary 256), 24 prompts `(L,)` and their batch-1 plain greedy
    continuations (`MAX_NEW` tokens, no EOS). Even prompts are random (1 and 40 tokens among them), odd ones repeat a
    span (prompt lookup finds it). Shared by the cells: nothing may change the target."""
    target = tiny_target(family)
    prompts = make_prompts(NUM_PROMPTS, seed=11)
    refs = [plain_greedy(target, p) for p in prompts]
    return target, prompts, refs


def make_prompts(count: int, seed: int) -> list[torch.LongTensor]:
    """`count` prompts `(L,)` over token ids 3-255: even ones random (the first 1 token, the third 40), odd ones a
    span, 4 tokens, the span again (prompt lookup finds it)."""
    gen = torch.Generator().manual_seed(seed)
    prompts = []
    for i in range(count):
        if i % 2 == 0:
            n = {0: 1, 2: 40}.get(i) or int(torch.randint(2, 40, (), generator=gen))
            prompts.append(torch.randint(3, 256, (n,), generator=gen))
        else:
            span = torch.randint(3, 256, (int(torch.randint(3, 12, (), generator=gen)),), generator=gen)
            prompts.append(torch.cat([span, torch.randint(3, 256, (4,), generator=gen), span]))
    return prompts


def plain_greedy(target, prompt: torch.LongTensor, max_new_tokens: int = MAX_NEW) -> torch.LongTensor:
    """The reference: plain batch-1 greedy `generate` of `prompt` `(L,)`, without EOS; its new tokens `(T,)`."""
    return target.generate(prompt[None], max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None,
                           pad_token_id=PAD)[0, prompt.shape[0]:]


def left_pad(prompts: list[torch.LongTensor]) -> tuple[torch.LongTensor, torch.LongTensor]:
    """Prompts `(L_b,)` -> left-padded ids and attention mask `(B, max L_b)`."""
    width = max(p.shape[0] for p in prompts)
    ids = torch.full((len(prompts), width), PAD, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, p in enumerate(prompts):
        ids[b, width - p.shape[0]:] = p
        mask[b, width - p.shape[0]:] = 1
    return ids, mask


def cut_at(ref: torch.LongTensor, eos: int | None) -> torch.LongTensor:
    """A greedy continuation as a call stopping on `eos` returns it: up to and including its first `eos`."""
    hits = (ref == eos).nonzero() if eos is not None else []
    return ref[: int(hits[0]) + 1] if len(hits) else ref


def assert_equivalent(target, drafter, prompts, refs, eos=None, **kwargs):
    """The equivalence check of one call: `prompts` `(L_b,)` (one: passed as it is; several: left-padded with a mask)
    generated greedily with `drafter`; every row equals its own plain greedy continuation `refs[b]` cut after `eos`,
    then pads; the output is as wide as the longest row; the statistics count each row's tokens. Returns the
    statistics."""
    want = [cut_at(r, eos) for r in refs]
    if len(prompts) == 1:
        ids, mask = prompts[0][None], None
    else:
        ids, mask = left_pad(prompts)
    out = target.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=eos,
                          pad_token_id=PAD, assistant_model=drafter, **kwargs)
    L = ids.shape[1]
    assert out.shape == (len(prompts), L + max(w.shape[0] for w in want)), (out.shape, [len(w) for w in want])
    for b, w in enumerate(want):
        assert torch.equal(out[b, :L], ids[b]), b
        assert torch.equal(out[b, L: L + w.shape[0]], w), (b, out[b, L:].tolist(), w.tolist())
        assert bool((out[b, L + w.shape[0]:] == PAD).all()), b
    stats = drafter.last_stats
    assert stats.speculative and stats.batch_size == len(prompts)
    assert stats.rounds > 0 or max(w.shape[0] for w in want) == 1, stats  # drafted after the prefill's token
    if len(prompts) == 1:
        assert stats.rows == []
    else:
        assert [r.new_tokens for r in stats.rows] == [w.shape[0] for w in want]
    return stats


def greedy_plan(cell: Cell, kind: DrafterKind) -> list[tuple[object, Setting, list[list[int]], list[int | None]]]:
    """The calls of a greedy cell: for every (variant, setting), prompt-index lists (one prompt each at batch 1, 2-8 at
    ragged) and the EOS position of each call in its first prompt's continuation (None: no EOS)."""
    plan = []
    offset = _kind_offset(kind.name) + 3 * MODES.index(cell.mode)
    for k, (variant, setting) in enumerate(itertools.product(kind.variants, settings(cell.mode))):
        calls, stops = [], []
        count = PROMPTS_PER_RUN if cell.batch == "batch1" else BATCHES_PER_RUN
        for j in range(count):
            first = (7 * k + 5 * j + 11 * offset) % NUM_PROMPTS
            if cell.batch == "batch1":
                calls.append([first])  # consecutive calls alternate random and repeated-span prompts
                stops.append(3 + 4 * ((k + j) % 4) if j in (2, 3) else None)  # a stop after 4, 8, 12 or 16 tokens
            else:
                size = BATCH_SIZES[(k * BATCHES_PER_RUN + j + offset) % len(BATCH_SIZES)]
                calls.append([(first + 5 * i) % NUM_PROMPTS for i in range(size)])
                stops.append(3 if (k + j + offset) % 2 else None)  # row 0 ends after at most 4 tokens
        plan.append((variant, setting, calls, stops))
    return plan


def _kind_offset(name: str) -> int:
    """Where a kind's cells start in the prompt rotation (kinds meet different prompts)."""
    return list(KINDS).index(name) if name in KINDS else len(KINDS)


def check_greedy(cell: Cell, kind: DrafterKind) -> dict:
    """Every call of the cell equals plain greedy `generate`; returns what it checked (calls, rows, early rows)."""
    target, prompts, refs = greedy_setup(cell.family)
    checked = {"calls": 0, "rows": 0, "early": 0, "stops": 0}
    for variant, setting, calls, stops in greedy_plan(cell, kind):
        drafter = kind.make(target, variant)
        setting.apply(drafter)
        lookups = trusted = longest = 0
        for rows, stop in zip(calls, stops):
            eos = None if stop is None else int(refs[rows[0]][stop])
            stats = assert_equivalent(target, drafter, [prompts[i] for i in rows], [refs[i] for i in rows], eos=eos)
            assert stats.loop == cell.loop, (cell, stats.loop)
            assert stats.mode == setting.mode
            checked["calls"] += 1
            checked["rows"] += len(rows)
            checked["stops"] += stop is not None
            checked["early"] += sum(r.new_tokens < MAX_NEW for r in stats.rows) if stats.rows else 0
            lookups += stats.lookup_rounds
            trusted += stats.lookup_only_rounds
            longest = max(longest, stats.longest_lookup)
        lookup = setting.lookup
        if lookup["lookup_num_tokens"] is None:
            assert lookups == 0, (cell, variant, setting)
        else:  # the branch was used; verified alone exactly when trusted; longer than asked only when it may grow
            assert lookups > 0, (cell, variant, setting)
            assert (trusted > 0) == (lookup["lookup_trust_ngram"] is not None), (cell, variant, setting, trusted)
            cap = lookup["lookup_max_tokens"] or lookup["lookup_num_tokens"]
            assert 1 <= longest <= cap, (cell, variant, setting, longest)
    if cell.batch == "ragged":  # rows of one batch finished at different rounds
        assert checked["early"] >= checked["stops"] > 0, checked
    return checked


# ---------------------------------------------------------------------------------------------- sampling
VOCAB = 12
TEMPERATURE, TOP_P = 0.8, 0.9
SHORT = torch.tensor([3, 7, 5, 9, 3, 7])  # "... 3 7" repeats: prompt lookup finds "5 9 ..."
LONG = torch.tensor([4, 8, 10, 6, 11, 3, 9, 5, 4])
BATCH1_CALLS = 1200
RAGGED_ROWS = (48, 16)  # copies of SHORT, of LONG in every ragged call
RAGGED_CALLS = (50, 100, 150, 200, 250, 300)  # the first at which the test has its power is used
POWER_EPS, POWER_DRAWS = 0.05, 10
HEAD_SCALE = {"batch1": 0.4, "ragged": 2.0}  # moderately peaked (several tokens matter) / peaked (5 % measurable)


@functools.lru_cache(maxsize=None)
def sampling_setup(family: str, batch: str):
    """A tiny target of the family (vocabulary 12, 2 layers), its head scaled for the batch setting, and the exact
    distribution `(VOCAB * VOCAB,)` of generated tokens 2 and 3 for each prompt. Shared: nothing may change it."""
    target = tiny_target(family, vocab_size=VOCAB, hidden_size=32, num_layers=2, seed=4)
    with torch.no_grad():
        target.lm_head.weight.mul_(HEAD_SCALE[batch])
    prompts = {"short": SHORT} if batch == "batch1" else {"short": SHORT, "long": LONG}
    exact = {name: exact_pair_distribution(target, p[None], TEMPERATURE, TOP_P, VOCAB).reshape(-1)
             for name, p in prompts.items()}
    return target, exact


def tv_test(counts, exact, gen) -> tuple[float, float]:
    """The total variation of the empirical distribution `counts` from `exact`, and the tolerance: 1.5x the largest
    TV of 30 simulated exact samplers of the same size. Passes when `tv < tolerance`."""
    n = int(counts.sum())
    tv = 0.5 * (counts / n - exact).abs().sum().item()
    null = []
    for _ in range(30):
        draw = torch.multinomial(exact.float(), n, replacement=True, generator=gen)
        null.append(0.5 * (torch.bincount(draw, minlength=exact.numel()).double() / n - exact).abs().sum().item())
    return tv, 1.5 * max(null)


def distorted(exact, eps=POWER_EPS):
    """`exact` with `eps` of its mass moved from its most probable cells (the top half of the mass) to the rest of its
    support, in proportion: a sampler off by total variation `eps`, too flat (as a wrong temperature would be)."""
    order = exact.argsort(descending=True)
    top = torch.zeros_like(exact, dtype=torch.bool)
    top[order[exact[order].cumsum(0) <= 0.5]] = True
    top[order[0]] = True
    low = ~top & (exact > 0)
    out = exact.clone()
    out[top] -= eps * exact[top] / exact[top].sum()
    out[low] += eps * exact[low] / exact[low].sum()
    return out


def rejects_distorted(exact, n, gen, draws=POWER_DRAWS) -> bool:
    """Whether `tv_test` at sample size `n` rejects every one of `draws` samplers distorted by `POWER_EPS`."""
    bad = distorted(exact)
    assert abs(0.5 * (bad - exact).abs().sum().item() - POWER_EPS) < 1e-9
    for _ in range(draws):
        draw = torch.bincount(torch.multinomial(bad.float(), n, replacement=True, generator=gen),
                              minlength=exact.numel()).double()
        tv, tolerance = tv_test(draw, exact, gen)
        if tv < tolerance:
            return False
    return True


def ragged_calls(exact) -> int:
    """The fewest calls (of `RAGGED_CALLS`) whose short-prompt sample, less a quarter (a margin), lets `tv_test`
    reject 5 %-distorted samplers (twice `POWER_DRAWS` tries), else the most."""
    gen = torch.Generator().manual_seed(2)
    for calls in RAGGED_CALLS:
        if rejects_distorted(exact, calls * RAGGED_ROWS[0] * 3 // 4, gen, draws=2 * POWER_DRAWS):
            return calls
    return RAGGED_CALLS[-1]


def sampling_drafter(cell: Cell, kind: DrafterKind, target):
    drafter = kind.make_sampling(target)
    g = drafter.generation_config
    g.num_assistant_tokens, g.draft_mode = 2, cell.mode.split("+")[0]
    g.tree_width, g.tree_depth, g.tree_budget = 3, 2, 4
    for name, value in LOOKUP_OFF.items():
        setattr(g, name, value)
    if cell.mode == "tree+lookup":
        g.lookup_num_tokens = 3
    return drafter


def check_sampling(cell: Cell, kind: DrafterKind, calls: int | None = None, max_new_tokens: int = 3) -> dict:
    """The cell's sampled tokens 2 and 3 keep the target's distribution, per prompt; `calls` overrides the number
    of calls (a mutation test that needs no power); `max_new_tokens` the tokens each call generates (a drafter that
    drafts no token before its second round, as Lafa, needs 4 for token 3 to be drafted). Returns the TVs,
    tolerances and sample sizes."""
    target, exact = sampling_setup(cell.family, cell.batch)
    drafter = sampling_drafter(cell, kind, target)
    if cell.batch == "batch1":
        ids, mask, rows = SHORT[None], None, {"short": slice(0, 1)}
        calls = calls or BATCH1_CALLS
    else:
        ids, mask = left_pad([SHORT] * RAGGED_ROWS[0] + [LONG] * RAGGED_ROWS[1])
        rows = {"short": slice(0, RAGGED_ROWS[0]), "long": slice(RAGGED_ROWS[0], sum(RAGGED_ROWS))}
        calls = calls or ragged_calls(exact["short"])
    counts = {name: torch.zeros(VOCAB * VOCAB, dtype=torch.float64) for name in exact}
    torch.manual_seed(0)
    accepted = lookup_rounds = 0
    for _ in range(calls):
        out = target.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=True,
                              temperature=TEMPERATURE, top_p=TOP_P, top_k=0, assistant_model=drafter, eos_token_id=None,
                              pad_token_id=PAD)
        L = ids.shape[1]
        cells = out[:, L + 1] * VOCAB + out[:, L + 2]  # generated tokens 2 and 3
        for name, sl in rows.items():
            counts[name] += torch.bincount(cells[sl], minlength=VOCAB * VOCAB).double()
        stats = drafter.last_stats
        accepted += sum(stats.accepted)
        lookup_rounds += stats.lookup_rounds
    assert stats.loop == cell.loop, (cell, stats.loop)
    assert accepted > 0, "no draft token was ever accepted: the test would not exercise rejection sampling"
    assert (lookup_rounds > 0) == (cell.mode == "tree+lookup"), lookup_rounds
    gen = torch.Generator().manual_seed(1)
    report = {}
    for name in exact:
        tv, tolerance = tv_test(counts[name], exact[name], gen)
        report[name] = (tv, tolerance, int(counts[name].sum()))
        assert tv < tolerance, (cell, name, tv, tolerance)
    if cell.batch == "ragged":  # the test, at the short prompt's sample size, fails on samplers distorted by 5 %
        assert rejects_distorted(exact["short"], int(counts["short"].sum()), gen), report
    return report
