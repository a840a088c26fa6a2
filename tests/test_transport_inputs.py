"""The transport's optional inputs: the bonus token's embedding (`bonus_embedding`) and fused target layers
(`target_layer_ids`).

Config validation; defaults that keep the shipped drafter's weights and drafts; a fresh drafter with either field
drafting what the same weights draft without it (zero-initialised); save/load; training through the Trainer and the
command line; and lossless generation on the three target families (dense Llama and Qwen3, the Qwen3.5 hybrid) in
every loop, with the drafter handed exactly the states a plain forward over the committed tokens gives.
"""

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import hf_chainflow  # noqa: F401  (installs the generate hook)
from hf_chainflow import ChainFlowConfig, ChainFlowDrafter
from hf_chainflow.checkpoints import default_drafter_path
from hf_chainflow.generation import drafting, serving
from hf_chainflow.testing import TINY_FAMILIES, tiny_target
from hf_chainflow.generation.verification import select_target_states

from _speculative import set_shape
from _windows import TINY_DRAFTER, make_windows, tiny_drafter_config

LEVERS = {"bonus": dict(bonus_embedding=True), "layers": dict(target_layer_ids=[0, 2]),
          "both": dict(bonus_embedding=True, target_layer_ids=[1])}


@pytest.fixture(scope="module")
def target():
    return tiny_target("llama")  # 4 layers: decoder layers 0..2 are not the final one


def _drafter(target, seed=0, randomize=True, **fields):
    """A tiny drafter; with `randomize`, its zero-initialised parts (feedback outputs, bonus projection, fusion)
    get random weights so that every input moves the drafts."""
    torch.manual_seed(seed)
    drafter = ChainFlowDrafter(tiny_drafter_config(target, **fields)).bind_target(target).eval()
    if randomize:
        gen = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for name, param in drafter.named_parameters():
                if any(k in name for k in ("path_head.out", "markov_head.u2", "bonus_proj.1", "layer_fusion.proj")):
                    param.copy_(torch.randn(param.shape, generator=gen) * 0.3)
    return drafter


def _states(target, ids, layers):
    with torch.no_grad():
        return select_target_states(target(ids, output_hidden_states=True).hidden_states, layers)


