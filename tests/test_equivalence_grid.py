"""The equivalence grid: every cell of `testing_common.grid()`, drafter kind x target family (tiny Llama, Qwen3,
Qwen3.5 hybrid) x draft mode (chain, tree, tree + prompt lookup) x batch (one prompt, a ragged batch) x decoding
(greedy, sampling), checked by the common tester (`tests/testing_common.py`, which says what each cell checks); a
cell a kind does not support asserts the kind's named refusal.

The tester's own tests: the grid's size and the coverage it keeps from the per-file tests it replaced; mutations
that break exactness (an acceptance that takes one wrong token, verification logits that differ from plain
decoding's, a sampler that always accepts) make the cells fail; a declared refusal is asserted, and a refusal that
does not happen fails.
"""

import importlib

import pytest
import torch

from hf_chainflow.testing import OracleDrafter

import testing_common as common
from testing_common import Cell, DrafterKind, Refusal, check_cell, grid


@pytest.mark.parametrize("cell", grid(), ids=str)
def test_cell(cell):
    check_cell(cell)


def test_the_grid_keeps_the_coverage_of_the_tests_it_replaced():
    cells = grid()
    assert len(cells) == len(set(cells)) == len(common.KINDS) * 3 * 3 * 2 * 2
    per_family = {}  # what one family's greedy cells check (every family runs the same plan)
    for cell in (c for c in cells if c.decoding == "greedy" and c.family == "llama"):
        for variant, setting, calls, stops in common.greedy_plan(cell, common.KINDS[cell.kind]):
            key = (cell.batch, cell.kind, variant, setting.mode, str(setting.shape), str(setting.lookup))
            per_family[key] = (len(calls), sum(len(rows) for rows in calls), sum(s is not None for s in stops))
    batch1 = {k: v for k, v in per_family.items() if k[0] == "batch1"}
    ragged = {k: v for k, v in per_family.items() if k[0] == "ragged"}
    # batch 1: every (drafter, shape) on 6 prompts, as tests/test_generation.py did (30 prompts per family there)
    assert all(calls == common.PROMPTS_PER_RUN == 6 for calls, _, _ in batch1.values())
    assert len({i for cell in cells if cell.batch == "batch1" and cell.decoding == "greedy"
                for _, _, calls, _ in common.greedy_plan(cell, common.KINDS[cell.kind]) for i, in calls}) == 24
    # ragged: 2 batches of 2-8 rows per (drafter, shape), half stopping early; 600 rows in all before, more now
    assert all(calls == 2 and 2 * 2 <= rows <= 2 * 8 and stops >= 1 for calls, rows, stops in ragged.values())
    assert sum(rows for _, rows, _ in ragged.values()) * len(common.FAMILIES) >= 600
    # the drafters and shapes of the old tests: OracleDrafter at 0, 0.3, 1 and a random ChainFlowDrafter; chains 1,
    # 3, 8; trees 4x3, 5x7, 16x4, 1x1, 8x4 cut to 10 nodes (8x4 whole: 16x4 is wider at the same depth)
    assert set(common.KINDS["oracle"].variants) == {0.0, 0.3, 1.0}
    assert set(common.CHAINS) == {1, 3, 8} and set(common.TREES) >= {(4, 3), (5, 7), (8, 4, 10), (16, 4), (1, 1)}
    # sampling: 1,200 calls at batch 1 (tests/test_generate_api.py), 64 rows per ragged call (tests/test_batch_...)
    assert common.BATCH1_CALLS == 1200 and common.RAGGED_ROWS == (48, 16) and common.POWER_EPS == 0.05


# ---------------------------------------------------------------------------------------------- mutations
def acceptance_module():
    """The module whose `accept_greedy` / `accept_sampling_tree` the loops reach (through `accept_round`)."""
    for name in ("hf_chainflow.generation.acceptance", "hf_chainflow.generation.verification"):
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(module, "accept_greedy"):
            return module
    raise AssertionError("no module defines `accept_greedy`")


@pytest.mark.parametrize("cell", [Cell("oracle", "llama", "tree", "batch1", "greedy"),
                                  Cell("chainflow", "qwen3_5", "chain", "ragged", "greedy")], ids=str)
