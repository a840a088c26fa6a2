"""Lossless speculative generation on tiny random Llama, Qwen3 and Qwen3.5-hybrid targets.

Every speculative call is compared token for token with plain `target.generate` (greedy), across 30 prompts per
family, with a random ChainFlowDrafter and with OracleDrafter at error rates 0, 0.3 and 1.0, chains of length
1, 3, 8 and trees 8x4, 5x7, 16x4, 1x1 and 8x4 cut to its 10 most probable nodes.  Each (drafter, shape) pair runs
on a rotating subset of the prompts so that every prompt meets several pairs and every pair meets several prompts.
"""

import itertools

import pytest
import torch

import hf_chainflow  # noqa: F401  (installs the generate hook)
from hf_chainflow.testing import TINY_FAMILIES, OracleDrafter, tiny_target

from _speculative import random_drafter, set_shape

SHAPES = [("chain", 1), ("chain", 3), ("chain", 8), ("tree", (8, 4)), ("tree", (5, 7)), ("tree", (16, 4)),
          ("tree", (1, 1)), ("tree", (8, 4, 10))]  # (width, depth[, budget])
NUM_PROMPTS = 30
MAX_NEW = 20


@pytest.fixture(scope="module", params=TINY_FAMILIES)
def family_setup(request):
    target = tiny_target(request.param)
    gen = torch.Generator().manual_seed(123)
    prompts = [torch.randint(3, 256, (1, int(torch.randint(2, 40, (), generator=gen))), generator=gen)
               for _ in range(NUM_PROMPTS)]
    refs = [target.generate(p, max_new_tokens=MAX_NEW, do_sample=False) for p in prompts]
    return request.param, target, prompts, refs


@pytest.mark.parametrize("drafter_kind", ["random", "oracle0", "oracle0.3", "oracle1"])
def test_greedy_is_lossless(family_setup, drafter_kind):
    family, target, prompts, refs = family_setup
    if drafter_kind == "random":
        drafter = random_drafter(target)
    else:
        drafter = OracleDrafter(target, error_rate=float(drafter_kind[len("oracle"):]), seed=7)
    cases = list(itertools.product(range(len(SHAPES)), range(NUM_PROMPTS)))
    offset = {"random": 0, "oracle0": 1, "oracle0.3": 2, "oracle1": 3}[drafter_kind]
    checked = 0
    for shape_index, prompt_index in cases:
        if (prompt_index + offset) % 5 != shape_index % 5:  # each pair: 6 prompts; each prompt: 1-2 shapes
            continue
        mode, shape = SHAPES[shape_index]
        set_shape(drafter, mode, shape)
        out = target.generate(prompts[prompt_index], max_new_tokens=MAX_NEW, do_sample=False, assistant_model=drafter)
        assert torch.equal(out, refs[prompt_index]), (family, drafter_kind, mode, shape, prompt_index)
        assert drafter.last_stats.rounds > 0
        checked += 1
    assert checked >= 6 * len(SHAPES) * 0.8


@pytest.mark.parametrize("mode,shape", [("chain", 3), ("chain", 8), ("tree", (8, 4)), ("tree", (5, 7))])
def test_perfect_oracle_accepts_full_depth(family_setup, mode, shape):
    family, target, prompts, refs = family_setup
    drafter = OracleDrafter(target, error_rate=0.0)
    set_shape(drafter, mode, shape)
    depth = shape if mode == "chain" else shape[1]
    prompt = prompts[3]
    out = target.generate(prompt, max_new_tokens=40, do_sample=False, assistant_model=drafter)
    ref = target.generate(prompt, max_new_tokens=40, do_sample=False)
    assert torch.equal(out, ref)
    stats = drafter.last_stats
    full_rounds = [a for a, d in zip(stats.accepted, stats.drafted_depth) if d == depth]
    assert full_rounds, "no full-depth round"
    assert all(a == depth for a in full_rounds)  # tau = depth + 1 on every full round
    assert stats.acceptance_per_depth() == [1.0] * depth


def test_loops_used(family_setup):
    family, target, prompts, _ = family_setup
    drafter = OracleDrafter(target, error_rate=0.3)
    set_shape(drafter, "chain", 3)
    target.generate(prompts[0], max_new_tokens=8, assistant_model=drafter)
    assert drafter.last_stats.loop == ("chainflow" if family == "qwen3_5" else "transformers")
    set_shape(drafter, "tree", (4, 3))
    target.generate(prompts[0], max_new_tokens=8, assistant_model=drafter)
    assert drafter.last_stats.loop == "chainflow"


def test_custom_generate_direct(family_setup):
    family, target, prompts, refs = family_setup
    drafter = OracleDrafter(target, error_rate=0.3, seed=3)
    set_shape(drafter, "tree", (4, 3))
    out = target.generate(prompts[5], max_new_tokens=MAX_NEW, do_sample=False,
                          custom_generate=hf_chainflow.speculative_generate, drafter=drafter)
    assert torch.equal(out, refs[5])


def test_own_loop_prefill_projects_only_the_last_position(family_setup):
    """The prompt forward asks for the last position's logits only (as `generate` does): the full `(L, V)`
    projection is what makes long prompts slow on CPU. Fails if the prefill drops `logits_to_keep=1`."""
    family, target, prompts, refs = family_setup
    prompt = max(prompts, key=lambda p: p.shape[1])
    assert prompt.shape[1] > 1
    drafter = OracleDrafter(target, error_rate=0.3, seed=3)
    set_shape(drafter, "tree", (4, 3))
    widths = []
    handle = target.get_output_embeddings().register_forward_hook(lambda m, args, out: widths.append(args[0].shape[1]))
    try:
        out = target.generate(prompt, max_new_tokens=8, do_sample=False,
                              custom_generate=hf_chainflow.speculative_generate, drafter=drafter)
    finally:
        handle.remove()
    assert widths[0] == 1, widths
    assert torch.equal(out, target.generate(prompt, max_new_tokens=8, do_sample=False))
