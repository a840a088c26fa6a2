"""Training a ChainFlow drafter with `transformers.Trainer` (SPEC.md, "Training objective").

`ChainFlowTrainer` only wires things: the loss is `hf_chainflow.training.losses.chainflow_loss`, the model is a bound
`ChainFlowDrafter` (or a `peft` model around one), the data are window dicts (`hf_chainflow.training.data`).  What it adds to
a plain `Trainer`:

- each loss term is logged separately (`loss_flow`, `loss_hid`, ..., averaged over the logging interval);
- optimiser parameter groups give the VAE `vae_lr_ratio` x the learning rate (paper: 1/20);
- an optional VAE pre-training stage (`vae_pretrain_steps`): only `L_rec` trains the VAE, on the cached states,
  before the joint training starts (a fresh run only; a resumed run skips it, it happened before the checkpoint);
- the target stays outside the model: the drafter borrows its `lm_head`/embeddings through `bind_target`, so they
  are neither optimised nor saved (checkpoints hold `config.json`, `model.safetensors`, `generation_config.json`);
- complete-only checkpoints (`hf_chainflow.training.checkpointing.CompleteCheckpointsMixin`, which every trainer inherits): a
  checkpoint counts only once its marker is written, after all its files, and resuming takes only such ones.

Language adaptation (warm start at a lower learning rate, replay of earlier-language rows): `warm_start`,
`adaptation_arguments`, `ReplayMixDataset`.
"""

from __future__ import annotations

import logging
import math
import warnings
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np
import torch
from torch.utils.data import Dataset
from tqdm.auto import tqdm
from transformers import PreTrainedModel, Trainer, TrainingArguments, default_data_collator

from hf_chainflow.training.data import check_windows_fit
from hf_chainflow.training.checkpointing import CompleteCheckpointsMixin
from hf_chainflow.training.losses import DEFAULT_LOSS_WEIGHTS, EXTRA_LOSS_WEIGHTS, chainflow_loss, reconstruction_loss
from hf_chainflow.models.chainflow.modeling_chainflow import ChainFlowDrafter

logger = logging.getLogger(__name__)

# The drafter's training-forward inputs; other keys of a batch (e.g. `domain`) are not passed to it.
FORWARD_KEYS = ("context_states", "target_states", "target_tokens", "prev_tokens", "context_mask", "target_mask")


