"""Fault drill for `hf-chainflow bench` on a tiny saved target: a run killed at a seeded prompt (between two
prompts, or in the middle of a journal line) resumes to the uninterrupted run's outputs, every prompt journaled
once; a rerun without `--resume` never discards finished prompts (`--overwrite` starts afresh, atomically);
duplicate prompt ids, unreadable prompt files and broken journals are refused naming the file and line, before any
model loads."""

import json
import os
import random
import re
import shutil

import pytest
import torch

from hf_chainflow import ChainFlowConfig, ChainFlowDrafter
from hf_chainflow.bench.journal import BenchJournal
from hf_chainflow.bench.prompts import load_prompts
from hf_chainflow.commands import main
from hf_chainflow.fileio import LOCK_NAME
from hf_chainflow.testing import tiny_target

from _fixtures import save_with_tokenizer
from _windows import TINY_DRAFTER, one_thread

PROMPTS = [{"id": f"q{i}", "domain": "code" if i < 2 else "math", "prompt": text} for i, text in
           enumerate(["Hi", "Hi again", "Sort a list", "2 + 2 = ?", "Count to five, five times: 1 2 3 4 5 1 2 3"])]
ARMS = "ar,pld,tree"


@pytest.fixture(scope="module", autouse=True)
def _single_thread():
    with one_thread():
        yield


def _tiny_tokenizer():
    """A byte-level tokenizer with a chat template, built in memory (no download, no GGUF file)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    for special in ("<|im_start|>", "<|im_end|>", "<pad>"):
        vocab[special] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                   pad_token="<pad>")
    fast.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    return fast


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A saved tiny target (with the tokenizer above), a saved random drafter drafting 2x2 trees, a prompts file."""
    tmp = tmp_path_factory.mktemp("faults-bench")
    tokenizer = _tiny_tokenizer()
    target = tiny_target("llama", vocab_size=len(tokenizer), hidden_size=64, num_layers=2)
    save_with_tokenizer(target, tokenizer, tmp / "target")
    torch.manual_seed(0)
    drafter = ChainFlowDrafter(ChainFlowConfig.for_target(target.config, **TINY_DRAFTER))
    g = drafter.generation_config
    g.tree_width, g.tree_depth, g.tree_budget, g.lookup_num_tokens = 2, 2, None, None
    drafter.save_pretrained(tmp / "drafter")
    (tmp / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in PROMPTS))
    return tmp


def _argv(tiny, out, prompts=None) -> list[str]:
    return ["bench", "--target", str(tiny / "target"), "--drafter-path", str(tiny / "drafter"), "--arms", ARMS,
            "--dtypes", "float32", "--prompts", str(prompts or tiny / "prompts.jsonl"), "--max-new-tokens", "6",
            "--threads", "1", "--no-progress", "--output-dir", str(out)]


def _journal(path) -> list[dict]:
    """The complete lines of a journal (a last line without its newline, cut short by a kill, left out)."""
    return [json.loads(line) for line in path.read_text().splitlines(keepends=True) if line.endswith("\n")]


def _outputs(out) -> dict[str, dict[str, list[int]]]:
    """Each journaled prompt's tokens per arm; every prompt of the file must be there exactly once."""
    prompts = [x for x in _journal(out / "runs.jsonl") if x["type"] == "prompt"]
    assert sorted(x["id"] for x in prompts) == sorted(r["id"] for r in PROMPTS)  # each once, none missing
    return {x["id"]: {arm: run["tokens"] for arm, run in x["runs"].items()} for x in prompts}


@pytest.fixture(scope="module")
def uninterrupted(tiny):
    out = tiny / "uninterrupted"
    assert main(_argv(tiny, out)) == 0
    return out, _outputs(out)


def _refuse_model_loads(monkeypatch) -> None:
    """Any model load fails the test: the checks under test must come first."""
    import hf_chainflow.targets

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the bench's input checks refused the run")

    monkeypatch.setattr(hf_chainflow.targets, "load_model_and_tokenizer", refuse)
    monkeypatch.setattr(ChainFlowDrafter, "from_pretrained", refuse)


@pytest.fixture
def no_model_loads(monkeypatch):
    _refuse_model_loads(monkeypatch)


