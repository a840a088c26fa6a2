"""The drafters shipped in `hf_chainflow/checkpoints/` on the real SmolLM2 target: they load from their float16 files
and every serving mode returns plain greedy `generate`'s tokens in float32."""

import pytest
import torch

import hf_chainflow  # noqa: F401  (registers the generation hooks)
from hf_chainflow import ChainFlowDrafter
from hf_chainflow.bench import load_prompts, stratified_selection
from hf_chainflow.checkpoints import default_drafter_path

MAX_NEW_TOKENS = 32


@pytest.fixture(scope="module")
def target_and_inputs():
    from hf_chainflow.targets import load_target

    target, tok = load_target()
    prompts = stratified_selection(load_prompts(), 2)  # two domains: enough for a smoke test on the real model
    inputs = [tok.apply_chat_template([{"role": "user", "content": p["prompt"]}], add_generation_prompt=True,
                                      return_tensors="pt", return_dict=True) for p in prompts]
    plain = [target.generate(**x, do_sample=False, max_new_tokens=MAX_NEW_TOKENS) for x in inputs]
    return target, tok, inputs, plain


@pytest.mark.slow
@pytest.mark.parametrize("folder, modes", [
    ("smollm2-135m-instruct", ["shipped", "chain", "tree"]),
    ("smollm2-135m-instruct-flashmap", ["shipped", "tree"]),  # its shipped setting is a chain of 3
])
def test_shipped_drafter_is_lossless_on_the_real_target(target_and_inputs, folder, modes):
    target, _, inputs, plain = target_and_inputs
    path = default_drafter_path().parent / folder
    drafter = ChainFlowDrafter.from_pretrained(path, target=target)
    assert drafter.dtype == torch.float32 and drafter.is_bound
    taus = {}
    for mode in modes:
        g = drafter.generation_config
        if mode == "chain":
            g.draft_mode, g.lookup_num_tokens = "chain", None
        elif mode == "tree":
            g.draft_mode, g.lookup_num_tokens = "tree", None
        for x, expected in zip(inputs, plain):
            out = target.generate(**x, assistant_model=drafter, do_sample=False, max_new_tokens=MAX_NEW_TOKENS)
            assert torch.equal(out, expected), f"{folder} ({mode}) differs from plain generation"
            taus.setdefault(mode, []).append(drafter.last_stats.tau)
    # Trained weights, not a broken file: an untrained drafter's tree accepts almost nothing (tau ~1.0); these
    # drafters' trees reach 1.6-1.9 on the evaluation prompts (docs/results.md).
    tree_tau = sum(taus["tree"]) / len(taus["tree"])
    assert tree_tau > 1.25, f"{folder}: tree tau {tree_tau:.2f} on the real target; taus per mode: {taus}"


@pytest.mark.slow
@pytest.mark.parametrize("folder", ["smollm2-135m-instruct", "smollm2-135m-instruct-flashmap"])
def test_shipped_drafter_serves_a_text_generation_pipeline(target_and_inputs, folder):
    # A pipeline built with `assistant_model=` accepts the drafter only if its config states the target's vocab_size
    # and bos/eos/pad ids ("The assistant model has a different tokenizer than the main model" otherwise).
    from transformers import pipeline

    target, tok = target_and_inputs[:2]
    drafter = ChainFlowDrafter.from_pretrained(default_drafter_path().parent / folder, target=target)
    for name in ("vocab_size", "bos_token_id", "eos_token_id", "pad_token_id"):
        assert getattr(drafter.config, name) == getattr(target.config, name), name
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    plain = pipeline("text-generation", model=target, tokenizer=tok)(chat, max_new_tokens=24, do_sample=False)
    assisted = pipeline("text-generation", model=target, tokenizer=tok, assistant_model=drafter)
    drafter.last_stats = None
    assert assisted(chat, max_new_tokens=24, do_sample=False) == plain
    assert drafter.last_stats is not None and drafter.last_stats.rounds > 0