# ---------------------------------------------------------------------------------------------------- config
@pytest.mark.parametrize("kwargs,needle", [
    (dict(bonus_embedding=1), r"`bonus_embedding` must be True or False, got 1 \(int\)"),
    (dict(bonus_embedding="yes"), r"`bonus_embedding` must be True or False, got 'yes' \(str\)"),
    (dict(target_layer_ids=[]), r"`target_layer_ids` must be None .* non-empty list .* got \[\]; e.g. `\[2, 15, 27\]`"),
    (dict(target_layer_ids=(1, 2)), r"`target_layer_ids` must be None .* got \(1, 2\)"),
    (dict(target_layer_ids=[1, -2]), r"non-negative ints, 0-based\), got \[1, -2\]"),
    (dict(target_layer_ids=[1.0]), r"got \[1.0\]"),
    (dict(target_layer_ids=[5, 2]), r"distinct and increasing .* got \[5, 2\]. Pass `sorted\(set\(ids\)\)` = \[2, 5\]"),
    (dict(target_layer_ids=[2, 2]), r"distinct and increasing .* got \[2, 2\]"),
])
def test_config_validation_names_the_field_value_rule_and_fix(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        ChainFlowConfig(**kwargs)


def test_config_defaults_and_derived_sizes(target):
    cfg = ChainFlowConfig()
    assert cfg.bonus_embedding is False and cfg.target_layer_ids is None
    assert cfg.state_layers == () and cfg.context_state_size == cfg.target_hidden_size
    cfg = ChainFlowConfig.for_target(target.config, target_layer_ids=[0, 2], bonus_embedding=True)
    assert cfg.state_layers == (0, 2) and cfg.context_state_size == 3 * 64
    cfg.target_layer_ids = [2, 0]  # an edit after construction is checked by `check_fields()` (and `validate()`)
    with pytest.raises(ValueError, match="distinct and increasing"):
        cfg.check_fields()


def test_binding_refuses_layers_the_target_lacks_and_stays_unbound(target):
    drafter = ChainFlowDrafter(tiny_drafter_config(target, target_layer_ids=[1, 3]))  # layer 3 is the last of 4
    with pytest.raises(ValueError, match=r"target_layer_ids=\[1, 3\].* num_hidden_layers=4: the layers must lie in "
                                         r"\[0, num_hidden_layers - 1\)"):
        drafter.bind_target(target)
    assert not drafter.is_bound


def test_layer_statistics_are_checked_saved_and_refused_without_fused_layers(target, tmp_path):
    drafter = _drafter(target, **LEVERS["layers"])
    mean, std = torch.randn(2, 64), torch.rand(2, 64) + 0.5
    drafter.set_layer_statistics(mean, std)
    for bad in ((torch.zeros(64), torch.ones(64)), (mean, torch.zeros(2, 64)), (mean.tolist(), std.tolist()),
                (torch.full((2, 64), float("nan")), std)):
        with pytest.raises(ValueError, match="`mean` and `std` must"):
            drafter.set_layer_statistics(*bad)
    assert torch.equal(drafter.layer_fusion.layer_mean, mean) and torch.equal(drafter.layer_fusion.layer_std, std)
    with pytest.raises(ValueError, match="this drafter has `target_layer_ids=None`"):
        _drafter(target).set_layer_statistics(mean, std)
    drafter.save_pretrained(tmp_path)
    loaded = ChainFlowDrafter.from_pretrained(tmp_path)
    assert torch.equal(loaded.layer_fusion.layer_mean, mean) and torch.equal(loaded.layer_fusion.layer_std, std)


# ---------------------------------------------------------------------------------------------------- defaults
def test_the_shipped_config_builds_exactly_the_shipped_weights():
    """With the new fields at their defaults a drafter has no parameter or buffer the shipped checkpoint lacks."""
    path = default_drafter_path()
    config = ChainFlowConfig.from_pretrained(path)
    assert config.bonus_embedding is False and config.target_layer_ids is None
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        stored = set(f.keys())
    with torch.device("meta"):
        built = set(ChainFlowDrafter(config).state_dict())
    assert built == stored


REFERENCE = Path(__file__).resolve().parent / "fixtures" / "shipped_drafts.json"


@pytest.mark.slow
def test_the_shipped_drafter_drafts_what_it_drafted_before_the_new_fields():
    """Chains and trees of the shipped drafter on the real SmolLM2 target at two fixed contexts equal those recorded
    (tests/fixtures/shipped_drafts.json, written on this project's AVX-512 BF16 CPUs, float32 drafter, bfloat16
    serving head; the predicted states' sum up to float32 rounding across CPU kinds): first before
    `bonus_embedding` and `target_layer_ids` existed, re-recorded for each shipped weight file after the previous one
    still reproduced its record (tests/fixtures/README.md)."""
    from hf_chainflow.targets import load_target

    reference = json.loads(REFERENCE.read_text())
    target, _ = load_target()
    drafter = ChainFlowDrafter.from_pretrained(default_drafter_path(), target=target).eval()
    ids = torch.tensor([reference["ids"]])
    states = _states(target, ids, ())
    for case in reference["cases"]:
        cut = case["cut"]
        tree = drafting.draft(drafter, states[:, :cut - 1], ids[:, :cut], **case["kwargs"])
        assert (tree.tokens.tolist(), tree.parents.tolist()) == (case["tokens"], case["parents"]), case["kwargs"]
        if "states_sum" in case:
            predicted = drafter.predict_states(states[:, :cut - 1], velocity=serving.serving_velocity(drafter))
            # Float32 products are reduced in a CPU-dependent order (oneDNN/MKL pick kernels per CPU): the sum moved
            # by 6.4e-7 relative between the recording EPYC Zen 4 and an Intel Xeon model 207, with identical drafts.
            assert float(predicted.double().sum()) == pytest.approx(case["states_sum"], rel=1e-5)


@pytest.mark.parametrize("lever", sorted(LEVERS))
def test_a_fresh_drafter_with_a_new_input_drafts_as_without_it(target, lever):
    """Zero-initialised, the bonus projection and the fusion add exactly nothing: the same weights draft the same
    tokens and states with or without the new inputs."""
    plain = _drafter(target)
    new = ChainFlowDrafter(tiny_drafter_config(target, **LEVERS[lever])).bind_target(target).eval()
    missing, unexpected = new.load_state_dict(plain.state_dict(), strict=False)
    assert not unexpected and missing and all("bonus_proj" in k or "layer_fusion" in k for k in missing)
    if new.layer_fusion is not None:
        new.set_layer_statistics(torch.randn(len(new.state_layers), 64), torch.rand(len(new.state_layers), 64) + 0.5)
    ids = torch.randint(3, 256, (1, 13), generator=torch.Generator().manual_seed(4))
    full = _states(target, ids[:, :-1], new.state_layers)
    assert torch.equal(new.predict_states(full, bonus_tokens=ids[:, -1]), plain.predict_states(full[..., :64]))
    for shape in (dict(mode="chain", num_tokens=3), dict(mode="tree", tree_width=4, tree_depth=3)):
        a, b = drafting.draft(new, full, ids, **shape), drafting.draft(plain, full[..., :64], ids, **shape)
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.parents, b.parents)