def _kill_at_prompt(monkeypatch, n: int, mid_line: bool) -> None:
    """Stop the run as a kill would when the journal is about to record its prompt `n + 1`: before that line is
    written, or after half of it (a torn last line)."""
    write = BenchJournal._write
    count = {"prompts": 0}

    def dying_write(self, obj, *args, **kwargs):
        if obj["type"] == "prompt":
            count["prompts"] += 1
            if count["prompts"] > n:
                if mid_line:
                    line = json.dumps(obj) + "\n"
                    with open(self.path, "a") as f:
                        f.write(line[: len(line) // 2])
                raise KeyboardInterrupt
        write(self, obj, *args, **kwargs)

    monkeypatch.setattr(BenchJournal, "_write", dying_write)


@pytest.mark.parametrize("seed,mid_line", [(0, False), (1, True)], ids=["between-prompts", "mid-line"])
def test_a_run_killed_at_a_seeded_prompt_resumes_to_the_uninterrupted_outputs(tiny, uninterrupted, monkeypatch,
                                                                              seed, mid_line):
    reference_dir, reference = uninterrupted
    n = random.Random(seed).randrange(1, len(PROMPTS))  # prompts finished before the kill
    out = tiny / f"killed-{seed}"
    argv = _argv(tiny, out)
    with monkeypatch.context() as m:
        _kill_at_prompt(m, n, mid_line)
        with pytest.raises(KeyboardInterrupt):
            main(argv)
    journal = out / "runs.jsonl"
    killed = journal.read_bytes()
    assert killed.endswith(b"\n") != mid_line  # a torn last line, or none
    assert len(_journal(journal)) == 2 + n  # header, part, the finished prompts

    # The same command without `--resume` would start a new journal: refused, before any model loads.
    with monkeypatch.context() as m:
        _refuse_model_loads(m)
        with pytest.raises(SystemExit, match=rf"`--output-dir` {re.escape(repr(str(out)))} already holds a bench "
                                             rf"journal \(runs.jsonl\) with {n} finished prompts? of {len(PROMPTS)}"
                                             r".*`--resume`.*`--overwrite`"):
            main(argv)
    assert journal.read_bytes() == killed

    assert main(argv + ["--resume"]) == 0  # the torn line (if any) dropped, the unfinished prompts run
    assert _outputs(out) == reference
    lines = _journal(journal)
    assert [x["type"] for x in lines] == ["header", "part", *["prompt"] * n, "part", *["prompt"] * (len(PROMPTS) - n)]
    results = json.loads((out / "results.json").read_text())
    expected = json.loads((reference_dir / "results.json").read_text())
    assert results["settings"]["parts"] == 2
    assert [r["id"] for r in results["prompts"]] == [r["id"] for r in expected["prompts"]]
    for key, arm in expected["arms"].items():
        assert (results["arms"][key]["new_tokens"], results["arms"][key]["tau"]) == (arm["new_tokens"], arm["tau"])


def test_duplicate_prompt_ids_are_refused_before_any_model_loads(tiny, tmp_path, no_model_loads):
    """Two rows of one id used to run, and the second was read back from the journal as a copy of the first."""
    cases = {  # rows after the first -> the refusal
        '{"id": "a", "domain": "qa", "prompt": "Hi again"}':
            r"dup.jsonl:2: prompt id 'a' is already the id of line 1; every row needs an id of its own .* Give it "
            r"another id, or delete it if it is a copy",
        '\n{"id": 1, "domain": "qa", "prompt": "one"}\n{"id": "1", "domain": "qa", "prompt": "One"}':
            r"dup.jsonl:4: prompt id '1' is already the id of line 3",
        '{"id": null, "domain": "qa", "prompt": "x"}': r"dup.jsonl:2: `id` must be a non-empty string or an integer, "
                                                       r"got None",
        '{"id": " ", "domain": "qa", "prompt": "x"}': r"dup.jsonl:2: `id` must be a non-empty string",
        '{"domain": "qa", "prompt": "x"}': r"dup.jsonl:2: every prompt row needs `id`, `domain` and `prompt`; "
                                           r"missing \['id'\]",
        '{"id": "b", "domain": "qa", "prompt": ["x"]}': r"dup.jsonl:2: `prompt` must be a string",
    }
    path = tmp_path / "dup.jsonl"
    for rest, refusal in cases.items():
        path.write_text('{"id": "a", "domain": "qa", "prompt": "Hi"}\n' + rest + "\n")
        with pytest.raises(ValueError, match=refusal):
            load_prompts(path)  # the loader of `hf-chainflow bench` and of the vLLM bench
        with pytest.raises(SystemExit, match=refusal):
            main(_argv(tiny, tmp_path / "out", prompts=path))
    assert not (tmp_path / "out" / "runs.jsonl").exists()


def test_unreadable_and_empty_prompt_files_are_refused_before_any_model_loads(tiny, tmp_path, no_model_loads):
    path = tmp_path / "p.jsonl"
    for text, refusal in (('{"id": "a", "domain": "qa", "prompt": "Hi"}\n{"id": "b", "dom\n',
                           r"p.jsonl:2: not valid JSON .*one JSON object per line"),
                          ("", r"`--prompts` file '.*p.jsonl' holds no prompt rows \(it is empty or blank\)"),
                          ("\n  \n", r"holds no prompt rows")):
        path.write_text(text)
        with pytest.raises(SystemExit, match=refusal):
            main(_argv(tiny, tmp_path / "out", prompts=path))


def test_a_finished_run_is_not_discarded_without_overwrite(tiny, uninterrupted, tmp_path, no_model_loads):
    out = tmp_path / "run"
    shutil.copytree(uninterrupted[0], out)
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file() and p.name != LOCK_NAME}
    with pytest.raises(SystemExit, match=rf"{re.escape(repr(str(out)))} already holds a bench journal \(runs.jsonl\) "
                                         rf"with {len(PROMPTS)} finished prompts of {len(PROMPTS)}; a new run would "
                                         r"discard them. Add `--resume` .* or `--overwrite` to discard them"):
        main(_argv(tiny, out))
    with pytest.raises(SystemExit, match=r"`--resume` and `--overwrite` contradict each other"):
        main(_argv(tiny, out) + ["--resume", "--overwrite"])
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file() and p.name != LOCK_NAME} == before
    # A journal whose run stopped before its first prompt finished holds nothing to lose: a new run replaces it.
    header_only = tmp_path / "header-only"
    header_only.mkdir()
    (header_only / "runs.jsonl").write_bytes((out / "runs.jsonl").read_bytes().splitlines(keepends=True)[0])
    with pytest.raises(AssertionError, match="a model was loaded"):  # the checks passed: it went on to load
        main(_argv(tiny, header_only))