def test_an_acceptance_taking_one_wrong_token_fails_the_grid(monkeypatch, cell):
    module = acceptance_module()
    original, calls = module.accept_greedy, []

    def one_wrong_token(tree, logits):
        """The right path, then one more child whose token is not the target's argmax (when there is one)."""
        calls.append(1)
        acc = original(tree, logits)
        node = acc.nodes[-1] if acc.nodes else -1
        top = int(logits[node + 1].argmax())
        wrong = [c for c, p in enumerate(tree.parents.tolist()) if p == node and int(tree.tokens[c]) != top]
        if not wrong:
            return acc
        return type(acc)(acc.nodes + wrong[:1], int(logits[wrong[0] + 1].argmax()))

    monkeypatch.setattr(module, "accept_greedy", one_wrong_token)
    with pytest.raises(AssertionError):
        check_cell(cell)
    assert calls, "the loop never reached the patched acceptance"


@pytest.mark.parametrize("cell", [Cell("chainflow", "llama", "chain", "batch1", "greedy"),  # transformers' loop
                                  Cell("oracle", "qwen3_5", "tree", "batch1", "greedy"),
                                  Cell("oracle", "qwen3", "tree+lookup", "ragged", "greedy")], ids=str)
def test_verification_logits_that_differ_from_plain_decoding_fail_the_grid(cell):
    """Through the public path only: the target's head gives a wrong argmax whenever it scores more than one position
    at once (a verification forward; plain decoding and every prefill score one), as a wrong tree mask, position or
    cache would. Independent of which loop runs and how it calls the verification maths."""
    target, prompts, refs = common.greedy_setup(cell.family)  # references first, unpatched
    corrupted = []

    def wrong_argmax(module, args, out):
        if out.shape[-2] == 1:
            return out
        corrupted.append(1)
        out = out.clone()
        out.scatter_(-1, out.argmax(-1, keepdim=True), out.min().item() - 1.0)
        return out

    handle = target.get_output_embeddings().register_forward_hook(wrong_argmax)
    try:
        with pytest.raises(AssertionError):
            check_cell(cell)
    finally:
        handle.remove()
    assert corrupted, "no forward scored more than one position"
    kind = common.KINDS[cell.kind]
    common.assert_equivalent(target, kind.make(target, kind.variants[0]), prompts[1:2], refs[1:2])  # hook gone: equal


def test_a_sampler_that_always_accepts_fails_the_grid(monkeypatch):
    """Trees accepted child by child with no coin (the first child always kept): the sampling check fails, at a
    quarter of its sample."""
    module = acceptance_module()

    def always_first_child(tree, target_probs):
        parents, nodes, node = tree.parents.tolist(), [], -1
        while (children := [c for c, p in enumerate(parents) if p == node]):
            node = children[0]
            nodes.append(node)
        row = target_probs[node + 1] if torch.is_tensor(target_probs) else target_probs(node + 1)
        return module.Acceptance(nodes, int(torch.multinomial(row.float(), 1)))

    monkeypatch.setattr(module, "accept_sampling_tree", always_first_child)
    with pytest.raises(AssertionError, match="short"):
        check_cell(Cell("chainflow", "llama", "tree", "batch1", "sampling"), calls=300)


# ---------------------------------------------------------------------------------------------- refusals
class ChainsOnlyOracle(OracleDrafter):
    """A drafter kind that drafts chains only and says so (the shape of a kind's named refusal)."""

    def draft(self, hidden_states, input_ids, *, mode="chain", **kwargs):
        if mode != "chain":
            raise ValueError(f"ChainsOnlyOracle drafts chains only; got draft_mode={mode!r}.")
        return super().draft(hidden_states, input_ids, mode=mode, **kwargs)


def chains_only(refuses):
    return DrafterKind("chains-only", (0.3,), make=lambda target, rate: ChainsOnlyOracle(target, error_rate=rate),
                       make_sampling=lambda target: ChainsOnlyOracle(target, error_rate=0.5), refusal=refuses)


def test_a_cell_a_kind_does_not_support_asserts_its_named_refusal():
    refusal = Refusal(ValueError, r"drafts chains only; got draft_mode='tree'")
    kinds = {"chains-only": chains_only(lambda cell: refusal if cell.mode != "chain" else None)}
    for mode in ("tree", "tree+lookup"):
        for batch in ("batch1", "ragged"):
            check_cell(Cell("chains-only", "llama", mode, batch, "greedy"), kinds)
    # a declared refusal that does not happen fails the cell, as a refusal with another message does
    wrong = {"chains-only": chains_only(lambda cell: refusal)}
    with pytest.raises(pytest.fail.Exception, match="DID NOT RAISE"):
        check_cell(Cell("chains-only", "llama", "chain", "batch1", "greedy"), wrong)
    other = {"chains-only": chains_only(lambda cell: Refusal(ValueError, "another message"))}
    with pytest.raises(AssertionError, match="Regex pattern did not match"):
        check_cell(Cell("chains-only", "llama", "tree", "batch1", "greedy"), other)
