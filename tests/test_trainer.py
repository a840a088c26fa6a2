"""ChainFlowTrainer on a tiny target and a tiny drafter: param groups, logged terms, saving, resuming, VAE stage."""

import json

import pytest
import torch
from safetensors.torch import load_file

from hf_chainflow import ChainFlowDrafter
from hf_chainflow.testing import tiny_target
from hf_chainflow.training.trainer import ChainFlowTrainer
from hf_chainflow.training.arguments import ChainFlowTrainingArguments
from hf_chainflow.training.replay import ReplayMixDataset
from hf_chainflow.training.adaptation import adaptation_arguments, warm_start

from _windows import greedy_sequences, make_windows, one_thread, tiny_drafter_config

TERMS = ("flow", "hid", "ce", "cov", "acc", "rec")


@pytest.fixture(scope="module", autouse=True)
def _single_thread():
    with one_thread():
        yield


@pytest.fixture(scope="module")
def target():
    return tiny_target("llama", num_layers=2)


@pytest.fixture(scope="module")
def windows(target):
    return make_windows(target, greedy_sequences(target, num_seqs=2, length=24))  # 44 windows


def new_drafter(target, seed=0, **overrides):
    torch.manual_seed(seed)
    return ChainFlowDrafter(tiny_drafter_config(target, **overrides)).bind_target(target)


def make_args(out, **kw):
    base = dict(output_dir=str(out), per_device_train_batch_size=8, max_steps=4, logging_steps=2,
                save_strategy="no", report_to="none", disable_tqdm=True, use_cpu=True, seed=0)
    base.update(kw)
    return ChainFlowTrainingArguments(**base)


def test_defaults_follow_the_paper(tmp_path):
    args = ChainFlowTrainingArguments(output_dir=str(tmp_path))
    assert args.learning_rate == 5e-4 and args.lr_scheduler_type == "constant"
    assert "adamw" in str(args.optim).lower() and args.remove_unused_columns is False
    assert args.loss_weights == {"flow": 0.2, "hid": 0.25, "ce": 0.3, "cov": 0.3, "acc": 0.15, "rec": 0.5, "kd": 0.0}
    assert (args.acceptance_gamma, args.coverage_top_b, args.kl_beta, args.vae_lr_ratio) == (0.8, 8, 3e-5, 0.05)
    with pytest.raises(ValueError, match="acceptance_gamma"):
        ChainFlowTrainingArguments(output_dir=str(tmp_path), acceptance_gamma=0.0)
    with pytest.raises(ValueError, match="loss_cov_weight"):
        ChainFlowTrainingArguments(output_dir=str(tmp_path), loss_cov_weight=-1.0)


def test_param_groups_give_the_vae_its_ratio_and_never_see_the_target(target, windows, tmp_path):
    drafter = new_drafter(target)
    trainer = ChainFlowTrainer(model=drafter, args=make_args(tmp_path, learning_rate=1e-3), train_dataset=windows)
    opt = trainer.create_optimizer()
    lrs = {g["name"]: g["lr"] for g in opt.param_groups}
    assert opt.param_groups[0]["name"] == "drafter"  # the group whose lr the Trainer logs
    assert lrs == {"drafter": 1e-3, "drafter_no_decay": 1e-3, "vae": pytest.approx(5e-5),
                   "vae_no_decay": pytest.approx(5e-5)}
    in_opt = [p for g in opt.param_groups for p in g["params"]]
    assert len(in_opt) == len({id(p) for p in in_opt}) == sum(1 for p in drafter.parameters() if p.requires_grad)
    vae_ids = {id(p) for p in drafter.vae.parameters()}
    for g in opt.param_groups:
        assert all((id(p) in vae_ids) == g["name"].startswith("vae") for p in g["params"])
    target_ptrs = {p.data_ptr() for p in target.parameters()}
    assert not target_ptrs & {p.data_ptr() for p in in_opt}
    assert not any("lm_head" in n or "embed_tokens" in n for n, _ in drafter.named_parameters())


