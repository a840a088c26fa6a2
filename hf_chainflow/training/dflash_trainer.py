"""Training a DFlash drafter (`hf_chainflow.training.dflash`) with `transformers.Trainer`.

`DFlashTrainer` only wires things: the model is transformers' own `MuseGlimmerAssistantModel`, the data are
`DFlashWindowDataset` windows, the loss is `hf_chainflow.training.losses.dflash_loss` over the logits
`hf_chainflow.training.dflash.dflash_block_logits` computes (the drafter between the target's embeddings and its LM head,
exactly as transformers' DFlash generation path runs it). The target stays outside the model: it is frozen, neither
optimised nor saved, so `trainer.save_model(dir)` writes a plain transformers folder (`config.json`,
`model.safetensors`) that stock transformers loads and runs with `speculation_type="dflash"`. Checkpoints are
complete-only, as `ChainFlowTrainer`'s (`hf_chainflow.training.checkpointing.CompleteCheckpointsMixin`).

Logged beside `loss`: `loss_ce`, `loss_accuracy` (top-1 of the masked positions) and `loss_tau` (1 + the mean
accepted length of greedy verification of the training blocks: an offline acceptance length), averaged over the
logging interval; after an evaluation `eval_loss_ce`, ... over its windows.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel, Trainer, TrainingArguments, default_data_collator

from hf_chainflow.checks import check_positive_int
from hf_chainflow.training.windows import ChainFlowWindowDataset
from hf_chainflow.training.dflash import check_dflash_drafter, dflash_block_logits
from hf_chainflow.training.dflash_data import DFlashWindowDataset
from hf_chainflow.training.losses import block_acceptance_lengths, dflash_loss
from hf_chainflow.training.checkpointing import CompleteCheckpointsMixin


@dataclass
class DFlashTrainingArguments(TrainingArguments):
    """`TrainingArguments` with the defaults of hf_chainflow's drafters (AdamW, constant lr 5e-4) and the DFlash
    loss's position decay."""

    learning_rate: float = field(default=5e-4, metadata={"help": "AdamW learning rate of the drafter."})
    lr_scheduler_type: str = field(default="constant", metadata={"help": "Learning-rate schedule."})
    remove_unused_columns: bool = field(
        default=False, metadata={"help": "Keep every column: windows are dicts of tensors read by the trainer."})
    prediction_loss_only: bool = field(
        default=True, metadata={"help": "Evaluation returns the loss (and its logged terms), not the logits."})
    loss_decay_gamma: float | None = field(
        default=4.0, metadata={"help": "gamma of the DFlash position weights exp(-(j - 1) / gamma) of mask j; None: "
                                       "equal weights."})

    def __post_init__(self):
        super().__post_init__()
        gamma = self.loss_decay_gamma
        if gamma is not None and (isinstance(gamma, bool) or not isinstance(gamma, (int, float)) or not gamma > 0):
            raise ValueError(f"`loss_decay_gamma` must be a number > 0, or None for equal weights, got {gamma!r}.")
        if self.label_smoothing_factor != 0:
            raise ValueError(f"`label_smoothing_factor` is not used by the DFlash loss, got "
                             f"{self.label_smoothing_factor!r}; leave it at 0.")
        if self.neftune_noise_alpha is not None:
            raise ValueError(f"`neftune_noise_alpha` adds noise to a language model's input embeddings; a DFlash "
                             f"drafter's are the target's, got {self.neftune_noise_alpha!r}; leave it None.")


def check_dflash_windows(config, dataset) -> None:
    """Raise a `ValueError` unless every window dataset inside `dataset` (a `DFlashWindowDataset`, or `Subset`,
    `ConcatDataset`, `ReplayMixDataset` of them) is cut for a DFlash drafter of `config`."""
    parts, stack = [], [dataset]
    while stack:
        d = stack.pop()
        if isinstance(d, ChainFlowWindowDataset):
            parts.append(d)
            continue
        for name in ("dataset", "new", "old"):
            if getattr(d, name, None) is not None:
                stack.append(getattr(d, name))
        stack.extend(getattr(d, "datasets", None) or [])
    for part in parts:
        if not isinstance(part, DFlashWindowDataset):
            raise ValueError(f"`{part.data_dir}`: ChainFlow windows cannot train a DFlash drafter; build them with "
                             f"`DFlashWindowDataset.for_drafter(data_dir, drafter.config)`.")
        got = {"context_len": part.C, "block_size": part.block_size, "target_layer_ids": part.target_layer_ids,
               "hidden_size": part.hidden_size}
        want = {"context_len": config.sliding_window, "block_size": config.block_size,
                "target_layer_ids": list(config.target_layer_ids), "hidden_size": config.hidden_size}
        if got != want:
            wrong = {k: (got[k], want[k]) for k in got if got[k] != want[k]}
            raise ValueError(f"The windows of `{part.data_dir}` do not fit this DFlash drafter ({wrong}, as (windows, "
                             f"drafter)); build them with `DFlashWindowDataset.for_drafter(data_dir, drafter.config)`.")