@pytest.mark.parametrize("lever", sorted(LEVERS))
def test_the_new_inputs_move_the_drafts_and_are_checked(target, lever):
    drafter = _drafter(target, **LEVERS[lever])
    W = drafter.config.context_state_size
    states = torch.randn(3, 6, W, generator=torch.Generator().manual_seed(5))
    bonus = torch.tensor([5, 6, 7])
    out = drafter.predict_states(states, bonus_tokens=bonus)
    if drafter.config.bonus_embedding:
        assert not torch.allclose(out, drafter.predict_states(states, bonus_tokens=bonus.flip(0)))
        with pytest.raises(ValueError, match=r"`bonus_embedding=True`\): pass `bonus_tokens`"):
            drafter.predict_states(states)
    if drafter.layer_fusion is not None:
        moved = states.clone()
        moved[..., 64:] += 1.0
        assert not torch.allclose(out, drafter.predict_states(moved, bonus_tokens=bonus))
        with pytest.raises(ValueError, match=rf"shape \(1, T, {W}\) .* followed by the outputs of decoder layers"):
            drafting.draft(drafter, states[:1, :, :64], bonus[None, :1])
        with pytest.raises(ValueError, match=rf"`context_states` must have {W} features"):
            drafter(context_states=torch.randn(2, 8, 64), target_states=torch.randn(2, 8, 64),
                    target_tokens=torch.randint(0, 256, (2, 8)), prev_tokens=torch.randint(0, 256, (2, 15)))


@pytest.mark.parametrize("lever", sorted(LEVERS))
def test_save_load_round_trip(target, lever, tmp_path):
    drafter = _drafter(target, **LEVERS[lever])
    drafter.save_pretrained(tmp_path)
    loaded = ChainFlowDrafter.from_pretrained(tmp_path, target=target).eval()
    for key in ("bonus_embedding", "target_layer_ids"):
        assert getattr(loaded.config, key) == getattr(drafter.config, key)
    assert json.loads((tmp_path / "config.json").read_text())["bonus_embedding"] == drafter.config.bonus_embedding
    mine, theirs = drafter.state_dict(), loaded.state_dict()
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    ids = torch.randint(3, 256, (1, 11), generator=torch.Generator().manual_seed(6))
    states = _states(target, ids[:, :-1], drafter.state_layers)
    a = drafting.draft(drafter, states, ids, mode="tree", tree_width=4, tree_depth=3)
    b = drafting.draft(loaded, states, ids, mode="tree", tree_width=4, tree_depth=3)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.parents, b.parents)


