"""Decoding with a Lafa drafter (issue 64, item 2): `target.generate(**inputs, assistant_model=lafa)` at batch 1.

- Greedy output equals plain `generate` token for token on tiny float32 Llama and Qwen3 targets, for a drafter with
  large random weights, a fresh one (its LoRA at zero) and an oracle (a test double through the real fused path:
  the drafter's own noise-row hooks, plus a hook on the target's head that makes the noise rows predict the target's
  true continuation), `block_size` 2, 3 and 4, 30 prompts per family and drafter, a quarter of them stopping on an
  EOS token (inside an accepted draft, checked for the oracle). The oracle commits a whole block every round after
  the first (close to `B` tokens per forward).
- Sampling keeps the target's distribution: the common tester's batch-1 sampling cell with a Lafa drafter
  (`testing_common.check_sampling`); a loop that accepts every Lafa draft fails it.
- The round's forward runs inside the drafter's noise-row context over exactly the extra rows; the target has no
  hook left after a call.
- Refused before anything runs, by name: a batch of prompts, a padded prompt, compiled verification, a tree, a lookup
  branch, a hybrid target; `around_forward` with compiled verification.
"""

from contextlib import contextmanager
from functools import lru_cache

import pytest
import torch
from transformers import DynamicCache

from hf_chainflow import LafaConfig, LafaDrafter
from hf_chainflow.generation import acceptance
from hf_chainflow.generation.lafa import extra_row_mask, lafa_extra_inputs, noise_rows_around
from hf_chainflow.generation.tree import DraftTree
from hf_chainflow.generation.verification import RaggedRows, verify_forward_batch
from hf_chainflow.models.lafa.binding_lafa import LafaTargetError
from hf_chainflow.testing import tiny_target

from testing_common import PAD, Cell, DrafterKind, assert_equivalent, check_sampling, make_prompts, plain_greedy

FAMILIES = ("llama", "qwen3")
BLOCK_SIZES = (2, 3, 4)
NUM_PROMPTS = 30
KINDS = ("random", "zero", "oracle")


@lru_cache(maxsize=None)
def setup(family: str):
    """A tiny target of the family, 30 prompts `(L,)` (1 and 40 tokens among them; odd ones repeat a span) and
    their plain greedy continuations (`MAX_NEW` tokens, no EOS). Shared: nothing may change the target."""
    target = tiny_target(family)
    prompts = make_prompts(NUM_PROMPTS, seed=64)
    with torch.no_grad():  # transformers installs its output-capturing hooks once, at the first such forward
        target(input_ids=prompts[0][None], output_hidden_states=True)
    return target, prompts, [plain_greedy(target, p) for p in prompts]


def random_lafa(target, block_size, std=0.5, seed=0):
    """A drafter with large random weights everywhere (LoRA B, norm modulations, time input, mask embedding)."""
    lafa = LafaDrafter(LafaConfig.for_target(target.config, block_size=block_size))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in lafa.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * std)
    return lafa


class OracleLafa(LafaDrafter):
    """A test double through the real fused path: the drafter's own noise-row context (its LoRA hooks active), plus
    a hook on the target's head that makes every noise row at position `p` predict `truth[p]` (the target's true
    continuation; positions past it keep the drafter's logits). `truth`: prompt + plain greedy continuation."""

    truth: torch.LongTensor | None = None

    @contextmanager
    def noise_rows(self, noise_mask, tau=0.0, generator=None):
        target = self._bound["target"]
        seen = {}

        def positions(module, args, kwargs):
            seen["positions"] = kwargs["position_ids"]

        def head(module, args, logits):  # (B, T, V): a noise row's logits peak at the truth at its position
            logits = logits.clone()
            for b, t in noise_mask.nonzero().tolist():
                p = int(seen["positions"][b, t])
                if p < self.truth.shape[0]:
                    logits[b, t, int(self.truth[p])] = logits[b, t].max() + 100.0
            return logits

        with super().noise_rows(noise_mask, tau, generator) as state:
            handles = [target.register_forward_pre_hook(positions, with_kwargs=True),
                       target.lm_head.register_forward_hook(head)]
            try:
                yield state
            finally:
                for handle in handles:
                    handle.remove()


