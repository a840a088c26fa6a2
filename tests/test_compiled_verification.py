"""Compiled verification (`hf_chainflow.generation.compiled_verification`): the target's verify forward compiled on a
static cache at bucketed shapes, lossless as the eager one.

- The maths: a static-cache verify forward padded to a bucket scores the draft exactly as the dynamic one (float32,
  atol 1e-5), and its commit leaves the same committed entries; rows leaving a static batch keep its width.
- The loop: the common tester's greedy cells (every family, mode and batch) and sampling cells (every family,
  a sampled chain and a tree with a lookup branch, ragged and batch 1) with a compiled `OracleDrafter` kind (`compile_verification=True`, torch.compile's
  `aot_eager` backend: Dynamo and AOTAutograd as inductor sees them, without its C++ code generation, which one test
  runs for real); dense targets run compiled rounds, the hybrid eager ones with the named reason.
- Faults: a backend that fails warns once and verifies eagerly (same output); a draft beyond the largest bucket runs
  eagerly, counted; mutations (a padding node the draft sees, a static commit that moves nothing) break exactness.
"""

import logging

import pytest
import torch
from transformers import DynamicCache, StaticCache

from hf_chainflow.generation import compiled_verification as cv
from hf_chainflow.generation import verification
from hf_chainflow.generation.tree import DraftTree
from hf_chainflow.testing import OracleDrafter, tiny_target

import testing_common as common
from testing_common import Cell, DrafterKind, check_cell


@pytest.fixture(autouse=True)
def light_backend(monkeypatch):
    """The light backend, and a fresh start: no compiled graphs (Dynamo's limit is per process) and none counted."""
    monkeypatch.setattr(cv, "COMPILE_BACKEND", "aot_eager")
    monkeypatch.setattr(cv, "_SHAPES", set())
    torch._dynamo.reset()


class CompiledCell(Cell):
    @property
    def loop(self) -> str:  # compiled verification runs every call in hf_chainflow's own loop
        return "chainflow"


def compiled_oracle(target, rate, seed=7):
    drafter = OracleDrafter(target, error_rate=rate, seed=seed)
    drafter.generation_config.compile_verification = True
    return drafter


KINDS = {"oracle": DrafterKind("oracle", (0.0, 0.3), make=compiled_oracle,
                               make_sampling=lambda target: compiled_oracle(target, 0.5, seed=1))}


@pytest.fixture
def rounds(monkeypatch):
    """Compiled and eager verify rounds (and reasons) of the calls made while the test runs."""
    seen = {"compiled": 0, "eager": 0, "reasons": set()}
    original = cv.CompiledVerifier.stats_fields

    def spy(self):
        fields = original(self)
        seen["compiled"] += fields["compiled_rounds"]
        seen["eager"] += fields["eager_rounds"]
        seen["reasons"] |= set(fields["compile_reasons"])
        return fields

    monkeypatch.setattr(cv.CompiledVerifier, "stats_fields", spy)
    return seen


