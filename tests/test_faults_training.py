"""Fault drills for training and data preparation (project issue 62, "Faults, not only typos"): what a kill, a
damaged file or an unwritable folder leaves behind, and what the next command does with it.

- Training killed while a checkpoint is being written (ChainFlow and DFlash): `train --resume last` skips the
  half-written checkpoint (no `checkpoint_complete.json`), resumes from the newest complete one and finishes; naming
  the half-written one is refused before the target loads; `save_total_limit` never deletes the last complete
  checkpoint in favour of an incomplete one.
- Damaged data folders (`manifest.json` of `[1, 2]`, without `finished`, garbage, cut short; a damaged shortlist or
  shard) are refused naming the file and the fix, before the target loads.
- `prepare` killed at a seeded point (a write cut short, or between two writes) and rerun gives the same files as an
  uninterrupted run, with no temporary file left.
- An output folder that cannot be written is refused before a model loads.

The training drills use the tiny target and data of the `tiny_prepared` fixture (`tests/conftest.py`).
"""

import contextlib
import errno
import json
import logging
import os
import random
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import Trainer

import hf_chainflow.targets as targets
import hf_chainflow.training.checkpointing as checkpointing
from hf_chainflow.commands import main
from hf_chainflow.training.prepare import prepare
from hf_chainflow.training.prepared_data import read_manifest
from hf_chainflow.fileio import CHECKPOINT_MARKER, TEMP_GLOB, is_complete_checkpoint, mark_checkpoint_complete

from _fixtures import PROMPTS
from _windows import TINY_DRAFTER

TRAINER_LOG = "hf_chainflow.training.checkpointing"


class Killed(BaseException):
    """What the drills raise where a kill would stop the process (not an `Exception`: nothing may catch it)."""


def _dead_pid() -> int:
    """The id of a process that has ended: what a temporary file left by a killed process is named after."""
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


@pytest.fixture
def no_model_loads(monkeypatch):
    """Any attempt to load a model fails the test: the checks must come before."""
    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the check")

    monkeypatch.setattr(targets, "load_model_and_tokenizer", refuse)


def _chainflow_train(data, out, *extra):
    return ["train", "--target", str(data.parent / "target"), "--data", str(data), "--out", str(out),
            "--batch-size", "4", "--save-steps", "2", "--logging-steps", "2", "--threads", "1",
            *[f"--drafter-arg={k}={v}" for k, v in TINY_DRAFTER.items()], *extra]


def _summary(out) -> dict:
    return json.loads((Path(out) / "train_summary.json").read_text())


