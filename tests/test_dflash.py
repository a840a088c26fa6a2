"""DFlash drafters (`hf_chainflow.training.dflash*`): the loss, the training windows, the training forward against stock
transformers' own DFlash generation path, a drafter trained through the Trainer, saved, and run by stock transformers
in a process that imports nothing of hf_chainflow, the bench's `dflash` arm, and the errors (tiny float32 targets)."""

import json
import math
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file
from transformers import MuseGlimmerAssistantModel

from hf_chainflow.bench import BenchPrompt, build_arms, run_bench
from hf_chainflow.training.windows import ChainFlowWindowDataset
from hf_chainflow.training.prepare import prepare
from hf_chainflow.training.prepared_data import read_shortlist
from hf_chainflow.training.dflash import (
    build_dflash_drafter,
    check_dflash_drafter,
    dflash_attention_mask,
    dflash_block_logits,
    load_dflash_drafter,
    parameter_count,
    spread_target_layers,
)
from hf_chainflow.training.dflash_data import DFlashWindowDataset
from hf_chainflow.training.dflash_trainer import DFlashTrainer, DFlashTrainingArguments, evaluate_dflash_offline
from hf_chainflow.training.losses import block_acceptance_lengths, dflash_loss
from hf_chainflow.testing import tiny_target

LAYERS = [0, 2]  # of the tiny 4-layer targets
DRAFTER = {"target_layer_ids": LAYERS, "block_size": 4, "num_hidden_layers": 1, "sliding_window": 8}
PROMPT, NEW = 10, 40


# ------------------------------------------------------------------------------------------ the loss (pure)

def test_dflash_loss_weights_positions_and_ignores_masked_ones():
    torch.manual_seed(0)
    logits, labels = torch.randn(2, 3, 5), torch.tensor([[1, 2, 3], [4, 0, 1]])
    mask = torch.tensor([[True, True, True], [True, False, False]])
    ce = torch.nn.functional.cross_entropy(logits.reshape(-1, 5), labels.reshape(-1), reduction="none").view(2, 3)
    w = torch.tensor([1.0, math.exp(-1 / 2), math.exp(-2 / 2)])
    want = (ce[0] * w).sum() + ce[1, 0] * w[0]
    loss, terms = dflash_loss(logits, labels, mask, decay_gamma=2.0)
    assert loss.item() == pytest.approx((want / (w.sum() + w[0])).item(), rel=1e-6)
    flat, _ = dflash_loss(logits, labels, mask, decay_gamma=None)
    assert flat.item() == pytest.approx((ce[mask].mean()).item(), rel=1e-6)
    # Masked positions do not count, whatever their logits and labels.
    other = logits.clone()
    other[1, 1:] = 100 * torch.randn(2, 5)
    assert dflash_loss(other, labels.masked_fill(~mask, 3), mask, decay_gamma=2.0)[0].item() == pytest.approx(
        loss.item(), rel=1e-6)
    assert set(terms) == {"ce", "accuracy", "tau"}


def test_dflash_loss_scores_the_token_of_each_masked_position_not_its_neighbour():
    labels = torch.tensor([[5, 6, 7, 8]])
    mask = torch.ones(1, 4, dtype=torch.bool)
    right = torch.full((1, 4, 10), -10.0).scatter(2, labels[..., None], 10.0)
    shifted = torch.full((1, 4, 10), -10.0).scatter(2, labels.roll(1, 1)[..., None], 10.0)  # one position late
    good, good_terms = dflash_loss(right, labels, mask)
    bad, bad_terms = dflash_loss(shifted, labels, mask)
    assert good.item() < 1e-6 < 10 < bad.item()
    assert good_terms["tau"].item() == 5.0 and bad_terms["tau"].item() == 1.0
    assert good_terms["accuracy"].item() == 1.0 and bad_terms["accuracy"].item() == 0.0