def test_overwrite_starts_a_fresh_journal_atomically(tiny, uninterrupted, tmp_path, monkeypatch, caplog):
    reference_dir, reference = uninterrupted
    out = tmp_path / "run"
    shutil.copytree(reference_dir, out)
    journal = out / "runs.jsonl"
    before = journal.read_bytes()
    replace = os.replace

    def killed_at_rename(src, dst):  # a kill while the fresh header is being put in place
        if str(dst) == str(journal):
            raise KeyboardInterrupt
        replace(src, dst)

    with monkeypatch.context() as m:
        m.setattr(os, "replace", killed_at_rename)
        with pytest.raises(KeyboardInterrupt):
            main(_argv(tiny, out) + ["--overwrite"])
    assert journal.read_bytes() == before  # the old journal whole, no temporary file left beside it
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".")) == [LOCK_NAME]  # the lock file (released)

    with caplog.at_level("WARNING", logger="hf_chainflow.bench.journal"):
        assert main(_argv(tiny, out) + ["--overwrite"]) == 0
    assert f"discarding its {len(PROMPTS)} finished prompts." in caplog.text
    assert [x["type"] for x in _journal(journal)] == ["header", "part"] + ["prompt"] * len(PROMPTS)
    assert _outputs(out) == reference
    assert json.loads((out / "results.json").read_text())["settings"]["parts"] == 1


def test_a_broken_journal_is_refused_naming_the_line_before_any_model_loads(tiny, uninterrupted, tmp_path,
                                                                            no_model_loads):
    lines = (uninterrupted[0] / "runs.jsonl").read_text().splitlines(keepends=True)  # header, part, 5 prompts
    prompt = json.loads(lines[2])
    broken = {
        "header cut": (['{"type": "hea\n'] + lines[1:], r"line 1 is not valid JSON"),
        "no header": (["[]\n"] + lines[1:], r"is not a bench journal \(its line 1 is not a header line\)"),
        "middle line cut": (lines[:3] + [lines[3][:40] + "\n"] + lines[4:], r"line 4 is not valid JSON"),
        "line of no kind": (lines[:3] + ['{"id": "x"}\n'] + lines[3:], r"line 4 is not a journal line"),
        "prompt without id": (lines[:3] + [json.dumps({k: v for k, v in prompt.items() if k != "id"}) + "\n"]
                              + lines[3:], r"line 4 \(a prompt line\) lacks \['id'\]"),
        "prompt twice": (lines + [lines[2]], rf"line 8 journals prompt '{prompt['id']}' again \(first on line 3\)"),
    }
    out = tmp_path / "run"
    out.mkdir()
    journal = out / "runs.jsonl"
    for name, (text, refusal) in broken.items():
        journal.write_text("".join(text))
        before = journal.read_bytes()
        for extra in (["--resume"], []):  # resumed, or a new run over it: both refused, the journal kept
            with pytest.raises(SystemExit, match=refusal):
                main(_argv(tiny, out) + extra)
            assert journal.read_bytes() == before, name


def test_a_second_bench_on_the_same_output_folder_is_refused_naming_the_first(tiny, tmp_path, no_model_loads):
    """Two benches writing one journal would interleave their lines: the second is refused before any model loads,
    naming the holder; once the first has ended, the same command goes on."""
    from hf_chainflow.fileio import FolderLock

    out = tmp_path / "busy"
    with FolderLock(out, what="bench output folder"):
        with pytest.raises(SystemExit, match=rf"The bench output folder {re.escape(repr(str(out)))} is being written "
                                             rf"by process {os.getpid()} on .*; one job writes to it at a time"):
            main(_argv(tiny, out))
    with pytest.raises(AssertionError, match="a model was loaded"):  # free again: the checks pass, it goes on
        main(_argv(tiny, out))
