"""The response corpus: shards that `datasets` loads, generation that resumes without losing or repeating a row,
several processes, refused input, and the hidden-state cache rebuilt from the corpus (tiny target, real tokenizer)."""

import json
import os
import subprocess
import sys

import datasets
import pytest
import torch

from hf_chainflow.training.corpus import COLUMNS, GenerationSettings, ResponseCorpus
from hf_chainflow.training.responses import generate_into_corpus
from hf_chainflow.training.prompts import read_prompt_source, select_prompts
from hf_chainflow.training.windows import ChainFlowWindowDataset
from hf_chainflow.training.prepared_data import iter_sequences
from hf_chainflow.training.prepare import prepare
from hf_chainflow.targets import load_tokenizer
from hf_chainflow.testing import tiny_target

from _fixtures import save_with_tokenizer

NEW = 6  # max new tokens: keeps generation fast
SETTINGS = GenerationSettings(dtype="float32", machine="test machine", software="test", max_new_tokens=NEW)
DOMAINS = ("code", "math", "qa", "transl")


def _prompts(n: int) -> list[dict]:
    return [{"id": f"p{i}", "domain": DOMAINS[i % 4], "language": "en", "source": "test",
             "prompt": f"Question {i}: what is {i} plus {i * 3}?" + " Explain." * (i % 5)} for i in range(n)]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


@pytest.fixture(scope="module")
def model(tok):
    return tiny_target("llama", vocab_size=len(tok), num_layers=2)  # SmolLM2's vocabulary; eos id 2


@pytest.fixture(scope="module")
def saved_target(tmp_path_factory, model, tok):
    return save_with_tokenizer(model, tok, tmp_path_factory.mktemp("target"))


def _rows(corpus: ResponseCorpus, split=None) -> list[dict]:
    return corpus.table(split).to_pylist()


def _generate(model, tok, corpus, prompts, **kwargs):
    kwargs = {"batch_size": 4, "shard_size": 5, "chunk_size": 8, "progress": False} | kwargs
    return generate_into_corpus(model, tok, prompts, corpus, SETTINGS, **kwargs)


def test_generation_resumes_without_losing_or_repeating_a_row(tmp_path, model, tok):
    corpus = ResponseCorpus.create(tmp_path / "c", target="tiny", tokenizer=tok)
    prompts = _prompts(23)
    first = _generate(model, tok, corpus, prompts, max_prompts=9)  # stopped part-way: a shard and pending rows
    assert first["generated"] == 9 and len(corpus.shards("train")) == 1
    assert len(_rows(corpus)) + first["pending"] == 9 and first["pending"] > 0
    # A kill mid-write leaves a torn last line; a kill between a shard's rename and emptying the pending file
    # leaves rows that are in both.
    with open(corpus.pending_path(0), "a") as f:
        f.write('{"id": "p20", "domain": "qa", "respo')
    pending = corpus.pending(0)
    corpus.add_responses(pending[:2], "train")
    assert [r["id"] for r in corpus.pending(0)] == [r["id"] for r in pending[2:]]

    second = _generate(model, tok, corpus, prompts)
    assert second["generated"] == 23 - 9 and second["pending"] == 0  # no prompt answered twice
    ids = [r["id"] for r in _rows(corpus)]
    assert sorted(ids) == sorted(p["id"] for p in prompts) and len(ids) == len(set(ids))
    # The rows are the target's own greedy responses to the chat-template prompt.
    row = next(r for r in _rows(corpus) if r["id"] == "p3")
    ids3 = tok.apply_chat_template([{"role": "user", "content": prompts[3]["prompt"]}], add_generation_prompt=True,
                                   tokenize=True, return_dict=False)
    assert row["prompt_ids"] == list(ids3)
    plain = model.generate(torch.tensor([ids3]), max_new_tokens=NEW, do_sample=False)[0, len(ids3):]
    assert row["response_ids"] == plain.tolist()[:len(row["response_ids"])]
    assert row["finish"] in ("eos", "length") and row["dtype"] == "float32" and row["machine"] == "test machine"
    third = _generate(model, tok, corpus, prompts)  # everything answered: nothing to do
    assert third["generated"] == 0 and third["shards"] == []