@pytest.mark.slow
def test_shipped_drafter_is_lossless_over_a_long_answer(target_and_inputs):
    # 400 new tokens (the bench and the tests above stop at 128 / 32): the cache grows long, and the prompt-lookup
    # branch of the shipped settings is verified alone and grows while accepted whole.
    target, tok = target_and_inputs[:2]
    prompt = next(p for p in load_prompts() if p["id"] == "gsm8k-test:1089")  # plain greedy answers past 400 tokens
    inputs = tok.apply_chat_template([{"role": "user", "content": prompt["prompt"]}], add_generation_prompt=True,
                                     return_tensors="pt", return_dict=True)
    plain = target.generate(**inputs, do_sample=False, max_new_tokens=400)
    assert plain.shape[1] == inputs["input_ids"].shape[1] + 400
    drafter = ChainFlowDrafter.from_pretrained(default_drafter_path(), target=target)
    out = target.generate(**inputs, assistant_model=drafter, do_sample=False, max_new_tokens=400)
    assert torch.equal(out, plain)
    stats = drafter.last_stats
    assert stats.mode == "tree" and stats.lookup_only_rounds > 0 and stats.longest_lookup > 10


@pytest.mark.slow
def test_shipped_drafter_drafts_up_to_its_measured_batch_cutoff(target_and_inputs):
    # The shipped generation config carries the decode-batch cutoff measured by `hf-chainflow bench --batch-sizes`
    # (docs/batching.md, "Measured: the shipped drafter at batch 1 to 8"): a batch of up to 4 prompts drafts, a
    # larger one decodes plainly, and both equal plain batched `generate`.
    target, tok, _, _ = target_and_inputs
    drafter = ChainFlowDrafter.from_pretrained(default_drafter_path(), target=target)
    cutoff = drafter.generation_config.max_speculative_batch_size
    assert cutoff == 4
    prompts = [p["prompt"] for p in stratified_selection(load_prompts(), cutoff + 1)]
    texts = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
             for p in prompts]
    for size, drafts in ((cutoff, True), (cutoff + 1, False)):
        batch = tok(texts[:size], padding=True, padding_side="left", return_tensors="pt", add_special_tokens=False)
        plain = target.generate(**batch, do_sample=False, max_new_tokens=8)
        out = target.generate(**batch, assistant_model=drafter, do_sample=False, max_new_tokens=8)
        assert torch.equal(out, plain)
        assert drafter.last_stats.speculative is drafts and drafter.last_stats.batch_size == size


@pytest.mark.slow
def test_shipped_dflash_drafter_runs_in_stock_transformers_on_the_real_target(target_and_inputs):
    # The DFlash comparison drafter (docs/dflash.md) is a plain transformers folder: a process that imports only
    # transformers loads it with `AutoModel` and its `speculation_type="dflash"` greedy output equals plain greedy
    # generation on the real target, with drafts accepted (fewer target forwards than new tokens).
    import json
    import subprocess
    import sys
    import textwrap

    from hf_chainflow.targets import convert_target

    _, _, inputs, plain = target_and_inputs
    folder = default_drafter_path().parent / "smollm2-135m-instruct-dflash"
    prompts = [x["input_ids"][0].tolist() for x in inputs]
    script = textwrap.dedent(f"""
        import json, sys
        import torch
        from transformers import AutoModel, AutoModelForCausalLM
        target = AutoModelForCausalLM.from_pretrained({str(convert_target())!r}, dtype=torch.float32).eval()
        drafter = AutoModel.from_pretrained({str(folder)!r}, dtype=torch.float32).eval()
        forwards = []
        target.register_forward_hook(lambda *a: forwards.append(1))
        report = []
        for ids in {prompts!r}:
            ids = torch.tensor([ids])
            forwards.clear()
            out = target.generate(ids, attention_mask=torch.ones_like(ids), assistant_model=drafter,
                                  speculation_type="dflash", do_sample=False, max_new_tokens={MAX_NEW_TOKENS})
            report.append({{"tokens": out[0].tolist(), "forwards": len(forwards)}})
        loaded = sorted(m for m in sys.modules if m.split(".")[0] == "hf_chainflow")
        print(json.dumps({{"class": type(drafter).__name__, "hf_chainflow": loaded, "report": report}}))
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["class"] == "MuseGlimmerAssistantModel" and result["hf_chainflow"] == []
    for r, expected in zip(result["report"], plain):
        assert r["tokens"] == expected[0].tolist()
    new_tokens = sum(len(e[0]) - x["input_ids"].shape[1] for x, e in zip(inputs, plain))
    assert sum(r["forwards"] for r in result["report"]) < new_tokens  # drafts were accepted
