"""`ChainFlowTrainingArguments`: `transformers.TrainingArguments` with ChainFlow's defaults and the loss's
hyper-parameters, each checked when the arguments are made."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from transformers import TrainingArguments

from hf_chainflow.checks import check_positive_int, is_int, is_number
from hf_chainflow.training.losses import DEFAULT_LOSS_WEIGHTS, EXTRA_LOSS_WEIGHTS

__all__ = ["ChainFlowTrainingArguments", "check_train_flow_steps"]


def check_train_flow_steps(value, name: str = "train_flow_steps") -> None:
    """The one check of a training-time `train_flow_steps` override (`ChainFlowTrainingArguments`,
    `hf-chainflow train --train-flow-steps` before anything loads): None (keep the drafter config's) or a positive
    integer, the Euler steps of the trajectory the loss integrates."""
    check_positive_int(name, value, optional=True, none="the drafter config's")


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
            if not is_number(value) or not math.isfinite(value):
                raise ValueError(f"`{name}` must be a finite number, got {value!r}.")
            if value < 0:
                raise ValueError(f"`{name}` must be >= 0, got {value!r}.")
        if not is_int(self.vae_pretrain_steps) or self.vae_pretrain_steps < 0:
            raise ValueError(f"`vae_pretrain_steps` must be an integer >= 0, got {self.vae_pretrain_steps!r}.")
        lr = self.vae_pretrain_learning_rate
        if lr is not None and (not is_number(lr) or not math.isfinite(lr) or lr <= 0):
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
        check_positive_int("coverage_top_b", self.coverage_top_b)
        if not self.vae_lr_ratio > 0:
            raise ValueError(f"`vae_lr_ratio` must be > 0 (freeze the VAE instead of a zero rate), got "
                             f"{self.vae_lr_ratio!r}.")
        check_train_flow_steps(self.train_flow_steps)

    @property
    def loss_weights(self) -> dict[str, float]:
        """The term weights by the names `chainflow_loss` uses (the SPEC's six and `kd`)."""
        return {name: getattr(self, f"loss_{name}_weight") for name in {**DEFAULT_LOSS_WEIGHTS, **EXTRA_LOSS_WEIGHTS}}

