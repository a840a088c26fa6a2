"""`hf-chainflow train` option resolution (built-in defaults < YAML --config < command line), and resuming a run."""

import json
from pathlib import Path

import pytest
import torch

from hf_chainflow import ChainFlowConfig
from hf_chainflow.commands import build_parser
from hf_chainflow.commands.train import TRAIN_DEFAULTS, resolve_train_options
from hf_chainflow.training.workflows import throughput_summary


def parse(*argv):
    return build_parser().parse_args(["train", *argv])


def test_yaml_fills_options_and_the_command_line_wins(tmp_path):
    cfg = tmp_path / "train.yaml"
    cfg.write_text("data: /d\nout: /o\nlr: 1e-3\nmax_steps: 7\nbatch-size: 16\ndrafter: {num_blocks: 2, num_heads: 4}\n"
                   "training_args: {loss_acc_weight: 0.5}\n")
    o = resolve_train_options(parse("--config", str(cfg), "--lr", "2e-4", "--drafter-arg", "num_blocks=3",
                                    "--training-arg", "kl_beta=1e-4"))
    assert (o["data"], o["out"], o["lr"], o["batch_size"]) == ("/d", "/o", 2e-4, 16)
    assert o["drafter"] == {"num_blocks": 3, "num_heads": 4}
    assert o["training_args"] == {"loss_acc_weight": 0.5, "kl_beta": 1e-4}
    assert o["max_steps"] == 7 and isinstance(o["max_steps"], int)
    assert o["epochs"] == TRAIN_DEFAULTS["epochs"] and o["vae_lr_ratio"] == 1 / 20


def test_bad_options_are_named(tmp_path):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("data: /d\nout: /o\nlearning_rate: 1\n")
    with pytest.raises(SystemExit, match="unknown key"):
        resolve_train_options(parse("--config", str(cfg)))
    with pytest.raises(SystemExit, match="--out is required"):
        resolve_train_options(parse("--data", "/d"))
    with pytest.raises(SystemExit, match="--init-from"):
        resolve_train_options(parse("--data", "/d", "--out", "/o", "--lora", "tr"))
    with pytest.raises(SystemExit):
        parse("--data", "/d", "--drafter-arg", "num_blocks")  # not KEY=VALUE


RECIPES = Path(__file__).resolve().parents[1] / "docs" / "research" / "recipes"  # the stage recipes


@pytest.mark.parametrize("name", sorted(p.name for p in RECIPES.glob("train_*.yaml")))
def test_shipped_recipes_resolve(name):
    config = RECIPES / name
    replay = ["--replay", "/r"] if "replay_shards" in config.read_text() else []
    o = resolve_train_options(parse("--config", str(config), "--data", "/d", "--out", "/o", *replay))
    assert o["max_steps"] > 0 and o["batch_size"] > 0 and o["shards"]
    if replay:
        assert o["replay_shards"] and 0 < o["replay_fraction"] < 1


def test_there_are_shipped_recipes():
    assert len(list(RECIPES.glob("train_*.yaml"))) >= 5


def test_prepare_rejects_an_unknown_device_before_loading_the_target():
    from hf_chainflow.commands.prepare import run_prepare

    args = build_parser().parse_args(["prepare", "--responses", "r.jsonl", "--out", "/o", "--device", "gpu0"])
    with pytest.raises(SystemExit, match=r"--device must name a torch device .*'gpu0'"):
        run_prepare(args)


def test_prepare_rejects_cuda_without_a_gpu(monkeypatch):
    import torch

    from hf_chainflow.commands.prepare import run_prepare

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    args = build_parser().parse_args(["prepare", "--responses", "r.jsonl", "--out", "/o", "--device", "cuda"])
    with pytest.raises(SystemExit, match=r"needs a CUDA GPU.*--device cpu"):
        run_prepare(args)


def test_replay_shards_parse_from_yaml_and_need_replay(tmp_path):
    cfg = tmp_path / "train.yaml"
    cfg.write_text("data: /d\nout: /o\nreplay: /r\nreplay_shards: 0-2,5\n")
    assert resolve_train_options(parse("--config", str(cfg)))["replay_shards"] == [[0, 1, 2, 5]]
    assert resolve_train_options(parse("--config", str(cfg), "--replay-shards", "3"))["replay_shards"] == [[3]]
    assert resolve_train_options(parse("--config", str(cfg)))["replay"] == ["/r"]
    with pytest.raises(SystemExit, match="--replay-shards .* give --replay too"):
        resolve_train_options(parse("--data", "/d", "--out", "/o", "--replay-shards", "0-20"))