@lru_cache(maxsize=None)
def drafter(family: str, kind: str, block_size: int):
    target = setup(family)[0]
    if kind == "random":
        return random_lafa(target, block_size)
    cls = OracleLafa if kind == "oracle" else LafaDrafter
    return cls(LafaConfig.for_target(target.config, block_size=block_size))  # unbound: `generate` binds it


def _hooks(model):
    """The forward hooks on `model` (transformers' output-capturing ones too: compare counts)."""
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


# ---------------------------------------------------------------------------------------------- greedy
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_output_equals_plain_generate(family, kind):
    target, prompts, refs = setup(family)
    eos_in_draft, hooks = 0, _hooks(target)
    for i, (prompt, ref) in enumerate(zip(prompts, refs)):
        B = BLOCK_SIZES[i % len(BLOCK_SIZES)]
        lafa = drafter(family, kind, B)
        lafa.truth = torch.cat([prompt, ref]) if kind == "oracle" else None
        stop = 3 + 4 * (i // 4 % 4) if i % 4 == 1 else None  # a stop after 4, 8, 12 or 16 tokens
        eos = None if stop is None else int(ref[stop])
        stats = assert_equivalent(target, lafa, [prompt], [ref], eos=eos)
        assert stats.loop == "chainflow" and stats.mode == "chain", stats
        if not stats.rounds:  # the prefill's token was the EOS
            continue
        assert stats.tau >= 1, stats
        assert stats.drafted_depth[0] == 0 and max(stats.drafted_depth) <= B - 1, stats  # round 1: block 0 only
        # a round cut short by the stop: its EOS was an accepted draft token (the bonus comes after them)
        eos_in_draft += stats.new_tokens < 1 + sum(stats.accepted) + stats.rounds
        if kind == "oracle":  # every drafted token accepted: a whole block per forward after the first round
            assert stats.accepted == stats.drafted_depth, stats
            assert all(d == B - 1 for d in stats.drafted_depth[1:-1]), stats
            if eos is None:
                assert stats.tau >= 0.75 * B, (B, stats.tau)
        assert _hooks(target) == hooks  # the noise-row hooks are gone after the call
    if kind == "oracle":
        assert eos_in_draft > 0


def test_num_assistant_tokens_cuts_the_draft():
    target, prompts, refs = setup("llama")
    lafa = OracleLafa(LafaConfig.for_target(target.config, block_size=4))
    lafa.generation_config.num_assistant_tokens = 2
    for prompt, ref in zip(prompts[:4], refs[:4]):
        lafa.truth = torch.cat([prompt, ref])
        stats = assert_equivalent(target, lafa, [prompt], [ref])
        assert max(stats.drafted_depth) == 2 and stats.accepted == stats.drafted_depth, stats


def test_the_round_runs_in_the_noise_row_context_of_exactly_the_extra_rows(monkeypatch):
    target, prompts, refs = setup("qwen3")
    lafa = drafter("qwen3", "zero", 3)
    masks = []
    original = LafaDrafter.noise_rows

    def recording(self, noise_mask, tau=0.0, generator=None):
        masks.append(noise_mask.clone())
        return original(self, noise_mask, tau, generator)

    monkeypatch.setattr(LafaDrafter, "noise_rows", recording)
    assert_equivalent(target, lafa, [prompts[3]], [refs[3]])
    assert len(masks) == lafa.last_stats.rounds - 1  # the last round (one token left) drafts no block
    for mask, depth in zip(masks, lafa.last_stats.drafted_depth):
        n, E = 1 + depth, 3 * (depth + 1)  # [root] + draft, then a block of 3 per accepted length
        assert mask.tolist() == [[False] * n + [True] * E], (depth, mask)


def test_extra_row_mask_marks_each_rows_extra_inputs_only():
    extra = [lafa_extra_inputs(3, 2), None, lafa_extra_inputs(3, 0)]  # E = 9, 0, 3
    mask = extra_row_mask(extra, extra_start=3, width=16)
    assert mask[0].tolist() == [False] * 3 + [True] * 9 + [False] * 4
    assert not mask[1].any()
    assert mask[2].tolist() == [False] * 3 + [True] * 3 + [False] * 10  # a shorter row's padding is not a noise row


# ---------------------------------------------------------------------------------------------- sampling
LAFA_KIND = DrafterKind("lafa", ("random",), make=lambda target, variant: random_lafa(target, 3),
                        make_sampling=lambda target: random_lafa(target, 3, std=0.3))


@pytest.mark.parametrize("family", FAMILIES)
def test_sampling_keeps_the_targets_distribution(family):
    # 4 new tokens: round 1 (after the prefill's token) drafts nothing, round 2 drafts token 3
    report = check_sampling(Cell("lafa", family, "chain", "batch1", "sampling"), LAFA_KIND, max_new_tokens=4)
    assert report["short"][2] > 0


def test_sampling_fails_when_every_lafa_draft_is_accepted(monkeypatch):
    original = acceptance.accept_round

    def accept_all(tree, rows, do_sample):
        if not do_sample or not tree.num_nodes:
            return original(tree, rows, do_sample)
        bonus = acceptance.choose_token(rows[tree.num_nodes], do_sample)
        return acceptance.Acceptance(list(range(tree.num_nodes)), bonus)

    monkeypatch.setattr(acceptance, "accept_round", accept_all)
    with pytest.raises(AssertionError):
        check_sampling(Cell("lafa", "llama", "chain", "batch1", "sampling"), LAFA_KIND, calls=300, max_new_tokens=4)


# ---------------------------------------------------------------------------------------------- refusals
def _call(target, lafa, ids=None, **kwargs):
    ids = setup("llama")[1][5][None] if ids is None else ids
    return target.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=PAD, assistant_model=lafa, **kwargs)


