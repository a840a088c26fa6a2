"""The work behind `hf-chainflow train --drafter-type dflash`: load the target, build (or warm-start, or resume) a
DFlash drafter, cut its windows from a prepared data directory, train it with `DFlashTrainer`, save it as a plain
transformers folder with `train_summary.json` and a model card (`README.md`)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from hf_chainflow.cli_args import usage_error
from hf_chainflow.fileio import atomic_write_text

# `hf-chainflow train` options that only a ChainFlow drafter uses; a DFlash run refuses them set.
CHAINFLOW_ONLY_OPTIONS = ("lora", "vae_pretrain_steps", "vae_lr_ratio", "train_flow_steps")


def dflash_fields(o: dict, manifest: dict, tokenizer) -> dict:
    """The fields of a fresh DFlash drafter from the `drafter` options: `target_layer_ids` default to the layers the
    data were prepared with, `mask_token_id` to the tokenizer's mask token (SmolLM2 has none: name one)."""
    from hf_chainflow.training.dflash import SMOLLM2_MASK_TOKEN_ID

    fields = dict(o["drafter"])
    if "target_layer_ids" not in fields:
        if not manifest.get("target_layers"):
            raise ValueError(f"`{o['data']}` was prepared without `--target-layers`: a DFlash drafter reads the "
                             f"outputs of several target layers; prepare the data again with e.g. "
                             f"`--target-layers 1,10,18,27`.")
        fields["target_layer_ids"] = list(manifest["target_layers"])
    if "mask_token_id" not in fields:
        if getattr(tokenizer, "mask_token_id", None) is None:
            raise ValueError(f"The target's tokenizer has no mask token: give one inside its vocabulary that its "
                             f"responses never use, `--drafter-arg mask_token_id=ID` (SmolLM2: "
                             f"{SMOLLM2_MASK_TOKEN_ID}, `<empty_output>`).")
        fields["mask_token_id"] = int(tokenizer.mask_token_id)
    return fields


def train_dflash_drafter(o: dict, defaults: dict | None = None) -> int:
    """Train a DFlash drafter as `hf-chainflow train --drafter-type dflash` does, from its resolved options `o`
    (`hf_chainflow.commands.train.resolve_train_options`); the model card's command names the options that differ
    from `defaults` (all of them without). Returns 0."""
    from transformers import MuseGlimmerAssistantModel

    from hf_chainflow.training.prepared_data import read_shortlist
    from hf_chainflow.training.dflash import build_dflash_drafter, check_dflash_drafter, check_dflash_target
    from hf_chainflow.training.dflash_data import DFlashWindowDataset
    from hf_chainflow.training.dflash_trainer import DFlashTrainer, DFlashTrainingArguments
    from hf_chainflow.training.evaluation import strict_json
    from hf_chainflow.targets import load_model_and_tokenizer
    from hf_chainflow.training.replay import ReplayMixDataset
    from hf_chainflow.training.workflows import check_training_inputs, run_training, throughput_summary

    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ValueError("DFlash training runs in one process; launch `hf-chainflow train --drafter-type dflash` "
                         "without torchrun / accelerate.")
    manifest, resume = check_training_inputs(o)  # before the target loads: bad data or checkpoints fail now
    if o["threads"]:
        torch.set_num_threads(o["threads"])
    dtype = getattr(torch, o["dtype"])
    target, tokenizer = load_model_and_tokenizer(o["target"], dtype)
    check_dflash_target(target)
    target.requires_grad_(False)
    start_from = resume or o["init_from"]
    if start_from:
        if o["drafter"]:
            raise usage_error("train", f"drafter fields {sorted(o['drafter'])} cannot change a resumed or warm-started "
                              f"DFlash drafter (it keeps its sizes); drop them.")
        drafter = MuseGlimmerAssistantModel.from_pretrained(start_from)
    else:
        drafter = build_dflash_drafter(target, seed=o["seed"], **dflash_fields(o, manifest, tokenizer))
    check_dflash_drafter(drafter, target)
    mask = drafter.config.mask_token_id
    if mask in set(read_shortlist(o["data"])):
        raise ValueError(f"`mask_token_id` {mask} occurs in the responses of `{o['data']}`: a mask must be a token the "
                         f"target never writes; choose another (SmolLM2: 16, `<empty_output>`).")
    drafter = drafter.to(dtype)

    config = drafter.config
    train_set = DFlashWindowDataset.for_drafter(o["data"], config, max_windows=o["max_windows"], seed=o["seed"],
                                                shards=o["shards"])
    if o["replay"]:
        parts = [DFlashWindowDataset.for_drafter(d, config, shards=s) for d, s in zip(o["replay"], o["replay_shards"])]
        train_set = ReplayMixDataset(train_set, torch.utils.data.ConcatDataset(parts), o["replay_fraction"],
                                     seed=o["seed"])
    targs = dict(output_dir=o["out"], num_train_epochs=o["epochs"], max_steps=o["max_steps"],
                 per_device_train_batch_size=o["batch_size"], learning_rate=o["lr"],
                 gradient_accumulation_steps=o["grad_accum"], seed=o["seed"], logging_steps=o["logging_steps"],
                 save_steps=o["save_steps"], save_total_limit=o["save_total_limit"],
                 dataloader_num_workers=o["num_workers"], report_to="none",
                 bf16=dtype == torch.bfloat16 and torch.cuda.is_available(),
                 dataloader_pin_memory=torch.cuda.is_available())
    targs.update(o["training_args"])
    args = DFlashTrainingArguments(**targs)
    target.to(args.device)
    trainer = DFlashTrainer(model=drafter, args=args, train_dataset=train_set, target=target)
    result, first_step, elapsed = run_training(trainer, resume, o["out"])
    logged = [h for h in trainer.state.log_history if "loss_tau" in h]
    summary = {**throughput_summary(first_step, trainer.state.global_step, o["batch_size"] * o["grad_accum"], elapsed),
               "train_loss": result.training_loss, "num_train_windows": len(train_set),
               "last_logged": logged[-1] if logged else None, "parameters": drafter.num_parameters(),
               "mask_token": tokenizer.convert_ids_to_tokens(mask), "data_manifest": {
                   k: manifest.get(k) for k in ("target", "num_sequences", "finished", "target_layers")},
               "options": dict(o)}
    atomic_write_text(Path(o["out"], "train_summary.json"), strict_json(summary, indent=1, default=str))
    atomic_write_text(Path(o["out"], "README.md"), dflash_model_card(config, summary, defaults))
    print(f"saved DFlash drafter to {o['out']}: {summary['steps']} steps, {summary['windows_this_run']} windows in "
          f"{elapsed:.1f} s, train loss {result.training_loss:.4f}")
    return 0