# ---------------------------------------------------------------------------------------------------- training
def _fused_windows(target, layers, seed=0):
    """`make_windows` with each context state followed by the outputs of `layers` (as the data pipeline builds
    them for a fused-layers drafter)."""
    from _windows import greedy_sequences

    ids = greedy_sequences(target, num_seqs=3, length=24, seed=seed)
    windows = make_windows(target, ids)
    if not layers:
        return windows
    with torch.no_grad():
        full = select_target_states(target(ids, output_hidden_states=True).hidden_states, layers)  # (S, L, W)
    out, n = [], 0
    for s in range(ids.shape[0]):
        for t in range(ids.shape[1] - 2):
            w = dict(windows[n])
            lo = max(0, t - 7)
            ctx = torch.zeros(8, full.shape[-1])
            ctx[8 - (t - lo + 1):] = full[s, lo:t + 1]
            assert torch.equal(ctx[:, :64], w["context_states"])
            w["context_states"] = ctx
            out.append(w)
            n += 1
    return out


@pytest.mark.parametrize("lever", sorted(LEVERS))
def test_a_tiny_training_run_through_the_trainer_trains_the_new_parts(target, lever, tmp_path):
    from hf_chainflow import ChainFlowTrainer, ChainFlowTrainingArguments

    drafter = ChainFlowDrafter(tiny_drafter_config(target, **LEVERS[lever])).bind_target(target)
    windows = _fused_windows(target, drafter.state_layers)
    new_parts = {n: p.detach().clone() for n, p in drafter.named_parameters()
                 if "bonus_proj.1" in n or "layer_fusion.proj" in n}
    assert new_parts and all(not p.any() for p in new_parts.values())  # zero-initialised
    args = ChainFlowTrainingArguments(output_dir=str(tmp_path), max_steps=6, per_device_train_batch_size=8,
                                      learning_rate=3e-3, report_to="none", logging_steps=3, save_strategy="no",
                                      disable_tqdm=True)
    result = ChainFlowTrainer(model=drafter, args=args, train_dataset=windows).train()
    assert torch.isfinite(torch.tensor(result.training_loss))
    trained = dict(drafter.named_parameters())
    assert all(trained[n].detach().abs().sum() > 0 for n in new_parts), "a new part received no gradient"


def test_the_train_command_sets_layer_statistics_and_eval_offline_walks(tmp_path):
    """`hf-chainflow prepare --target-layers` -> `train --drafter-arg target_layer_ids=[0]` -> `eval-offline
    --walk-sequences`: the fused layer's statistics come from the data, the drafter trains, loads and walks."""
    from hf_chainflow.commands import main
    from hf_chainflow.training.prepared_data import layer_statistics
    from hf_chainflow.targets import load_tokenizer

    from _fixtures import PROMPTS

    tok = load_tokenizer()
    small = tiny_target("llama", vocab_size=len(tok), hidden_size=64, num_layers=2)
    small.generation_config.eos_token_id, small.generation_config.pad_token_id = tok.eos_token_id, tok.pad_token_id
    small.save_pretrained(tmp_path / "target")
    tok.save_pretrained(tmp_path / "target")
    (tmp_path / "p.jsonl").write_text("\n".join(PROMPTS.read_text().splitlines()[:6]) + "\n")
    assert main(["prepare", "--target", str(tmp_path / "target"), "--prompts", str(tmp_path / "p.jsonl"), "--out",
                 str(tmp_path / "data"), "--max-new-tokens", "12", "--dtype", "float32", "--target-layers", "0"]) == 0
    sizes = [a for k, v in TINY_DRAFTER.items() for a in ("--drafter-arg", f"{k}={v}")]
    assert main(["train", "--target", str(tmp_path / "target"), "--data", str(tmp_path / "data"), "--out",
                 str(tmp_path / "drafter"), "--max-steps", "3", "--batch-size", "8", "--threads", "1",
                 "--drafter-arg", "target_layer_ids=[0]", "--drafter-arg", "bonus_embedding=true", *sizes]) == 0
    drafter = ChainFlowDrafter.from_pretrained(tmp_path / "drafter")
    assert drafter.config.target_layer_ids == [0] and drafter.config.bonus_embedding
    mean, std = layer_statistics(tmp_path / "data", [0])
    assert torch.equal(drafter.layer_fusion.layer_mean, mean) and torch.equal(drafter.layer_fusion.layer_std, std)
    assert main(["eval-offline", "--target", str(tmp_path / "target"), "--drafter", str(tmp_path / "drafter"),
                 "--data", str(tmp_path / "data"), "--out", str(tmp_path / "eval"), "--walk-sequences", "3",
                 "--tree", "4x3", "--threads", "1"]) == 0
    report = json.loads((tmp_path / "eval" / "offline_eval.json").read_text())
    assert report["walk"]["num_sequences"] == 3 and report["walk"]["tree"]["rounds"] > 0


