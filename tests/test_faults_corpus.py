"""Fault drills for the response corpus and `hf-chainflow generate-responses` (tiny target, real tokenizer): a kill
or a full disk in the middle of a write, then the same command again; two writing jobs; a torn `corpus.json`; a
read-only corpus; prompts that are not there. Each fault leaves the corpus as it was or is refused with the file, the
rule and the fix named, before any model loads."""

import errno
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import datasets
import pytest

from hf_chainflow.commands import main
from hf_chainflow.training.corpus import GenerationSettings, ResponseCorpus
from hf_chainflow.training.responses import generate_into_corpus
from hf_chainflow.training.prompts import read_prompt_source
from hf_chainflow.fileio import FolderBusyError
from hf_chainflow.targets import load_tokenizer
from hf_chainflow.testing import tiny_target

from _fixtures import save_with_tokenizer

NEW = 4  # max new tokens: keeps generation fast
SEED = 20261207  # where the drills inject their fault
SETTINGS = GenerationSettings(dtype="float32", machine="test machine", software="test", max_new_tokens=NEW)
DOMAINS = ("code", "math", "qa", "transl")


def _prompts(n: int) -> list[dict]:
    return [{"id": f"p{i}", "domain": DOMAINS[i % 4], "language": "en", "source": "test",
             "prompt": f"Question {i}: what is {i} times {i + 2}?"} for i in range(n)]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


@pytest.fixture(scope="module")
def model(tok):
    return tiny_target("llama", vocab_size=len(tok), num_layers=1)


@pytest.fixture(scope="module")
def saved_target(tmp_path_factory, model, tok):
    return save_with_tokenizer(model, tok, tmp_path_factory.mktemp("target"))


@pytest.fixture
def prompts_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in _prompts(14)))
    return path


@pytest.fixture
def no_model(monkeypatch):
    """Loading a model fails the test: the faults must be found before the model loads."""
    import hf_chainflow.targets

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the fault was found")

    monkeypatch.setattr(hf_chainflow.targets, "load_model_and_tokenizer", refuse)


def _cli(target, prompts, corpus, *extra) -> list[str]:
    return ["generate-responses", "--target", str(target), "--prompts", str(prompts), "--corpus", str(corpus),
            "--max-new-tokens", str(NEW), "--dtype", "float32", "--batch-size", "4", "--shard-size", "3", *extra]


def _refusal(argv) -> str:
    with pytest.raises(SystemExit) as err:
        main(argv)
    return str(err.value)


def _temps(folder: Path) -> list[Path]:
    return sorted(folder.rglob(".*.tmp-*"))


def _check_complete(folder: Path, n: int) -> None:
    """Every prompt answered once, no temporary file left, the counts and `load_dataset` agree."""
    corpus = ResponseCorpus(folder)
    ids = corpus.table("train", ["id"]).column("id").to_pylist()
    assert sorted(ids) == sorted(f"p{i}" for i in range(n)) and len(ids) == len(set(ids)) == n
    assert corpus.pending() == [] and _temps(folder) == []
    assert corpus.counts()["train"]["rows"] == n
    assert len(datasets.load_dataset(str(folder))["train"]) == n  # the lock file is no data file


def _fail_fsync_of(monkeypatch, marker: str, nth: int) -> list[str]:
    """`os.fsync` of the `nth` file whose path holds `marker` fails with ENOSPC (a disk that fills)."""
    real, seen = os.fsync, []

    def fsync(fd):
        name = os.readlink(f"/proc/self/fd/{fd}")
        if marker in name:
            seen.append(name)
            if len(seen) == nth:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), name)
        return real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    return seen


# ----------------------------------------------------------------------------------------------------------------
# A kill or a full disk, then the same command again
# ----------------------------------------------------------------------------------------------------------------

KILL_AT_SHARD = """
import os, signal, sys
n, seen, real = int(sys.argv[1]), [], os.replace
def replace(src, dst, *args, **kwargs):
    if ".parquet.tmp-" in str(src):
        seen.append(src)
        if len(seen) == n:  # the shard is written to its temporary file, not yet renamed
            os.kill(os.getpid(), signal.SIGKILL)
    return real(src, dst, *args, **kwargs)
os.replace = replace
from hf_chainflow.commands import main
sys.exit(main(sys.argv[2:]))
"""