def test_unbound_drafter_and_wrong_args_are_refused(target, windows, tmp_path):
    with pytest.raises(ValueError, match="bind_target"):
        ChainFlowTrainer(model=ChainFlowDrafter(tiny_drafter_config(target)), args=make_args(tmp_path))
    from transformers import TrainingArguments

    with pytest.raises(ValueError, match="ChainFlowTrainingArguments"):
        ChainFlowTrainer(model=new_drafter(target), args=TrainingArguments(output_dir=str(tmp_path)))
    with pytest.raises(ValueError, match=r"`model_init` is not supported by ChainFlowTrainer.*Pass the drafter as"):
        ChainFlowTrainer(model_init=lambda: new_drafter(target), args=make_args(tmp_path), target=target)


def test_failed_construction_and_failed_vae_stage_leave_the_drafter_unchanged(target, windows, tmp_path,
                                                                                monkeypatch):
    drafter = ChainFlowDrafter(tiny_drafter_config(target))
    steps = drafter.config.train_flow_steps
    from transformers import Trainer

    def refused(self, *args, **kwargs):  # `Trainer.__init__` failing after the drafter was bound and configured
        raise ValueError("refused by Trainer")

    with monkeypatch.context() as patch:
        patch.setattr(Trainer, "__init__", refused)
        with pytest.raises(ValueError, match="refused by Trainer"):
            ChainFlowTrainer(model=drafter, args=make_args(tmp_path, train_flow_steps=steps + 2), target=target)
    assert not drafter.is_bound and drafter.config.train_flow_steps == steps

    trainer = ChainFlowTrainer(model=drafter, args=make_args(tmp_path), target=target, train_dataset=windows)
    drafter.eval()

    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr("hf_chainflow.training.vae_pretraining.vae_reconstruction_loss", broken)
    with pytest.raises(RuntimeError, match="boom"):
        trainer.pretrain_vae(num_steps=2)
    assert not drafter.training


def test_train_logs_every_term_and_saves_only_the_drafter(target, windows, tmp_path):
    drafter = new_drafter(target)
    before = {k: v.clone() for k, v in drafter.state_dict().items()}
    target_before = {k: v.clone() for k, v in target.state_dict().items()}
    trainer = ChainFlowTrainer(model=drafter, args=make_args(tmp_path / "run"), train_dataset=windows)
    trainer.train()
    logs = [row for row in trainer.state.log_history if "loss" in row]
    assert len(logs) == 2  # steps 2 and 4
    for row in logs:
        for term in TERMS:
            assert torch.isfinite(torch.tensor(row[f"loss_{term}"]))
        # the logged total is the weighted sum of the logged terms (both averaged over the same two steps)
        assert row["learning_rate"] == pytest.approx(5e-4)  # the drafter's, not the VAE's 1/20
        weights = trainer.args.loss_weights
        assert row["loss"] == pytest.approx(sum(weights[t] * row[f"loss_{t}"] for t in TERMS), rel=1e-3)
    assert any(not torch.equal(before[k], v) for k, v in drafter.state_dict().items())
    assert all(torch.equal(target_before[k], v) for k, v in target.state_dict().items())

    metrics = trainer.evaluate(eval_dataset=windows[:16])
    assert {"eval_loss", *(f"eval_loss_{t}" for t in TERMS)} <= set(metrics)
    assert metrics["eval_loss"] == pytest.approx(sum(weights[t] * metrics[f"eval_loss_{t}"] for t in TERMS),
                                                  rel=1e-3)

    out = tmp_path / "saved"
    trainer.save_model(str(out))
    for name in ("config.json", "model.safetensors", "generation_config.json"):
        assert (out / name).is_file(), name
    saved = load_file(str(out / "model.safetensors"))
    assert not [k for k in saved if "lm_head" in k or "embed" in k]
    saved_buffers = drafter.state_mean.numel() + drafter.state_std.numel()  # the standardisation statistics
    assert sum(v.numel() for v in saved.values()) == sum(p.numel() for p in drafter.parameters()) + saved_buffers
    assert json.loads((out / "config.json").read_text())["model_type"] == "chainflow"
    reloaded = ChainFlowDrafter.from_pretrained(str(out), target=target)
    for k, v in drafter.state_dict().items():
        assert torch.equal(reloaded.state_dict()[k], v), k


