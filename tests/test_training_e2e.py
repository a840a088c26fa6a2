"""End to end through the CLI: prepare -> train -> eval-offline, on a tiny random Llama with SmolLM2's real tokenizer
and real prompts.  The trained drafter's held-out acceptance length must clearly beat the untrained one's."""

import json
from pathlib import Path

import pytest
import torch

from hf_chainflow import ChainFlowConfig, ChainFlowDrafter
from hf_chainflow.commands import main
from hf_chainflow.training.prepared_data import read_shortlist
from hf_chainflow.targets import load_tokenizer
from hf_chainflow.testing import tiny_target

from _fixtures import PROMPTS
from _windows import one_thread

DRAFTER = {"num_blocks": 1, "num_heads": 2, "ffn_multiplier": 2, "vae_num_layers": 1, "vae_num_heads": 2,
           "path_hidden_size": 32, "markov_rank": 32}


@pytest.mark.slow
def test_prepare_train_eval_offline_beats_untrained(tmp_path):
    with one_thread():
        _run(tmp_path)


def _run(tmp: Path):
    tokenizer = load_tokenizer()  # SmolLM2-135M-Instruct's, vocabulary 49152
    target = tiny_target("llama", vocab_size=len(tokenizer), hidden_size=64, num_layers=2)
    target.generation_config.eos_token_id = tokenizer.eos_token_id
    target.generation_config.pad_token_id = tokenizer.pad_token_id
    target.save_pretrained(tmp / "target")
    tokenizer.save_pretrained(tmp / "target")
    rows = PROMPTS.read_text().splitlines()
    assert len(rows) == 48
    (tmp / "train.jsonl").write_text("\n".join(rows[:36]) + "\n")
    (tmp / "heldout.jsonl").write_text("\n".join(rows[36:]) + "\n")

    for name in ("train", "heldout"):
        assert main(["prepare", "--target", str(tmp / "target"), "--prompts", str(tmp / f"{name}.jsonl"),
                     "--out", str(tmp / f"data-{name}"), "--max-new-tokens", "48", "--dtype", "float32"]) == 0

    # The untrained baseline: the drafter `train` starts from (same config, same seed).
    shortlist = read_shortlist(tmp / "data-train")
    torch.manual_seed(0)
    ChainFlowDrafter(ChainFlowConfig.for_target(target.config, shortlist=shortlist, **DRAFTER)).save_pretrained(
        tmp / "untrained")

    (tmp / "train.yaml").write_text(json.dumps({  # JSON is YAML
        "target": str(tmp / "target"), "data": str(tmp / "data-train"), "out": str(tmp / "drafter"),
        "max_steps": 300, "batch_size": 32, "lr": 2e-3, "logging_steps": 100, "save_steps": 1000, "seed": 0,
        "drafter": DRAFTER}))
    assert main(["train", "--config", str(tmp / "train.yaml")]) == 0
    summary = json.loads((tmp / "drafter" / "train_summary.json").read_text())
    assert summary["steps"] == 300
    print(f"training: {summary['windows_per_second']} windows/s")

    tau = {}
    for name in ("untrained", "drafter"):
        out = tmp / f"eval-{name}"
        walk = ["--walk-sequences", "4"] if name == "drafter" else []
        assert main(["eval-offline", "--drafter", str(tmp / name), "--target", str(tmp / "target"),
                     "--data", str(tmp / "data-heldout"), "--out", str(out), "--num-tokens", "3", *walk]) == 0
        tau[name] = json.loads((out / "offline_eval.json").read_text())
        assert (out / "acceptance.png").is_file()
    print(f"held-out tau: untrained {tau['untrained']['tau']:.3f}, trained {tau['drafter']['tau']:.3f}")
    assert tau["drafter"]["num_windows"] == tau["untrained"]["num_windows"] > 300
    assert tau["untrained"]["tau"] < 1.1  # a fresh drafter drafts essentially nothing the target would accept
    assert tau["drafter"]["tau"] > tau["untrained"]["tau"] + 0.3
    assert tau["drafter"]["acceptance"][0] > tau["untrained"]["acceptance"][0] + 0.15
    walk = tau["drafter"]["walk"]  # the serving walk over 4 held-out responses
    assert walk["num_sequences"] == 4 and "walk" not in tau["untrained"]
    assert 1.0 < walk["chain"]["tau"] <= 4.0 and len(walk["chain"]["acceptance_per_depth"]) == 3

    # Warm-start on the held-out data with the training data replayed, its shards chosen (`--replay-shards`).
    assert main(["train", "--target", str(tmp / "target"), "--init-from", str(tmp / "drafter"),
                 "--data", str(tmp / "data-heldout"), "--out", str(tmp / "continued"), "--replay",
                 str(tmp / "data-train"), "--replay-shards", "0", "--replay-fraction", "0.5", "--max-steps", "2",
                 "--batch-size", "8", "--save-steps", "1000"]) == 0
    continued = json.loads((tmp / "continued" / "train_summary.json").read_text())
    assert continued["num_train_windows"] == 2 * tau["drafter"]["num_windows"]  # the held-out windows + as many replayed
    assert [r["shards"] for r in continued["replay_windows_available"]] == [[0]]
    # Two replay directories, each with its own selection: the replayed rows come from both together.
    assert main(["train", "--target", str(tmp / "target"), "--init-from", str(tmp / "drafter"),
                 "--data", str(tmp / "data-heldout"), "--out", str(tmp / "continued-2"),
                 "--replay", str(tmp / "data-train"), "--replay-shards", "0", "--replay", str(tmp / "data-heldout"),
                 "--replay-shards", "all", "--replay-fraction", "0.5", "--max-steps", "1", "--batch-size", "8",
                 "--save-steps", "1000"]) == 0
    two = json.loads((tmp / "continued-2" / "train_summary.json").read_text())
    assert [(r["shards"], r["windows"]) for r in two["replay_windows_available"]] == [
        ([0], continued["replay_windows_available"][0]["windows"]), (None, tau["drafter"]["num_windows"])]
    assert two["num_train_windows"] == 2 * tau["drafter"]["num_windows"]
    with pytest.raises(SystemExit, match=r"`shards` \[7\] are not finished"):  # the replay data has shard 0 only
        main(["train", "--target", str(tmp / "target"), "--init-from", str(tmp / "drafter"), "--data",
              str(tmp / "data-heldout"), "--out", str(tmp / "continued-7"), "--replay", str(tmp / "data-train"),
              "--replay-shards", "7", "--max-steps", "1"])
