"""Corpus lookup: the continuation table (build, propose, rules), its place in a drafter (save/load), lossless greedy
generation with a corpus-lookup branch on every tiny target family, batch 1 and batched, and the command. Sampling
with the branch: `tests/test_generate_api.py::test_sampling_keeps_target_distribution`."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import hf_chainflow  # noqa: F401  (installs the generate hook)
from hf_chainflow import ChainFlowDrafter, ContinuationTable
from hf_chainflow.generation import drafting
from hf_chainflow.generation.corpus_lookup import pack_ngrams, token_bits
from hf_chainflow.testing import TINY_FAMILIES, OracleDrafter, tiny_target

from _speculative import random_drafter, set_shape


def test_build_keeps_the_most_frequent_next_token_of_ngrams_seen_often_enough():
    seqs = [[1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 3, 5], [7, 2, 3, 4], [9, 9]]
    table = ContinuationTable.build(seqs, vocab_size=16, min_ngram=2, max_ngram=3, min_count=2)
    # "2 3" is followed by 4 twice and 5 twice: the tie goes to the smaller id; "1 2 3" -> 5 (twice vs once);
    # "1 2" -> 3 (three times); "7 2 3" was seen once: dropped.
    assert table.propose(torch.tensor([0, 2, 3]), 1).tolist() == [4]
    assert table.propose(torch.tensor([1, 2, 3]), 1).tolist() == [5]  # the longest known n-gram wins
    assert table.propose(torch.tensor([7, 2, 3]), 1).tolist() == [4]  # unknown 3-gram: back off to "2 3"
    assert table.propose(torch.tensor([8, 1, 2]), 3).tolist() == [3, 5]  # "1 2" -> 3, "1 2 3" -> 5, then nothing
    assert table.propose(torch.tensor([9, 9]), 4) is None  # seen once only
    assert table.propose(torch.tensor([3]), 4) is None  # shorter than min_ngram
    assert len(table) == 3 and bool((table.keys[1:] > table.keys[:-1]).all())  # sorted, one entry per n-gram
    assert table.next_tokens.dtype == torch.int32 and table.keys.dtype == torch.int64
    whole = ContinuationTable.build(seqs, vocab_size=16, min_ngram=2, max_ngram=3, min_count=1)
    assert whole.propose(torch.tensor([7, 2, 3]), 1).tolist() == [4] and len(whole) > len(table)
    assert len(ContinuationTable.build([], vocab_size=16)) == 0
    assert ContinuationTable.build([], vocab_size=16).propose(torch.tensor([1, 2]), 3) is None


def test_packed_keys_are_exact_and_differ_across_lengths():
    bits = token_bits(49152)
    assert bits == 16
    import numpy as np

    top = np.array([[49151, 49151, 49151, 49151]])  # the highest ids fill all 64 bits
    keys = np.concatenate([pack_ngrams(top, bits), pack_ngrams(top[:, :3], bits), pack_ngrams(np.zeros((1, 4),
                                                                                                      np.int64), bits)])
    assert len(set(keys.tolist())) == 3
    table = ContinuationTable.build([[49151] * 6, [49151] * 6], vocab_size=49152, max_ngram=4)
    assert table.propose(torch.tensor([49151] * 5), 3).tolist() == [49151] * 3


@pytest.mark.parametrize("kwargs,match", [
    (dict(vocab_size=49152, max_ngram=5), r"`max_ngram` \(5\) n-grams of a 49152-token vocabulary need 80 bits.*"
                                          r"use `max_ngram` <= 4"),
    (dict(vocab_size=16, min_ngram=3, max_ngram=2), r"`min_ngram` \(3\) cannot exceed `max_ngram` \(2\)"),
    (dict(vocab_size=16, min_count=0), r"`min_count` must be a positive integer, got 0"),
])
def test_table_rules(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ContinuationTable.build([[1, 2, 3]], **kwargs)


def test_bad_sequences_and_committed_shapes_are_refused():
    with pytest.raises(ValueError, match=r"token ids outside \[0, 16\): 1..16"):
        ContinuationTable.build([[1, 2, 16]], vocab_size=16)
    table = ContinuationTable.build([[1, 2, 3], [1, 2, 3]], vocab_size=16)
    with pytest.raises(ValueError, match=r"shape \(L,\), got \(1, 2\)"):
        table.propose(torch.tensor([[1, 2]]), 2)


# ---------------------------------------------------------------------------------------------- in a drafter
def test_a_drafter_saves_and_loads_its_table(tmp_path):
    target = tiny_target("llama")
    drafter = random_drafter(target)
    table = ContinuationTable.build([[5, 6, 7, 8, 9]] * 2 + [[5, 6, 1]], vocab_size=256, max_ngram=3)
    drafting.set_continuation_table(drafter, table)
    drafter.generation_config.corpus_lookup_num_tokens = 4
    drafter.save_pretrained(tmp_path / "with")
    tensors = load_file(tmp_path / "with" / "model.safetensors")
    assert torch.equal(tensors["continuation_keys"], table.keys)
    assert tensors["continuation_next_tokens"].dtype == torch.int32
    assert torch.equal(tensors["continuation_next_tokens"], table.next_tokens)
    config = json.loads((tmp_path / "with" / "config.json").read_text())
    assert (config["continuation_table_size"], config["continuation_min_ngram"], config["continuation_max_ngram"]) \
        == (len(table), 2, 3)
    loaded = ChainFlowDrafter.from_pretrained(tmp_path / "with", target=target)
    assert torch.equal(drafting.continuation_table(loaded).keys, table.keys)
    assert drafting.continuation_table(loaded).propose(torch.tensor([5, 6]), 3).tolist() == [7, 8, 9]
    assert loaded.generation_config.corpus_lookup_num_tokens == 4
    loaded.half()  # integer buffers keep their dtype
    assert loaded.continuation_keys.dtype == torch.int64 and loaded.continuation_next_tokens.dtype == torch.int32

    drafting.set_continuation_table(drafter, None)  # removed: saved without the buffers, loads without a table
    drafter.generation_config.corpus_lookup_num_tokens = None
    drafter.save_pretrained(tmp_path / "without")
    assert not any(k.startswith("continuation_") for k in load_file(tmp_path / "without" / "model.safetensors"))
    plain, info = ChainFlowDrafter.from_pretrained(tmp_path / "without", target=target, output_loading_info=True)
    assert drafting.continuation_table(plain) is None and plain.config.continuation_table_size == 0
    assert not info["missing_keys"] and not info["unexpected_keys"]


def test_set_continuation_table_refusals_leave_the_drafter_unchanged():
    target = tiny_target("llama")
    drafter = random_drafter(target)
    table = ContinuationTable.build([[1, 2, 3]] * 2, vocab_size=256)
    drafting.set_continuation_table(drafter, table)
    for bad, match in ((ContinuationTable.build([[1, 2, 3]] * 2, vocab_size=300), "300-token vocabulary"),
                       (ContinuationTable.build([[1, 2, 3]], vocab_size=256), "`table` is empty"),
                       ({"keys": table.keys}, "must be a `hf_chainflow.ContinuationTable` or None, got dict")):
        with pytest.raises(ValueError, match=match):
            drafting.set_continuation_table(drafter, bad)
        assert drafting.continuation_table(drafter).keys is table.keys
        assert drafter.config.continuation_table_size == len(table)


def test_corpus_lookup_needs_a_table_and_a_positive_length():
    target = tiny_target("llama")
    prompt = torch.randint(3, 256, (1, 8))
    drafter = random_drafter(target)
    drafter.generation_config.corpus_lookup_num_tokens = 4
    with pytest.raises(ValueError, match=r"`drafter.generation_config.corpus_lookup_num_tokens` is 4, but this drafter "
                                         r"holds no corpus-lookup table"):
        target.generate(prompt, max_new_tokens=4, assistant_model=drafter)
    drafting.set_continuation_table(drafter, ContinuationTable.build([[1, 2, 3]] * 2, vocab_size=256))
    drafter.generation_config.corpus_lookup_num_tokens = 0
    with pytest.raises(ValueError, match=r"`drafter.generation_config.corpus_lookup_num_tokens` must be a positive "
                                         r"integer or None \(off\), got 0"):
        target.generate(prompt, max_new_tokens=4, assistant_model=drafter)


# ---------------------------------------------------------------------------------------------- lossless
@pytest.fixture(scope="module", params=TINY_FAMILIES)
def family_setup(request):
    """A target, prompts, their greedy references, and a table from the target's greedy responses to half of the
    prompts (their branches are often right) and to other prompts (often wrong)."""
    target = tiny_target(request.param)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 256, (int(torch.randint(2, 12, (), generator=gen)),), generator=gen)
               for _ in range(8)]
    refs = [target.generate(p[None], max_new_tokens=20, do_sample=False)[0, p.shape[0]:] for p in prompts]
    others = [torch.randint(3, 256, (6,), generator=gen) for _ in range(8)]
    responses = [target.generate(p[None], max_new_tokens=20, do_sample=False)[0] for p in others]
    sequences = [torch.cat([p[-2:], r]).tolist() for p, r in zip(prompts[:4], refs[:4])] * 2
    table = ContinuationTable.build(sequences + [r.tolist() for r in responses] * 2, vocab_size=256, max_ngram=3)
    return request.param, target, prompts, refs, table


def _drafters(target, table):
    chainflow = drafting.set_continuation_table(random_drafter(target), table)
    oracle = OracleDrafter(target, error_rate=0.5, seed=1)
    oracle.continuation_table = table  # the loop reads `drafting.continuation_table(drafter)`
    return chainflow, oracle


@pytest.mark.parametrize("shape,num_tokens,prompt_lookup", [(("tree", (4, 3)), 5, None), (("chain", 2), 8, None),
                                                            (("tree", (4, 2, 6)), 5, (4, None)),
                                                            (("tree", (4, 2, 6)), 5, (4, 1))])
def test_corpus_lookup_branch_is_lossless(family_setup, shape, num_tokens, prompt_lookup):
    family, target, prompts, refs, table = family_setup
    for drafter in _drafters(target, table):
        set_shape(drafter, *shape)
        g = drafter.generation_config
        g.corpus_lookup_num_tokens = num_tokens
        if prompt_lookup is not None:
            g.lookup_num_tokens, g.lookup_trust_ngram = prompt_lookup
        recalled = 0
        for prompt, ref in zip(prompts, refs):
            out = target.generate(prompt[None], max_new_tokens=20, do_sample=False, assistant_model=drafter)
            assert torch.equal(out[0, prompt.shape[0]:], ref), (family, shape, type(drafter).__name__)
            assert drafter.last_stats.loop == "chainflow"
            recalled += drafter.last_stats.corpus_lookup_rounds
        assert recalled > 0


def test_corpus_lookup_branch_in_a_batch_is_lossless(family_setup):
    family, target, prompts, refs, table = family_setup
    width = max(p.shape[0] for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, p in enumerate(prompts):
        ids[b, width - p.shape[0]:], mask[b, width - p.shape[0]:] = p, 1
    for drafter in _drafters(target, table):
        set_shape(drafter, "tree", (4, 3))
        drafter.generation_config.corpus_lookup_num_tokens = 5
        out = target.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False, eos_token_id=None,
                              pad_token_id=0, assistant_model=drafter)
        for b, ref in enumerate(refs):
            assert torch.equal(out[b, width:], ref), (family, b)
        assert drafter.last_stats.corpus_lookup_rounds > 0



# ---------------------------------------------------------------------------------------------- the command
def test_the_command_adds_a_table_to_a_saved_drafter_in_its_dtype(tmp_path):
    from hf_chainflow.checkpoints import default_drafter_path
    from hf_chainflow.commands import main

    shipped = default_drafter_path()
    corpus = str(Path(__file__).resolve().parents[1] / "corpus" / "smollm2-135m-instruct")  # the repo's corpus
    out = tmp_path / "with-table"
    assert main(["corpus-lookup", "--drafter", str(shipped), "--corpus", corpus, "--split", "heldout",
                 "--num-tokens", "5", "--out", str(out)]) == 0
    before, after = load_file(shipped / "model.safetensors"), load_file(out / "model.safetensors")
    assert all(torch.equal(before[k], after[k]) for k in before)  # the weights as stored (float16), unchanged
    assert after["continuation_keys"].dtype == torch.int64 and after["continuation_keys"].numel() > 1000
    drafter = ChainFlowDrafter.from_pretrained(out)
    assert drafter.generation_config.corpus_lookup_num_tokens == 5
    assert (drafter.config.continuation_min_ngram, drafter.config.continuation_max_ngram) == (2, 4)
    from hf_chainflow.training.corpus import ResponseCorpus

    header = ResponseCorpus(corpus).table("heldout", ["prompt_ids"]).column("prompt_ids")[0].as_py()[-4:]
    # the assistant header: counted
    assert drafting.continuation_table(drafter).propose(torch.tensor(header), 3) is not None


def test_the_command_refuses_a_folder_that_is_no_corpus(tmp_path):
    from hf_chainflow.checkpoints import default_drafter_path
    from hf_chainflow.commands import main

    with pytest.raises(SystemExit, match=r"hf-chainflow corpus-lookup: error: `corpus` .* holds no corpus.json"):
        main(["corpus-lookup", "--drafter", str(default_drafter_path()), "--corpus", str(tmp_path),
              "--out", str(tmp_path / "o")])
    assert not (tmp_path / "o").exists()
