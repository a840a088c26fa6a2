"""Speculative generation for a batch of prompts (ragged acceptance) on tiny Llama, Qwen3 and Qwen3.5-hybrid targets:
what the equivalence grid (`tests/test_equivalence_grid.py`: every row of ragged batches equal to its own batch-1
plain greedy output, then pads, over drafters x shapes x lookup settings; each row's sampled distribution kept) does
not check: the "fork" Gated DeltaNet back-end, per-row and pooled statistics, the output equal to plain batched
`generate`, the batch-size cutoff, refused batches, the `text-generation` pipeline with `batch_size`.
"""

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, pipeline

import hf_chainflow  # noqa: F401  (installs the generate hook)
from hf_chainflow import ChainFlowConfig, ChainFlowDrafter
from hf_chainflow.testing import TINY_FAMILIES, OracleDrafter, tiny_target

from _speculative import random_drafter, set_shape
from testing_common import MAX_NEW, PAD, assert_equivalent, greedy_setup, left_pad


def make_drafter(target, kind):
    if kind == "random":
        return random_drafter(target)
    return OracleDrafter(target, error_rate=float(kind[len("oracle"):]), seed=7)


def check_batch(target, drafter, prompts, refs, eos=None, **kwargs):
    """One batched speculative call: every row equals its own batch-1 plain greedy output, then pads (the common
    tester's check, `testing_common.assert_equivalent`). Returns the rows checked."""
    assert_equivalent(target, drafter, prompts, refs, eos=eos, **kwargs)
    return len(prompts)


@pytest.fixture(scope="module", params=TINY_FAMILIES)
def family_setup(request):
    """The grid's target of the family, its 24 prompts `(L,)` (1-40 tokens) and their batch-1 plain greedy
    continuations (`testing_common.greedy_setup`)."""
    return (request.param, *greedy_setup(request.param))


def test_hybrid_fork_back_end_in_a_batch():
    target, prompts, refs = greedy_setup("qwen3_5")
    drafter = make_drafter(target, "oracle0.3")
    set_shape(drafter, "tree", (4, 3))
    check_batch(target, drafter, prompts[:6], refs[:6], gdn_method="fork")  # the reference back-end, one tree per row


def test_per_row_and_pooled_stats(family_setup):
    family, target, prompts, refs = family_setup
    drafter = make_drafter(target, "oracle0")
    set_shape(drafter, "chain", 3)
    rows = [0, 1, 4, 9]
    check_batch(target, drafter, [prompts[i] for i in rows], [refs[i] for i in rows])
    stats = drafter.last_stats
    assert stats.accepted == [a for r in stats.rows for a in r.accepted]
    assert stats.new_tokens == sum(r.new_tokens for r in stats.rows) == MAX_NEW * len(rows)
    assert stats.forwards == max(r.rounds for r in stats.rows)  # one verify forward per round for the batch
    for r in stats.rows:  # a perfect oracle: every full round accepts the whole chain
        full = [a for a, d in zip(r.accepted, r.drafted_depth) if d == 3]
        assert full and all(a == 3 for a in full)
    d = stats.to_dict()
    assert d["batch_size"] == len(rows) and len(d["rows"]) == len(rows) and d["speculative"] is True


def test_output_is_plain_batched_generate(family_setup):
    """Shape, padding and dict output as plain batched `generate` (which itself equals batch-1 on these targets)."""
    family, target, prompts, refs = family_setup
    drafter = random_drafter(target)
    set_shape(drafter, "tree", (4, 3))
    ids, mask = left_pad(prompts[:5])
    eos = int(refs[0][2])
    plain = target.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=eos,
                            pad_token_id=PAD)
    out = target.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=eos,
                          pad_token_id=PAD, assistant_model=drafter, return_dict_in_generate=True)
    assert torch.equal(out.sequences, plain)
    assert out.cache is None  # rows left the batch as they finished: no cache of every row to continue from


