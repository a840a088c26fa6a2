"""Forward-only data: text the target did not write, labelled with the target's own next-token choices
(`prepare(..., target_labels=True, prompt_text=...)`, `hf-chainflow prepare --target-labels --prompt-text`), and the
windows of fused target layers (`ChainFlowWindowDataset(target_layers=...)`). A tiny random Llama with SmolLM2's
tokenizer and the fixture prompts."""

import json

import pytest
import torch

from hf_chainflow import ChainFlowConfig
from hf_chainflow.training.corpus import GenerationSettings, ResponseCorpus
from hf_chainflow.training.windows import ChainFlowWindowDataset, check_windows_fit
from hf_chainflow.training.prepared_data import iter_sequences, layer_statistics, read_manifest, read_shortlist
from hf_chainflow.training.prepare import prepare
from hf_chainflow.training.prompts import text_ids
from hf_chainflow.targets import load_tokenizer
from hf_chainflow.testing import tiny_target

from _fixtures import PROMPTS

ROWS = [json.loads(line) for line in PROMPTS.read_text().splitlines()[:6]]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


@pytest.fixture(scope="module")
def model(tok):
    target = tiny_target("llama", vocab_size=len(tok), hidden_size=64, num_layers=3)
    target.generation_config.eos_token_id = tok.eos_token_id
    target.generation_config.pad_token_id = tok.pad_token_id
    return target


@pytest.fixture(scope="module")
def text_data(tmp_path_factory, model, tok):
    out = tmp_path_factory.mktemp("text") / "data"
    prepare(model, tok, out, prompts=ROWS, prompt_text="chat", target_labels=True, target_layers=[0, 1],
            shard_size=4, progress=False)
    return out


def _argmax(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].argmax(-1)


def test_text_ids_split_the_chat_turn_at_the_users_text(tok):
    prefix, text = text_ids(tok, "Hello world", "chat")
    assert prefix + text == tok.apply_chat_template([{"role": "user", "content": "Hello world"}],
                                                    add_generation_prompt=True, tokenize=True, return_dict=False)
    assert tok.decode(text).startswith("Hello world") and "Hello" not in tok.decode(prefix)
    prefix, text = text_ids(tok, "Hello world", "raw")
    assert prefix + text == tok("Hello world")["input_ids"] and len(prefix) == 1
    with pytest.raises(ValueError, match=r"`prompt_text` must be one of \('chat', 'raw'\), got 'html'"):
        text_ids(tok, "x", "html")


def test_labels_are_the_targets_own_argmax_at_every_stored_position(text_data, model, tok):
    manifest = read_manifest(text_data)
    assert manifest["target_labels"] is True and manifest["prompt_text"] == "chat"
    seqs = {s["id"]: s for s in iter_sequences(text_data)}
    assert sorted(seqs) == sorted(r["id"] for r in ROWS)
    for row in ROWS:
        s = seqs[row["id"]]
        prefix, text = text_ids(tok, row["prompt"], "chat")
        keep = min(16, len(prefix))
        assert s["tokens"].tolist() == (prefix + text)[len(prefix) - keep:]  # the text, not a response
        assert s["finish"] == "text" and s["response_start"] == keep
        assert torch.equal(s["labels"], _argmax(model, prefix + text)[len(prefix) - keep:])
    # The shortlist is what the windows predict: the labels from the first text position to the second-to-last.
    want = set(manifest["eos_token_ids"])
    for s in seqs.values():
        want |= set(s["labels"][s["response_start"]: s["length"] - 1].tolist())
    assert read_shortlist(text_data) == sorted(want)


def test_windows_predict_the_labels_and_read_the_texts_tokens(text_data):
    data = ChainFlowWindowDataset(text_data, shuffle=True, seed=1)
    assert data.labelled and len(data) > 50
    for k in range(0, len(data), 17):
        w = data[k]
        seq, t = data.sequences[int(data.seq_of[k])], int(data.anchor[k])
        n = int(w["target_mask"].sum())
        assert n >= 1 and w["target_tokens"][:n].tolist() == seq["labels"][t + 1: t + 1 + n].tolist()
        assert w["prev_tokens"][7].item() == seq["tokens"][t + 1].item()  # the bonus token is the text's


def test_target_labels_on_the_targets_own_responses_are_its_next_tokens(tmp_path, model, tok):
    """On greedy float32 responses the label after each response token is the next response token."""
    prepare(model, tok, tmp_path, prompts=ROWS[:3], target_labels=True, max_new_tokens=10,
            generation_dtype=torch.float32, progress=False)
    for s in iter_sequences(tmp_path):
        rs = s["response_start"]
        assert torch.equal(s["labels"][rs - 1: -1], s["tokens"][rs:])
    data = ChainFlowWindowDataset(tmp_path)
    plain_tokens = [data.sequences[int(data.seq_of[k])]["tokens"] for k in range(len(data))]
    for k in range(len(data)):
        w, t, n = data[k], int(data.anchor[k]), int(data[k]["target_mask"].sum())
        assert w["target_tokens"][:n].tolist() == plain_tokens[k][t + 2: t + 2 + n].tolist()


def test_raw_text_and_excluded_ids(tmp_path, model, tok):
    keep = [r["id"] for r in ROWS[2:]]
    prepare(model, tok, tmp_path, prompts=ROWS, prompt_text="raw", target_labels=True, progress=False,
            exclude_ids={r["id"] for r in ROWS[:2]})
    seqs = {s["id"]: s for s in iter_sequences(tmp_path)}
    assert sorted(seqs) == sorted(keep)
    row = ROWS[3]
    ids = tok(row["prompt"])["input_ids"]
    assert seqs[row["id"]]["tokens"].tolist() == ids and seqs[row["id"]]["response_start"] == 1
    assert torch.equal(seqs[row["id"]]["labels"], _argmax(model, ids))


