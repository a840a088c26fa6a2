"""Training a ChainFlow drafter with `transformers.Trainer` (SPEC.md, "Training objective").

`ChainFlowTrainer` only wires things: the loss is `hf_chainflow.training.losses.chainflow_loss`, the model is a bound
`ChainFlowDrafter` (or a `peft` model around one), the data are window dicts (`hf_chainflow.training.windows`), the
arguments `ChainFlowTrainingArguments` (`hf_chainflow.training.arguments`).  What it adds to a plain `Trainer`:

- each loss term is logged separately (`loss_flow`, `loss_hid`, ..., averaged over the logging interval);
- optimiser parameter groups give the VAE `vae_lr_ratio` x the learning rate (paper: 1/20);
- an optional VAE pre-training stage (`vae_pretrain_steps`, `hf_chainflow.training.vae_pretraining`): only `L_rec`
  trains the VAE, on the cached states, before the joint training starts (a fresh run only; a resumed run skips it,
  it happened before the checkpoint);
- the target stays outside the model: the drafter borrows its `lm_head`/embeddings through `bind_target`, so they
  are neither optimised nor saved (checkpoints hold `config.json`, `model.safetensors`, `generation_config.json`);
- complete-only checkpoints (`hf_chainflow.training.checkpointing.CompleteCheckpointsMixin`, which every trainer inherits): a
  checkpoint counts only once its marker is written, after all its files, and resuming takes only such ones.

Language adaptation (warm start at a lower learning rate, replay of earlier-language rows):
`hf_chainflow.training.adaptation` (`warm_start`, `adaptation_arguments`), `hf_chainflow.training.replay`
(`ReplayMixDataset`).
"""

from __future__ import annotations

import logging
from collections import defaultdict

import torch
from transformers import PreTrainedModel, Trainer, default_data_collator

from hf_chainflow.models.chainflow.modeling_chainflow import ChainFlowDrafter
from hf_chainflow.training.arguments import ChainFlowTrainingArguments
from hf_chainflow.training.checkpointing import CompleteCheckpointsMixin
from hf_chainflow.training.losses import chainflow_loss
from hf_chainflow.training.vae_pretraining import pretrain_vae
from hf_chainflow.training.windows import check_windows_fit

logger = logging.getLogger(__name__)

# The drafter's training-forward inputs; other keys of a batch (e.g. `domain`) are not passed to it.
FORWARD_KEYS = ("context_states", "target_states", "target_tokens", "prev_tokens", "context_mask", "target_mask")


def unwrap_drafter(model) -> ChainFlowDrafter:
    """The `ChainFlowDrafter` inside `model` (itself, or the base model of a `peft` model)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if not isinstance(base, ChainFlowDrafter):
        raise ValueError(f"`model` must be a ChainFlowDrafter (or a peft model around one), got {type(base).__name__}.")
    return base


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
        (`hf_chainflow.training.vae_pretraining.pretrain_vae`). Defaults: `args.vae_pretrain_steps` steps at
        `args.vae_pretrain_learning_rate` (else `args.learning_rate`). Returns the per-step losses (also kept as
        `vae_pretrain_losses`)."""
        return pretrain_vae(self, num_steps, learning_rate)

    def train(self, resume_from_checkpoint=None, trial=None, **kwargs):
        """`Trainer.train`, preceded on a fresh run by `pretrain_vae()` when `args.vae_pretrain_steps > 0` (unless
        `pretrain_vae` already ran on this trainer)."""
        if self.args.vae_pretrain_steps > 0 and not resume_from_checkpoint and self.vae_pretrain_losses is None:
            self.pretrain_vae()
        return super().train(resume_from_checkpoint=resume_from_checkpoint, trial=trial, **kwargs)


__all__ = ["ChainFlowTrainer", "FORWARD_KEYS", "unwrap_drafter"]
