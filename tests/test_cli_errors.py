"""Bad command-line input: one clear line naming the option, the value and the fix, before anything loads."""

import argparse

import pytest

from hf_chainflow.cli_args import check_model_source, check_output_dir, parse_shards
from hf_chainflow.commands import build_parser, main
from hf_chainflow.commands.train import resolve_train_options


def _train_options(*argv):
    return resolve_train_options(build_parser().parse_args(["train", *argv]))


def test_main_prints_a_user_error_as_one_line_without_a_traceback(tmp_path, monkeypatch):
    missing = tmp_path / "missing.jsonl"
    with pytest.raises(SystemExit) as err:
        main(["prepare", "--prompts", str(missing), "--out", str(tmp_path / "out")])
    assert str(err.value.code) == f"hf-chainflow prepare: error: `--prompts` must be a JSONL file, got " \
                                  f"{str(missing)!r}, which does not exist."
    assert not (tmp_path / "out").exists()
    monkeypatch.setenv("HF_CHAINFLOW_TRACEBACK", "1")  # for debugging: the exception itself
    with pytest.raises(ValueError, match="must be a JSONL file"):
        main(["prepare", "--prompts", str(missing), "--out", str(tmp_path / "out")])


@pytest.mark.parametrize("argv", [["prepare", "--responses", "r.jsonl", "--out", "o", "--limit", "0"],
                                  ["prepare", "--responses", "r.jsonl", "--out", "o", "--threads", "-2"],
                                  ["prepare", "--responses", "r.jsonl", "--out", "o", "--max-shards", "-1"],
                                  ["eval-offline", "--drafter", "d", "--data", "x", "--num-flow-steps", "0"],
                                  ["eval-offline", "--drafter", "d", "--data", "x", "--walk-sequences", "-1"],
                                  ["bench", "--pld-tokens", "0"], ["bench", "--threads", "0"],
                                  ["bench", "--lookup-tokens", "-1"], ["bench", "--tree-budget", "0"],
                                  ["demo", "--threads", "0"], ["demo", "--max-new-tokens", "0"]])