@dataclass
class ChainFlowTrainingArguments(TrainingArguments):
    """`TrainingArguments` with ChainFlow's defaults (AdamW, constant lr 5e-4) and loss hyper-parameters."""

    learning_rate: float = field(default=5e-4, metadata={"help": "AdamW learning rate of the drafter (paper: 5e-4)."})
    lr_scheduler_type: str = field(default="constant", metadata={"help": "Learning-rate schedule (paper: constant)."})
    remove_unused_columns: bool = field(
        default=False, metadata={"help": "Keep every column: windows are dicts of tensors read by the trainer."})
    prediction_loss_only: bool = field(
        default=True, metadata={"help": "Evaluation returns the loss (and its logged terms), not the logits."})
    loss_flow_weight: float = field(default=DEFAULT_LOSS_WEIGHTS["flow"],
                                    metadata={"help": "Weight of L_flow, the flow-matching MSE."})
    loss_hid_weight: float = field(default=DEFAULT_LOSS_WEIGHTS["hid"],
                                   metadata={"help": "Weight of L_hid, the relative squared error of the states."})
    loss_ce_weight: float = field(default=DEFAULT_LOSS_WEIGHTS["ce"],
                                  metadata={"help": "Weight of L_CE, corrected + 0.2 x marginal cross-entropy."})
    loss_cov_weight: float = field(default=DEFAULT_LOSS_WEIGHTS["cov"],
                                   metadata={"help": "Weight of L_cov, the top-b coverage hinge."})
    loss_acc_weight: float = field(default=DEFAULT_LOSS_WEIGHTS["acc"],
                                   metadata={"help": "Weight of L_acc, the expected-acceptance surrogate."})
    loss_rec_weight: float = field(default=DEFAULT_LOSS_WEIGHTS["rec"],
                                   metadata={"help": "Weight of L_rec, VAE reconstruction + beta x KL."})
    loss_kd_weight: float = field(
        default=EXTRA_LOSS_WEIGHTS["kd"],
        metadata={"help": "Weight of L_kd, the KL from the target's next-token distribution (its lm_head over the "
                          "cached true states) to the drafter's; not in the paper, 0 (off) by default."})
    kd_temperature: float = field(default=1.0, metadata={"help": "Softmax temperature of both sides of L_kd."})
    acceptance_gamma: float = field(default=0.8, metadata={"help": "Discount gamma per draft position in L_acc."})
    coverage_top_b: int = field(default=8, metadata={"help": "b: L_cov pushes the true token into the top b logits."})
    coverage_margin: float = field(default=1.0, metadata={"help": "Logit margin of the L_cov hinge."})
    marginal_ce_weight: float = field(default=0.2,
                                      metadata={"help": "Weight of the marginal-logit cross-entropy inside L_CE."})
    kl_beta: float = field(default=3e-5, metadata={"help": "beta: weight of the VAE's KL term inside L_rec."})
    train_flow_steps: int | None = field(
        default=None, metadata={"help": "N: Euler steps of the trajectory integrated in training (paper: 2); "
                                        "None keeps the drafter config's `train_flow_steps`."})
    vae_lr_ratio: float = field(default=1 / 20,
                                metadata={"help": "VAE learning rate as a fraction of `learning_rate` (paper: 1/20)."})
    vae_pretrain_steps: int = field(
        default=0, metadata={"help": "Steps of VAE-only pre-training (L_rec) on the cached states before joint "
                                     "training; 0 skips it."})
    vae_pretrain_learning_rate: float | None = field(
        default=None, metadata={"help": "Learning rate of the VAE pre-training stage; None uses `learning_rate`."})

    def __post_init__(self):
        super().__post_init__()
        for name in ("loss_flow_weight", "loss_hid_weight", "loss_ce_weight", "loss_cov_weight", "loss_acc_weight",
                     "loss_rec_weight", "loss_kd_weight", "kl_beta", "marginal_ce_weight", "coverage_margin",
                     "kd_temperature", "acceptance_gamma", "vae_lr_ratio"):
            value = getattr(self, name)
            if not _is_number(value) or not math.isfinite(value):
                raise ValueError(f"`{name}` must be a finite number, got {value!r}.")
            if value < 0:
                raise ValueError(f"`{name}` must be >= 0, got {value!r}.")
        if not _is_int(self.vae_pretrain_steps) or self.vae_pretrain_steps < 0:
            raise ValueError(f"`vae_pretrain_steps` must be an integer >= 0, got {self.vae_pretrain_steps!r}.")
        lr = self.vae_pretrain_learning_rate
        if lr is not None and (not _is_number(lr) or not math.isfinite(lr) or lr <= 0):
            raise ValueError(f"`vae_pretrain_learning_rate` must be a positive number, or None to use "
                             f"`learning_rate`, got {lr!r}.")
        # Trainer options the ChainFlow loss does not use: refused rather than silently ignored.
        if self.label_smoothing_factor != 0:
            raise ValueError(f"`label_smoothing_factor` is not used by the ChainFlow loss (its cross-entropy is over "
                             f"the shortlist), got {self.label_smoothing_factor!r}; leave it at 0.")
        if self.neftune_noise_alpha is not None:
            raise ValueError(f"`neftune_noise_alpha` adds noise to a language model's input embeddings; a drafter "
                             f"reads the target's hidden states instead, got {self.neftune_noise_alpha!r}; leave it "
                             f"None.")
        if not self.kd_temperature > 0:
            raise ValueError(f"`kd_temperature` must be > 0, got {self.kd_temperature!r}.")
        if not 0 < self.acceptance_gamma <= 1:
            raise ValueError(f"`acceptance_gamma` must lie in (0, 1], got {self.acceptance_gamma!r}.")
        if not _is_int(self.coverage_top_b) or self.coverage_top_b < 1:
            raise ValueError(f"`coverage_top_b` must be a positive integer, got {self.coverage_top_b!r}.")
        if not self.vae_lr_ratio > 0:
            raise ValueError(f"`vae_lr_ratio` must be > 0 (freeze the VAE instead of a zero rate), got "
                             f"{self.vae_lr_ratio!r}.")
        if self.train_flow_steps is not None and (not _is_int(self.train_flow_steps) or self.train_flow_steps < 1):
            raise ValueError(f"`train_flow_steps` must be a positive integer or None, got {self.train_flow_steps!r}.")

    @property
    def loss_weights(self) -> dict[str, float]:
        """The term weights by the names `chainflow_loss` uses (the SPEC's six and `kd`)."""
        return {name: getattr(self, f"loss_{name}_weight") for name in {**DEFAULT_LOSS_WEIGHTS, **EXTRA_LOSS_WEIGHTS}}


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def unwrap_drafter(model) -> ChainFlowDrafter:
    """The `ChainFlowDrafter` inside `model` (itself, or the base model of a `peft` model)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if not isinstance(base, ChainFlowDrafter):
        raise ValueError(f"`model` must be a ChainFlowDrafter (or a peft model around one), got {type(base).__name__}.")
    return base


def vae_reconstruction_loss(drafter: ChainFlowDrafter, batch: dict, kl_beta: float = 3e-5) -> torch.Tensor:
    """`L_rec` alone, as the training forward computes it (context and target windows encoded separately, a sampled
    latent decoded), without running the flow or the heads.  For the VAE pre-training stage."""
    if drafter.vae is None:
        raise ValueError("This drafter has no VAE (`use_vae=False`): there is nothing to pre-train.")
    recon, targets, masks, kls = [], [], [], []
    for key in ("context", "target"):
        states = drafter.normalize(batch[f"{key}_states"].to(drafter.dtype))  # (B, T, D), standardised
        mask = batch.get(f"{key}_mask")
        mask = torch.ones(states.shape[:2], dtype=torch.bool, device=states.device) if mask is None else mask.bool()
        mean, logvar = drafter.vae.encode(states, mask)  # (B, T, Z)
        sample = mean + torch.randn_like(mean) * (0.5 * logvar).exp()
        recon.append(drafter.vae.decode(sample))
        targets.append(states)
        masks.append(mask)
        kls.append(0.5 * (mean.pow(2) + logvar.exp() - 1.0 - logvar).mean(-1))  # (B, T)
    mask = torch.cat(masks, 1)
    kl = (torch.cat(kls, 1) * mask).sum() / mask.sum().clamp(min=1)
    return reconstruction_loss(torch.cat(recon, 1), torch.cat(targets, 1), mask, kl, kl_beta)


def _is_vae_parameter(name: str) -> bool:
    return ".vae." in f".{name}"


class ChainFlowTrainer(CompleteCheckpointsMixin, Trainer):
    """`Trainer` for a `ChainFlowDrafter` bound to its target.

    Args:
        model: a `ChainFlowDrafter` (or a `peft` model around one).
        args: `ChainFlowTrainingArguments` (defaults: output under `chainflow-drafter/`).
        target: optional; when given, the drafter is bound to it here (`drafter.bind_target(target)`).
            Otherwise the drafter must already be bound. A construction that raises leaves the drafter unchanged
            (unbound, `config.train_flow_steps` as it was).
        Other arguments are `Trainer`'s; `data_collator` defaults to stacking the window tensors.
    """

    def __init__(self, model=None, args: ChainFlowTrainingArguments | None = None, data_collator=None,
                 train_dataset=None, eval_dataset=None, *, target: PreTrainedModel | None = None, **kwargs):
        if kwargs.get("model_init") is not None:
            raise ValueError(
                "`model_init` is not supported by ChainFlowTrainer: the drafter it trains is bound to its target "
                "(`bind_target`) before training, which a model built by `model_init` (hyperparameter search) is "
                "not. Pass the drafter as `model` (with `target=`), one trainer per setting."
            )
        if args is None:
            args = ChainFlowTrainingArguments(output_dir="chainflow-drafter")
        if not isinstance(args, ChainFlowTrainingArguments):
            raise ValueError(f"`args` must be ChainFlowTrainingArguments (it carries the loss weights), got "
                             f"{type(args).__name__}.")
        drafter = unwrap_drafter(model)
        if target is None:
            drafter._require_bound()
        evals = eval_dataset.values() if isinstance(eval_dataset, dict) else [eval_dataset]
        for dataset in (train_dataset, *evals):  # windows cut for another drafter would train it on the wrong thing
            check_windows_fit(drafter.config, dataset)
        # A construction that raises (here or in `Trainer.__init__`) leaves the drafter as it was given.
        configured_steps = drafter.config.train_flow_steps
        before = (drafter._bound, getattr(drafter, "_draft_head_cache", None), drafter.shortlist_ids,
                  configured_steps)
        try:
            if target is not None:
                drafter.bind_target(target)
            if args.train_flow_steps is not None:
                drafter.config.train_flow_steps = args.train_flow_steps
            super().__init__(model=model, args=args, data_collator=data_collator or default_data_collator,
                             train_dataset=train_dataset, eval_dataset=eval_dataset, **kwargs)
            head = drafter._bound["lm_head"].weight
            if head.device != drafter.device:
                raise ValueError(f"The bound target's lm_head is on {head.device} but the drafter trains on "
                                 f"{drafter.device}; move the target to the training device (`target.to(...)`).")
        except BaseException:
            drafter._bound, drafter._draft_head_cache, drafter.shortlist_ids, drafter.config.train_flow_steps = before
            raise
        if drafter.config.train_flow_steps != configured_steps:
            # The override is saved with the drafter and changes what its loss trains: say so once, here.
            steps = drafter.config.train_flow_steps
            logger.warning(f"`train_flow_steps={steps}` overrides the drafter config's {configured_steps}: the loss "
                           f"now scores a {steps}-step trajectory and the saved config records it; the drafter still "
                           f"serves `num_flow_steps={drafter.config.num_flow_steps}`.")
        # `compute_loss` returns a per-batch mean: let the Trainer divide it for gradient accumulation, and do not
        # pass `num_items_in_batch` into the drafter's forward.
        self.model_accepts_loss_kwargs = False
        self.loss_is_scaled_for_ga = False
        if not self.label_names:  # evaluation computes the loss only for batches holding the "labels"
            self.label_names = ["target_tokens"]
        self._terms: dict[str, dict[str, list[torch.Tensor]]] = {"train": defaultdict(list), "eval": defaultdict(list)}
        self.vae_pretrain_losses: list[float] | None = None  # set by `pretrain_vae`

    @property
    def drafter(self) -> ChainFlowDrafter:
        return unwrap_drafter(self.accelerator.unwrap_model(self.model))

    # ------------------------------------------------------------------ loss and logging
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        a = self.args
        outputs = model(**{k: v for k, v in inputs.items() if k in FORWARD_KEYS},
                        return_teacher_logits=a.loss_kd_weight != 0)
        total, terms = chainflow_loss(outputs, a.loss_weights, gamma=a.acceptance_gamma, top_b=a.coverage_top_b,
                                      coverage_margin=a.coverage_margin, kl_beta=a.kl_beta,
                                      marginal_weight=a.marginal_ce_weight, kd_temperature=a.kd_temperature)
        mode = "train" if model.training else "eval"
        size = float(inputs["target_tokens"].shape[0])  # evaluation weights each batch by its windows, as its loss
        for name, value in terms.items():
            self._terms[mode][name].append(torch.stack([value.detach().float(), value.new_tensor(size).float()]))
        return (total, outputs) if return_outputs else total

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Adds the mean of each loss term since the last log: `loss_<term>` (training, the mean over steps like
        `loss`), `<prefix>_loss_<term>` after an evaluation logged as `<prefix>_loss` (the mean over windows, like
        `eval_loss`; `eval_<name>_loss_<term>` for each dataset of a dict `eval_dataset`)."""
        eval_key = next((k for k in logs if k.startswith("eval") and k.endswith("_loss")), None)
        mode = "eval" if eval_key is not None else "train" if "loss" in logs else None
        if mode is not None and self._terms[mode]:
            prefix = f"{eval_key}_" if mode == "eval" else "loss_"
            for name, values in self._terms[mode].items():
                value, size = torch.stack(values).unbind(-1)  # (batches,)
                weight = size if mode == "eval" else torch.ones_like(size)
                total = self.accelerator.gather(torch.stack([(value * weight).sum(), weight.sum()])[None])  # (P, 2)
                logs[prefix + name] = round((total[:, 0].sum() / total[:, 1].sum()).item(), 6)
            self._terms[mode].clear()
        super().log(logs, start_time)

    def _track_num_input_tokens(self, inputs):
        """`include_num_input_tokens_seen` counts the windows' context positions, one per target token whose state
        the drafter reads: `"all"` counts every position of `context_mask (B, C)`, padding included, `"non_padding"`
        only its True entries. (`Trainer` would count `main_input_name`'s elements: `context_states` holds `D`
        floats per position.)"""
        mode = self.args.include_num_input_tokens_seen
        if mode == "no" or "context_mask" not in inputs:
            return super()._track_num_input_tokens(inputs)
        mask = inputs["context_mask"]  # (B, C)
        seen = mask.sum() if mode == "non_padding" else torch.tensor(mask.numel())
        seen = torch.as_tensor(seen, device=self.args.device, dtype=torch.int64)
        self.state.num_input_tokens_seen += self.accelerator.gather(seen).sum().item()

    def evaluation_loop(self, *args, **kwargs):
        """`Trainer.evaluation_loop` with its random draws (flow time, VAE noise) seeded from `args.seed`: the same
        weights give the same `eval_loss`, and evaluating during training leaves the training's random stream as it
        was. Loss terms left over from an earlier `predict` are dropped."""
        self._terms["eval"].clear()
        devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(self.args.seed)
            return super().evaluation_loop(*args, **kwargs)

    # ------------------------------------------------------------------ optimiser
    def create_optimizer(self, model=None):
        """AdamW (or `args.optim`) with four groups: drafter/VAE x weight decay/no decay; VAE lr x `vae_lr_ratio`."""
        if self.optimizer is not None:
            return self.optimizer
        opt_model = self.model if model is None else model
        decay = set(self.get_decay_parameter_names(opt_model))
        lr = self.args.learning_rate
        groups = {key: None for key in ("drafter", "drafter_no_decay", "vae", "vae_no_decay")}  # drafter first: the
        # Trainer logs the first group's learning rate
        for name, param in opt_model.named_parameters():
            if not param.requires_grad:
                continue
            vae = _is_vae_parameter(name)
            key = ("vae" if vae else "drafter") + ("" if name in decay else "_no_decay")
            if groups[key] is None:
                groups[key] = {"params": [], "name": key, "lr": lr * (self.args.vae_lr_ratio if vae else 1),
                               "weight_decay": self.args.weight_decay if name in decay else 0.0}
            groups[key]["params"].append(param)
        if self.optimizer_cls_and_kwargs is not None:
            optimizer_cls, optimizer_kwargs = self.optimizer_cls_and_kwargs
        else:
            optimizer_cls, optimizer_kwargs = self.get_optimizer_cls_and_kwargs(self.args, opt_model)
        self.optimizer = optimizer_cls([g for g in groups.values() if g is not None], **optimizer_kwargs)
        return self.optimizer

    # ------------------------------------------------------------------ VAE pre-training
    def pretrain_vae(self, num_steps: int | None = None, learning_rate: float | None = None) -> list[float]:
        """Train only the VAE on `L_rec` for `num_steps` batches of the training set (repeated), with its own AdamW
        (weight decay except on norms and biases, gradients clipped to `args.max_grad_norm`, a constant rate).

        Defaults: `args.vae_pretrain_steps` steps at `args.vae_pretrain_learning_rate` (else `args.learning_rate`).
        With several processes the VAE gradients are averaged across them.  Returns the per-step losses.
        """
        steps = self.args.vae_pretrain_steps if num_steps is None else num_steps
        if not isinstance(steps, int) or steps < 1:
            raise ValueError(f"`num_steps` must be a positive integer, got {steps!r}.")
        drafter = self.drafter
        if drafter.vae is None:
            raise ValueError("`vae_pretrain_steps` > 0 but this drafter has no VAE (`use_vae=False`); set it to 0.")
        params = [p for p in drafter.vae.parameters() if p.requires_grad]
        if not params:
            raise ValueError("The drafter's VAE is frozen (no trainable parameter); set `vae_pretrain_steps=0`.")
        lr = next(v for v in (learning_rate, self.args.vae_pretrain_learning_rate, self.args.learning_rate)
                  if v is not None)
        a = self.args
        decay = set(self.get_decay_parameter_names(drafter.vae))  # as the joint stage: no decay on norms and biases
        named = [(n, p) for n, p in drafter.vae.named_parameters() if p.requires_grad]
        groups = [{"params": [p for n, p in named if n in decay], "weight_decay": a.weight_decay},
                  {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0}]
        optimizer = torch.optim.AdamW([g for g in groups if g["params"]], lr=lr, betas=(a.adam_beta1, a.adam_beta2),
                                      eps=a.adam_epsilon)
        # `logging_steps` below 1 is a fraction of the steps, as in `TrainingArguments`
        every = max(1, math.ceil(a.logging_steps * steps) if a.logging_steps < 1 else int(a.logging_steps))
        batches = self._endless_batches()
        was_training = drafter.training
        drafter.train()
        losses = []
        # The Trainer's console callback prints only once `train()` has opened its bar: this stage prints its own logs
        # on its bar (with `disable_tqdm=True`, transformers' PrinterCallback prints them).
        bar = tqdm(range(steps), desc="VAE pre-training", disable=a.disable_tqdm or not self.is_world_process_zero())
        try:
            for step in bar:
                batch = self._prepare_inputs(next(batches))
                loss = vae_reconstruction_loss(drafter, batch, a.kl_beta)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                if self.accelerator.num_processes > 1:
                    for p in params:
                        if p.grad is not None:
                            p.grad = self.accelerator.reduce(p.grad, "mean")
                if a.max_grad_norm:
                    torch.nn.utils.clip_grad_norm_(params, a.max_grad_norm)
                optimizer.step()
                losses.append(loss.item())
                if (step + 1) % every == 0:
                    logs = {"vae_pretrain_loss_rec": float(np.mean(losses[-every:])), "vae_pretrain_step": step + 1}
                    super().log(logs)
                    if not bar.disable:
                        bar.write(str({"vae_pretrain_loss_rec": f"{logs['vae_pretrain_loss_rec']:.4g}",
                                       "vae_pretrain_step": step + 1}))
        finally:
            bar.close()
            drafter.train(was_training)
        self.vae_pretrain_losses = losses  # (the Trainer's `state.log_history` starts afresh in `train`)
        return losses

    def _endless_batches(self):
        """The training batches, epoch after epoch (a fresh pass each time, so no epoch is held in memory)."""
        while True:
            empty = True
            for batch in self.get_train_dataloader():
                empty = False
                yield batch
            if empty:
                raise ValueError("The training dataset holds no batch: there is nothing to pre-train the VAE on.")

    def train(self, resume_from_checkpoint=None, trial=None, **kwargs):
        """`Trainer.train`, preceded on a fresh run by `pretrain_vae()` when `args.vae_pretrain_steps > 0` (unless
        `pretrain_vae` already ran on this trainer)."""
        if self.args.vae_pretrain_steps > 0 and not resume_from_checkpoint and self.vae_pretrain_losses is None:
            self.pretrain_vae()
        return super().train(resume_from_checkpoint=resume_from_checkpoint, trial=trial, **kwargs)