def _kill_while_saving_optimizer(monkeypatch, step: int):
    """At checkpoint `step`, the optimizer file is cut short and the process 'dies': the folder holds the model, half
    an optimizer and the scheduler, no RNG state, trainer state or marker."""
    save = Trainer._save_optimizer_and_scheduler

    def dying(self, output_dir):
        save(self, output_dir)
        if self.state.global_step == step:
            optimizer = Path(output_dir, "optimizer.pt")
            optimizer.write_bytes(optimizer.read_bytes()[: optimizer.stat().st_size // 2])
            raise Killed

    monkeypatch.setattr(Trainer, "_save_optimizer_and_scheduler", dying)


# ---------------------------------------------------------------------------------------- checkpoints: ChainFlow

def test_resume_last_skips_a_checkpoint_killed_while_being_written(tiny_prepared, tmp_path, monkeypatch, caplog):
    data, out = tiny_prepared / "data", tmp_path / "run"
    with monkeypatch.context() as m:
        _kill_while_saving_optimizer(m, step=6)
        with pytest.raises(Killed):
            main(_chainflow_train(data, out, "--max-steps", "8"))
    assert (out / "checkpoint-6" / "model.safetensors").is_file()  # half-written: it used to be picked (an OSError)
    shutil.copytree(out / "checkpoint-6", tmp_path / "half-written")

    with caplog.at_level(logging.WARNING, logger=TRAINER_LOG):
        assert main(_chainflow_train(data, out, "--max-steps", "8", "--resume", "last")) == 0
    assert [r.getMessage() for r in caplog.records if r.name == TRAINER_LOG] == [
        f"Resuming from {out}/checkpoint-4, the newest complete checkpoint; skipped the incomplete checkpoint-6 (no "
        f"{CHECKPOINT_MARKER}: stopped while being written)."]
    summary = _summary(out)
    assert (summary["resumed_from_step"], summary["steps"]) == (4, 8)
    # checkpoint-6 was written again, completely; rotation (save_total_limit 2) kept the two newest complete ones
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-6", "checkpoint-8"]
    assert all(is_complete_checkpoint(p) for p in out.glob("checkpoint-*"))
    assert json.loads((out / "checkpoint-8" / CHECKPOINT_MARKER).read_text())["global_step"] == 8

    half = out / "checkpoint-7"  # naming a half-written checkpoint is refused before the target loads
    shutil.copytree(tmp_path / "half-written", half)
    monkeypatch.setattr(targets, "load_model_and_tokenizer", lambda *a, **k: pytest.fail("the target was loaded"))
    with pytest.raises(SystemExit, match=rf"--resume '{half}' is an incomplete checkpoint: it lacks "
                                         rf"{CHECKPOINT_MARKER} and a readable trainer_state.json .* resume from "
                                         rf"--resume {out}/checkpoint-8 \(the newest complete one there\)"):
        main(_chainflow_train(data, out, "--max-steps", "10", "--resume", str(half)))


def test_a_kill_before_the_marker_keeps_the_last_complete_checkpoint(tiny_prepared, tmp_path, monkeypatch, caplog):
    """`save_total_limit 1`: the previous checkpoint goes only once the new one is marked complete (the Trainer's own
    rotation runs before a marker could be written, and would leave no complete checkpoint after this kill)."""
    data, out = tiny_prepared / "data", tmp_path / "run"
    mark = checkpointing.mark_checkpoint_complete

    def dying(folder, **facts):
        if facts["global_step"] == 4:
            raise Killed  # every file of checkpoint-4 written, its marker not
        mark(folder, **facts)

    with monkeypatch.context() as m:
        m.setattr(checkpointing, "mark_checkpoint_complete", dying)
        with pytest.raises(Killed):
            main(_chainflow_train(data, out, "--max-steps", "6", "--save-total-limit", "1"))
    assert is_complete_checkpoint(out / "checkpoint-2") and (out / "checkpoint-4" / "trainer_state.json").is_file()
    assert not is_complete_checkpoint(out / "checkpoint-4")

    with caplog.at_level(logging.WARNING, logger=TRAINER_LOG):
        assert main(_chainflow_train(data, out, "--max-steps", "6", "--save-total-limit", "1", "--resume",
                                     "last")) == 0
    assert "skipped the incomplete checkpoint-4" in caplog.text
    assert _summary(out)["resumed_from_step"] == 2
    assert [p.name for p in out.glob("checkpoint-*")] == ["checkpoint-6"] and is_complete_checkpoint(
        out / "checkpoint-6")


# ---------------------------------------------------------------------------------------- checkpoints: DFlash

@pytest.fixture(scope="module")
def layered_data(tiny_prepared, tmp_path_factory):
    """The tiny target's responses prepared again with layer 0 cached (DFlash reads target layers), and a mask token
    its responses never use."""
    data = tmp_path_factory.mktemp("dflash-faults") / "data"
    responses = tiny_prepared / "data" / "responses" / "shard-00000.jsonl"
    assert main(["prepare", "--target", str(tiny_prepared / "target"), "--responses", str(responses), "--out",
                 str(data), "--target-layers", "0", "--dtype", "float32", "--threads", "1"]) == 0
    used = set(json.loads((data / "shortlist.json").read_text())["shortlist"])
    return data, next(i for i in range(3, 49152) if i not in used)


def test_dflash_resume_last_skips_a_checkpoint_killed_while_being_written(tiny_prepared, layered_data, tmp_path,
                                                                          monkeypatch, caplog):
    data, mask = layered_data
    out = tmp_path / "dflash"
    base = ["train", "--drafter-type", "dflash", "--target", str(tiny_prepared / "target"), "--data", str(data),
            "--out", str(out), "--threads", "1", "--batch-size", "8", "--save-steps", "2", "--max-steps", "6"]
    fields = ["--drafter-arg", "block_size=4", "--drafter-arg", "sliding_window=8", "--drafter-arg",
              "num_hidden_layers=1", "--drafter-arg", f"mask_token_id={mask}"]
    with monkeypatch.context() as m:
        _kill_while_saving_optimizer(m, step=4)
        with pytest.raises(Killed):
            main([*base, *fields])
    with caplog.at_level(logging.WARNING, logger=TRAINER_LOG):
        assert main([*base, "--resume", "last"]) == 0
    assert "skipped the incomplete checkpoint-4" in caplog.text
    summary = _summary(out)
    assert (summary["resumed_from_step"], summary["steps"]) == (2, 6)
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-4", "checkpoint-6"]
    assert all(is_complete_checkpoint(p) for p in out.glob("checkpoint-*"))


# ---------------------------------------------------------------------------------------- checkpoints: the rules

def _checkpoint(out: Path, step: int, *, complete: bool, files=("trainer_state.json", "model.safetensors",
                                                                  "optimizer.pt", "scheduler.pt")) -> Path:
    folder = out / f"checkpoint-{step}"
    folder.mkdir(parents=True)
    for name in files:
        (folder / name).write_text(json.dumps({"global_step": step}) if name.endswith(".json") else "x")
    if complete:
        mark_checkpoint_complete(folder, global_step=step)
    return folder


def test_rotation_deletes_incomplete_checkpoints_first_and_never_the_kept_ones(tmp_path):
    from hf_chainflow.training.checkpointing import rotate_checkpoints

    for step, complete in ((2, True), (4, True), (6, False), (8, True), (10, False)):
        _checkpoint(tmp_path, step, complete=complete)
    deleted = rotate_checkpoints(tmp_path, 2, keep=(tmp_path / "checkpoint-8",))
    assert [p.name for p in deleted] == ["checkpoint-6", "checkpoint-10", "checkpoint-2"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-4", "checkpoint-8"]
    # the kept ones (the one just marked, the best) stay even beyond the limit
    assert rotate_checkpoints(tmp_path, 1, keep=(tmp_path / "checkpoint-8", tmp_path / "checkpoint-4")) == []
    assert rotate_checkpoints(tmp_path, None) == [] and len(list(tmp_path.iterdir())) == 2


def test_a_checkpoint_without_its_marker_resumes_only_when_named(tmp_path, caplog):
    """A checkpoint written before complete-only checkpoints (every file, no marker): `last` does not take it but
    says how to; named, it is taken with a warning. One missing a file is refused either way."""
    from hf_chainflow.training.checkpointing import resolve_resume_checkpoint

    old = _checkpoint(tmp_path, 500, complete=False)
    cut = _checkpoint(tmp_path, 1000, complete=False, files=("model.safetensors",))
    with pytest.raises(ValueError, match=rf"--resume last: --out '{tmp_path}' holds no complete checkpoint: "
                                         rf"checkpoint-1000, checkpoint-500 lack {CHECKPOINT_MARKER}.* "
                                         rf"{old} holds every file .* name it: --resume {old}\."):
        resolve_resume_checkpoint("last", tmp_path, flags=("--resume", "--out"))
    with pytest.raises(ValueError, match=r"`resume_from_checkpoint=True`: output_dir .* no complete checkpoint"):
        resolve_resume_checkpoint(True, tmp_path)
    with caplog.at_level(logging.WARNING, logger=TRAINER_LOG):
        assert resolve_resume_checkpoint(str(old), tmp_path) == str(old)
    assert f"{old} has no {CHECKPOINT_MARKER}" in caplog.text and "holds every checkpoint file" in caplog.text
    with pytest.raises(ValueError, match=rf"'{cut}' is an incomplete checkpoint: it lacks {CHECKPOINT_MARKER} and a "
                                         r"readable trainer_state.json, optimizer.pt, scheduler.pt .* train afresh"):
        resolve_resume_checkpoint(str(cut), tmp_path, flags=("--resume", "--out"))
    mark_checkpoint_complete(old)
    assert resolve_resume_checkpoint(True, tmp_path) == str(old)  # the Trainer's own spelling of `last`
    assert resolve_resume_checkpoint(None, tmp_path) is None and resolve_resume_checkpoint(False, tmp_path) is None


# ---------------------------------------------------------------------------------------- damaged data folders

def _cut(text: str) -> str:
    return text[: len(text) // 2]


MANIFEST_FAULTS = {  # name: (how the manifest is damaged, what the message says)
    "a list": (lambda m: "[1, 2]", r"the data manifest must hold a JSON object, got a JSON list \(\[1, 2\]\)"),
    "no finished": (lambda m: json.dumps({k: v for k, v in json.loads(m).items() if k != "finished"}),
                    r"the data manifest has no `finished`"),
    "garbage": (lambda m: "garbage{", r"the data manifest is not valid JSON: Expecting value"),
    "cut short": (_cut, r"the data manifest is not valid JSON: .*cut short"),
    "empty": (lambda m: "", r"the data manifest is not valid JSON: .*\(the file is empty\)"),
    "finished of strings": (lambda m: json.dumps({**json.loads(m), "finished": ["0"]}),
                            r'`finished` must be a list of shard numbers \(integers >= 0\), got \["0"\]'),
    "hidden size of null": (lambda m: json.dumps({**json.loads(m), "hidden_size": None}),
                            r"`hidden_size` must be an integer >= 1, got null"),
}


@pytest.fixture
def data_copy(tiny_prepared, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(tiny_prepared / "data", data)
    return data


@pytest.mark.parametrize("fault", sorted(MANIFEST_FAULTS))
def test_a_damaged_manifest_is_refused_naming_the_file(fault, data_copy, tmp_path, no_model_loads):
    damage, message = MANIFEST_FAULTS[fault]
    manifest = data_copy / "manifest.json"
    manifest.write_text(damage(manifest.read_text()))
    with pytest.raises(SystemExit, match=rf"{manifest}(:\d+:\d+)?: {message}.*Move it aside and rerun the "
                                         rf"`hf-chainflow prepare \.\.\. --out {data_copy}` command"):
        main(_chainflow_train(data_copy, tmp_path / "out", "--max-steps", "1"))
    assert not (tmp_path / "out").exists()


def test_prepare_refuses_a_damaged_manifest_before_the_target_loads(tiny_prepared, data_copy, no_model_loads):
    (data_copy / "manifest.json").write_text('{"finished": [0], "num_shards": ')
    with pytest.raises(SystemExit, match=rf"{data_copy}/manifest.json:1:\d+: the data manifest is not valid JSON.* "
                                         rf"Move it aside and rerun"):
        main(["prepare", "--target", str(tiny_prepared / "target"), "--responses",
              str(data_copy / "responses" / "shard-00000.jsonl"), "--out", str(data_copy), "--device", "cpu"])


def test_dflash_training_refuses_a_damaged_manifest_too(data_copy, tmp_path, no_model_loads):
    (data_copy / "manifest.json").write_text("[1, 2]")
    with pytest.raises(SystemExit, match=rf"{data_copy}/manifest.json: the data manifest must hold a JSON object"):
        main(["train", "--drafter-type", "dflash", "--data", str(data_copy), "--out", str(tmp_path / "out")])


def test_prepare_refuses_duplicate_prompt_ids_before_the_target_loads(tmp_path, no_model_loads):
    """Responses, shards and resumes go by prompt id: a second row of one id would be read back as the first."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"id": "a", "prompt": "Hi"}\n{"id": "b", "prompt": "Sort"}\n{"id": "a", "prompt": "Hi again"}\n')
    with pytest.raises(SystemExit, match=rf"{prompts}: prompt row 2: id 'a' occurs twice \(first at row 0\); prompt "
                                         r"ids must be unique"):
        main(["prepare", "--prompts", str(prompts), "--out", str(tmp_path / "out")])


def test_eval_offline_refuses_a_damaged_manifest_before_any_model_loads(data_copy, tmp_path, no_model_loads):
    drafter = tmp_path / "drafter"  # a folder that passes the drafter check (config and weights present)
    drafter.mkdir()
    (drafter / "config.json").write_text("{}")
    (drafter / "model.safetensors").write_bytes(b"")
    (data_copy / "manifest.json").write_text('{"finished": [0')
    with pytest.raises(SystemExit, match=rf"{data_copy}/manifest.json:1:\d+: the data manifest is not valid JSON"):
        main(["eval-offline", "--drafter", str(drafter), "--data", str(data_copy), "--out", str(tmp_path / "out")])


@pytest.mark.parametrize("fault", ["shortlist garbage", "shortlist of strings", "shard cut short", "shard missing"])
def test_a_damaged_shortlist_or_shard_is_refused_before_the_target_loads(fault, data_copy, tmp_path,
                                                                          no_model_loads):
    shortlist, shard = data_copy / "shortlist.json", data_copy / "shards" / "shard-00000.safetensors"
    if fault == "shortlist garbage":
        shortlist.write_text('{"shortlist": [1, 2')
        message = rf"{shortlist}:1:\d+: the vocabulary shortlist is not valid JSON.* writes shortlist.json again"
    elif fault == "shortlist of strings":
        shortlist.write_text('{"shortlist": ["a"]}')
        message = rf"{shortlist}: `shortlist` must be a list of token ids"
    elif fault == "shard cut short":
        shard.write_bytes(shard.read_bytes()[:100])
        message = rf"{shard}: the shard file is damaged .* delete it and rerun the `hf-chainflow prepare"
    else:
        shard.unlink()
        message = rf"Shard 0 is listed as finished in `{data_copy}` but {shard} is missing"
    with pytest.raises(SystemExit, match=message):
        main(_chainflow_train(data_copy, tmp_path / "out", "--max-steps", "1"))


# ---------------------------------------------------------------------------------------- prepare, killed

@pytest.fixture(scope="module")
def small_target():
    from hf_chainflow.targets import load_tokenizer
    from hf_chainflow.testing import tiny_target

    tokenizer = load_tokenizer()
    return tiny_target("llama", vocab_size=len(tokenizer), hidden_size=32, num_layers=2), tokenizer


PROMPT_ROWS = [json.loads(line) for line in PROMPTS.read_text().splitlines()[:6]]


def _prepare(small_target, out):
    model, tokenizer = small_target
    return prepare(model, tokenizer, out, prompts=PROMPT_ROWS, max_new_tokens=8, generation_dtype=torch.float32,
                   shard_size=2, progress=False)


def _files(folder: Path) -> dict[str, object]:
    """Every file's bytes; for a shard, its metadata and tensors (safetensors writes its metadata map in an order
    that varies from run to run)."""
    return {str(p.relative_to(folder)): _shard(p) if p.suffix == ".safetensors" else p.read_bytes()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _shard(path: Path) -> tuple:
    with safe_open(str(path), framework="pt") as f:
        return f.metadata(), {k: f.get_tensor(k).numpy().tobytes() for k in sorted(f.keys())}


@pytest.fixture(scope="module")
def uninterrupted(small_target, tmp_path_factory):
    out = tmp_path_factory.mktemp("prepare-whole") / "data"
    with killed_at_rename(out, kill_at=0, cut_short=False) as renames:  # counts, never kills
        _prepare(small_target, out)
    assert len(renames) == WRITES
    return _files(out)


@contextlib.contextmanager
def killed_at_rename(folder: Path, kill_at: int, cut_short: bool):
    """Every rename into `folder` counts (each file `prepare` writes ends with one); the `kill_at`-th 'kills' the
    process: with `cut_short`, before the rename, leaving its temporary file half-written under the name of a process
    that has ended (what a SIGKILL in the middle of the write leaves); else right after it, between two writes."""
    real, dead, renames = os.replace, _dead_pid(), []

    def replace(src, dst, *args, **kwargs):
        if not str(dst).startswith(str(folder)):
            return real(src, dst, *args, **kwargs)
        renames.append(dst)
        if len(renames) != kill_at:
            return real(src, dst, *args, **kwargs)
        if cut_short:
            src = Path(src)
            src.write_bytes(src.read_bytes()[: src.stat().st_size // 2])
            real(src, src.with_name(f".{Path(dst).name}.tmp-{dead}"))
        else:
            real(src, dst, *args, **kwargs)
        raise Killed

    os.replace = replace
    try:
        yield renames
    finally:
        os.replace = real


# Renames into the output folder of an uninterrupted run of `_prepare`: plan, index, shortlist, manifest; then per
# shard (3): responses, shard, index, shortlist, manifest.
WRITES = 4 + 3 * 5


def _seeded_point(seed: int) -> tuple[int, bool]:
    rng = random.Random(seed)
    return rng.randint(1, WRITES), rng.random() < 0.5


KILL_POINTS = [pytest.param(*_seeded_point(seed), id=f"seed{seed}") for seed in range(6)] + [
    pytest.param(5, True, id="responses-0-cut-short"), pytest.param(6, True, id="shard-0-cut-short")]


@pytest.mark.parametrize("kill_at, cut_short", KILL_POINTS)
def test_prepare_killed_at_a_seeded_point_resumes_to_the_same_files(kill_at, cut_short, small_target, uninterrupted,
                                                                   tmp_path):
    out = tmp_path / "data"
    with killed_at_rename(out, kill_at=kill_at, cut_short=cut_short) as renames:
        with pytest.raises(Killed):
            _prepare(small_target, out)
    assert renames  # the kill happened inside `prepare`
    manifest = _prepare(small_target, out)  # the same command again
    assert manifest["finished"] == [0, 1, 2]
    assert not list(out.rglob(TEMP_GLOB))  # the dead process's temporary file is gone
    assert _files(out) == uninterrupted  # nothing lost, nothing duplicated: the same bytes, the same tensors


def test_prepare_refuses_a_damaged_manifest_and_its_fix_resumes(small_target, uninterrupted, tmp_path):
    out = tmp_path / "data"
    with pytest.raises(Killed), killed_at_rename(out, kill_at=4 + 5, cut_short=False):  # after shard 0's manifest
        _prepare(small_target, out)
    (out / "manifest.json").write_text('{"finished": [0], "num_shards": ')
    with pytest.raises(ValueError, match=rf"{out}/manifest.json:1:\d+: the data manifest is not valid JSON.* Move "
                                         rf"it aside and rerun"):
        _prepare(small_target, out)
    (out / "manifest.json").rename(tmp_path / "manifest.json.damaged")  # the fix the message gives
    _prepare(small_target, out)
    assert _files(out) == uninterrupted and read_manifest(out)["finished"] == [0, 1, 2]


# ---------------------------------------------------------------------------------------- unwritable output

@contextlib.contextmanager
def unwritable(folder: Path):
    """Creating a file under `folder` fails as it would without write permission (the tests run as root, whom
    permissions do not stop)."""
    real = os.open

    def guarded(path, flags, *args, **kwargs):
        if str(Path(path).absolute()).startswith(str(folder)) and flags & os.O_CREAT:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        return real(path, flags, *args, **kwargs)

    os.open = guarded
    try:
        yield
    finally:
        os.open = real


def test_an_output_folder_that_cannot_be_written_is_refused_before_a_model_loads(tiny_prepared, tmp_path,
                                                                                  no_model_loads):
    locked = tmp_path / "locked"
    locked.mkdir()
    data = tiny_prepared / "data"
    with unwritable(locked):
        with pytest.raises(SystemExit, match=rf"`--out` '{locked}/run' cannot be written \(it does not exist yet; its "
                                             rf"parent '{locked}' is where it would be made\): creating a file there "
                                             rf"failed \(Permission denied\); choose a folder you can write to"):
            main(_chainflow_train(data, locked / "run", "--max-steps", "1"))
        with pytest.raises(SystemExit, match=rf"`--out` '{locked}' cannot be written: .*Permission denied"):
            main(["prepare", "--target", str(tiny_prepared / "target"), "--responses",
                  str(data / "responses" / "shard-00000.jsonl"), "--out", str(locked), "--device", "cpu"])
    assert list(locked.iterdir()) == []


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0,
                    reason="root writes through folder permissions; the patched variant above covers root")
def test_a_read_only_output_folder_is_refused(tmp_path, tiny_prepared, no_model_loads):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    try:
        with pytest.raises(SystemExit, match=rf"`--out` '{locked}' cannot be written"):
            main(_chainflow_train(tiny_prepared / "data", locked, "--max-steps", "1"))
    finally:
        locked.chmod(0o700)


def test_every_trainer_of_the_package_writes_complete_checkpoints():
    """A trainer added later must inherit the rule too: every `Trainer` subclass defined in hf_chainflow's modules
    has `CompleteCheckpointsMixin` before `Trainer` in its MRO."""
    import importlib
    import inspect
    import pkgutil

    from transformers import Trainer

    import hf_chainflow
    from hf_chainflow.training.checkpointing import CompleteCheckpointsMixin

    found = {}
    for info in pkgutil.walk_packages(hf_chainflow.__path__, "hf_chainflow."):
        if info.name.startswith(("hf_chainflow.vllm", "hf_chainflow.commands.__main__")):
            continue  # vLLM's own environment; the command's entry point runs the CLI
        module = importlib.import_module(info.name)
        for name, obj in inspect.getmembers(module, inspect.isclass):
            if issubclass(obj, Trainer) and obj is not Trainer and obj.__module__ == info.name:
                found[f"{info.name}.{name}"] = obj
    assert {"hf_chainflow.training.trainer.ChainFlowTrainer", "hf_chainflow.training.dflash_trainer.DFlashTrainer"} <= set(found)
    for name, cls in found.items():
        mro = cls.__mro__
        assert CompleteCheckpointsMixin in mro and mro.index(CompleteCheckpointsMixin) < mro.index(Trainer), name