def test_counts_must_be_positive(argv, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(argv)
    assert "expected a positive integer" in capsys.readouterr().err


def test_shard_ranges_must_ascend():
    assert parse_shards("0-2,5") == [0, 1, 2, 5]
    for text in ("3-1", "-1", "a"):
        with pytest.raises(argparse.ArgumentTypeError, match="ascending ranges"):
            parse_shards(text)


@pytest.mark.parametrize("flags, message", [
    (["--epochs", "-1"], r"--epochs must be a number > 0, got -1.0"),
    (["--batch-size", "0"], r"--batch-size must be an integer >= 1, got 0"),
    (["--grad-accum", "0"], r"--grad-accum must be an integer >= 1, got 0"),
    (["--lr", "-1"], r"--lr must be a number > 0, got -1.0"),
    (["--max-windows", "-5"], r"--max-windows must be an integer >= 1, got -5"),
    (["--max-steps", "0"], r"--max-steps must be a positive integer \(or -1: train for --epochs\), got 0"),
    (["--drafter-arg", "num_blocs=1"], r"names \['num_blocs'\], which are not ChainFlowConfig fields"),
    (["--training-arg", "bogus=1"], r"names \['bogus'\], which are not ChainFlowTrainingArguments fields"),
    (["--resume", "no-such-checkpoint"], r"--resume must be `last` or a checkpoint directory"),
    (["--init-from", "no-such-drafter"], r"`--init-from` must be an existing local directory or a Hub repo id"),
])
def test_train_checks_its_options_before_loading_anything(flags, message):
    with pytest.raises((SystemExit, ValueError), match=message):
        _train_options("--data", "d", "--out", "o", *flags)


def test_train_checks_yaml_values_and_files_like_flags(tmp_path):
    cfg = tmp_path / "train.yaml"
    cfg.write_text("data: d\nout: o\nbatch_size: 0\n")
    with pytest.raises(SystemExit, match=r"--batch-size must be an integer >= 1, got 0"):
        _train_options("--config", str(cfg))
    cfg.write_text("data: d\nout: o\ntraining_args:\n  loss_acc_weigth: 0.3\n")
    with pytest.raises(SystemExit, match=r"\['loss_acc_weigth'\], which are not ChainFlowTrainingArguments"):
        _train_options("--config", str(cfg))
    cfg.write_text("epochs: [1\n")
    with pytest.raises(SystemExit, match="is not valid YAML"):
        _train_options("--config", str(cfg))
    with pytest.raises(SystemExit, match="must be a YAML file, got .*which does not exist"):
        _train_options("--config", str(tmp_path / "missing.yaml"))
    cfg.write_text("data: d\nout: o\nmax_steps: 10\nthreads: 1\n")
    assert _train_options("--config", str(cfg))["max_steps"] == 10


def test_a_failed_train_run_leaves_no_empty_output_directory(tmp_path, monkeypatch):
    import hf_chainflow.training.workflows as workflows

    def fails(o):
        import os

        os.makedirs(o["out"], exist_ok=True)  # as the Trainer does before it can fail
        raise ValueError("`--data` holds no windows.")

    monkeypatch.setattr(workflows, "train_drafter", fails)
    out = tmp_path / "drafter"
    with pytest.raises(SystemExit, match="hf-chainflow train: error: `--data` holds no windows"):
        main(["train", "--data", "d", "--out", str(out)])
    assert not out.exists()
    out.mkdir()
    (out / "keep.txt").write_text("an earlier run's file")
    with pytest.raises(SystemExit):
        main(["train", "--data", "d", "--out", str(out)])
    assert (out / "keep.txt").is_file()  # an existing directory is never removed


def _model_folder(path):
    """A folder that passes the model-folder check (config.json and a weight file; their contents are not read)."""
    path.mkdir()
    (path / "config.json").write_text("{}")
    (path / "model.safetensors").write_text("")
    return path


def test_output_paths_must_not_be_files(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("")
    check_output_dir("--out", tmp_path)
    check_output_dir("--out", tmp_path / "new")
    with pytest.raises(ValueError, match=r"`--out` must name a directory, got .*afile.*existing file"):
        check_output_dir("--out", afile)
    drafter = _model_folder(tmp_path / "drafter")
    for argv in (["train", "--data", "d", "--out", str(afile)],
                 ["eval-offline", "--drafter", str(drafter), "--data", "d", "--out", str(afile)]):
        with pytest.raises(SystemExit, match="must name a directory"):
            main(argv)


def test_model_arguments_are_names_directories_or_hub_ids(tmp_path, monkeypatch):
    import hf_chainflow.fileio as fileio

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    check_model_source("--target", "smollm2-135m-instruct", ("smollm2-135m-instruct",))  # known names: no Hub look-up
    check_model_source("--drafter", str(_model_folder(tmp_path / "drafter")))
    with pytest.raises(ValueError, match=r"`--drafter` .* is a folder but not a saved model: it holds no config.json "
                                         r"and no weights \(model.safetensors, "):
        check_model_source("--drafter", str(tmp_path))
    with pytest.raises(ValueError, match=r"`--drafter` 'someone/chainflow-drafter' is neither an existing local folder "
                                         r"\(no such folder\) nor a Hub repo in the local cache"):
        check_model_source("--drafter", "someone/chainflow-drafter")  # offline, not cached
    monkeypatch.setattr(fileio, "_hub_reachable", lambda: True)
    check_model_source("--drafter", "someone/chainflow-drafter")  # a reachable Hub id: left to transformers
    with pytest.raises(ValueError, match=r"`--drafter` must be an existing local directory or a Hub repo id "
                                         r"`namespace/name`, got 'no-such-drafter'"):
        check_model_source("--drafter", "no-such-drafter")
    with pytest.raises(ValueError, match=r"`--target` must be a known name \(smollm2-135m-instruct\)"):
        check_model_source("--target", "/no/such/dir", ("smollm2-135m-instruct",))
    (tmp_path / "model.safetensors").write_text("")
    with pytest.raises(ValueError, match="which is a file"):
        check_model_source("--drafter", str(tmp_path / "model.safetensors"))


def test_eval_offline_checks_tree_options_first():
    with pytest.raises(SystemExit, match=r"--tree-budget 3 cuts the trees of --tree; give --tree too"):
        main(["eval-offline", "--drafter", "d", "--data", "x", "--tree-budget", "3"])
    with pytest.raises(SystemExit, match=r"--tree needs a positive width and depth"):
        main(["eval-offline", "--drafter", "d", "--data", "x", "--tree", "0x4"])


def test_bench_names_the_clash_of_arms_and_no_default_drafter(tmp_path):
    with pytest.raises(SystemExit, match=r"asks for \['chain'\], arms of the default drafter, but "
                                         r"`--no-default-drafter` leaves it out"):
        main(["bench", "--no-default-drafter", "--arms", "ar,chain", "--dtypes", "float32", "--threads", "1"])
    afile = tmp_path / "afile"
    afile.write_text("")
    with pytest.raises(SystemExit, match="`--output-dir` must name a directory"):
        main(["bench", "--no-default-drafter", "--arms", "ar", "--dtypes", "float32", "--threads", "1",
              "--output-dir", str(afile)])


def test_jsonl_errors_name_the_file_and_line(tmp_path):
    from hf_chainflow.bench.prompts import load_prompts as bench_prompts
    from hf_chainflow.training.prompts import load_prompts

    bad = tmp_path / "prompts.jsonl"
    bad.write_text('{"id": "a", "domain": "qa", "prompt": "hi"}\n\nnot json\n')
    for load in (load_prompts, bench_prompts):
        with pytest.raises(ValueError, match=r"prompts.jsonl:3: not valid JSON .*one JSON object per line"):
            load(bad)
    bad.write_text('["a list"]\n')
    with pytest.raises(ValueError, match=r"prompts.jsonl:1: expected a JSON object per line, got a list"):
        load_prompts(bad)


def test_prepare_refuses_empty_inputs_before_writing(tmp_path):
    from hf_chainflow.training.prepare import prepare

    with pytest.raises(ValueError, match="no rows to prepare"):
        prepare(None, None, tmp_path / "out", prompts=[])
    with pytest.raises(ValueError, match=r"`limit` must be a positive integer or None, got 0"):
        prepare(None, None, tmp_path / "out", prompts=[], limit=0)
    assert not (tmp_path / "out").exists()


def test_train_checks_data_and_shards_before_loading_the_target(tmp_path, monkeypatch):
    import json

    import hf_chainflow.targets as targets

    def no_loading(*args, **kwargs):
        raise AssertionError("the target was loaded")

    monkeypatch.setattr(targets, "load_model_and_tokenizer", no_loading)
    with pytest.raises(SystemExit, match=r"holds no manifest.json; run `hf-chainflow prepare"):
        main(["train", "--data", str(tmp_path / "missing"), "--out", str(tmp_path / "out")])
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "manifest.json").write_text(json.dumps({"finished": [0, 1]}))
    with pytest.raises(SystemExit, match=r"`--shards` \(or `shards:` in --config\) selects \[5\], which are not "
                                         r"finished in .* \(finished: \[0, 1\]\)"):
        main(["train", "--data", str(tmp_path / "data"), "--shards", "1,5", "--out", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()


def test_bench_lists_every_arm_it_could_run_for_an_unknown_one():
    with pytest.raises(SystemExit, match=r"unknown arms \['bogus'\]; the arms of this run are \['ar', 'ar-compiled', 'pld', "
                                         r"'pld-compiled', 'chain', 'tree', 'tree\+lookup', 'tree\+lookup-auto', "
                                         r"'tree\+lookup-compiled', 'other-chain', 'other-tree'\]"):
        main(["bench", "--arms", "ar,bogus", "--drafter", "other=someone/drafter", "--dtypes", "float32",
              "--threads", "1"])
    with pytest.raises(SystemExit, match=r"unknown arms \['tree@bfloat16'\].* or in one as NAME@DTYPE"):
        main(["bench", "--arms", "ar,tree@bfloat16", "--dtypes", "float32", "--threads", "1"])
    with pytest.raises(SystemExit, match=r"runs nothing in \['bfloat16'\]: drop it from `--dtypes`"):
        main(["bench", "--arms", "ar@float32,pld@float32", "--dtypes", "float32,bfloat16", "--threads", "1"])