def test_killed_during_a_shard_write_then_rerun(tmp_path, saved_target, prompts_file):
    nth = random.Random(SEED).randint(1, 3)  # 14 prompts in shards of at least 3: four shards
    argv = _cli(saved_target, prompts_file, tmp_path / "c")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_CHAINFLOW_TRACEBACK": ""}
    run = subprocess.run([sys.executable, "-c", KILL_AT_SHARD, str(nth), *argv, "--threads", "1"], env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == -signal.SIGKILL, run.stderr[-2000:]
    assert len(ResponseCorpus(tmp_path / "c").shards()) == nth - 1 and len(_temps(tmp_path / "c")) == 1
    assert main(argv) == 0  # the same command: the dead process's temporary file goes, the pending rows are kept
    _check_complete(tmp_path / "c", 14)


def test_disk_full_during_generation_then_rerun(tmp_path, model, tok, monkeypatch):
    corpus = ResponseCorpus.create(tmp_path / "c", target="tiny", tokenizer=tok)
    prompts = _prompts(14)
    kwargs = {"batch_size": 4, "shard_size": 3, "chunk_size": 8, "progress": False}
    nth = random.Random(SEED + 1).randint(1, 3)
    seen = _fail_fsync_of(monkeypatch, ".parquet.tmp-", nth)
    with pytest.raises(OSError, match="No space left"):
        generate_into_corpus(model, tok, prompts, corpus, SETTINGS, **kwargs)
    assert len(seen) == nth and len(corpus.shards()) == nth - 1
    assert _temps(corpus.path) == []  # the half-written shard is gone, its rows still pending
    monkeypatch.undo()  # space freed
    result = generate_into_corpus(model, tok, prompts, corpus, SETTINGS, **kwargs)
    assert result["generated"] == 14 - 4 * nth  # the rows of the failed shard were kept, not answered again
    _check_complete(corpus.path, 14)


def test_disk_full_while_a_new_corpus_is_made_then_rerun(tmp_path, tok, monkeypatch):
    folder = tmp_path / "c"
    _fail_fsync_of(monkeypatch, ".corpus.json.tmp-", 1)
    with pytest.raises(OSError, match="No space left"):
        ResponseCorpus.create(folder, target="tiny", tokenizer=tok)
    monkeypatch.undo()
    assert not (folder / "corpus.json").exists() and (folder / "data").is_dir() and _temps(folder) == []
    # What the same fault left before temporary files were removed on error: a dead process's temporary file.
    dead = subprocess.Popen(["true"])
    dead.wait()
    (folder / f".corpus.json.tmp-{dead.pid}").write_text('{"format": "hf_cha')
    corpus = ResponseCorpus.create(folder, target="tiny", tokenizer=tok)  # the same call again makes it
    assert corpus.info["selections"] == [] and _temps(folder) == []
    # A folder that holds anything else is still refused.
    (tmp_path / "other" / "data").mkdir(parents=True)
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match=r"folder without corpus.json that holds other things \(notes.txt\)"):
        ResponseCorpus.create(tmp_path / "other", target="tiny", tokenizer=tok)


# ----------------------------------------------------------------------------------------------------------------
# Two writers
# ----------------------------------------------------------------------------------------------------------------

HOLD = """
import sys
from hf_chainflow.training.corpus import writer_lock
with writer_lock(sys.argv[1]):
    print("held", flush=True)
    sys.stdin.read()
"""


def _holder(folder: Path, **env) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(folder)], env={**os.environ, **env}, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert proc.stdout.readline().strip() == "held"
    return proc


def _release(proc: subprocess.Popen) -> None:
    proc.stdin.close()
    assert proc.wait(timeout=30) == 0


def test_a_second_writing_job_is_refused_naming_the_holder(tmp_path, model, tok, saved_target, prompts_file,
                                                           no_model, monkeypatch):
    corpus = ResponseCorpus.create(tmp_path / "c", target="tiny", tokenizer=tok)
    holder = _holder(corpus.path)
    try:
        with pytest.raises(FolderBusyError, match=f"being written by process {holder.pid} "):
            generate_into_corpus(model, tok, _prompts(4), corpus, SETTINGS, progress=False)
        message = _refusal(_cli(saved_target, prompts_file, corpus.path))
        assert f"is being written by process {holder.pid}" in message and "one job writes to it at a time" in message
        with pytest.raises(FolderBusyError, match=str(holder.pid)):
            ResponseCorpus.create(corpus.path, target="tiny", tokenizer=tok)
        # a rank of a job of two processes is refused at once, not after waiting for its rank 0
        for name, value in {"TORCHELASTIC_RUN_ID": "another-job", "RANK": "1", "WORLD_SIZE": "2"}.items():
            monkeypatch.setenv(name, value)
        start = time.monotonic()
        with pytest.raises(FolderBusyError, match=str(holder.pid)):
            generate_into_corpus(model, tok, _prompts(4), corpus, SETTINGS, rank=1, world_size=2, progress=False)
        assert time.monotonic() - start < 5
        for name in ("TORCHELASTIC_RUN_ID", "RANK", "WORLD_SIZE"):
            monkeypatch.delenv(name)
    finally:
        _release(holder)
    assert corpus.shards() == [] and corpus.pending() == []
    generate_into_corpus(model, tok, _prompts(4), corpus, SETTINGS, progress=False)  # free again
    assert len(corpus.ids()) == 4


