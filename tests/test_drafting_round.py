"""The compiled drafting round (`hf_chainflow.generation.drafting_round`) drafts what the eager round drafts.

Over many windows of tiny random drafters (folded feedback with a candidate budget, a shortlist), chains and trees
with a budget cut: identical tokens and parents, log-probabilities within float tolerance, or a parting only at a
near tie (`compare_drafts`, counted and bounded). Compiling takes tens of seconds per shape: marked slow.
"""

import pytest
import torch

from hf_chainflow import ChainFlowDrafter
from hf_chainflow.generation import drafting
from hf_chainflow.generation.drafting_round import compare_drafts
from hf_chainflow.testing import tiny_target

from _windows import one_thread, tiny_drafter_config


@pytest.fixture(scope="module", autouse=True)
def _single_thread():
    with one_thread():
        yield


def _drafter(target, **overrides):
    torch.manual_seed(0)
    drafter = ChainFlowDrafter(tiny_drafter_config(target, **overrides)).bind_target(target).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # zero-initialised feedback outputs (and new inputs): give them weight so every term matters
        extra = [e.bonus_proj for e in drafter.velocity.experts if e.bonus_proj is not None] + [
            m for m in (drafter.layer_fusion,) if m is not None]
        for module in (drafter.path_head, drafter.markov_head, *extra):
            for param in module.parameters():
                param.copy_(torch.randn(param.shape, generator=gen) * 0.3)
    return drafter


@pytest.mark.slow
@pytest.mark.parametrize("overrides", [dict(candidate_budget=30), dict(shortlist=list(range(10, 120))),
                                       dict(candidate_budget=30, bonus_embedding=True, target_layer_ids=[0])],
                         ids=["candidate-budget", "shortlist", "bonus-and-fused-layers"])
def test_the_compiled_round_drafts_what_the_eager_round_drafts(overrides):
    target = tiny_target("llama", num_layers=2)
    drafter = _drafter(target, **overrides)
    C, D, V = drafter.config.context_size, drafter.config.context_state_size, drafter.config.vocab_size
    gen = torch.Generator().manual_seed(3)
    counts = {"same": 0, "near-tie": 0, "different": 0}
    shapes = [dict(mode="chain", num_tokens=4), dict(mode="tree", tree_width=5, tree_depth=4, tree_budget=7)]
    with torch.no_grad():
        for w in range(60):
            states = torch.randn(1, C, D, generator=gen) * 3.0
            committed = torch.randint(3, V, (1, 1 + (5 * w) % 13), generator=gen)
            for shape in shapes:
                want = drafting.draft(drafter, states, committed, **shape, compile=False)
                got = drafting.draft(drafter, states, committed, **shape, compile=True)
                verdict = compare_drafts(want, got)
                counts[verdict] += 1
                if verdict == "same":
                    torch.testing.assert_close(got.logprobs, want.logprobs, rtol=1e-4, atol=1e-4)
    rounds = drafting.compiled_round(drafter)
    assert rounds is not None and len(rounds.keys) == len(shapes)
    assert rounds.eager_reason is None
    assert counts["different"] == 0, counts
    assert counts["same"] >= 0.95 * sum(counts.values()), counts


def test_compile_must_be_a_bool():
    target = tiny_target("llama", num_layers=2)
    drafter = _drafter(target)
    states = torch.randn(1, 8, drafter.config.target_hidden_size)
    with pytest.raises(ValueError, match="compile"):
        drafting.draft(drafter, states, torch.tensor([[5, 6]]), compile="yes")


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen3_5"])
def test_generate_with_the_compiled_round_equals_plain_generate(family):
    """Greedy speculative `generate` with `compile_drafting` on equals plain `generate`, chain and tree, on the three
    target families (dense and the Qwen3.5 hybrid); rounds near `max_length` draft shallower (other compiled keys)."""
    target = tiny_target(family, num_layers=2)
    drafter = _drafter(target)
    drafter.generation_config.compile_drafting = True
    V = target.config.vocab_size
    gen = torch.Generator().manual_seed(5)
    for mode in ("chain", "tree"):
        drafter.generation_config.draft_mode = mode
        for i in range(3):
            ids = torch.randint(3, V, (1, 9 + 4 * i), generator=gen)  # at least the drafter's C = 8 states
            kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=14, do_sample=False)
            plain = target.generate(ids, **kwargs)
            speculative = target.generate(ids, **kwargs, assistant_model=drafter)
            assert torch.equal(speculative, plain), (family, mode, i)
    assert drafting.compiled_round(drafter) is not None and drafting.compiled_round(drafter).eager_reason is None
    assert len(drafting.compiled_round(drafter).keys) >= 2  # both modes ran compiled


@pytest.mark.slow
def test_more_keys_than_dynamos_recompile_limit_all_compile():
    """Each key compiles its own copy of the round: beyond Dynamo's 8 graphs per code object (its recompile limit,
    past which a shared function would silently run eagerly) every new key still gets a graph of its own."""
    from torch._dynamo.utils import counters

    from hf_chainflow.generation.drafting_round import CompiledDraftingRound

    target = tiny_target("llama", num_layers=2)
    drafter = _drafter(target)
    drafter._runtime["compiled_round"] = CompiledDraftingRound(cpp_wrapper=False)  # the Python wrapper compiles sooner
    C, D = drafter.config.context_size, drafter.config.context_state_size
    limit = torch._dynamo.config.recompile_limit
    shapes = [dict(mode="tree", tree_width=w, tree_depth=2) for w in range(2, limit + 3)]
    states, committed = torch.randn(1, C, D), torch.tensor([[5, 6, 7]])
    before = counters["stats"]["unique_graphs"]
    with torch.no_grad():
        for shape in shapes:
            want = drafting.draft(drafter, states, committed, **shape, compile=False)
            got = drafting.draft(drafter, states, committed, **shape, compile=True)
            assert compare_drafts(want, got) != "different", shape
    assert len(drafting.compiled_round(drafter).keys) == len(shapes) > limit
    assert counters["stats"]["unique_graphs"] - before == len(shapes)