def test_block_acceptance_lengths_stop_at_the_first_miss_or_missing_token():
    labels = torch.tensor([[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4]])
    preds = torch.tensor([[1, 2, 3, 4], [1, 9, 3, 4], [9, 2, 3, 4], [1, 2, 3, 4]])
    mask = torch.tensor([[True] * 4, [True] * 4, [True] * 4, [True, True, False, False]])
    assert block_acceptance_lengths(preds, labels, mask).tolist() == [4, 1, 0, 2]


def test_dflash_loss_refuses_bad_input():
    with pytest.raises(ValueError, match="decay_gamma"):
        dflash_loss(torch.zeros(1, 2, 3), torch.zeros(1, 2, dtype=torch.long), torch.ones(1, 2, dtype=torch.bool),
                    decay_gamma=0)
    with pytest.raises(ValueError, match=r"\(N, K, V\)"):
        dflash_loss(torch.zeros(2, 3), torch.zeros(2, dtype=torch.long), torch.ones(2, dtype=torch.bool))


# ------------------------------------------------------------------------------------------ tiny targets and data

def _greedy_rows(target, n=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    rows = {}
    for i in range(n):
        p = torch.randint(20, 256, (1, PROMPT), generator=g)
        with torch.no_grad():
            out = target.generate(p, attention_mask=torch.ones_like(p), max_new_tokens=NEW, do_sample=False,
                                  eos_token_id=None, pad_token_id=0)
        rows[f"r{i}"] = {"id": f"r{i}", "prompt_ids": p[0].tolist(), "response_ids": out[0, PROMPT:].tolist()}
    return rows


def _unused_token(data_dir) -> int:
    return min(set(range(3, 256)) - set(read_shortlist(data_dir)))


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def setup(request, tmp_path_factory):
    """A tiny target of each family, its prepared greedy responses (layers 0 and 2 cached) and a DFlash drafter
    trained on them for 60 steps through `DFlashTrainer`, saved."""
    tmp = tmp_path_factory.mktemp(f"dflash-{request.param}")
    target = tiny_target(request.param, vocab_size=256, hidden_size=64, num_layers=4)
    rows = _greedy_rows(target)
    prepare(target, SimpleNamespace(pad_token_id=0, eos_token_id=2), tmp / "data", responses=rows,
            target_layers=LAYERS, shard_size=8, generation_dtype=torch.float32, progress=False)
    drafter = build_dflash_drafter(target, seed=0, mask_token_id=_unused_token(tmp / "data"), **DRAFTER)
    windows = DFlashWindowDataset.for_drafter(tmp / "data", drafter.config)
    args = DFlashTrainingArguments(output_dir=str(tmp / "run"), max_steps=60, per_device_train_batch_size=32,
                                   learning_rate=3e-3, logging_steps=20, report_to="none", save_strategy="no",
                                   disable_tqdm=True, seed=0, dataloader_pin_memory=False)
    trainer = DFlashTrainer(model=drafter, args=args, train_dataset=windows, target=target)
    before = evaluate_dflash_offline(drafter, target, windows)
    trainer.train()
    trainer.save_model(str(tmp / "drafter"))
    target.save_pretrained(tmp / "target")
    return SimpleNamespace(tmp=tmp, family=request.param, target=target, drafter=drafter.eval(), windows=windows,
                           rows=rows, trainer=trainer, before=before)


def test_training_lowers_the_loss_and_raises_offline_tau(setup):
    logs = [h for h in setup.trainer.state.log_history if "loss_tau" in h]
    assert len(logs) == 3 and logs[-1]["loss"] < 0.7 * logs[0]["loss"]
    after = evaluate_dflash_offline(setup.drafter, setup.target, setup.windows)
    assert setup.before["tau"] < 1.2 and after["tau"] > 1.8 and after["windows"] == len(setup.windows)
    assert after["acceptance_per_depth"] == sorted(after["acceptance_per_depth"], reverse=True)


def test_windows_hold_the_cached_layers_tokens_and_positions(setup):
    """Each window against the target's own forward over the whole sequence (float16 cache tolerance)."""
    w = setup.windows
    C, B = w.C, w.block_size
    seen = 0
    for k in range(0, len(w), 7):
        seq = w.sequences[int(w.seq_of[k])]
        row = setup.rows[seq["id"]]
        ids = torch.tensor([row["prompt_ids"] + row["response_ids"]])
        with torch.no_grad():
            hs = setup.target(ids, output_hidden_states=True).hidden_states
        feats = torch.cat([hs[i + 1][0] for i in LAYERS], -1)  # (L, F): transformers' hidden_states[i + 1]
        item = w[k]
        p = int(item["position_ids"][C])  # the bonus token's position
        assert item["bonus_token"].item() == ids[0, p].item()
        n = int(item["context_mask"].sum())
        assert n == min(C, p) and item["context_mask"][C - n:].all()
        torch.testing.assert_close(item["context_states"][C - n:], feats[p - n:p], atol=2e-2, rtol=2e-3)
        assert (item["context_states"][:C - n] == 0).all()
        assert item["position_ids"][C:].tolist() == list(range(p, p + B))
        n_lab = int(item["label_mask"].sum())
        assert item["labels"][:n_lab].tolist() == ids[0, p + 1:p + 1 + n_lab].tolist()
        assert n_lab == min(B - 1, ids.shape[1] - 1 - p) >= 1
        seen += 1
    assert seen > 10


def _record_drafter_calls(drafter):
    calls = []

    def hook(module, args, kwargs, out):
        calls.append({"positions": kwargs["position_ids"].clone(), "context": kwargs["context_hidden_states"].shape[1],
                      "hidden": out.last_hidden_state.clone()})

    return calls, drafter.register_forward_hook(hook, with_kwargs=True)


def test_training_forward_is_the_stock_generation_forward(setup):
    """transformers' DFlash generation path (its cache, masks and positions) against `dflash_block_logits` over
    windows rebuilt from one forward of the whole output: the same block states, to float32 rounding. A mask off by
    one position of the sliding window is far from them."""
    target, drafter = setup.target, setup.drafter
    c = drafter.config
    prompt = torch.tensor([setup.rows["r0"]["prompt_ids"]])
    calls, handle = _record_drafter_calls(drafter)
    try:
        with torch.no_grad():
            out = target.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=NEW,
                                  do_sample=False, assistant_model=drafter, speculation_type="dflash",
                                  eos_token_id=None, pad_token_id=0)
    finally:
        handle.remove()
    assert max(call["context"] for call in calls[1:]) > 1  # rounds that accepted drafts: several new context states
    with torch.no_grad():
        hs = target(out, output_hidden_states=True).hidden_states
    feats = torch.cat([hs[i + 1][0] for i in c.target_layer_ids], -1)  # (L, F)
    C, B = c.sliding_window, c.block_size
    worst, off_by_one = 0.0, 0.0
    for call in calls:
        p = int(call["positions"][0, -B])  # the bonus token's position
        n = min(C, p)
        ctx = torch.zeros(1, C, feats.shape[-1])
        ctx[0, C - n:] = feats[p - n:p]
        mask = torch.zeros(1, C, dtype=torch.bool)
        mask[0, C - n:] = True
        batch = {"context_states": ctx, "context_mask": mask, "bonus_token": out[0, p:p + 1],
                 "position_ids": torch.arange(p - C, p + B).clamp(min=0)[None]}
        with torch.no_grad():
            logits = dflash_block_logits(drafter, target, batch)
            stock = target.get_output_embeddings()(call["hidden"][:, 1:])
            worst = max(worst, (logits - stock).abs().max().item())
            wrong = dflash_attention_mask(mask, B, C - 1)
            hidden = drafter(noise_embeds=target.get_input_embeddings()(
                torch.cat([out[0, p:p + 1], torch.full((B - 1,), c.mask_token_id)]))[None],
                context_hidden_states=ctx, attention_mask=wrong, position_ids=batch["position_ids"]).last_hidden_state
            off_by_one = max(off_by_one, (hidden - call["hidden"]).abs().max().item())
    assert worst < 1e-4 and off_by_one > 1e-2


