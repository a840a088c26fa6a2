"""Language adaptation of a trained drafter (docs/adaptation.md): warm-start it (`warm_start`), train on the new
language at a lower learning rate (`adaptation_arguments`), replaying about 20 % of the earlier languages' windows
(`hf_chainflow.training.replay.ReplayMixDataset`); per-language LoRA adapters: `hf_chainflow.training.adapters`."""

from __future__ import annotations

import warnings

from transformers import PreTrainedModel

from hf_chainflow.models.chainflow.modeling_chainflow import ChainFlowDrafter
from hf_chainflow.training.arguments import ChainFlowTrainingArguments

__all__ = ["ADAPTATION_LR_RANGE", "adaptation_arguments", "warm_start"]

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