def test_decode_batch_cutoff(family_setup):
    family, target, prompts, refs = family_setup
    drafter = make_drafter(target, "oracle0.3")
    set_shape(drafter, "tree", (4, 3))
    drafter.generation_config.max_speculative_batch_size = 2
    try:
        check_batch(target, drafter, prompts[:2], refs[:2])  # at the cutoff: drafts
        ids, mask = left_pad(prompts[:3])
        out = target.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None,
                              pad_token_id=PAD, assistant_model=drafter)
        plain = target.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, do_sample=False,
                                eos_token_id=None, pad_token_id=PAD)
        assert torch.equal(out, plain)
        stats = drafter.last_stats
        assert stats.speculative is False and stats.batch_size == 3 and stats.rounds == 0
        assert "max_speculative_batch_size=2" in stats.reason and stats.new_tokens == 3 * MAX_NEW
        drafter.generation_config.max_speculative_batch_size = 0
        with pytest.raises(ValueError, match=r"max_speculative_batch_size` must be None .* got 0"):
            target.generate(ids, attention_mask=mask, max_new_tokens=4, assistant_model=drafter)
    finally:
        drafter.generation_config.max_speculative_batch_size = None


# ---------------------------------------------------------------------------------------------- bad input
@pytest.fixture(scope="module")
def llama():
    return tiny_target("llama")


def test_bad_batches_are_refused_and_change_nothing(llama):
    cfg = ChainFlowConfig.for_target(llama.config, num_blocks=1, num_heads=4, path_hidden_size=32, markov_rank=16)
    torch.manual_seed(0)
    drafter = ChainFlowDrafter(cfg).eval()  # unbound: a refused call must leave it unbound
    drafter.generation_config.draft_mode = "tree"
    before = drafter.generation_config.to_dict()
    drafter.last_stats = sentinel = object()
    ids, mask = left_pad([torch.tensor([5, 6, 7, 8]), torch.tensor([9, 10])])
    right = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    cases = [
        (dict(input_ids=ids), r"holding the pad token id 0 but no `attention_mask`.*padding_side = 'left'"),
        (dict(input_ids=ids, attention_mask=right), r"rows \[1\] are padded on the right.*padding_side = 'left'"),
        (dict(input_ids=ids, attention_mask=mask[:, 1:]), r"`attention_mask` has shape \(2, 3\) but `input_ids` has "
                                                          r"shape \(2, 4\)"),
        (dict(input_ids=ids, attention_mask=mask * 2), r"only 0 \(padding\) and 1"),
        (dict(input_ids=ids, attention_mask=torch.tensor([[1, 1, 1, 1], [0, 0, 0, 0]])), r"rows \[1\] hold no token"),
    ]
    for mode in ("chain", "tree"):
        drafter.generation_config.draft_mode = mode
        for kwargs, needle in cases:
            with pytest.raises(ValueError, match=needle):
                llama.generate(**kwargs, max_new_tokens=4, pad_token_id=PAD, assistant_model=drafter)
            assert not drafter.is_bound and drafter.last_stats is sentinel
    drafter.generation_config.draft_mode = "tree"
    assert drafter.generation_config.to_dict() == before
    # the same batch, well formed, runs (and binds the drafter)
    out = llama.generate(ids, attention_mask=mask, max_new_tokens=4, pad_token_id=PAD, assistant_model=drafter)
    assert out.shape[0] == 2 and drafter.is_bound


# ---------------------------------------------------------------------------------------------- pipeline
def word_tokenizer(vocab_size=256):
    vocab = {f"w{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0", pad_token="w0", eos_token="w2",
                                   padding_side="left")


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_text_generation_pipeline_with_batch_size(family):
    target = tiny_target(family)
    drafter = random_drafter(target)
    drafter.generation_config.draft_mode = "tree"
    tok = word_tokenizer()
    texts = ["w5 w17 w99 w42 w7 w130", "w8 w9", "w200 w3 w4 w77", "w61"]
    plain = pipeline("text-generation", model=target, tokenizer=tok, device="cpu")
    refs = [plain(t, max_new_tokens=10, do_sample=False) for t in texts]  # one at a time
    assisted = pipeline("text-generation", model=target, tokenizer=tok, assistant_model=drafter, device="cpu")
    drafter.last_stats = None
    assert assisted(texts, batch_size=4, max_new_tokens=10, do_sample=False) == refs
    assert drafter.last_stats.batch_size == 4 and drafter.last_stats.forwards > 0
