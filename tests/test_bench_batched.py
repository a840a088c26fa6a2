"""The batched bench (`hf-chainflow bench --batch-sizes`) on a tiny random target: every arm at every batch size,
every row checked against its own batch-1 plain output (all `same` in float32), tau per row, the measured cutoff,
the written files, and the option's checks."""

import json

import pytest
import torch

from hf_chainflow import ChainFlowConfig, ChainFlowDrafter
from hf_chainflow.bench import BenchPrompt, batched_table, build_arms, run_batched_bench, write_batched_results
from hf_chainflow.commands.bench import _parse_batch_sizes
from hf_chainflow.testing import OracleDrafter, tiny_target


def test_batched_bench_on_a_tiny_target(tmp_path):
    target = tiny_target("llama")
    cfg = ChainFlowConfig.for_target(target.config, num_blocks=1, num_heads=4, path_hidden_size=32, markov_rank=16)
    torch.manual_seed(0)
    drafters = {"chainflow": {"float32": ChainFlowDrafter(cfg).eval().bind_target(target)},
                "oracle": {"float32": OracleDrafter(target, error_rate=0.3, seed=2)}}
    drafters["chainflow"]["float32"].generation_config.max_speculative_batch_size = 1  # switched off by the bench
    gen = torch.Generator().manual_seed(5)
    prompts = [BenchPrompt(f"p{i}", "d", torch.randint(3, 256, (1, int(n)), generator=gen))
               for i, n in enumerate([3, 17, 8, 30, 1])]
    arms = build_arms(["float32"], {n: d["float32"] for n, d in drafters.items()}, chain=3, tree=(4, 3))
    assert any(a.kind == "pld" for a in arms)  # batch-1 only: skipped by the batched bench
    results = run_batched_bench({"float32": target}, prompts, arms, drafters, [2, 4], max_new_tokens=10,
                                eos_token_id=2, pad_token_id=0, progress=False)
    assert results["batch_sizes"] == [1, 2, 4]
    keys = {"ar@float32", "chain@float32", "tree@float32", "oracle-chain@float32", "oracle-tree@float32"}
    for size, summary in results["by_batch_size"].items():
        assert set(summary) == keys
        for key, s in summary.items():
            assert s["rows_same"] == len(prompts) and s["rows_unexplained"] == s["rows_near_tie"] == 0, (size, key)
            assert s["tokens_per_second"] > 0 and s["speedup"] is not None
            if key != "ar@float32":
                assert len(s["tau_per_row"]) == len(prompts) and s["drafted"] is True
                assert s["verify_forwards"] > 0 and s["tau"] >= 1
    assert results["by_batch_size"]["4"]["oracle-chain@float32"]["tau"] > 1.3
    assert set(results["measured_cutoff"]) == {"float32"}
    paths = write_batched_results(results, tmp_path)
    assert json.loads(paths["json"].read_text())["batch_sizes"] == [1, 2, 4]
    assert "| 4 | tree@float32 |" in batched_table(results) and "Measured cutoff" in paths["markdown"].read_text()


def test_batch_sizes_option():
    assert _parse_batch_sizes("8,1,2,4,2") == [1, 2, 4, 8]
    assert _parse_batch_sizes(None) is None
    for bad in ("", "1,x", "0,2", "-1"):
        with pytest.raises(ValueError, match="--batch-sizes"):
            _parse_batch_sizes(bad)
    with pytest.raises(ValueError, match="--batch-sizes"):
        run_batched_bench({}, [], [], {}, [0])
