"""The work behind `hf-chainflow train`, `eval-offline` and `corpus-lookup`, callable from Python: load the target,
build or load the drafter, the windows of a prepared data directory, then train (`train_drafter`), measure offline
acceptance (`evaluate_drafter`) or give a saved drafter a corpus-lookup table (`add_corpus_lookup`). The commands
(`hf_chainflow.commands`) parse and check the options and call these.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch
from torch.utils.data import ConcatDataset

from hf_chainflow.checks import check_positive_int
from hf_chainflow.cli_args import usage_error
from hf_chainflow.generation.corpus_lookup import ContinuationTable
from hf_chainflow.training.corpus_lookup import table_from_corpus
from hf_chainflow.fileio import atomic_write_text


def window_dataset(data_dir, config, **kwargs):
    """The training windows of a prepared data directory for a drafter of `config`
    (`ChainFlowWindowDataset.for_drafter`)."""
    from hf_chainflow.training.windows import ChainFlowWindowDataset

    return ChainFlowWindowDataset.for_drafter(data_dir, config, **kwargs)


def train_drafter(o: dict) -> int:
    """Train a drafter (or a LoRA adapter) as `hf-chainflow train` does, from its resolved options `o` (every key of
    `hf_chainflow.commands.train.TRAIN_DEFAULTS`, checked by `resolve_train_options`): load the target, build,
    warm-start or resume the drafter, mix in the replay data, train, save to `o["out"]` with
    `train_summary.json`. Returns 0."""
    from hf_chainflow.models.chainflow.configuration_chainflow import ChainFlowConfig
    from hf_chainflow.training.prepared_data import (compute_shortlist, layer_statistics, read_shortlist,
                                                     state_statistics)
    from hf_chainflow.training.evaluation import strict_json
    from hf_chainflow.models.chainflow.modeling_chainflow import ChainFlowDrafter
    from hf_chainflow.targets import load_model_and_tokenizer
    from hf_chainflow.training.trainer import ChainFlowTrainer
    from hf_chainflow.training.arguments import ChainFlowTrainingArguments
    from hf_chainflow.training.replay import ReplayMixDataset

    manifest, resume = check_training_inputs(o)  # before the target loads: bad data or checkpoints fail now
    # A resumed run continues the checkpoint's own drafter (its sizes, shortlist and state statistics), whatever
    # options built it; a LoRA checkpoint holds only the adapter, which the Trainer reloads into --init-from.
    resume_drafter = bool(resume) and not o["lora"] and Path(resume, "config.json").is_file()
    if o["threads"]:
        torch.set_num_threads(o["threads"])
    dtype = getattr(torch, o["dtype"])
    target, _ = load_model_and_tokenizer(o["target"], dtype)
    target.requires_grad_(False)
    if resume_drafter:
        model = ChainFlowDrafter.from_pretrained(resume, target=target, dtype=dtype)
        differ = {k: (v, getattr(model.config, k, None)) for k, v in o["drafter"].items()
                  if getattr(model.config, k, None) != v}
        if differ:
            raise usage_error("train", f"drafter fields {differ} (given, in the checkpoint) differ from the drafter of "
                              f"the checkpoint {resume}; a resumed run keeps its drafter: drop them.")
    elif o["init_from"]:
        if o["drafter"]:
            raise usage_error("train", f"drafter fields {sorted(o['drafter'])} cannot change a warm-started drafter "
                              f"(--init-from keeps its sizes); drop them or train a fresh drafter.")
        model = ChainFlowDrafter.from_pretrained(o["init_from"], target=target, dtype=dtype)
    else:
        shortlist = read_shortlist(o["data"])
        if o["shards"] is not None:  # the tokens seen in the responses this drafter trains on
            shortlist = compute_shortlist(o["data"], {**manifest, "finished": o["shards"]})
        config = ChainFlowConfig.for_target(target.config, shortlist=shortlist, **o["drafter"])
        torch.manual_seed(o["seed"])
        model = ChainFlowDrafter(config).to(dtype).bind_target(target)
        model.set_state_statistics(*state_statistics(o["data"], shards=o["shards"]))
        if model.layer_fusion is not None:  # fused target layers: their statistics, from the same states
            model.set_layer_statistics(*layer_statistics(o["data"], config.target_layer_ids, shards=o["shards"]))
    config = model.config
    if o["lora"]:
        from hf_chainflow.training.adapters import add_language_adapter, lora_config

        model = add_language_adapter(model, o["lora"], lora_config(r=o["lora_rank"]))

    train_set = window_dataset(o["data"], config, max_windows=o["max_windows"], seed=o["seed"], shards=o["shards"])
    replay_windows = []
    if o["replay"]:
        parts = [window_dataset(d, config, shards=s) for d, s in zip(o["replay"], o["replay_shards"])]
        replay_windows = [{"dir": d, "shards": s, "windows": len(part)}
                          for d, s, part in zip(o["replay"], o["replay_shards"], parts)]
        replay = ConcatDataset(parts)  # replayed rows are drawn from all directories, in proportion to their windows
        train_set = ReplayMixDataset(train_set, replay, o["replay_fraction"], seed=o["seed"])
    targs = dict(output_dir=o["out"], num_train_epochs=o["epochs"], max_steps=o["max_steps"],
                 per_device_train_batch_size=o["batch_size"], learning_rate=o["lr"],
                 gradient_accumulation_steps=o["grad_accum"], seed=o["seed"], logging_steps=o["logging_steps"],
                 save_steps=o["save_steps"], save_total_limit=o["save_total_limit"],
                 vae_pretrain_steps=o["vae_pretrain_steps"], vae_lr_ratio=o["vae_lr_ratio"],
                 train_flow_steps=o["train_flow_steps"], dataloader_num_workers=o["num_workers"],
                 report_to="none", bf16=dtype == torch.bfloat16 and torch.cuda.is_available(),
                 dataloader_pin_memory=torch.cuda.is_available())
    targs.update(o["training_args"])
    training_args = ChainFlowTrainingArguments(**targs)
    launched = int(os.environ.get("WORLD_SIZE", "1"))  # torchrun / accelerate launch
    if launched > 1 and training_args.world_size != launched:
        raise ValueError(
            f"launched as {launched} processes (WORLD_SIZE={launched}), but the training arguments set up "
            f"{training_args.world_size} (parallel mode {training_args.parallel_mode.value!r}): each process would "
            f"train a drafter of its own. On a machine without GPUs transformers runs distributed training only with "
            f"`use_cpu`: add `--training-arg use_cpu=true`."
        )
    target.to(training_args.device)  # the drafter borrows its lm_head: it trains where the Trainer puts the drafter
    trainer = ChainFlowTrainer(model=model, args=training_args, train_dataset=train_set)
    result, first_step, elapsed = run_training(trainer, resume, o["out"])
    if not trainer.is_world_process_zero():
        return 0
    windows_per_step = o["batch_size"] * o["grad_accum"] * training_args.world_size  # every process's batches
    summary = {**throughput_summary(first_step, trainer.state.global_step, windows_per_step, elapsed),
               "train_loss": result.training_loss, "num_train_windows": len(train_set),
               "replay_windows_available": replay_windows, "num_processes": training_args.world_size,
               "vae_pretrain": vae_pretrain_summary(trainer.vae_pretrain_losses),
               "options": {k: v for k, v in o.items()}}
    atomic_write_text(Path(o["out"], "train_summary.json"), strict_json(summary, indent=1, default=str))
    what = f"LoRA adapter {o['lora']!r}" if o["lora"] else "drafter"
    print(f"saved {what} to {o['out']}: {summary['steps']} steps ({summary['steps_this_run']} in this run), "
          f"{summary['windows_this_run']} windows in {elapsed:.1f} s ({summary['windows_per_second']} windows/s), "
          f"train loss {result.training_loss:.4f}")
    return 0


def check_training_inputs(o: dict) -> tuple[dict, str | None]:
    """What `hf-chainflow train` checks before it loads a model (`o`: its resolved options): the `--data` and
    `--replay` folders (`hf_chainflow.training.prepared_data.check_prepared_data`: manifest, shortlist, the selected shards) and the
    checkpoint to resume from (`hf_chainflow.training.checkpointing.resolve_resume_checkpoint`: `last` is the newest complete one).
    Returns `(the --data manifest, the checkpoint folder or None)`; raises a `ValueError` naming the file or option
    and the fix."""
    from hf_chainflow.training.prepared_data import check_prepared_data, read_manifest
    from hf_chainflow.training.checkpointing import resolve_resume_checkpoint

    finished = read_manifest(o["data"])["finished"]
    missing = sorted(set(o["shards"] or []) - set(finished))
    if missing:
        raise ValueError(f"`--shards` (or `shards:` in --config) selects {missing}, which are not finished in "
                         f"`{o['data']}` (finished: {finished}); choose finished shards, or finish them with the "
                         f"same `hf-chainflow prepare` command.")
    manifest = check_prepared_data(o["data"], o["shards"])
    for folder, shards in zip(o["replay"] or [], o["replay_shards"] or []):
        check_prepared_data(folder, shards)
    return manifest, resolve_resume_checkpoint(o["resume"], o["out"], flags=("--resume", "--out"))


def run_training(trainer, resume: str | None, out: str) -> tuple:
    """`trainer.train(resume_from_checkpoint=resume)`, timed, then `trainer.save_model(out)` (the main process
    writes, transformers' rule). Returns `(result, first_step, seconds)`; `first_step` is the resumed checkpoint's
    step (0 on a fresh run)."""
    first_step = 0
    if resume:
        from transformers import TrainerState

        first_step = TrainerState.load_from_json(str(Path(resume, "trainer_state.json"))).global_step
    start = time.perf_counter()
    result = trainer.train(resume_from_checkpoint=resume)
    elapsed = time.perf_counter() - start
    trainer.save_model(out)
    return result, first_step, elapsed


def vae_pretrain_summary(losses: list[float] | None) -> dict | None:
    """The VAE pre-training stage in `train_summary.json`: its steps and the mean `L_rec` of its first and last tenth."""
    if not losses:
        return None
    tenth = max(1, len(losses) // 10)
    return {"steps": len(losses), "loss_rec_first": float(sum(losses[:tenth]) / tenth),
            "loss_rec_last": float(sum(losses[-tenth:]) / tenth)}


def throughput_summary(first_step: int, last_step: int, windows_per_step: int, seconds: float) -> dict:
    """Steps and windows of a training run and its speed; a resumed run is timed on its own steps only."""
    steps = last_step - first_step
    return {"steps": last_step, "resumed_from_step": first_step, "steps_this_run": steps,
            "windows_seen": last_step * windows_per_step, "windows_this_run": steps * windows_per_step,
            "train_seconds": round(seconds, 2),
            "windows_per_second": round(steps * windows_per_step / seconds, 1) if seconds else None}


def evaluate_drafter(drafter: str, data: str, *, target: str = "smollm2-135m-instruct", adapter: str | None = None,
                     dtype: str = "float32", shards: list[int] | None = None, out: str | None = None,
                     **evaluate_kwargs) -> dict:
    """Offline acceptance of the drafter at `drafter` (with the LoRA adapter directory `adapter`, if given) bound to
    `target` in `dtype`, on the windows of the prepared data directory `data` (`shards`: only those):
    `hf_chainflow.training.evaluation.evaluate_offline(**evaluate_kwargs)`, with the report and `offline_eval.json` written
    to `out` when given. Returns the result, with `drafter` and `data` recorded."""
    from hf_chainflow.training.evaluation import evaluate_offline, strict_json
    from hf_chainflow.models.chainflow.modeling_chainflow import ChainFlowDrafter
    from hf_chainflow.targets import load_model_and_tokenizer
    from hf_chainflow.training.trainer import unwrap_drafter

    torch_dtype = getattr(torch, dtype)
    model, _ = load_model_and_tokenizer(target, torch_dtype)
    drafter_model = ChainFlowDrafter.from_pretrained(drafter, target=model, dtype=torch_dtype)
    if adapter:
        from hf_chainflow.training.adapters import load_language_adapter

        drafter_model = load_language_adapter(drafter_model, adapter, Path(adapter).name)
    windows = window_dataset(data, unwrap_drafter(drafter_model).config, shards=shards)
    result = evaluate_offline(drafter_model, windows, output_dir=out, **evaluate_kwargs)
    result["drafter"], result["data"] = str(drafter), str(data)
    if out:
        atomic_write_text(Path(out, "offline_eval.json"), strict_json(result, indent=1))
    return result


def add_corpus_lookup(drafter, corpus, out, *, num_tokens: int = 6, **table_kwargs) -> ContinuationTable:
    """What `hf-chainflow corpus-lookup` does: load the drafter saved at `drafter` (a folder or Hub id) in its stored
    dtype, give it the table of `corpus` (`table_from_corpus(corpus, **table_kwargs)`), turn the branch on
    (`generation_config.corpus_lookup_num_tokens = num_tokens`) and save it to `out`. Returns the table."""
    from hf_chainflow.generation.drafting import set_continuation_table
    from hf_chainflow.models.chainflow.modeling_chainflow import ChainFlowDrafter

    check_positive_int("num_tokens", num_tokens, meaning="the longest corpus-lookup branch")
    table = table_from_corpus(corpus, **table_kwargs)  # before the drafter loads: a bad corpus fails first
    model = ChainFlowDrafter.from_pretrained(drafter, dtype="auto")
    set_continuation_table(model, table)  # refuses a table of another vocabulary
    model.generation_config.corpus_lookup_num_tokens = num_tokens
    model.save_pretrained(out)
    return table


__all__ = ["add_corpus_lookup", "check_training_inputs", "evaluate_drafter", "run_training", "throughput_summary",
           "train_drafter", "vae_pretrain_summary", "window_dataset"]