# ----------------------------------------------------------------------------------------------------------------
# Language adaptation
# ----------------------------------------------------------------------------------------------------------------
ADAPTATION_LR_RANGE = (1e-4, 1.5e-4)


def warm_start(drafter_path, target: PreTrainedModel, **kwargs) -> ChainFlowDrafter:
    """Load a trained drafter to continue training it (e.g. on a new language), bound to `target`."""
    return ChainFlowDrafter.from_pretrained(drafter_path, target=target, **kwargs)


def adaptation_arguments(output_dir: str, *, learning_rate: float = 1e-4, num_train_epochs: float = 2.0,
                         **kwargs) -> ChainFlowTrainingArguments:
    """Training arguments for adapting a warm-started drafter to a new language (paper: lr 1e-4 to 1.5e-4,
    2 to 6 epochs, same objective).  A learning rate outside that range is allowed, with a warning."""
    lo, hi = ADAPTATION_LR_RANGE
    if not lo <= learning_rate <= hi:
        warnings.warn(f"Language adaptation used lr {lo:g}..{hi:g} in the paper; got {learning_rate:g}.",
                      stacklevel=2)
    return ChainFlowTrainingArguments(output_dir=output_dir, learning_rate=learning_rate,
                                      num_train_epochs=num_train_epochs, **kwargs)