def test_resume_from_checkpoint_continues_the_same_run(target, windows, tmp_path):
    full = new_drafter(target)
    args = make_args(tmp_path / "a", max_steps=4, save_strategy="steps", save_steps=2, logging_steps=1)
    ChainFlowTrainer(model=full, args=args, train_dataset=windows).train()
    assert (tmp_path / "a" / "checkpoint-2" / "model.safetensors").is_file()
    assert (tmp_path / "a" / "checkpoint-2" / "optimizer.pt").is_file()

    resumed = new_drafter(target, seed=123)  # different init: everything must come from the checkpoint
    args_b = make_args(tmp_path / "b", max_steps=4, save_strategy="steps", save_steps=2, logging_steps=1)
    trainer = ChainFlowTrainer(model=resumed, args=args_b, train_dataset=windows)
    trainer.train(resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-2"))
    assert trainer.state.global_step == 4
    assert [r["step"] for r in trainer.state.log_history if "loss" in r][-2:] == [3, 4]
    for k, v in full.state_dict().items():
        torch.testing.assert_close(resumed.state_dict()[k], v, rtol=1e-5, atol=1e-6, msg=k)


def test_resume_from_checkpoint_true_takes_the_newest_complete_checkpoint(target, windows, tmp_path, caplog):
    """The Trainer's own `resume_from_checkpoint=True` skips a half-written checkpoint (no marker; here the kill left
    no trainer state or optimizer) for the newest complete one; naming the half-written one is refused."""
    full = new_drafter(target)
    args = make_args(tmp_path, max_steps=4, save_strategy="steps", save_steps=2, logging_steps=1)
    ChainFlowTrainer(model=full, args=args, train_dataset=windows).train()
    half = tmp_path / "checkpoint-4"
    for name in ("checkpoint_complete.json", "trainer_state.json", "optimizer.pt"):
        (half / name).unlink(missing_ok=True)
    trainer = ChainFlowTrainer(model=new_drafter(target, seed=123), args=args, train_dataset=windows)
    with pytest.raises(ValueError, match=r"resume_from_checkpoint '.*checkpoint-4' is an incomplete checkpoint: it "
                                         r"lacks checkpoint_complete.json and a readable trainer_state.json, "
                                         r"optimizer.pt .* resume from `resume_from_checkpoint='.*checkpoint-2'`"):
        trainer.train(resume_from_checkpoint=str(half))
    with caplog.at_level("WARNING", logger="hf_chainflow.training.trainer"):
        trainer.train(resume_from_checkpoint=True)
    assert "Resuming from" in caplog.text and "checkpoint-2" in caplog.text and "skipped the incomplete checkpoint-4" \
        in caplog.text
    # resumed at step 2: the checkpoint's history, then steps 3 and 4
    assert [r["step"] for r in trainer.state.log_history if "loss" in r] == [1, 2, 3, 4]
    assert (half / "checkpoint_complete.json").is_file()  # written again, completely


def test_vae_pretraining_trains_only_the_vae_then_joint_training_runs(target, windows, tmp_path):
    drafter = new_drafter(target)
    args = make_args(tmp_path, vae_pretrain_steps=2, logging_steps=1, max_steps=1, learning_rate=2e-3)
    trainer = ChainFlowTrainer(model=drafter, args=args, train_dataset=windows)
    before = {n: p.detach().clone() for n, p in drafter.named_parameters()}
    losses = trainer.pretrain_vae(num_steps=6)
    assert len(losses) == 6 and losses[-1] < losses[0]
    for n, p in drafter.named_parameters():
        assert torch.equal(before[n], p) != n.startswith("vae."), n  # VAE moved, nothing else did
    trainer.train()  # the stage already ran on this trainer: straight to the joint step
    assert trainer.state.global_step == 1 and trainer.vae_pretrain_losses == losses

    fresh = ChainFlowTrainer(model=new_drafter(target), args=args, train_dataset=windows)
    fresh.train()  # a fresh run pre-trains first
    assert len(fresh.vae_pretrain_losses) == 2 and fresh.state.global_step == 1


def test_vae_pretraining_logs_interval_means_clips_and_spares_norms_from_decay(target, windows, tmp_path,
                                                                               monkeypatch):
    args = make_args(tmp_path, logging_steps=0.5, weight_decay=0.1, max_grad_norm=0.5)  # log every half of the steps
    trainer = ChainFlowTrainer(model=new_drafter(target), args=args, train_dataset=windows)
    made, clipped = [], []
    real_adamw, real_clip = torch.optim.AdamW, torch.nn.utils.clip_grad_norm_
    monkeypatch.setattr(torch.optim, "AdamW", lambda groups, **kw: made.append(groups) or real_adamw(groups, **kw))
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_",
                        lambda params, norm, **kw: clipped.append(norm) or real_clip(params, norm, **kw))
    losses = trainer.pretrain_vae(num_steps=8)  # 44 windows in batches of 8: the stage runs into a second epoch
    logged = [(r["vae_pretrain_step"], r["vae_pretrain_loss_rec"]) for r in trainer.state.log_history
              if "vae_pretrain_step" in r]
    assert logged == [(4, pytest.approx(sum(losses[:4]) / 4)), (8, pytest.approx(sum(losses[4:]) / 4))]
    assert clipped == [0.5] * 8
    decayed, plain = made[0]
    names = {id(p): n for n, p in trainer.drafter.vae.named_parameters()}
    assert decayed["weight_decay"] == 0.1 and plain["weight_decay"] == 0.0
    assert all("bias" in names[id(p)] or "norm" in names[id(p)] for p in plain["params"])
    assert len(decayed["params"]) + len(plain["params"]) == len(names)


