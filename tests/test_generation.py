"""Speculative generation of one prompt on tiny random Llama, Qwen3 and Qwen3.5-hybrid targets: what the equivalence
grid (`tests/test_equivalence_grid.py`, which compares every call with plain `generate` over drafters x shapes) does
not check: a perfect oracle accepts every full-depth round, which loop runs, the direct `custom_generate` route, the
prefill's one-position projection.
"""

import pytest
import torch

import hf_chainflow  # noqa: F401  (installs the generate hook)
from hf_chainflow.testing import TINY_FAMILIES, OracleDrafter, tiny_target

from _speculative import set_shape

NUM_PROMPTS = 6
MAX_NEW = 20


@pytest.fixture(scope="module", params=TINY_FAMILIES)
def family_setup(request):
    target = tiny_target(request.param)
    gen = torch.Generator().manual_seed(123)
    prompts = [torch.randint(3, 256, (1, int(torch.randint(2, 40, (), generator=gen))), generator=gen)
               for _ in range(NUM_PROMPTS)]
    refs = [target.generate(p, max_new_tokens=MAX_NEW, do_sample=False) for p in prompts]
    return request.param, target, prompts, refs


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
