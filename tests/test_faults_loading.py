"""Fault drill for loading models: damaged, missing and mistyped drafter folders are refused before anything loads,
naming the file (and line) or the argument, instead of loading the defaults silently or retrying the Hub for a minute.

Each fault is made on a tiny drafter saved once per module (an in-process tiny target, no download).
"""

import re
import shutil
import time

import pytest
import torch

import hf_chainflow  # noqa: F401  (registers the `chainflow` model type)
from hf_chainflow import ChainFlowConfig, ChainFlowDrafter
from hf_chainflow.cli_args import check_model_source
from hf_chainflow.commands import main
from hf_chainflow.testing import tiny_target

SMALL = dict(num_blocks=1, num_heads=4, path_hidden_size=32, markov_rank=16)
BOTH_READINGS = r"neither an existing local folder \(no such folder\) nor a Hub repo in the local cache"


@pytest.fixture(scope="module")
def target():
    return tiny_target("llama")


@pytest.fixture(scope="module")
def saved(target, tmp_path_factory):
    """A drafter saved with the shipped kind of settings: an 8x4 tree cut to 12 nodes with a lookup branch."""
    torch.manual_seed(0)
    drafter = ChainFlowDrafter(ChainFlowConfig.for_target(target.config, **SMALL))
    g = drafter.generation_config
    g.draft_mode, g.tree_width, g.tree_depth, g.tree_budget, g.lookup_num_tokens = "tree", 8, 4, 12, 10
    path = tmp_path_factory.mktemp("drafter")
    drafter.save_pretrained(path)
    return path


@pytest.fixture
def drafter_dir(saved, tmp_path):
    """A fresh copy of the saved drafter, to damage."""
    return shutil.copytree(saved, tmp_path / "drafter")


def tear(path, keep=0.5):
    """Cut a file short, as an interrupted copy or download leaves it."""
    text = path.read_text()
    path.write_text(text[: int(len(text) * keep)])


@pytest.fixture
def nothing_loads(monkeypatch):
    """Fail the test if a command gets as far as loading a model; keep the test process's thread count."""
    import hf_chainflow.bench.run as bench_run
    import hf_chainflow.commands.demo_run as demo
    import hf_chainflow.targets as targets
    import hf_chainflow.training.workflows as workflows

    def loaded(*args, **kwargs):
        raise AssertionError("a model was loaded before the drafter folder was checked")

    for module, name in ((targets, "load_model_and_tokenizer"), (targets, "load_target"),
                         (workflows, "evaluate_drafter"), (bench_run, "benchmark"), (demo, "demo")):
        monkeypatch.setattr(module, name, loaded)
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)


# ------------------------------------------------------------------------------------------- generation_config.json
def test_a_torn_generation_config_is_refused_naming_the_file_and_line(drafter_dir, target):
    tear(drafter_dir / "generation_config.json")
    with pytest.raises(ValueError, match=r"generation_config.json:\d+:\d+: the generation config .* is not valid "
                                         r"JSON: .*cut short"):
        ChainFlowDrafter.from_pretrained(drafter_dir, target=target)


def test_a_generation_config_that_is_not_an_object_is_refused(drafter_dir):
    (drafter_dir / "generation_config.json").write_text("[]\n")
    with pytest.raises(ValueError, match=r"generation_config.json: the generation config .* must hold a JSON "
                                         r"object, got a JSON list"):
        ChainFlowDrafter.from_pretrained(drafter_dir)


def test_a_torn_generation_config_in_the_hub_cache_is_refused(saved, tmp_path):
    cache, sha = tmp_path / "hub", "0" * 40
    snapshot = shutil.copytree(saved, cache / "models--me--drafter" / "snapshots" / sha)
    (cache / "models--me--drafter" / "refs").mkdir()
    (cache / "models--me--drafter" / "refs" / "main").write_text(sha)
    assert ChainFlowDrafter.from_pretrained("me/drafter", cache_dir=cache,
                                            local_files_only=True).generation_config.tree_budget == 12
    tear(snapshot / "generation_config.json")
    with pytest.raises(ValueError, match=r"models--me--drafter/snapshots/0+/generation_config.json:\d+:\d+: the "
                                         r"generation config of the drafter 'me/drafter' is not valid JSON"):
        ChainFlowDrafter.from_pretrained("me/drafter", cache_dir=cache, local_files_only=True)


def test_a_missing_generation_config_gives_the_defaults(drafter_dir):
    assert ChainFlowDrafter.from_pretrained(drafter_dir).generation_config.draft_mode == "tree"  # as saved
    (drafter_dir / "generation_config.json").unlink()
    g = ChainFlowDrafter.from_pretrained(drafter_dir).generation_config
    assert (g.draft_mode, g.num_assistant_tokens) == ("chain", 3)