# ---------------------------------------------------------------------------------------------------- serving
class _Recorder:
    """Wraps `hf_chainflow.generation.drafting.draft` / `draft_batch` (what the speculative loops call) and keeps what
    each call for `drafter` was handed."""

    def __init__(self, drafter, monkeypatch):
        self.calls, self.drafter = [], drafter
        self._draft, self._draft_batch = drafting.draft, drafting.draft_batch
        monkeypatch.setattr(drafting, "draft", self.draft)
        monkeypatch.setattr(drafting, "draft_batch", self.draft_batch)

    def draft(self, drafter, hidden_states, input_ids, **kwargs):
        if drafter is self.drafter:
            self.calls.append([(hidden_states[0], input_ids[0])])
        return self._draft(drafter, hidden_states, input_ids, **kwargs)

    def draft_batch(self, drafter, hidden_states, committed, context_mask=None, **kwargs):
        if drafter is self.drafter:
            rows = [(h if context_mask is None else h[context_mask[b]], committed[b])
                    for b, h in enumerate(hidden_states)]
            self.calls.append(rows)
        return self._draft_batch(drafter, hidden_states, committed, context_mask, **kwargs)


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_fused_and_bonus_drafters_are_lossless_and_read_the_right_states(family, monkeypatch):
    """Greedy speculative `generate` equals plain `generate` (one prompt in the own loop and in transformers'
    assisted loop, a left-padded batch in the batched loop; chains and trees), and every drafting call is handed the
    last `C` committed positions' final states followed by the chosen layers' outputs, as a plain forward over the
    committed tokens gives them."""
    tgt = tiny_target(family)
    drafter = _drafter(tgt, **LEVERS["both"] | {"target_layer_ids": [0, 2]})
    recorder = _Recorder(drafter, monkeypatch)
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 256, (int(torch.randint(2, 20, (), generator=gen)),), generator=gen)
               for _ in range(4)]
    for mode, shape in (("chain", 3), ("tree", (4, 3))):
        set_shape(drafter, mode, shape)
        for p in prompts[:2]:
            plain = tgt.generate(p[None], max_new_tokens=12, do_sample=False)
            assert torch.equal(tgt.generate(p[None], max_new_tokens=12, do_sample=False, assistant_model=drafter),
                               plain), (family, mode)
        width = max(len(p) for p in prompts)
        ids = torch.zeros(len(prompts), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for b, p in enumerate(prompts):
            ids[b, width - len(p):], mask[b, width - len(p):] = p, 1
        out = tgt.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, assistant_model=drafter,
                           pad_token_id=0)
        for b, p in enumerate(prompts):
            plain = tgt.generate(p[None], max_new_tokens=10, do_sample=False)[0]
            assert torch.equal(out[b, width - len(p): width - len(p) + len(plain)], plain), (family, mode, b)
    checked = 0
    for call in recorder.calls:
        for states, committed in call:
            want = _states(tgt, committed[None, :-1], drafter.state_layers)[0, -drafter.context_size:]
            assert states.shape == want.shape == (min(8, len(committed) - 1), 3 * 64)
            torch.testing.assert_close(states.float(), want, atol=2e-4, rtol=1e-4)
            checked += 1
    assert checked >= 30 and len({len(c) for c in recorder.calls}) > 1  # single-row and batched calls