class ReplayMixDataset(Dataset):
    """`new` plus a seeded sample of rows of `old` (earlier languages) making up `replay_fraction` of the mix.

    Length `len(new) + round(len(new) * f / (1 - f))`: rows `[0, len(new))` are `new` in order, the rest are
    `old` rows drawn without replacement (with replacement only when `old` is too small).  The Trainer's sampler
    shuffles the mix.  Paper: ~20 % replay.
    """

    def __init__(self, new: Dataset, old: Dataset, replay_fraction: float = 0.2, seed: int = 0):
        if not 0 <= replay_fraction < 1:
            raise ValueError(f"`replay_fraction` must lie in [0, 1), got {replay_fraction!r}.")
        if len(new) == 0:
            raise ValueError("`new` is empty: there is nothing to adapt on.")
        if replay_fraction > 0 and len(old) == 0:
            raise ValueError("`old` is empty but `replay_fraction` > 0; pass earlier-language rows or 0.")
        self.new, self.old, self.replay_fraction = new, old, replay_fraction
        n_old = round(len(new) * replay_fraction / (1 - replay_fraction))
        rng = np.random.default_rng(seed)
        self.old_rows = rng.choice(len(old), size=n_old, replace=n_old > len(old)) if n_old else np.zeros(0, int)

    def __len__(self) -> int:
        return len(self.new) + len(self.old_rows)

    def __getitem__(self, i: int):
        if not -len(self) <= i < len(self):
            raise IndexError(f"index {i} out of range for a ReplayMixDataset of length {len(self)}")
        i = i % len(self)
        return self.new[i] if i < len(self.new) else self.old[int(self.old_rows[i - len(self.new)])]

    def is_replay(self, i: int) -> bool:
        return i >= len(self.new)


__all__ = [
    "ChainFlowTrainer",
    "ChainFlowTrainingArguments",
    "ReplayMixDataset",
    "adaptation_arguments",
    "unwrap_drafter",
    "vae_reconstruction_loss",
    "warm_start",
]