def _command(o: dict, defaults: dict | None) -> str:
    """The `hf-chainflow train` command line of the options `o` that differ from `defaults` (None: all given)."""
    parts = ["hf-chainflow train --drafter-type dflash"]
    for key, value in o.items():
        if key in ("drafter_type", "drafter", "training_args", "replay_shards") or value in (None, []) or (
                defaults is not None and value == defaults.get(key)):
            continue
        values = value if key == "replay" else [",".join(map(str, value)) if isinstance(value, list) else value]
        parts += [f"--{key.replace('_', '-')} {v}" for v in values]
    if any(s is not None for s in o.get("replay_shards") or []):
        parts += [f"--replay-shards {'all' if s is None else ','.join(map(str, s))}" for s in o["replay_shards"]]
    parts += [f"--drafter-arg {k}={json.dumps(v).replace(' ', '')}" for k, v in o["drafter"].items()]
    parts += [f"--training-arg {k}={json.dumps(v)}" for k, v in o["training_args"].items()]
    return " \\\n    ".join(parts)


def dflash_model_card(config, summary: dict, defaults: dict | None = None) -> str:
    """The `README.md` of a trained DFlash drafter: how to run it with stock transformers, its sizes, data, budget,
    the command that made it, and the acceptance measured during training."""
    o, m = summary["options"], summary["data_manifest"]
    last = summary["last_logged"] or {}
    tau = (f"{last['loss_tau']:.3f} (training windows, the last logging interval; offline: the accepted length of "
           f"greedy verification against the cached responses)") if last else "not logged (too few steps)"
    return f"""---
library_name: transformers
tags: [speculative-decoding, dflash, hf-chainflow]
---

# DFlash drafter for `{o['target']}`

A `MuseGlimmerAssistantModel` (`model_type = "muse_glimmer_assistant"`), the DFlash drafter format of stock
transformers, trained by hf_chainflow (`hf-chainflow train --drafter-type dflash`). It holds no embeddings and no LM
head (it borrows the target's). Run it with transformers alone, nothing of hf_chainflow imported:

```python
from transformers import AutoModel, AutoModelForCausalLM
target = AutoModelForCausalLM.from_pretrained(TARGET)
drafter = AutoModel.from_pretrained(DRAFTER_DIR, dtype=target.dtype)  # the target's dtype
out = target.generate(**inputs, assistant_model=drafter, speculation_type="dflash", do_sample=False)
```

- **Size:** {summary['parameters']:,} parameters: {config.num_hidden_layers} layers of width {config.hidden_size}, \
{config.num_attention_heads} heads ({config.num_key_value_heads} key/value), FFN {config.intermediate_size}.
- **Context:** the outputs of the target's layers {list(config.target_layer_ids)}, concatenated; sliding-window \
attention over the last {config.sliding_window} positions.
- **Block:** {config.block_size} tokens, the bonus token and {config.block_size - 1} masks: {config.block_size - 1} \
drafted tokens per round; mask token id {config.mask_token_id} (`{summary['mask_token']}`).
- **Limits of stock transformers' DFlash path:** one prompt at a time (assisted decoding is batch 1); stateful \
(hybrid) targets are refused; the drafter must be in the target's dtype.

## Data

`{o['data']}`: the target's greedy responses (`{m['target']}`, {m['num_sequences']} sequences) with its hidden states \
at layers {m['target_layers']} (`hf-chainflow prepare --target-layers ...`); trained on shards \
{o['shards'] if o['shards'] is not None else m['finished']}: {summary['num_train_windows']:,} windows.

## Budget and command

{summary['steps']} steps of {o['batch_size'] * o['grad_accum']} windows, lr {o['lr']}, {o['dtype']}, \
{o['threads'] or 'default'} thread(s): {summary['train_seconds']} s ({summary['windows_per_second']} windows/s); \
final train loss {summary['train_loss']:.4f}.

```bash
{_command(o, defaults)}
```

## Acceptance

τ during training: {tau}. The online τ and the speed against plain decoding: `hf-chainflow bench --dflash DIR`.
"""


__all__ = ["CHAINFLOW_ONLY_OPTIONS", "dflash_fields", "dflash_model_card", "train_dflash_drafter"]