@pytest.mark.parametrize("disable_tqdm", [False, True])
def test_vae_pretraining_losses_reach_the_console(target, windows, tmp_path, capsys, disable_tqdm):
    # transformers' console callback prints only once `train()` has opened its bar: the stage prints on its own bar,
    # and with `disable_tqdm=True` transformers' PrinterCallback prints the logs; either way once per log.
    args = make_args(tmp_path, logging_steps=2, disable_tqdm=disable_tqdm)
    trainer = ChainFlowTrainer(model=new_drafter(target), args=args, train_dataset=windows)
    trainer.pretrain_vae(num_steps=4)
    printed = capsys.readouterr().out
    assert printed.count("vae_pretrain_loss_rec") == 2 and "'vae_pretrain_step': 4" in printed


def test_train_flow_steps_overrides_the_trajectory_length(target, windows, tmp_path, caplog):
    drafter = new_drafter(target)
    before = drafter.config.train_flow_steps
    with caplog.at_level("WARNING", logger="hf_chainflow.training.trainer"):
        trainer = ChainFlowTrainer(model=drafter, args=make_args(tmp_path, train_flow_steps=3), train_dataset=windows)
    assert f"`train_flow_steps=3` overrides the drafter config's {before}" in caplog.text  # a changed recipe is said
    batch = trainer.data_collator(windows[:2])
    out = drafter(**{k: v for k, v in batch.items() if k != "domain"})
    assert drafter.config.train_flow_steps == 3 and out.predicted_states.shape[1] == 3
    caplog.clear()
    with caplog.at_level("WARNING", logger="hf_chainflow.training.trainer"):  # the same value again: nothing to say
        ChainFlowTrainer(model=drafter, args=make_args(tmp_path, train_flow_steps=3), train_dataset=windows)
    assert "overrides" not in caplog.text