class DFlashTrainer(CompleteCheckpointsMixin, Trainer):
    """`Trainer` for a DFlash drafter (`MuseGlimmerAssistantModel`) of `target`.

    Args:
        model: the drafter (`hf_chainflow.training.dflash.build_dflash_drafter`, or a saved one).
        args: `DFlashTrainingArguments` (defaults: output under `dflash-drafter/`).
        target: the target whose embeddings and LM head the drafter uses; frozen here (`requires_grad_(False)`),
            on the device the drafter trains on.
        Other arguments are `Trainer`'s; `data_collator` defaults to stacking the window tensors.
    """

    def __init__(self, model=None, args: DFlashTrainingArguments | None = None, data_collator=None,
                 train_dataset=None, eval_dataset=None, *, target: PreTrainedModel, **kwargs):
        if kwargs.get("model_init") is not None:
            raise ValueError("`model_init` is not supported by DFlashTrainer: pass the drafter as `model`.")
        if args is None:
            args = DFlashTrainingArguments(output_dir="dflash-drafter")
        if not isinstance(args, DFlashTrainingArguments):
            raise ValueError(f"`args` must be DFlashTrainingArguments (they carry `loss_decay_gamma`), got "
                             f"{type(args).__name__}.")
        check_dflash_drafter(model, target)
        evals = eval_dataset.values() if isinstance(eval_dataset, dict) else [eval_dataset]
        for dataset in (train_dataset, *evals):
            if dataset is not None:
                check_dflash_windows(model.config, dataset)
        super().__init__(model=model, args=args, data_collator=data_collator or default_data_collator,
                         train_dataset=train_dataset, eval_dataset=eval_dataset, **kwargs)
        head = target.get_output_embeddings().weight
        if head.device != self.args.device:
            raise ValueError(f"The target's LM head is on {head.device} but the drafter trains on {self.args.device}; "
                             f"move the target there first (`target.to({str(self.args.device)!r})`).")
        self.target_model = target.requires_grad_(False).eval()
        self.model_accepts_loss_kwargs = False  # `compute_loss` returns a per-batch mean
        if not self.label_names:
            self.label_names = ["labels"]
        self._terms: dict[str, dict[str, list[torch.Tensor]]] = {"train": defaultdict(list), "eval": defaultdict(list)}

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        logits = dflash_block_logits(model, self.target_model, inputs)  # (N, B-1, V)
        loss, terms = dflash_loss(logits, inputs["labels"], inputs["label_mask"],
                                  decay_gamma=self.args.loss_decay_gamma)
        mode = "train" if model.training else "eval"
        size = float(inputs["labels"].shape[0])
        for name, value in terms.items():
            self._terms[mode][name].append(torch.stack([value.float(), value.new_tensor(size).float()]))
        return (loss, {"logits": logits}) if return_outputs else loss

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Adds the mean of each term since the last log: `loss_<term>` in training (over steps),
        `<prefix>_loss_<term>` after an evaluation logged as `<prefix>_loss` (over windows)."""
        eval_key = next((k for k in logs if k.startswith("eval") and k.endswith("_loss")), None)
        mode = "eval" if eval_key is not None else "train" if "loss" in logs else None
        if mode is not None and self._terms[mode]:
            prefix = f"{eval_key}_" if mode == "eval" else "loss_"
            for name, values in self._terms[mode].items():
                value, size = torch.stack(values).unbind(-1)
                weight = size if mode == "eval" else torch.ones_like(size)
                total = self.accelerator.gather(torch.stack([(value * weight).sum(), weight.sum()])[None])  # (P, 2)
                logs[prefix + name] = round((total[:, 0].sum() / total[:, 1].sum()).item(), 6)
            self._terms[mode].clear()
        super().log(logs, start_time)


@torch.no_grad()
def evaluate_dflash_offline(drafter, target: PreTrainedModel, windows, *, batch_size: int = 64) -> dict:
    """Offline acceptance of a DFlash drafter on `windows` (a `DFlashWindowDataset`): per block, how many of its
    `B - 1` greedy drafts match the cached response before the first miss. Returns `tau` (1 + the mean, tokens per
    target forward if the target's greedy tokens are the cached ones), `accuracy` (top-1 per masked position),
    `acceptance_per_depth` (fraction of blocks accepted beyond depth d) and `windows`."""
    check_dflash_drafter(drafter, target)
    check_dflash_windows(drafter.config, windows)
    check_positive_int("batch_size", batch_size)
    if len(windows) == 0:
        raise ValueError("`windows` is empty: there is nothing to evaluate.")
    was_training = drafter.training
    drafter.eval()
    accepted, hits, valid = [], 0, 0
    loader = torch.utils.data.DataLoader(windows, batch_size=batch_size, collate_fn=default_data_collator)
    try:
        for batch in loader:
            batch = {k: v.to(drafter.device) for k, v in batch.items()}
            predictions = dflash_block_logits(drafter, target, batch).argmax(-1)  # (N, B-1)
            mask = batch["label_mask"]
            accepted.append(block_acceptance_lengths(predictions, batch["labels"], mask).cpu())
            hits += int(((predictions == batch["labels"]) & mask).sum())
            valid += int(mask.sum())
    finally:
        drafter.train(was_training)
    accepted = torch.cat(accepted)  # (W,)
    depth = drafter.config.block_size - 1
    return {"tau": 1.0 + accepted.float().mean().item(), "accuracy": hits / max(valid, 1),
            "acceptance_per_depth": [(accepted > d).float().mean().item() for d in range(depth)],
            "windows": len(accepted)}


__all__ = ["DFlashTrainer", "DFlashTrainingArguments", "check_dflash_windows", "evaluate_dflash_offline"]
