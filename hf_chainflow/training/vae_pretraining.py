"""The VAE pre-training stage of ChainFlow training (`vae_pretrain_steps`): before the joint training, only the
VAE trains, on `L_rec` over the cached states (`vae_reconstruction_loss`), with its own optimiser
(`pretrain_vae`, which `ChainFlowTrainer.pretrain_vae` and, on a fresh run, `ChainFlowTrainer.train` call)."""

from __future__ import annotations

import math

import numpy as np
import torch
from tqdm.auto import tqdm
from transformers import Trainer

from hf_chainflow.checks import check_positive_int
from hf_chainflow.models.chainflow.layers_chainflow import vae_kl, vae_sample
from hf_chainflow.models.chainflow.modeling_chainflow import ChainFlowDrafter
from hf_chainflow.training.losses import reconstruction_loss

__all__ = ["endless_batches", "pretrain_vae", "vae_reconstruction_loss"]


def vae_reconstruction_loss(drafter: ChainFlowDrafter, batch: dict, kl_beta: float = 3e-5) -> torch.Tensor:
    """`L_rec` alone, as the training forward computes it (context and target windows encoded separately, a sampled
    latent decoded), without running the flow or the heads.  For the VAE pre-training stage."""
    if drafter.vae is None:
        raise ValueError("This drafter has no VAE (`use_vae=False`): there is nothing to pre-train.")
    recon, targets, masks, means, logvars = [], [], [], [], []
    for key in ("context", "target"):
        states = drafter.normalize(batch[f"{key}_states"].to(drafter.dtype))  # (B, T, D), standardised
        mask = batch.get(f"{key}_mask")
        mask = torch.ones(states.shape[:2], dtype=torch.bool, device=states.device) if mask is None else mask.bool()
        mean, logvar = drafter.vae.encode(states, mask)  # (B, T, Z)
        recon.append(drafter.vae.decode(vae_sample(mean, logvar)))
        targets.append(states)
        masks.append(mask)
        means.append(mean)
        logvars.append(logvar)
    mask = torch.cat(masks, 1)
    kl = vae_kl(torch.cat(means, 1), torch.cat(logvars, 1), mask)  # as the training forward's
    return reconstruction_loss(torch.cat(recon, 1), torch.cat(targets, 1), mask, kl, kl_beta)


def pretrain_vae(trainer, num_steps: int | None = None, learning_rate: float | None = None) -> list[float]:
    """Train only the VAE of `trainer`'s drafter (a `ChainFlowTrainer`) on `L_rec` for `num_steps` batches of its
    training set (repeated), with its own AdamW (weight decay except on norms and biases, gradients clipped to
    `args.max_grad_norm`, a constant rate).

    Defaults: `args.vae_pretrain_steps` steps at `args.vae_pretrain_learning_rate` (else `args.learning_rate`).
    With several processes the VAE gradients are averaged across them.  Returns the per-step losses.
    """
    steps = trainer.args.vae_pretrain_steps if num_steps is None else num_steps
    check_positive_int("num_steps", steps)
    drafter = trainer.drafter
    if drafter.vae is None:
        raise ValueError("`vae_pretrain_steps` > 0 but this drafter has no VAE (`use_vae=False`); set it to 0.")
    params = [p for p in drafter.vae.parameters() if p.requires_grad]
    if not params:
        raise ValueError("The drafter's VAE is frozen (no trainable parameter); set `vae_pretrain_steps=0`.")
    lr = next(v for v in (learning_rate, trainer.args.vae_pretrain_learning_rate, trainer.args.learning_rate)
              if v is not None)
    a = trainer.args
    decay = set(trainer.get_decay_parameter_names(drafter.vae))  # as the joint stage: no decay on norms and biases
    named = [(n, p) for n, p in drafter.vae.named_parameters() if p.requires_grad]
    groups = [{"params": [p for n, p in named if n in decay], "weight_decay": a.weight_decay},
              {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW([g for g in groups if g["params"]], lr=lr, betas=(a.adam_beta1, a.adam_beta2),
                                  eps=a.adam_epsilon)
    # `logging_steps` below 1 is a fraction of the steps, as in `TrainingArguments`
    every = max(1, math.ceil(a.logging_steps * steps) if a.logging_steps < 1 else int(a.logging_steps))
    batches = endless_batches(trainer)
    was_training = drafter.training
    drafter.train()
    losses = []
    # The Trainer's console callback prints only once `train()` has opened its bar: this stage prints its own logs
    # on its bar (with `disable_tqdm=True`, transformers' PrinterCallback prints them).
    bar = tqdm(range(steps), desc="VAE pre-training", disable=a.disable_tqdm or not trainer.is_world_process_zero())
    try:
        for step in bar:
            batch = trainer._prepare_inputs(next(batches))
            loss = vae_reconstruction_loss(drafter, batch, a.kl_beta)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if trainer.accelerator.num_processes > 1:
                for p in params:
                    if p.grad is not None:
                        p.grad = trainer.accelerator.reduce(p.grad, "mean")
            if a.max_grad_norm:
                torch.nn.utils.clip_grad_norm_(params, a.max_grad_norm)
            optimizer.step()
            losses.append(loss.item())
            if (step + 1) % every == 0:
                logs = {"vae_pretrain_loss_rec": float(np.mean(losses[-every:])), "vae_pretrain_step": step + 1}
                Trainer.log(trainer, logs)  # the plain Trainer's: no loss terms of the joint stage
                if not bar.disable:
                    bar.write(str({"vae_pretrain_loss_rec": f"{logs['vae_pretrain_loss_rec']:.4g}",
                                   "vae_pretrain_step": step + 1}))
    finally:
        bar.close()
        drafter.train(was_training)
    trainer.vae_pretrain_losses = losses  # (the Trainer's `state.log_history` starts afresh in `train`)
    return losses

def endless_batches(trainer):
    """`trainer`'s training batches, epoch after epoch (a fresh pass each time, so no epoch is held in memory)."""
    while True:
        empty = True
        for batch in trainer.get_train_dataloader():
            empty = False
            yield batch
        if empty:
            raise ValueError("The training dataset holds no batch: there is nothing to pre-train the VAE on.")
