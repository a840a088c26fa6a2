"""The user examples in `examples/` run end to end on a tiny random Llama (SmolLM2's tokenizer, prompts written
here): train a drafter for it (prepare -> train -> evaluate), generate with that drafter (lossless), and adapt it
to a second set of prompts with a LoRA adapter."""

import hashlib
import importlib.util
from pathlib import Path

import pytest
import torch

from hf_chainflow import ChainFlowConfig, ChainFlowDrafter
from hf_chainflow.training.windows import ChainFlowWindowDataset
from hf_chainflow.training.prepared_data import read_shortlist
from hf_chainflow.training.evaluation import evaluate_offline
from hf_chainflow.targets import load_tokenizer
from hf_chainflow.testing import tiny_target

from _windows import TINY_DRAFTER, one_thread

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"

TOPICS = ["rain", "the moon", "bread", "a river", "chess", "winter", "a library", "bees", "the ocean", "trains",
          "coffee", "a garden", "volcanoes", "music", "maps", "glass"]
PROMPTS = [{"id": f"en-{i}", "domain": "qa" if i % 2 else "instruct", "prompt": text.format(topic)}
           for i, (text, topic) in enumerate(
               (t, topic) for topic in TOPICS for t in ("Tell me one fact about {}.", "Write a short poem about {}."))]
TRAIN, HELDOUT = PROMPTS[:24], PROMPTS[24:]
TR_PROMPTS = [{"id": f"tr-{i}", "language": "tr", "prompt": f"{topic} hakkında kısa bir şiir yaz, lütfen."}
              for i, topic in enumerate(["yağmur", "ay", "ekmek", "nehir", "satranç", "kış", "kütüphane", "arılar",
                                         "okyanus", "trenler", "kahve", "bahçe", "yanardağlar", "müzik"])]
TR_TRAIN, TR_HELDOUT = TR_PROMPTS[:10], TR_PROMPTS[10:]


def example(name):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    """A tiny random Llama with SmolLM2's tokenizer and chat template, saved as a model folder."""
    tokenizer = load_tokenizer()
    target = tiny_target("llama", vocab_size=len(tokenizer), hidden_size=64, num_layers=2)
    target.generation_config.eos_token_id = tokenizer.eos_token_id
    target.generation_config.pad_token_id = tokenizer.pad_token_id
    path = tmp_path_factory.mktemp("target")
    target.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def trained(target_dir, tmp_path_factory):
    """examples/train_drafter.py on the tiny target: the output folder and the returned report."""
    out = tmp_path_factory.mktemp("mine")
    report = example("train_drafter").main(
        str(target_dir), TRAIN, HELDOUT, str(out), max_new_tokens=32, generation_dtype="float32", max_steps=200,
        batch_size=32, learning_rate=2e-3, vae_pretrain_steps=20, drafter_config=TINY_DRAFTER, tree=(4, 3),
        tree_budget=6, walk_sequences=4)
    return out, report


@pytest.fixture(scope="module", autouse=True)
def _single_thread():  # tiny models: one thread (see tests/_windows.py)
    with one_thread():
        yield


@pytest.mark.slow
def test_train_drafter_prepares_trains_and_beats_an_untrained_drafter(target_dir, trained):
    out, report = trained
    for path in ("data/manifest.json", "data-heldout/manifest.json", "drafter/config.json",
                 "drafter/model.safetensors", "drafter/generation_config.json", "eval/offline_eval.json",
                 "eval/acceptance.png"):
        assert (out / path).is_file(), path
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    heldout = ChainFlowWindowDataset.for_drafter(out / "data-heldout", ChainFlowConfig.from_pretrained(out / "drafter"))
    # The saved drafter is the one evaluated: reloaded, it gives the same held-out tau.
    reloaded = ChainFlowDrafter.from_pretrained(out / "drafter", target=target)
    assert evaluate_offline(reloaded, heldout, num_tokens=3, progress=False)["tau"] == report["tau"]
    # The untrained drafter the example starts from (same config and seed) drafts essentially nothing acceptable.
    torch.manual_seed(0)
    config = ChainFlowConfig.for_target(target.config, shortlist=read_shortlist(out / "data"), **TINY_DRAFTER)
    untrained = ChainFlowDrafter(config).bind_target(target)
    baseline = evaluate_offline(untrained, heldout, num_tokens=3, progress=False)["tau"]
    assert report["num_windows"] > 100 and baseline < 1.1
    assert report["tau"] > baseline + 0.2, (report["tau"], baseline)
    assert report["tree"]["tau"] > baseline + 0.2
    walk = report["walk"]
    assert walk["num_sequences"] == 4 and 1.0 < walk["chain"]["tau"] <= 4.0 and 1.0 < walk["tree"]["tau"] <= 4.0


@pytest.mark.slow
def test_generate_with_the_trained_drafter_equals_plain_greedy(target_dir, trained):
    out, _ = trained
    generate = example("generate")
    prompts = ["Tell me one fact about clouds.", "Write a short poem about salt."]
    for mode in (None, "tree"):
        results = generate.main(str(target_dir), str(out / "drafter"), prompts, max_new_tokens=24, mode=mode)
        assert [r["prompt"] for r in results] == prompts
        assert all(r["equal"] for r in results)  # lossless: the speculative output is plain greedy output
        assert all(r["tau"] > 1.0 for r in results)  # the trained drafter is accepted at least sometimes
    with pytest.raises(ValueError, match="no drafter is shipped for target"):
        generate.main(str(target_dir), None, prompts)


@pytest.mark.slow
def test_language_adapter_improves_the_new_language_and_serves_merged(target_dir, trained, tmp_path):
    out, _ = trained
    base_file = out / "drafter" / "model.safetensors"
    before = hashlib.sha256(base_file.read_bytes()).hexdigest()
    with pytest.warns(UserWarning, match="Language adaptation used lr"):  # a tiny drafter needs a larger rate
        result = example("language_adapter").main(
            str(target_dir), str(out / "drafter"), "tr", TR_TRAIN, TR_HELDOUT, str(tmp_path), rank=8,
            max_new_tokens=32, generation_dtype="float32", max_steps=200, batch_size=32, learning_rate=3e-2)
    assert (result["adapter_dir"] / "adapter_model.safetensors").is_file()
    assert hashlib.sha256(base_file.read_bytes()).hexdigest() == before  # the base drafter's files are untouched
    assert result["adapter"]["tau"] > result["base"]["tau"] + 0.05, (result["adapter"]["tau"], result["base"]["tau"])
    # The merged drafter is a plain drafter: generate with it, losslessly.
    merged = example("generate").main(str(target_dir), str(result["merged_dir"]), ["Yağmur hakkında bir şiir yaz."],
                                      max_new_tokens=24)
    assert merged[0]["equal"]