# ------------------------------------------------------------------------------------------------------ config.json
def test_a_torn_config_is_refused_naming_the_file_and_line(drafter_dir):
    tear(drafter_dir / "config.json")
    with pytest.raises(ValueError, match=r"config.json:\d+:\d+: the model config .* is not valid JSON"):
        ChainFlowDrafter.from_pretrained(drafter_dir)


def test_a_folder_without_config_is_not_a_drafter(tmp_path):
    with pytest.raises(ValueError, match=r"`pretrained_model_name_or_path` .* is a folder but not a saved model: it "
                                         r"holds no config.json"):
        ChainFlowDrafter.from_pretrained(tmp_path)


def test_a_torn_config_of_a_dflash_drafter_is_refused(target, tmp_path):
    from hf_chainflow.training.dflash import build_dflash_drafter, load_dflash_drafter

    build_dflash_drafter(target, seed=0, mask_token_id=3, target_layer_ids=[1, 2], block_size=4, num_hidden_layers=1,
                         sliding_window=8).save_pretrained(tmp_path)
    tear(tmp_path / "config.json")
    with pytest.raises(ValueError, match=r"config.json:\d+:\d+: the model config of `path` is not valid JSON"):
        load_dflash_drafter(tmp_path, target)


# ------------------------------------------------------------------------------------ commands: empty folders, typos
@pytest.mark.parametrize("argv", [["eval-offline", "--drafter", "{d}", "--data", "{d}"],
                                  ["bench", "--drafter-path", "{d}", "--dtypes", "float32", "--threads", "1"],
                                  ["demo", "--drafter-path", "{d}", "--threads", "1"]])
def test_commands_refuse_an_empty_drafter_folder_before_the_target_loads(argv, tmp_path, nothing_loads):
    flag = argv[1]
    with pytest.raises(SystemExit, match=rf"error: `{flag}` '{tmp_path}' is a folder but not a saved model: it holds "
                                         r"no config.json and no weights \(model.safetensors, .*\). Give the folder"):
        main([a.format(d=tmp_path) for a in argv])


@pytest.mark.parametrize("fault", ["generation_config.json", "config.json"])
def test_commands_refuse_a_torn_drafter_before_the_target_loads(fault, drafter_dir, nothing_loads):
    tear(drafter_dir / fault)
    with pytest.raises(SystemExit, match=rf"hf-chainflow eval-offline: error: .*{fault}:\d+:\d+: the \w+ config of "
                                         r"`--drafter` is not valid JSON"):
        main(["eval-offline", "--drafter", str(drafter_dir), "--data", str(drafter_dir)])


def test_a_training_folder_without_its_final_save_points_at_its_checkpoint(tmp_path):
    (tmp_path / "checkpoint-20").mkdir()
    with pytest.raises(ValueError, match=r"it holds training checkpoints: give the newest, '.*checkpoint-20'"):
        check_model_source("--init-from", str(tmp_path))


def test_a_mistyped_drafter_path_fails_fast_offline_naming_both_readings(monkeypatch, nothing_loads):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    start = time.monotonic()
    with pytest.raises(SystemExit, match=rf"demo: error: `--drafter-path` 'no/such_dir' is {BOTH_READINGS}"):
        main(["demo", "--drafter-path", "no/such_dir", "--threads", "1"])
    with pytest.raises(ValueError, match=rf"`pretrained_model_name_or_path` 'no/such_dir' is {BOTH_READINGS}"):
        ChainFlowDrafter.from_pretrained("no/such_dir")
    monkeypatch.delenv("HF_HUB_OFFLINE")  # not set, but the Hub does not answer (a closed local port here)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    with pytest.raises(SystemExit, match=rf"eval-offline: error: `--drafter` 'no/such_dir' is {BOTH_READINGS}"):
        main(["eval-offline", "--drafter", "no/such_dir", "--data", "d"])
    assert time.monotonic() - start < 5.0
    check_model_source("--target", "smollm2-135m-instruct", ("smollm2-135m-instruct",))  # a known name passes


def test_vllm_config_refuses_a_torn_drafter(drafter_dir, capsys):
    from hf_chainflow.vllm.__main__ import main as vllm_main

    tear(drafter_dir / "config.json")
    with pytest.raises(SystemExit):
        vllm_main(["config", "--drafter-path", str(drafter_dir)])
    assert re.search(r"config.json:\d+:\d+: the model config of `--drafter-path` is not valid JSON",
                     capsys.readouterr().err)
