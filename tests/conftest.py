"""Test-session settings: one intra-op thread (tiny models; two threads thrash on a shared 2-core machine); the
`tiny_prepared` fixture (a tiny target saved with its prepared data) for the command-line training tests."""

import os

import pytest
import torch

from _fixtures import PROMPTS, save_with_tokenizer

torch.set_num_threads(int(os.environ.get("HF_CHAINFLOW_TEST_THREADS", "1")))


@pytest.fixture(scope="session")
def tiny_prepared(tmp_path_factory):
    """A tiny random Llama with SmolLM2's tokenizer (`target/`) and its prepared responses to the first 16
    fixture prompts (`data/`, one shard), in a temporary directory."""
    tmp = tmp_path_factory.mktemp("tiny-prepared")
    from hf_chainflow.commands import main
    from hf_chainflow.targets import load_tokenizer
    from hf_chainflow.testing import tiny_target

    tokenizer = load_tokenizer()
    target = tiny_target("llama", vocab_size=len(tokenizer), hidden_size=64, num_layers=2)
    save_with_tokenizer(target, tokenizer, tmp / "target")
    (tmp / "prompts.jsonl").write_text("\n".join(PROMPTS.read_text().splitlines()[:16]) + "\n")
    assert main(["prepare", "--target", str(tmp / "target"), "--prompts", str(tmp / "prompts.jsonl"), "--out",
                 str(tmp / "data"), "--max-new-tokens", "32", "--dtype", "float32", "--threads", "1"]) == 0
    return tmp