# ---------------------------------------------------------------------------------------------- the maths
def test_buckets_and_cache_length():
    assert [cv.bucket(n) for n in (1, 4, 5, 13, 23, 44, 64)] == [4, 4, 8, 16, 24, 44, 64]
    assert cv.bucket(65) is None
    assert cv.static_cache_length(100) == 192 and cv.static_cache_length(128) == 192
    assert cv.static_cache_length(129) == 256


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_static_padded_verify_equals_dynamic(family):
    torch.manual_seed(0)
    target = tiny_target(family).float().eval()
    prompts = [torch.randint(5, 200, (n,)) for n in (9, 4)]
    ids, mask = common.left_pad(prompts)
    trees = [DraftTree(tokens=torch.tensor([11, 12, 13, 14]), parents=torch.tensor([-1, -1, 0, 2]),
                       depths=torch.tensor([1, 1, 2, 3]), logprobs=torch.zeros(4)), DraftTree.chain(torch.tensor([21, 22]))]
    results = {}
    for kind in ("dynamic", "static"):
        cache = DynamicCache(config=target.config) if kind == "dynamic" else StaticCache(config=target.config,
                                                                                         max_cache_len=256)
        padding = {"attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0)}
        target(input_ids=ids, cache=cache, use_cache=True, **padding)
        rows = verification.RaggedRows.from_attention_mask(mask)
        verifier = cv.CompiledVerifier(target, backend="eager") if kind == "static" else None
        out = verification.verify_forward_batch(target, cache, rows, [5, 6], trees, compiled=verifier)
        verification.commit_batch(target, cache, rows, [[0, 2, 3], [0]], out.handle)
        results[kind] = (out, cache, rows)
    (dyn, dcache, drows), (sta, scache, srows) = results["dynamic"], results["static"]
    assert sta.handle.num_inputs == 8 and dyn.handle.num_inputs == 5  # padded to the bucket
    for b, tree in enumerate(trees):
        m = tree.num_nodes + 1
        torch.testing.assert_close(sta.logits[b, :m], dyn.logits[b, :m], atol=1e-5, rtol=0)
    assert srows.lengths == drows.lengths and srows.starts == drows.starts
    assert verification.committed_length(scache) == drows.cache_length
    for dl, sl in zip(dcache.layers, scache.layers):
        for b in range(2):
            cols = slice(drows.starts[b], drows.lengths[b])
            torch.testing.assert_close(sl.keys[b, :, cols], dl.keys[b, :, cols], atol=1e-5, rtol=0)
            torch.testing.assert_close(sl.values[b, :, cols], dl.values[b, :, cols], atol=1e-5, rtol=0)
    verification.select_rows(scache, srows, [1])  # a row leaves: the width stays, the length follows the rows
    assert scache.layers[0].keys.shape[0] == 1 and scache.layers[0].keys.shape[2] == 256
    assert verification.committed_length(scache) == srows.cache_length == drows.lengths[1]


# ---------------------------------------------------------------------------------------------- the loop
@pytest.mark.parametrize("cell", [CompiledCell("oracle", family, mode, batch, "greedy")
                                  for family in common.FAMILIES for mode in common.MODES
                                  for batch in common.BATCHES], ids=str)
def test_greedy_cells_compiled(cell, rounds):
    check_cell(cell, kinds=KINDS)
    if cell.family == "qwen3_5":
        assert rounds["compiled"] == 0 and rounds["eager"] > 0 and cv.HYBRID_REASON in rounds["reasons"]
    else:
        assert rounds["compiled"] > 0, rounds


@pytest.mark.parametrize("cell", [CompiledCell("oracle", family, mode, batch, "sampling")
                                  for family in common.FAMILIES for mode in ("chain", "tree+lookup")
                                  for batch in common.BATCHES], ids=str)
def test_sampling_cells_compiled(cell, rounds):
    check_cell(cell, kinds=KINDS)
    assert (rounds["compiled"] > 0) == (cell.family != "qwen3_5"), rounds


def _generate(target, drafter, prompt, **kwargs):
    """The continuation `(MAX_NEW,)` of one prompt (the tester's references are plain greedy continuations)."""
    out = target.generate(prompt[None], max_new_tokens=common.MAX_NEW, do_sample=False, assistant_model=drafter,
                          eos_token_id=None, pad_token_id=0, **kwargs)
    return out[0, prompt.shape[0]:]


def test_inductor_round_trip(monkeypatch):
    """inductor itself (C++ code generation): compiled rounds only, the same tokens as plain greedy."""
    monkeypatch.setattr(cv, "COMPILE_BACKEND", "inductor")
    target, prompts, refs = common.greedy_setup("llama")
    drafter = compiled_oracle(target, 0.3)
    drafter.generation_config.draft_mode = "tree"
    drafter.generation_config.tree_width, drafter.generation_config.tree_depth = 2, 3
    out = _generate(target, drafter, prompts[1])
    assert torch.equal(out, refs[1])
    stats = drafter.last_stats
    assert stats.compiled_rounds == stats.rounds > 0 and stats.eager_rounds == 0 and stats.compile_reasons == []


def test_a_failing_backend_warns_once_and_verifies_eagerly(monkeypatch, caplog):
    monkeypatch.setattr(cv, "COMPILE_BACKEND", "hf_chainflow_test_broken")
    monkeypatch.setattr(cv, "_BROKEN", {})
    target, prompts, refs = common.greedy_setup("qwen3")
    drafter = compiled_oracle(target, 0.3)
    with caplog.at_level(logging.WARNING):
        for i in (0, 1):
            out = _generate(target, drafter, prompts[i])
            assert torch.equal(out, refs[i])
            stats = drafter.last_stats
            assert stats.compiled_rounds == 0 and stats.eager_rounds == stats.rounds > 0
            assert any("hf_chainflow_test_broken" in r for r in stats.compile_reasons)
    assert sum("compiled verification is off" in r.message for r in caplog.records) == 1


def test_a_draft_beyond_the_largest_bucket_runs_eagerly_and_is_counted(rounds):
    target, prompts, refs = common.greedy_setup("llama")
    drafter = compiled_oracle(target, 0.3)
    g = drafter.generation_config
    g.draft_mode, g.tree_width, g.tree_depth = "tree", 16, 4  # 64 nodes + the root: 65 inputs
    out = _generate(target, drafter, prompts[2])
    assert torch.equal(out, refs[2])
    stats = drafter.last_stats
    assert stats.eager_rounds > 0 and any("largest bucket" in r for r in stats.compile_reasons)


def test_compile_verification_is_checked():
    target, _, _ = common.greedy_setup("llama")
    drafter = OracleDrafter(target, error_rate=0.0)
    drafter.generation_config.compile_verification = "yes"
    with pytest.raises(ValueError, match="compile_verification` must be True"):
        _generate(target, drafter, torch.tensor([5, 6, 7]))


# ---------------------------------------------------------------------------------------------- mutations
def _greedy_matches(family="llama", prompts_used=(0, 1, 3)):
    target, prompts, refs = common.greedy_setup(family)
    drafter = compiled_oracle(target, 0.0)
    g = drafter.generation_config
    g.draft_mode, g.tree_width, g.tree_depth = "tree", 2, 3
    return all(torch.equal(_generate(target, drafter, prompts[i]), refs[i])
               for i in prompts_used)


def test_mutation_a_padding_node_the_draft_sees_breaks_exactness(monkeypatch):
    assert _greedy_matches()
    original = verification._padded

    def leaky(width, ids, depths, parents, ancestors):
        ids, depths, parents, grown = original(width, ids, depths, parents, ancestors)
        grown[:, 1:, -1] = True  # every node sees the last padding node
        ids[:, -1] = 3
        return ids, depths, parents, grown

    monkeypatch.setattr(verification, "_padded", leaky)
    assert not _greedy_matches()


def test_mutation_a_static_commit_that_moves_nothing_breaks_exactness(monkeypatch):
    original = verification.commit_batch

    def lazy(target, cache, rows, accepted, handle):  # the lengths advance, the accepted entries stay where scored
        before = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
        original(target, cache, rows, accepted, handle)
        if verification.is_static(cache):
            for layer, (keys, values) in zip(cache.layers, before):
                layer.keys.copy_(keys)
                layer.values.copy_(values)

    monkeypatch.setattr(verification, "commit_batch", lazy)
    assert not _greedy_matches()