@pytest.mark.parametrize("kwargs,needle", [
    (dict(prompt_text="chat"), r"`prompt_text='chat'` .* pass `target_labels=True`"),
    (dict(prompt_text="html", target_labels=True), r"`prompt_text` must be one of \('chat', 'raw'\)"),
    (dict(prompt_text="chat", target_labels=True, responses={}), r"takes no `responses`"),
    (dict(target_labels=1), r"`target_labels` must be True or False, got 1"),
    (dict(exclude_ids="alpaca:1"), r"`exclude_ids` must be a collection of row ids .* got the string"),
    (dict(exclude_ids=[r["id"] for r in ROWS]), r"no rows to prepare.* once `exclude_ids` are left out"),
    (dict(hidden_dtype=torch.int64), r"`hidden_dtype` must be a floating torch dtype"),
])
def test_bad_arguments_are_refused_before_any_work(tmp_path, model, tok, kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        prepare(model, tok, tmp_path / "out", prompts=ROWS, progress=False, **kwargs)
    assert not (tmp_path / "out").exists()


def test_resuming_data_prepared_before_the_new_settings(tmp_path, model, tok):
    """A manifest written before `target_labels`, `prompt_text` and `hidden_dtype` existed resumes as their defaults,
    and is refused with any other value."""
    args = dict(prompts=ROWS[:2], max_new_tokens=4, shard_size=1, progress=False, generation_dtype=torch.float32)
    prepare(model, tok, tmp_path, max_shards=1, **args)
    manifest = read_manifest(tmp_path)
    for key in ("target_labels", "prompt_text", "hidden_dtype"):
        del manifest[key]
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    assert prepare(model, tok, tmp_path, **args)["finished"] == [0, 1]
    with pytest.raises(ValueError, match=r"prepared from other inputs or settings .*'target_labels': \(False, True\)"):
        prepare(model, tok, tmp_path, target_labels=True, **args)


def test_fused_layer_windows_and_their_statistics(text_data):
    plain = ChainFlowWindowDataset(text_data)
    fused = ChainFlowWindowDataset(text_data, target_layers=[1])
    seqs = list(iter_sequences(text_data))  # in the windows' sequence order
    for k in (0, 5, len(plain) - 1):
        a, b = plain[k], fused[k]
        assert b["context_states"].shape == (8, 128)
        assert torch.equal(b["context_states"][:, :64], a["context_states"])
        assert torch.equal(b["target_states"], a["target_states"])
        layer = seqs[int(plain.seq_of[k])]["layers"][1].float()  # (L, D): layer 1's output at each position
        assert torch.equal(b["context_states"][-1, 64:], layer[int(plain.anchor[k])])
    mean, std = layer_statistics(text_data, [0, 1])
    assert mean.shape == std.shape == (2, 64) and not torch.allclose(mean[0], mean[1])
    with pytest.raises(ValueError, match=r"`target_layers` must be None .* the layers .* stores \(\[0, 1\]\), got \[2\]"):
        ChainFlowWindowDataset(text_data, target_layers=[2])
    with pytest.raises(ValueError, match=r"`layers` must be a non-empty list of the layers"):
        layer_statistics(text_data, [2])
    config = ChainFlowConfig(target_hidden_size=64, vocab_size=49152, target_layer_ids=[1])
    check_windows_fit(config, fused)
    with pytest.raises(ValueError, match=r"do not fit this drafter: they have \{'target_layer_ids': None\}"):
        check_windows_fit(config, plain)
    assert ChainFlowWindowDataset.for_drafter(text_data, config).target_layers == [1]


def test_the_prepare_command_leaves_out_the_held_out_prompts(tmp_path, model, tok):
    from hf_chainflow.commands import main

    model.save_pretrained(tmp_path / "target")
    tok.save_pretrained(tmp_path / "target")
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    corpus = ResponseCorpus.create(tmp_path / "corpus", target="tiny", tokenizer=tok)
    held = {k: v for k, v in ROWS[0].items() if k in ("id", "domain", "language", "source")}
    held |= {"prompt_ids": [1, 2], "response_ids": [3], "finish": "eos"}
    corpus.add_responses([held], "heldout", GenerationSettings(dtype="float32", machine="m", software="s",
                                                                max_new_tokens=4))
    base = ["prepare", "--target", str(tmp_path / "target"), "--prompts", str(tmp_path / "p.jsonl"), "--threads", "1"]
    assert main([*base, "--prompt-text", "chat", "--target-labels", "--exclude-heldout", str(tmp_path / "corpus"),
                 "--out", str(tmp_path / "out")]) == 0
    manifest = read_manifest(tmp_path / "out")
    assert manifest["num_sequences"] == len(ROWS) - 1 and manifest["target_labels"]
    assert ROWS[0]["id"] not in {s["id"] for s in iter_sequences(tmp_path / "out")}
    with pytest.raises(SystemExit, match="--prompt-text needs --target-labels"):
        main([*base, "--prompt-text", "chat", "--out", str(tmp_path / "x")])
    with pytest.raises(SystemExit, match="--prompt-text makes the data the text of --prompts"):
        main(["prepare", "--corpus", str(tmp_path / "corpus"), "--prompt-text", "raw", "--target-labels",
              "--out", str(tmp_path / "y")])