def test_saved_drafter_runs_in_stock_transformers_without_hf_chainflow(setup):
    """The saved folder holds the trained tensors; a fresh process that imports only transformers loads it with
    `AutoModel` and its `speculation_type="dflash"` greedy output equals plain greedy output token for token."""
    folder = setup.tmp / "drafter"
    saved = load_file(str(folder / "model.safetensors"))
    assert saved.keys() == setup.drafter.state_dict().keys()
    for name, tensor in setup.drafter.state_dict().items():
        assert torch.equal(saved[name], tensor), name
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "muse_glimmer_assistant" and config["target_layer_ids"] == LAYERS
    reloaded = MuseGlimmerAssistantModel.from_pretrained(folder)
    assert all(torch.equal(a, b) for a, b in zip(reloaded.state_dict().values(), setup.drafter.state_dict().values()))

    prompts = [setup.rows[k]["prompt_ids"] for k in ("r1", "r2")] + [[30 + i for i in range(7)]]
    script = textwrap.dedent(f"""
        import json, sys
        import torch
        from transformers import AutoModel, AutoModelForCausalLM
        torch.set_num_threads(1)
        target = AutoModelForCausalLM.from_pretrained({str(setup.tmp / "target")!r}).eval()
        drafter = AutoModel.from_pretrained({str(folder)!r}).eval()
        forwards = []
        target.register_forward_hook(lambda *a: forwards.append(1))
        report = []
        for ids in {prompts!r}:
            ids = torch.tensor([ids])
            kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens={NEW}, do_sample=False, eos_token_id=None,
                      pad_token_id=0)
            plain = target.generate(ids, **kw)[0].tolist()
            forwards.clear()
            dflash = target.generate(ids, assistant_model=drafter, speculation_type="dflash", **kw)[0].tolist()
            report.append({{"plain": plain, "dflash": dflash, "forwards": len(forwards)}})
        loaded = sorted(m for m in sys.modules if m.split(".")[0] == "hf_chainflow")
        print(json.dumps({{"class": type(drafter).__name__, "hf_chainflow": loaded, "report": report}}))
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=setup.tmp,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["class"] == "MuseGlimmerAssistantModel" and result["hf_chainflow"] == []
    for r in result["report"]:
        assert r["dflash"] == r["plain"] and len(r["plain"]) > NEW
    assert sum(r["forwards"] for r in result["report"][:2]) < 2 * NEW  # drafts were accepted


def test_bench_dflash_arm_is_checked_and_counted(setup, monkeypatch):
    """The `dflash` arm beside `ar`, in float32 and bfloat16: every output is compared with the same-dtype `ar`
    output (float32: identical), τ is counted from the target's forwards."""
    import hf_chainflow.bench.run as bench_run

    checked = []
    original = bench_run.explain_mismatch

    def spy(model, prompt_ids, reference, other, dtype, tolerance):
        checked.append(dtype)
        return original(model, prompt_ids, reference, other, dtype, tolerance)

    monkeypatch.setattr(bench_run, "explain_mismatch", spy)
    bf16 = tiny_target(setup.family, vocab_size=256, hidden_size=64, num_layers=4).to(torch.bfloat16)
    models = {"float32": setup.target, "bfloat16": bf16}
    drafters = {"dflash": {dt: load_dflash_drafter(setup.tmp / "drafter", m) for dt, m in models.items()}}
    assert drafters["dflash"]["bfloat16"].dtype == torch.bfloat16
    arms = build_arms(list(models), {}, dflash=True, only=["ar", "dflash"])
    assert [a.key for a in arms] == ["ar@float32", "dflash@float32", "ar@bfloat16", "dflash@bfloat16"]
    prompts = [BenchPrompt(k, "x", torch.tensor([setup.rows[k]["prompt_ids"]])) for k in ("r3", "r4")]
    results = run_bench(models, prompts, arms, drafters, max_new_tokens=24, progress=False, eos_token_id=None,
                        pad_token_id=0)
    arm = results["arms"]["dflash@float32"]
    assert arm["mismatches"] == 0 and arm["new_tokens"] == 48 and arm["tau"] > 1.3
    assert results["arms"]["dflash@bfloat16"]["tau"] >= 1.0
    assert checked.count("float32") == 2 and checked.count("bfloat16") == 2


# ------------------------------------------------------------------------------------------ sizes and errors

def test_spread_target_layers_and_sizes():
    assert spread_target_layers(30, 4) == [1, 10, 18, 27]
    assert spread_target_layers(4, 1) == [1]
    target = tiny_target("llama", vocab_size=256, hidden_size=64, num_layers=4)
    drafter = build_dflash_drafter(target, mask_token_id=3, **DRAFTER)
    H, I, F = 64, 128, 2 * 64
    attention = H * 64 + 2 * H * 32 + 64 * H + 2 * 16  # q, k, v (2 key/value heads of 16), o, q/k norms
    assert parameter_count(drafter) == F * H + H + attention + 3 * H * I + 2 * H + H
    assert drafter.config.layer_types == ["sliding_attention"] and drafter.config.eos_token_id == 2


def test_bad_input_raises_value_errors(tmp_path):
    llama = tiny_target("llama", vocab_size=256, hidden_size=64, num_layers=4)
    with pytest.raises(ValueError, match="stateful"):
        build_dflash_drafter(tiny_target("qwen3_5", vocab_size=256, hidden_size=64, num_layers=4), mask_token_id=3,
                             **DRAFTER)
    with pytest.raises(ValueError, match=r"mask_token_id.*\[0, 256\)"):
        build_dflash_drafter(llama, **{**DRAFTER, "mask_token_id": 256})
    with pytest.raises(ValueError, match="target_layer_ids"):
        build_dflash_drafter(llama, **{**DRAFTER, "target_layer_ids": [0, 4]}, mask_token_id=3)
    with pytest.raises(ValueError, match="sliding_window"):
        build_dflash_drafter(llama, **{**DRAFTER, "sliding_window": 2}, mask_token_id=3)
    with pytest.raises(ValueError, match="Unknown DFlash drafter field"):
        build_dflash_drafter(llama, mask_token_id=3, num_blocks=2)
    drafter = build_dflash_drafter(llama, mask_token_id=3, **DRAFTER)
    with pytest.raises(ValueError, match="hidden size"):
        check_dflash_drafter(drafter, tiny_target("llama", vocab_size=256, hidden_size=32, num_layers=4))
    with pytest.raises(ValueError, match="stateful"):
        check_dflash_drafter(drafter, tiny_target("qwen3_5", vocab_size=256, hidden_size=64, num_layers=4))

    rows = _greedy_rows(llama, n=2)
    prepare(llama, SimpleNamespace(pad_token_id=0, eos_token_id=2), tmp_path / "d", responses=rows,
            target_layers=[0], generation_dtype=torch.float32, progress=False)
    with pytest.raises(ValueError, match=r"not all cached.*--target-layers"):
        DFlashWindowDataset.for_drafter(tmp_path / "d", drafter.config)
    chainflow_windows = ChainFlowWindowDataset(tmp_path / "d")
    one_layer = build_dflash_drafter(llama, mask_token_id=3, **{**DRAFTER, "target_layer_ids": [0]})
    args = DFlashTrainingArguments(output_dir=str(tmp_path / "o"), report_to="none")
    with pytest.raises(ValueError, match="ChainFlow windows cannot train a DFlash drafter"):
        DFlashTrainer(model=one_layer, args=args, train_dataset=chainflow_windows, target=llama)
    short = DFlashWindowDataset(tmp_path / "d", target_layer_ids=[0], context_len=4, block_size=4)
    with pytest.raises(ValueError, match="do not fit this DFlash drafter"):
        DFlashTrainer(model=one_layer, args=args, train_dataset=short, target=llama)
    with pytest.raises(ValueError, match="loss_decay_gamma"):
        DFlashTrainingArguments(output_dir=str(tmp_path / "o"), loss_decay_gamma=-1.0)


# ------------------------------------------------------------------------------------------ the commands

def test_train_command_trains_a_dflash_drafter(tiny_prepared, tmp_path):
    """`hf-chainflow prepare --target-layers` then `hf-chainflow train --drafter-type dflash`: a plain transformers
    folder with its model card; the refusals before anything trains."""
    from hf_chainflow.commands import main

    target = str(tiny_prepared / "target")
    responses = str(tiny_prepared / "data" / "responses" / "shard-00000.jsonl")
    data = tmp_path / "data"
    assert main(["prepare", "--target", target, "--responses", responses, "--out", str(data), "--target-layers", "0",
                 "--dtype", "float32", "--threads", "1"]) == 0
    used = read_shortlist(data)
    mask = next(i for i in range(3, 49152) if i not in used)
    base = ["train", "--drafter-type", "dflash", "--target", target, "--data", str(data), "--threads", "1",
            "--batch-size", "8", "--logging-steps", "2", "--drafter-arg", "block_size=4", "--drafter-arg",
            "sliding_window=8", "--drafter-arg", "num_hidden_layers=1"]
    out = tmp_path / "drafter"
    assert main([*base, "--out", str(out), "--max-steps", "4", "--drafter-arg", f"mask_token_id={mask}"]) == 0
    assert {"config.json", "model.safetensors", "README.md", "train_summary.json"} <= {p.name for p in out.iterdir()}
    drafter = MuseGlimmerAssistantModel.from_pretrained(out)
    assert drafter.config.target_layer_ids == [0] and drafter.config.mask_token_id == mask
    summary = json.loads((out / "train_summary.json").read_text())
    assert summary["steps"] == 4 and summary["last_logged"]["loss_tau"] >= 1.0
    card = (out / "README.md").read_text()
    assert "hf-chainflow train --drafter-type dflash" in card and f"mask_token_id={mask}" in card
    assert f"{summary['parameters']:,} parameters" in card and "τ during training" in card

    with pytest.raises(SystemExit, match="has no mask token"):
        main([*base, "--out", str(tmp_path / "a"), "--max-steps", "1"])
    with pytest.raises(SystemExit, match=r"mask_token_id.*occurs in the responses"):
        main([*base, "--out", str(tmp_path / "b"), "--max-steps", "1", "--drafter-arg", f"mask_token_id={used[3]}"])
    with pytest.raises(SystemExit, match=r"--vae-pretrain-steps.*train ChainFlow drafters"):
        main([*base, "--out", str(tmp_path / "c"), "--vae-pretrain-steps", "5"])
    with pytest.raises(SystemExit, match=r"\['num_blocks'\], which are not hf_chainflow.training.dflash.dflash_config fields"):
        main([*base, "--out", str(tmp_path / "d"), "--drafter-arg", "num_blocks=2"])
    (tmp_path / "eagle.yaml").write_text("drafter_type: eagle\n")
    with pytest.raises(SystemExit, match=r"--drafter-type must be one of \['chainflow', 'dflash'\], got 'eagle'"):
        main(["train", "--config", str(tmp_path / "eagle.yaml"), "--data", str(data), "--out", str(tmp_path / "e")])
    with pytest.raises(SystemExit, match="batch 1"):
        main(["bench", "--dflash", str(out), "--batch-sizes", "1,2", "--output-dir", str(tmp_path / "f")])
    with pytest.raises(SystemExit, match="'dflash'"):
        main(["bench", "--drafter", f"dflash={out}", "--output-dir", str(tmp_path / "g")])