def test_datasets_loads_every_row_of_the_folder(tmp_path, model, tok):
    corpus = ResponseCorpus.create(tmp_path / "c", target="tiny", tokenizer=tok)
    _generate(model, tok, corpus, _prompts(11))
    held = [{**r, "id": "h" + r["id"]} for r in _rows(corpus)[:3]]
    corpus.add_responses(held, "heldout")
    corpus.write_card()
    loaded = datasets.load_dataset(str(corpus.path))  # the card's `configs` name the splits
    assert sorted(loaded) == ["heldout", "train"]
    assert sorted(loaded["train"]["id"]) == sorted(corpus.ids("train")) and len(loaded["train"]) == 11
    assert sorted(loaded["heldout"]["id"]) == sorted(r["id"] for r in held)
    assert set(loaded["train"].column_names) == set(COLUMNS)
    by_id = {r["id"]: r for r in _rows(corpus)}
    for r in loaded["train"]:
        assert r == by_id[r["id"]] | {"temperature": pytest.approx(by_id[r["id"]]["temperature"])}
    explicit = datasets.load_dataset("parquet", data_files=[str(p) for p in corpus.shards("train")], split="train")
    assert len(explicit) == 11
    card = (corpus.path / "README.md").read_text()
    assert "| train | 11 |" in card and "split: heldout" in card
    corpus.write_card()  # rewriting keeps one header and one counts section
    again = (corpus.path / "README.md").read_text()
    assert again == card


def test_two_processes_split_the_prompts(tmp_path, saved_target):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in _prompts(14)))
    args = [sys.executable, "-m", "hf_chainflow.commands", "generate-responses", "--target", str(saved_target),
            "--prompts", str(prompts), "--corpus", str(tmp_path / "c"), "--max-new-tokens", str(NEW),
            "--dtype", "float32", "--threads", "1", "--batch-size", "4", "--shard-size", "3"]
    # as under torchrun: one job id (TORCHELASTIC_RUN_ID), so the two processes share the corpus's writer lock; they
    # make the new corpus together
    env = {**os.environ, "WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": f"test-{os.getpid()}"}
    procs = [subprocess.Popen(args, env={**env, "RANK": str(r)}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for r in range(2)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    corpus = ResponseCorpus(tmp_path / "c")
    ids = [r["id"] for r in _rows(corpus)]
    assert sorted(ids) == sorted(f"p{i}" for i in range(14)) and len(set(ids)) == 14
    names = [p.name for p in corpus.shards()]
    assert any("-p0-" in n for n in names) and any("-p1-" in n for n in names)  # each process its own shards


def test_bad_input_is_refused_before_anything_is_written(tmp_path, model, tok):
    corpus = ResponseCorpus.create(tmp_path / "c", target="tiny", tokenizer=tok)
    good = {"id": "a", "domain": "qa", "language": "en", "source": "s", "prompt_ids": [1, 2, 3],
            "response_ids": [4, 2], "finish": "eos"}
    with pytest.raises(ValueError, match=r"row 1 .*lacks \['response_ids'\]"):
        corpus.add_responses([good, {k: v for k, v in good.items() if k != "response_ids"} | {"id": "b"}], "train",
                             SETTINGS)
    with pytest.raises(ValueError, match=r"row 1: id 'a' is in these rows twice"):
        corpus.add_responses([good, good], "train", SETTINGS)
    with pytest.raises(ValueError, match=r"row 0 \(id 'a'\): `response_ids` holds ids \[49152\] outside"):
        corpus.add_responses([good | {"response_ids": [5, 49152]}], "train", SETTINGS)
    with pytest.raises(ValueError, match="`finish` must be one of"):
        corpus.add_responses([good | {"finish": "stop"}], "train", SETTINGS)
    with pytest.raises(ValueError, match="lacks the generation settings"):
        corpus.add_responses([good], "train")
    with pytest.raises(ValueError, match="`split` must be one of"):
        corpus.add_responses([good], "test", SETTINGS)
    assert corpus.shards() == []
    corpus.add_responses([good], "train", SETTINGS)
    with pytest.raises(ValueError, match="id 'a' is already in the corpus"):
        corpus.add_responses([good | {"id": "z"}, good], "heldout", SETTINGS)
    assert len(corpus.shards()) == 1

    rows = tmp_path / "prompts.jsonl"
    rows.write_text('{"id": "x", "domain": "qa", "prompt": "a"}\n{"id": "x", "domain": "qa", "prompt": "b"}\n')
    with pytest.raises(ValueError, match="id 'x' occurs twice"):
        read_prompt_source(rows)
    rows.write_text('{"id": "x", "domain": "qa", "prompt": "a"}\n{"id": "y", "domain": "qa"}\n')
    with pytest.raises(ValueError, match="Prompt row 1"):
        read_prompt_source(rows)
    with pytest.raises(ValueError, match="Prompt row 0 has no `id`"):
        read_prompt_source([{"prompt": "a"}])
    with pytest.raises(ValueError, match="does not exist"):
        read_prompt_source(tmp_path / "missing.jsonl")
    with pytest.raises(ValueError, match=r"`prompt_ids` holds \[50000\]"):
        _generate(model, tok, corpus, [{"id": "q", "domain": "qa", "language": "en", "prompt_ids": [1, 50000]}])

    info = json.loads((corpus.path / "corpus.json").read_text())
    other = tmp_path / "other"
    other.mkdir()
    (other / "data").mkdir()
    (other / "corpus.json").write_text(json.dumps(info | {"tokenizer_sha256": "0" * 64}))
    with pytest.raises(ValueError, match="made for another tokenizer"):
        ResponseCorpus.create(other, target="tiny", tokenizer=tok)
    with pytest.raises(ValueError, match="made for another tokenizer"):
        _generate(model, tok, ResponseCorpus(other), _prompts(2))
    assert list((other / "data").iterdir()) == [] and not (other / ".pending").exists()
    with pytest.raises(ValueError, match="holds no corpus.json"):
        ResponseCorpus(tmp_path)


def test_prompt_sources_datasets_folder_and_selection(tmp_path):
    rows = _prompts(12)
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    assert [r["id"] for r in read_prompt_source(tmp_path / "saved")] == [r["id"] for r in rows]
    (tmp_path / "pq").mkdir()
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "pq" / "train-0.parquet"))
    assert len(read_prompt_source(str(tmp_path / "pq"))) == 12  # a folder load_dataset reads, like a Hub id
    picked = select_prompts(rows, domains=["code", "qa"], per_domain=2, seed=3, exclude={"p0"})
    assert len(picked) == 4 and {r["domain"] for r in picked} == {"code", "qa"} and "p0" not in {r["id"] for r in picked}
    assert picked == select_prompts(rows, domains=["code", "qa"], per_domain=2, seed=3, exclude={"p0"})