@pytest.mark.parametrize("field, value, match", [
    ("compile_verification", True, r"compile_verification.*verifies eagerly.*forward hooks"),
    ("draft_mode", "tree", r"draft_mode.*'tree'.*one chain per round"),
    ("lookup_num_tokens", 3, r"lookup_num_tokens.*no lookup branch"),
    ("corpus_lookup_num_tokens", 3, r"corpus_lookup_num_tokens.*no corpus-lookup table"),
    ("num_assistant_tokens", 4, r"num_assistant_tokens.*\[1, 3\]"),
])
def test_drafting_settings_a_lafa_call_cannot_run_are_refused(field, value, match):
    target = setup("llama")[0]
    lafa = LafaDrafter(LafaConfig.for_target(target.config, block_size=4))
    setattr(lafa.generation_config, field, value)
    hooks = _hooks(target)
    with pytest.raises(ValueError, match=match):
        _call(target, lafa)
    assert not lafa.is_bound and _hooks(target) == hooks


def test_a_batch_and_a_padded_prompt_are_refused():
    target, prompts, _ = setup("llama")
    lafa = LafaDrafter(LafaConfig.for_target(target.config, block_size=3))
    ids = torch.stack([prompts[5][:6], prompts[7][:6]])
    with pytest.raises(ValueError, match=r"batch of 2 prompts.*one prompt per call"):
        _call(target, lafa, ids, attention_mask=torch.ones_like(ids))
    ids = prompts[5][None]
    mask = torch.ones_like(ids)
    mask[0, 0] = 0
    with pytest.raises(ValueError, match=r"`attention_mask` pads the prompt"):
        _call(target, lafa, ids, attention_mask=mask)


def test_a_hybrid_target_is_refused():
    hybrid = tiny_target("qwen3_5")
    lafa = LafaDrafter(LafaConfig.for_target(setup("llama")[0].config, block_size=3))
    with pytest.raises(LafaTargetError, match=r"attention-only target.*recurrent layers"):
        _call(hybrid, lafa, torch.tensor([[5, 6, 7]]))


def test_around_forward_with_compiled_verification_is_refused():
    target = setup("llama")[0]
    lafa = random_lafa(target, 3).bind_target(target)
    cache = DynamicCache(config=target.config)
    extra = [lafa_extra_inputs(3, 0)]
    with pytest.raises(ValueError, match=r"`around_forward`.*cannot be combined with `compiled`.*traced"):
        verify_forward_batch(target, cache, RaggedRows([0], [0]), [5], [DraftTree.empty()], extra=extra,
                             compiled=object(), around_forward=noise_rows_around(lafa, extra))