def test_distillation_term_reads_the_targets_own_logits(target, windows, tmp_path):
    drafter = new_drafter(target)
    batch = ChainFlowTrainer(model=drafter, args=make_args(tmp_path), train_dataset=windows).data_collator(windows)
    out = drafter(**{k: v for k, v in batch.items() if k != "domain"}, return_teacher_logits=True)
    assert drafter(**{k: v for k, v in batch.items() if k != "domain"}).teacher_logits is None
    # the fixture's 2 sequences give len(windows) // 2 windows each (t = 0, 1, ...); label k of window t is token
    # t+2+k, generated greedily after the 4 prompt tokens, so there the target's own logits pick the label
    t = torch.arange(len(windows)) % (len(windows) // 2)
    generated = (t[:, None] + 2 + torch.arange(out.labels.shape[1])) >= 4  # (B, K)
    valid = (out.labels != -100) & generated
    assert valid.sum() > 200 and torch.equal(out.teacher_logits.argmax(-1)[valid], out.labels[valid])
    assert not out.teacher_logits.requires_grad

    trainer = ChainFlowTrainer(model=drafter, args=make_args(tmp_path / "kd", loss_kd_weight=0.5),
                               train_dataset=windows)
    trainer.train()
    weights = trainer.args.loss_weights
    for row in [r for r in trainer.state.log_history if "loss" in r]:
        assert row["loss_kd"] > 0
        assert row["loss"] == pytest.approx(sum(weights[n] * row[f"loss_{n}"] for n in (*TERMS, "kd")), rel=1e-3)
    with pytest.raises(ValueError, match="kd_temperature"):
        make_args(tmp_path, kd_temperature=0.0)
    with pytest.raises(ValueError, match="loss_kd_weight"):
        make_args(tmp_path, loss_kd_weight=-1.0)


def test_replay_mix_fraction_and_determinism():
    new, old = list(range(80)), [f"old{i}" for i in range(50)]
    mix = ReplayMixDataset(new, old, replay_fraction=0.2, seed=1)
    assert len(mix) == 100 and sum(mix.is_replay(i) for i in range(len(mix))) == 20
    rows = [mix[i] for i in range(len(mix))]
    assert rows[:80] == new and len(set(rows[80:])) == 20 and all(r in old for r in rows[80:])
    assert rows == [ReplayMixDataset(new, old, 0.2, seed=1)[i] for i in range(100)]
    assert len(ReplayMixDataset(new, old, 0.0)) == 80
    with pytest.raises(ValueError, match="replay_fraction"):
        ReplayMixDataset(new, old, 1.0)
    with pytest.raises(ValueError, match="old"):
        ReplayMixDataset(new, [], 0.2)


def test_language_adaptation_helpers(target, tmp_path):
    drafter = new_drafter(target)
    drafter.save_pretrained(tmp_path / "en")
    warm = warm_start(tmp_path / "en", target)
    assert warm.is_bound and all(torch.equal(warm.state_dict()[k], v) for k, v in drafter.state_dict().items())
    args = adaptation_arguments(str(tmp_path / "tr"), learning_rate=1.2e-4)
    assert args.learning_rate == 1.2e-4 and args.num_train_epochs == 2.0
    with pytest.warns(UserWarning, match="1e-4|0.0001"):
        adaptation_arguments(str(tmp_path / "tr"), learning_rate=5e-4)


def test_reloaded_drafter_keeps_its_shortlist(target, tmp_path):
    """Regression: `from_pretrained` left the non-persistent `shortlist_ids` buffer uninitialised (garbage ids)."""
    drafter = new_drafter(target, shortlist=[2, 5, 7, 11, 200])
    drafter.save_pretrained(tmp_path)
    reloaded = ChainFlowDrafter.from_pretrained(str(tmp_path), target=target)
    assert reloaded.shortlist_ids.tolist() == [2, 5, 7, 11, 200]
    assert torch.equal(reloaded.draft_head_weight(), target.lm_head.weight[[2, 5, 7, 11, 200]])


@pytest.mark.parametrize("kwargs, needle", [
    (dict(loss_rec_weight=float("nan")), r"`loss_rec_weight` must be a finite number, got nan"),
    (dict(kl_beta=float("inf")), r"`kl_beta` must be a finite number"),
    (dict(vae_lr_ratio=float("inf")), r"`vae_lr_ratio` must be a finite number"),
    (dict(loss_acc_weight="0.3"), r"`loss_acc_weight` must be a finite number, got '0.3'"),
    (dict(vae_pretrain_steps=2.5), r"`vae_pretrain_steps` must be an integer >= 0, got 2.5"),
    (dict(vae_pretrain_learning_rate=-1e-3), r"`vae_pretrain_learning_rate` must be a positive number"),
    (dict(coverage_top_b=True), r"`coverage_top_b` must be a positive integer"),
    (dict(train_flow_steps=True), r"`train_flow_steps` must be a positive integer or None"),
    (dict(label_smoothing_factor=0.1), r"`label_smoothing_factor` is not used by the ChainFlow loss"),
    (dict(neftune_noise_alpha=5.0), r"`neftune_noise_alpha` adds noise to a language model's input embeddings"),
])
def test_bad_training_arguments_are_refused(tmp_path, kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        ChainFlowTrainingArguments(output_dir=str(tmp_path), **kwargs)


def test_evaluation_is_seeded_weighted_per_window_and_leaves_training_alone(target, windows, tmp_path):
    trainer = ChainFlowTrainer(model=new_drafter(target), args=make_args(tmp_path / "a"), train_dataset=windows)
    keys = ["eval_loss", *(f"eval_loss_{t}" for t in TERMS)]
    first = trainer.evaluate(eval_dataset=windows[:20])  # batches of 8, 8 and 4
    trainer.predict(windows[:8])  # its terms must not leak into the next evaluation
    again = trainer.evaluate(eval_dataset=windows[:20])
    assert [first[k] for k in keys] == [again[k] for k in keys]  # the same weights give the same eval loss
    weights = trainer.args.loss_weights  # the terms are averaged per window, like eval_loss
    assert first["eval_loss"] == pytest.approx(sum(weights[t] * first[f"eval_loss_{t}"] for t in TERMS), abs=2e-5)
    both = trainer.evaluate(eval_dataset={"a": windows[:8], "b": windows[8:16]})
    assert {"eval_a_loss", "eval_b_loss", "eval_a_loss_flow", "eval_b_loss_flow"} <= set(both)
    assert "eval_loss_flow" not in both

    plain = new_drafter(target)
    ChainFlowTrainer(model=plain, args=make_args(tmp_path / "p"), train_dataset=windows).train()
    evaluated = new_drafter(target)
    ChainFlowTrainer(model=evaluated, args=make_args(tmp_path / "e", eval_strategy="steps", eval_steps=2),
                     train_dataset=windows, eval_dataset=windows[:8]).train()
    for k, v in plain.state_dict().items():
        assert torch.equal(evaluated.state_dict()[k], v), k


@pytest.mark.parametrize("mode", ["all", "non_padding"])
def test_tokens_seen_counts_context_positions_not_floats(target, windows, tmp_path, mode):
    epoch = windows[:32]  # 4 steps of 8: every window once
    trainer = ChainFlowTrainer(model=new_drafter(target), args=make_args(tmp_path, include_num_input_tokens_seen=mode),
                               train_dataset=epoch)
    trainer.train()
    masks = torch.stack([w["context_mask"] for w in epoch])  # (32, C)
    expected = masks.numel() if mode == "all" else int(masks.sum())
    assert 0 < int(masks.sum()) < masks.numel()  # some windows are padded, so the two modes differ
    assert trainer.state.num_input_tokens_seen == expected