def test_cache_from_the_corpus_equals_the_cache_from_jsonl(tmp_path, model, tok):
    corpus = ResponseCorpus.create(tmp_path / "c", target="tiny", tokenizer=tok)
    _generate(model, tok, corpus, _prompts(9))
    rows = _rows(corpus)
    jsonl = tmp_path / "responses.jsonl"
    keys = ("id", "domain", "language", "source", "prompt_ids", "response_ids", "finish")
    jsonl.write_text("".join(json.dumps({k: r[k] for k in keys}) + "\n" for r in rows))
    kw = {"shard_size": 4, "progress": False, "shuffle_seed": 0}
    prepare(model, tok, tmp_path / "from-jsonl", responses=str(jsonl), **kw)
    prepare(model, tok, tmp_path / "from-corpus", responses=corpus.responses("train"), **kw)
    a = ChainFlowWindowDataset(tmp_path / "from-jsonl", context_len=4, num_draft=3, num_parents=2)
    b = ChainFlowWindowDataset(tmp_path / "from-corpus", context_len=4, num_draft=3, num_parents=2)
    assert len(a) == len(b) > 0
    for k in range(len(a)):
        wa, wb = a[k], b[k]
        assert wa.keys() == wb.keys() and all(torch.equal(wa[f], wb[f]) for f in wa)