def test_a_job_holds_the_corpus_until_its_last_rank_ends(tmp_path, tok):
    corpus = ResponseCorpus.create(tmp_path / "c", target="tiny", tokenizer=tok)
    job = {"TORCHELASTIC_RUN_ID": "job-a", "WORLD_SIZE": "2"}
    rank0 = _holder(corpus.path, **job, RANK="0")
    rank1 = _holder(corpus.path, **job, RANK="1")  # joins its rank 0
    _release(rank0)  # rank 0 has answered its share; rank 1 still writes
    with pytest.raises(FolderBusyError, match=rf"process {rank1.pid} \(rank 1 of job torchrun:job-a"):
        corpus.flush_pending()
    _release(rank1)
    late = _holder(corpus.path, **job, RANK="1")  # a rank that comes after its rank 0 ended still joins its job
    _release(late)
    with corpus.writing():
        pass


# ----------------------------------------------------------------------------------------------------------------
# Refused before the model loads
# ----------------------------------------------------------------------------------------------------------------

def test_a_torn_corpus_json_is_refused_with_file_and_line(tmp_path, tok, saved_target, prompts_file, no_model):
    corpus = ResponseCorpus.create(tmp_path / "c", target="tiny", tokenizer=tok)
    info = corpus.path / "corpus.json"
    text = info.read_text()
    info.write_text(text[:len(text) // 2])  # cut short
    line = text[:len(text) // 2].count("\n") + 1
    with pytest.raises(ValueError, match=rf"corpus.json:{line}:\d+: the corpus description is not valid JSON"):
        ResponseCorpus(corpus.path)
    message = _refusal(_cli(saved_target, prompts_file, corpus.path))
    assert f"corpus.json:{line}:" in message and "Restore it" in message
    info.write_text("")
    assert "corpus.json:1:1:" in _refusal(_cli(saved_target, prompts_file, corpus.path))
    info.write_text(json.dumps({"format": "hf_chainflow.corpus/1", "target": "tiny"}))
    with pytest.raises(ValueError, match=r"corpus.json: lacks \['vocab_size', 'tokenizer_sha256', 'selections'\]"):
        ResponseCorpus(corpus.path)


def test_a_read_only_corpus_is_refused_before_the_model_loads(tmp_path, tok, model, saved_target, prompts_file,
                                                             no_model, monkeypatch):
    corpus = ResponseCorpus.create(tmp_path / "c", target="tiny", tokenizer=tok)
    real_open = os.open

    def read_only(path, flags, *args, **kwargs):  # as a read-only mount does, also for root
        if str(path).startswith(str(corpus.path)) and flags & os.O_CREAT:
            raise PermissionError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", read_only)
    message = _refusal(_cli(saved_target, prompts_file, corpus.path))
    assert (f"`corpus` {str(corpus.path)!r} cannot be written: creating a file there failed (Read-only file system)"
            in message)
    import hf_chainflow.training.responses

    def no_batch(*args, **kwargs):
        raise AssertionError("a batch was generated before the read-only corpus was found")

    monkeypatch.setattr(hf_chainflow.training.responses, "generate_responses", no_batch)
    with pytest.raises(ValueError, match="cannot be written"):
        generate_into_corpus(model, tok, _prompts(4), corpus, SETTINGS, progress=False)


def test_missing_or_empty_prompts(tmp_path, saved_target, no_model, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    start = time.monotonic()
    with pytest.raises(ValueError, match=r"'nosuch/prompts' is neither a local file or folder \(there is no such "
                                         r"path\) nor a Hub dataset in the local cache"):
        read_prompt_source("nosuch/prompts")
    message = _refusal(_cli(saved_target, "nosuch/prompts", tmp_path / "c"))
    assert "HF_HUB_OFFLINE is set" in message and time.monotonic() - start < 5
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # a Hub that cannot be reached: no minute of retries
    start = time.monotonic()
    with pytest.raises(ValueError, match="the Hub cannot be reached"):
        read_prompt_source("nosuch/prompts")
    assert time.monotonic() - start < 5
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    message = _refusal(_cli(saved_target, empty, tmp_path / "c"))
    assert f"`prompts` {str(empty)!r} holds no prompt rows" in message
    some = tmp_path / "some.jsonl"
    some.write_text(json.dumps(_prompts(1)[0]) + "\n")
    message = _refusal(_cli(saved_target, some, tmp_path / "c", "--domains", "cod"))
    assert "`--domains` cod names none of the domains of `--prompts`" in message and "(code)" in message
    assert not (tmp_path / "c").exists()  # nothing written for any of them


def test_a_cached_hub_dataset_is_not_refused_offline(tmp_path, monkeypatch):
    from hf_chainflow.training.prompts import _dataset_in_cache

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path)
    assert not _dataset_in_cache("someone/MyPrompts")
    (tmp_path / "someone___my_prompts").mkdir()  # where `load_dataset` keeps what it built, and reads offline
    assert _dataset_in_cache("someone/MyPrompts")