def test_several_replay_directories_pair_with_their_shard_selections(tmp_path):
    o = resolve_train_options(parse("--data", "/d", "--out", "/o", "--replay", "/a", "--replay-shards", "0-2",
                                    "--replay", "/b", "--replay-shards", "all"))
    assert o["replay"] == ["/a", "/b"] and o["replay_shards"] == [[0, 1, 2], None]
    o = resolve_train_options(parse("--data", "/d", "--out", "/o", "--replay", "/a", "--replay", "/b"))
    assert o["replay"] == ["/a", "/b"] and o["replay_shards"] == [None, None]
    with pytest.raises(SystemExit, match=r"--replay-shards was given 1 time\(s\) for 2 --replay directories "
                                         r"\['/a', '/b'\]; give it once per --replay"):
        resolve_train_options(parse("--data", "/d", "--out", "/o", "--replay", "/a", "--replay-shards", "0",
                                    "--replay", "/b"))
    cfg = tmp_path / "train.yaml"  # the same in YAML: a list of directories, a list of selections
    cfg.write_text("data: /d\nout: /o\nreplay: [/a, /b]\nreplay_shards: ['0-1', all]\n")
    o = resolve_train_options(parse("--config", str(cfg)))
    assert o["replay"] == ["/a", "/b"] and o["replay_shards"] == [[0, 1], None]
    with pytest.raises(SystemExit, match="given 2 time"):  # the command line's one directory, the file's two selections
        resolve_train_options(parse("--config", str(cfg), "--replay", "/c"))


def test_throughput_of_a_resumed_run_counts_only_its_own_steps():
    fresh = throughput_summary(0, 6000, 64, 2874.0)
    assert fresh["windows_seen"] == fresh["windows_this_run"] == 384000 and fresh["windows_per_second"] == 133.6
    resumed = throughput_summary(3000, 6000, 64, 3033.2)  # the more-data ChainFlow run, resumed at step 3,000
    assert resumed["windows_seen"] == 384000 and resumed["windows_this_run"] == 192000
    assert resumed["steps_this_run"] == 3000 and resumed["windows_per_second"] == 63.3


def test_state_statistics_come_from_the_training_shards(tmp_path):
    """`run_train --shards` takes the state statistics from those shards, not from the first finished ones."""
    import json

    from safetensors.torch import save_file

    from hf_chainflow.training.prepared_data import MANIFEST, shard_path, state_statistics

    shard_path(tmp_path, 0).parent.mkdir(parents=True)
    for shard, value in ((0, 1.0), (1, 5.0), (2, 9.0)):
        save_file({"hidden": torch.full((4, 3), value) + torch.arange(4.0)[:, None]}, str(shard_path(tmp_path, shard)))
    (tmp_path / MANIFEST).write_text(json.dumps({"finished": [0, 1, 2]}))
    mean, _ = state_statistics(tmp_path)
    assert torch.allclose(mean, torch.full((3,), 6.5))  # all three shards: mean of 1..12 shifted
    mean, std = state_statistics(tmp_path, shards=[2])
    assert torch.allclose(mean, torch.full((3,), 10.5)) and torch.allclose(std, torch.full((3,), 1.25 ** 0.5))
    for shards, needle in (([7], r"`shards` \[7\] are not finished"), (["0"], "list of distinct shard numbers"),
                           ([0, 0], "distinct"), ([True], "distinct shard numbers")):
        with pytest.raises(ValueError, match=needle):
            state_statistics(tmp_path, shards=shards)
    for max_states in (0, -5, 1.5):
        with pytest.raises(ValueError, match="`max_states` must be a positive int"):
            state_statistics(tmp_path, max_states=max_states)


@pytest.mark.slow
def test_resume_continues_the_checkpoints_drafter(tiny_prepared, tmp_path):
    from _windows import TINY_DRAFTER
    from hf_chainflow.commands import main

    base = ["train", "--target", str(tiny_prepared / "target"), "--data", str(tiny_prepared / "data"), "--out",
            str(tmp_path / "run"), "--batch-size", "4", "--save-steps", "2", "--threads", "1"]
    sizes = [f"--drafter-arg={k}={v}" for k, v in TINY_DRAFTER.items()]
    assert main([*base, *sizes, "--max-steps", "4"]) == 0
    # Resumed without the options that sized the drafter: the checkpoint's drafter continues (it failed with a
    # size-mismatch traceback while the default sizes were built anew).
    assert main([*base, "--resume", "last", "--max-steps", "6"]) == 0
    summary = json.loads((tmp_path / "run" / "train_summary.json").read_text())
    assert (summary["steps"], summary["resumed_from_step"]) == (6, 4)
    assert ChainFlowConfig.from_pretrained(tmp_path / "run").num_blocks == TINY_DRAFTER["num_blocks"]
    with pytest.raises(SystemExit, match=r"drafter fields \{'num_blocks': \(3, 1\)\} .* differ from the drafter of "
                                         r"the checkpoint"):
        main([*base, "--resume", "last", "--max-steps", "8", "--drafter-arg", "num_blocks=3"])
    with pytest.raises(SystemExit, match=r"--resume last, but --out '.*empty' holds no checkpoint"):
        main([*base[:-7], str(tmp_path / "empty"), "--resume", "last"])
    with pytest.raises(SystemExit, match=r"`--shards` \(or `shards:` in --config\) selects \[3\], which are not "
                                         r"finished"):
        main([*base, "--shards", "3", "--max-steps", "1"])