def test_training_data_never_holds_the_heldout_split(tmp_path, saved_target, tok, model):
    from hf_chainflow.commands import main

    corpus = ResponseCorpus.create(tmp_path / "c", target="tiny", tokenizer=tok)
    _generate(model, tok, corpus, _prompts(8))
    held = _rows(corpus)[:3]
    moved = [{**r, "id": "held-" + r["id"]} for r in held]
    corpus.add_responses(moved, "heldout")
    assert set(corpus.responses("train")).isdisjoint(corpus.ids("heldout"))
    common = ["prepare", "--target", str(saved_target), "--corpus", str(corpus.path), "--threads", "1",
              "--device", "cpu"]
    assert main(common + ["--out", str(tmp_path / "train")]) == 0
    trained_on = {s["id"] for s in iter_sequences(tmp_path / "train")}
    assert trained_on == corpus.ids("train") and trained_on.isdisjoint(corpus.ids("heldout"))
    assert main(common + ["--split", "heldout", "--out", str(tmp_path / "held")]) == 0
    assert {s["id"] for s in iter_sequences(tmp_path / "held")} == corpus.ids("heldout")
    assert main(common + ["--domains", "qa", "--out", str(tmp_path / "qa")]) == 0
    assert {s["domain"] for s in iter_sequences(tmp_path / "qa")} == {"qa"}


def test_cache_of_chosen_target_layers(tmp_path, model, tok):
    corpus = ResponseCorpus.create(tmp_path / "c", target="tiny", tokenizer=tok)
    _generate(model, tok, corpus, _prompts(3))
    responses = corpus.responses("train")
    prepare(model, tok, tmp_path / "final", responses=responses, shard_size=4, progress=False)
    prepare(model, tok, tmp_path / "layers", responses=responses, shard_size=4, progress=False, target_layers=[0])
    plain, fused = list(iter_sequences(tmp_path / "final")), list(iter_sequences(tmp_path / "layers"))
    assert "layers" not in plain[0] and sorted(fused[0]["layers"]) == [0]
    for a, b in zip(plain, fused):
        assert torch.equal(a["hidden"], b["hidden"]) and torch.equal(a["tokens"], b["tokens"])
        row = responses[b["id"]]
        full = torch.tensor([row["prompt_ids"] + row["response_ids"]])
        with torch.no_grad():
            ref = model(full, output_hidden_states=True).hidden_states  # (embeddings, layer 0, norm(layer 1))
        torch.testing.assert_close(b["layers"][0].float(), ref[1][0, -b["length"]:], atol=2e-2, rtol=2e-3)
        assert not torch.allclose(b["layers"][0].float(), b["hidden"].float(), atol=1e-2)
    with pytest.raises(ValueError, match=r"`target_layers` must be a non-empty list of distinct decoder-layer "
                                         r"indices in \[0, 1\)"):
        prepare(model, tok, tmp_path / "bad", responses=responses, progress=False, target_layers=[1])
    assert not (tmp_path / "bad").exists()
    with pytest.raises(ValueError, match="prepared from other inputs or settings"):
        prepare(model, tok, tmp_path / "final", responses=responses, shard_size=4, progress=False, target_layers=[0])


def test_push_to_hub_uploads_the_folder_without_pending_rows(tmp_path, model, tok, monkeypatch):
    import huggingface_hub

    calls = []

    class FakeApi:  # records the calls instead of reaching the Hub
        def __init__(self, token=None):
            calls.append(("init", token))

        def create_repo(self, repo_id, **kw):
            calls.append(("create_repo", repo_id, kw))

        def upload_folder(self, **kw):
            calls.append(("upload_folder", kw))
            return "url"

    monkeypatch.setattr(huggingface_hub, "HfApi", FakeApi)
    corpus = ResponseCorpus.create(tmp_path / "c", target="tiny", tokenizer=tok)
    _generate(model, tok, corpus, _prompts(7), max_prompts=4)  # pending rows only
    assert corpus.pending(0)
    assert corpus.push_to_hub("me/responses", private=True) == "url"
    (_, token), (_, repo, create), (_, upload) = calls
    assert repo == "me/responses" and create == {"repo_type": "dataset", "private": True, "exist_ok": True}
    assert upload["repo_type"] == "dataset" and upload["folder_path"] == str(corpus.path)
    assert ".pending/*" in upload["ignore_patterns"] and (corpus.path / "README.md").is_file()
    assert ".writer*.lock" in upload["ignore_patterns"] and (corpus.path / ".writer.lock").is_file()  # the lock stays
