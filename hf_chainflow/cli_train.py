"""`hf-chainflow train` trains a ChainFlow drafter (or a LoRA adapter); `hf-chainflow eval-offline` measures its τ.

    hf-chainflow train --target smollm2-135m-instruct --data DATA_DIR --out DRAFTER_DIR [--config train.yaml]
    hf-chainflow train --init-from EN_DRAFTER --data TR_DATA --out TR_DRAFTER --lr 1.2e-4 --replay EN_DATA
    hf-chainflow train --init-from D1 --data NEW --replay OLD1 --replay-shards 0-20 --replay OLD2 --replay-shards all
    hf-chainflow train --init-from EN_DRAFTER --data TR_DATA --out TR_ADAPTER --lora tr
    hf-chainflow eval-offline --drafter DRAFTER_DIR --data HELD_OUT_DIR --out REPORT_DIR [--tree 8x4]

`--config` reads a YAML mapping whose keys are the long option names (with `_` or `-`); options given on the
command line win over the file.  Two keys take mappings: `drafter` (ChainFlowConfig fields for a fresh drafter) and
`training_args` (any `ChainFlowTrainingArguments` field, e.g. the loss weights); on the command line they are the
repeatable `--drafter-arg KEY=VALUE` and `--training-arg KEY=VALUE` (values parsed as YAML).
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
from torch.utils.data import ConcatDataset

from hf_chainflow.cli_args import check_model_source, check_output_dir, positive_int, usage_error

# Built-in defaults of `train`; the parser's defaults are None so that a YAML value can fill any option not given.
TRAIN_DEFAULTS = {
    "target": "smollm2-135m-instruct", "data": None, "out": None, "init_from": None, "lora": None, "lora_rank": 8,
    "epochs": 15.0, "max_steps": -1, "batch_size": 64, "lr": 5e-4, "grad_accum": 1, "seed": 0,
    "logging_steps": 50, "save_steps": 500, "save_total_limit": 2, "vae_pretrain_steps": 0, "vae_lr_ratio": 1 / 20,
    "train_flow_steps": None, "max_windows": None, "shards": None, "replay": None, "replay_shards": None, "replay_fraction": 0.2, "num_workers": 0,
    "resume": None, "threads": None, "dtype": "float32", "drafter": {}, "training_args": {},
}


def _numbers(value):
    """YAML 1.1 reads `1e-4` (no dot) as a string: make such strings numbers, in nested mappings too."""
    if isinstance(value, dict):
        return {k: _numbers(v) for k, v in value.items()}
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


def _key_value(text: str) -> tuple[str, object]:
    import yaml

    if "=" not in text:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    key, value = text.split("=", 1)
    return key.strip().replace("-", "_"), _numbers(yaml.safe_load(value))


# ------------------------------------------------------------------------------------------------------------ train
def add_train_parser(sub) -> None:
    p = sub.add_parser("train", help="Train a ChainFlow drafter (or a LoRA adapter) on a prepared data directory.",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--config", help="YAML file of options (keys = long option names); the command line overrides it")
    a("--target", help=f"known target name or local model directory (default {TRAIN_DEFAULTS['target']})")
    a("--data", help="prepared data directory (`hf-chainflow prepare --out`)")
    a("--out", help="output directory: the drafter (or adapter) and the checkpoints")
    a("--init-from", help="warm-start from this drafter (language adaptation); its shortlist and sizes are kept")
    a("--lora", metavar="NAME", help="train a LoRA adapter NAME on the --init-from drafter instead of all weights")
    a("--lora-rank", type=int, help="LoRA rank (default 8)")
    a("--epochs", type=float, help="training epochs (default 15, the paper's)")
    a("--max-steps", type=int, help="stop after this many optimiser steps (overrides --epochs)")
    a("--batch-size", type=int, help="windows per device per step (default 64)")
    a("--lr", type=float, help="learning rate (default 5e-4; 1e-4..1.5e-4 for language adaptation)")
    a("--grad-accum", type=int, help="gradient accumulation steps")
    a("--seed", type=int, help="seed of the drafter's initialisation, the data order and the subsets (default 0)")
    a("--logging-steps", type=int, help="log the losses every N steps (default 50)")
    a("--save-steps", type=int, help="write a checkpoint every N steps (default 500)")
    a("--save-total-limit", type=int, help="keep at most N checkpoints (default 2)")
    a("--vae-pretrain-steps", type=int, help="VAE-only (L_rec) steps before joint training (default 0)")
    a("--vae-lr-ratio", type=float, help="VAE lr as a fraction of --lr (default 1/20)")
    a("--train-flow-steps", type=int, help="N, Euler steps integrated in training (default: the drafter config's)")
    a("--max-windows", type=int, help="train on a seeded random subset of this many windows")
    a("--shards", type=parse_shards, help="use only these finished shards, e.g. `0-6` or `0,2,5` (default: all)")
    a("--replay", action="append",
      help="prepared data directory of earlier data (languages, rounds) to mix in; repeatable: the replayed rows are "
           "drawn from all of them together, in proportion to their windows")
    a("--replay-shards", action="append", type=parse_shard_selection,
      help="use only these finished shards of --replay, e.g. `0-20` to keep its held-out shards out (default: all); "
           "with several --replay, give it once per --replay in the same order (`all` for every finished shard)")
    a("--replay-fraction", type=float, help="share of replay rows in the mix (default 0.2)")
    a("--num-workers", type=int, help="data-loader workers")
    a("--resume", help="resume from a checkpoint directory, or 'last' for the newest under --out")
    a("--threads", type=int, help="torch.set_num_threads")
    a("--dtype", choices=("float32", "bfloat16"), help="dtype of the target and the drafter (default float32)")
    a("--drafter-arg", action="append", type=_key_value, metavar="KEY=VALUE",
      help="ChainFlowConfig field of a fresh drafter, e.g. num_blocks=4 (repeatable)")
    a("--training-arg", action="append", type=_key_value, metavar="KEY=VALUE",
      help="ChainFlowTrainingArguments field, e.g. loss_acc_weight=0.3 (repeatable)")
    p.set_defaults(func=run_train)


def resolve_train_options(args: argparse.Namespace) -> dict:
    """Built-in defaults < YAML `--config` < command line; returns a plain dict of every train option."""
    import yaml

    opts = {k: (dict(v) if isinstance(v, dict) else v) for k, v in TRAIN_DEFAULTS.items()}
    if args.config:
        if not Path(args.config).is_file():
            raise usage_error("train", f"--config must be a YAML file, got {args.config!r}, which does not exist.")
        try:
            loaded = yaml.safe_load(Path(args.config).read_text()) or {}
        except yaml.YAMLError as err:
            raise usage_error("train", f"--config {args.config} is not valid YAML:\n{err}") from None
        if not isinstance(loaded, dict):
            raise usage_error("train", f"--config {args.config} must hold a YAML mapping, got {type(loaded).__name__}.")
        loaded = {k.replace("-", "_"): _numbers(v) for k, v in loaded.items()}
        unknown = sorted(set(loaded) - set(TRAIN_DEFAULTS))
        if unknown:
            raise usage_error("train", f"unknown key(s) {unknown} in {args.config}; valid keys: "
                              f"{sorted(TRAIN_DEFAULTS)}.")
        for key in ("drafter", "training_args"):
            if not isinstance(loaded.get(key, {}), dict):
                raise usage_error("train", f"`{key}` in {args.config} must be a mapping.")
        opts.update(loaded)
    for key in TRAIN_DEFAULTS:
        value = getattr(args, key, None)
        if value is not None and key not in ("drafter", "training_args"):
            opts[key] = value
    opts["drafter"] = {**opts["drafter"], **dict(args.drafter_arg or [])}
    opts["training_args"] = {**opts["training_args"], **dict(args.training_arg or [])}
    if opts["shards"] is not None and not isinstance(opts["shards"], list):
        opts["shards"] = parse_shards(opts["shards"])  # from the YAML file
    for key in ("data", "out"):
        if not opts[key]:
            raise usage_error("train", f"--{key} is required (on the command line or in --config).")
    if opts["replay_shards"] is not None and not opts["replay"]:
        raise usage_error("train", "--replay-shards selects shards of the --replay data; give --replay too.")
    opts["replay"], opts["replay_shards"] = replay_sources(opts["replay"], opts["replay_shards"])
    if opts["lora"] and not opts["init_from"]:
        raise usage_error("train", "--lora adapts an existing drafter; give it with --init-from.")
    _check_train_numbers(opts)
    _check_field_names(opts)
    check_output_dir("--out", opts["out"])
    if opts["init_from"]:
        check_model_source("--init-from", opts["init_from"])
    if opts["resume"] not in (None, "last") and not Path(opts["resume"], "trainer_state.json").is_file():
        raise usage_error("train", f"--resume must be `last` or a checkpoint directory holding trainer_state.json, got "
                          f"{opts['resume']!r}; the checkpoints are the checkpoint-* directories under --out.")
    return opts


# option: (smallest value, whether it must be an integer, whether None is allowed)
_TRAIN_NUMBERS = {
    "epochs": (0, False, False), "batch_size": (1, True, False), "lr": (0, False, False), "grad_accum": (1, True, False),
    "logging_steps": (1, True, False), "save_steps": (1, True, False), "save_total_limit": (1, True, False),
    "lora_rank": (1, True, False), "vae_pretrain_steps": (0, True, False), "vae_lr_ratio": (0, False, False),
    "num_workers": (0, True, False), "train_flow_steps": (1, True, True), "max_windows": (1, True, True),
    "threads": (1, True, True), "seed": (None, True, False),
}


def _check_train_numbers(opts: dict) -> None:
    """Numbers from the command line or the YAML file, checked before anything loads."""
    for key, (low, integer, optional) in _TRAIN_NUMBERS.items():
        value = opts[key]
        if value is None and optional:
            continue
        kind = "an integer" if integer else "a number"
        ok = isinstance(value, int if integer else (int, float)) and not isinstance(value, bool)
        if ok and low is not None:
            ok = value >= low if integer or low else value > 0
        if not ok:
            rule = "" if low is None else (f" >= {low}" if integer else " > 0")
            raise usage_error("train", f"--{key.replace('_', '-')} must be {kind}{rule}, got {value!r}.")
    steps = opts["max_steps"]
    if not isinstance(steps, int) or isinstance(steps, bool) or (steps != -1 and steps < 1):
        raise usage_error("train", f"--max-steps must be a positive integer (or -1: train for --epochs), got "
                          f"{steps!r}.")


def _check_field_names(opts: dict) -> None:
    """`--drafter-arg` / `--training-arg` keys must name fields, or a typo would be ignored (or fail after loading)."""
    import dataclasses

    from hf_chainflow.configuration_chainflow import ChainFlowConfig
    from hf_chainflow.trainer import ChainFlowTrainingArguments

    checks = (("--drafter-arg", "drafter", set(ChainFlowConfig.__annotations__), "ChainFlowConfig"),
              ("--training-arg", "training_args", {f.name for f in dataclasses.fields(ChainFlowTrainingArguments)},
               "ChainFlowTrainingArguments"))
    for flag, key, fields, owner in checks:
        unknown = sorted(set(opts[key]) - fields)
        if unknown:
            raise usage_error("train", f"{flag} (or `{key}` in --config) names {unknown}, which are not "
                              f"{owner} fields; check the spelling (see `help({owner})`).")


def parse_shards(text: str) -> list[int]:
    """`"0-6"` / `"0,2,5"` / `"0-3,7"` -> shard numbers."""
    shards = []
    try:
        for part in str(text).split(","):
            lo, _, hi = part.strip().partition("-")
            lo, hi = int(lo), int(hi or lo)
            if hi < lo:
                raise ValueError
            shards += list(range(lo, hi + 1))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--shards takes shard numbers and ascending ranges like `0-6` or `0,2,5`, "
                                         f"got {text!r}.") from None
    return shards


def parse_shard_selection(text: str) -> list[int] | None:
    """`parse_shards`, or None (every finished shard) for `"all"`."""
    return None if str(text).strip() == "all" else parse_shards(text)


def replay_sources(replay, replay_shards) -> tuple[list[str], list[list[int] | None]]:
    """The replay directories and, aligned with them, each one's shard selection (None: every finished shard).

    `replay`: None, one directory or a list (repeated `--replay`, or a YAML list).  `replay_shards`: None, one
    selection (`"0-20"`, or a YAML list of numbers) for a single directory, or one selection per directory (repeated
    `--replay-shards`, or a YAML list of strings; `"all"` keeps every finished shard)."""
    dirs = [] if replay is None else [replay] if isinstance(replay, (str, Path)) else list(replay)
    dirs = [str(d) for d in dirs]
    if replay_shards is None:
        selections = [None] * len(dirs)
    elif isinstance(replay_shards, str):
        selections = [parse_shard_selection(replay_shards)]
    elif all(isinstance(x, int) for x in replay_shards):
        selections = [list(replay_shards)]
    else:
        selections = [x if x is None or isinstance(x, list) else parse_shard_selection(x) for x in replay_shards]
    if len(selections) != len(dirs):
        raise usage_error("train", f"--replay-shards was given {len(selections)} time(s) for {len(dirs)} --replay "
                          f"director{'y' if len(dirs) == 1 else 'ies'} {dirs}; give it once per --replay, in the same "
                          f"order (`all` for every finished shard), or not at all.")
    return dirs, selections


def _window_dataset(data_dir, config, **kwargs):
    from hf_chainflow.data import ChainFlowWindowDataset

    return ChainFlowWindowDataset.for_drafter(data_dir, config, **kwargs)


def run_train(args: argparse.Namespace) -> int:
    o = resolve_train_options(args)
    out = Path(o["out"])
    created = not out.exists()
    try:
        return _train(o)
    except BaseException:
        if created and out.is_dir() and not any(out.iterdir()):
            out.rmdir()  # a run that failed before writing anything leaves no empty --out behind
        raise


def _train(o: dict) -> int:
    from hf_chainflow import ChainFlowConfig, ChainFlowDrafter
    from hf_chainflow.cli import load_model_and_tokenizer
    from hf_chainflow.data import compute_shortlist, read_manifest, read_shortlist, state_statistics
    from hf_chainflow.evaluation import strict_json
    from hf_chainflow.trainer import ChainFlowTrainer, ChainFlowTrainingArguments, ReplayMixDataset

    manifest = read_manifest(o["data"])  # before the target loads: a missing --data fails now
    finished = manifest["finished"]
    missing = sorted(set(o["shards"] or []) - set(finished))
    if missing:
        raise ValueError(f"`--shards` (or `shards:` in --config) selects {missing}, which are not finished in "
                         f"`{o['data']}` (finished: {finished}); choose finished shards, or finish them with the "
                         f"same `hf-chainflow prepare` command.")
    resume = o["resume"]
    if resume == "last":  # before the target loads
        from transformers.trainer_utils import get_last_checkpoint

        resume = get_last_checkpoint(o["out"]) if Path(o["out"]).is_dir() else None
        if resume is None:
            raise usage_error("train", f"--resume last, but --out {o['out']!r} holds no checkpoint-* directory.")
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
    config = model.config
    if o["lora"]:
        from hf_chainflow.adapters import add_language_adapter, lora_config

        model = add_language_adapter(model, o["lora"], lora_config(r=o["lora_rank"]))

    train_set = _window_dataset(o["data"], config, max_windows=o["max_windows"], seed=o["seed"], shards=o["shards"])
    replay_windows = []
    if o["replay"]:
        parts = [_window_dataset(d, config, shards=s) for d, s in zip(o["replay"], o["replay_shards"])]
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
    first_step = 0
    if resume:
        from transformers import TrainerState

        first_step = TrainerState.load_from_json(str(Path(resume, "trainer_state.json"))).global_step
    start = time.perf_counter()
    result = trainer.train(resume_from_checkpoint=resume)
    elapsed = time.perf_counter() - start
    trainer.save_model(o["out"])  # the main process writes (transformers' rule); the others return here
    if not trainer.is_world_process_zero():
        return 0
    windows_per_step = o["batch_size"] * o["grad_accum"] * training_args.world_size  # every process's batches
    summary = {**throughput_summary(first_step, trainer.state.global_step, windows_per_step, elapsed),
               "train_loss": result.training_loss, "num_train_windows": len(train_set),
               "replay_windows_available": replay_windows, "num_processes": training_args.world_size,
               "vae_pretrain": _vae_pretrain_summary(trainer.vae_pretrain_losses),
               "options": {k: v for k, v in o.items()}}
    Path(o["out"], "train_summary.json").write_text(strict_json(summary, indent=1, default=str))
    what = f"LoRA adapter {o['lora']!r}" if o["lora"] else "drafter"
    print(f"saved {what} to {o['out']}: {summary['steps']} steps ({summary['steps_this_run']} in this run), "
          f"{summary['windows_this_run']} windows in {elapsed:.1f} s ({summary['windows_per_second']} windows/s), "
          f"train loss {result.training_loss:.4f}")
    return 0


def _vae_pretrain_summary(losses: list[float] | None) -> dict | None:
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


# ----------------------------------------------------------------------------------------------------- eval-offline
def add_eval_offline_parser(sub) -> None:
    p = sub.add_parser("eval-offline", help="Offline acceptance length tau of a drafter on prepared windows.",
                       description="Greedy chain (and optionally tree) drafts from exactly what the serving loop "
                                   "gives the drafter, compared with the target's own next tokens.")
    a = p.add_argument
    a("--drafter", required=True, help="drafter directory (save_pretrained)")
    a("--adapter", help="LoRA adapter directory to apply on the drafter")
    a("--target", default="smollm2-135m-instruct", help="known target name or local model directory")
    a("--data", required=True, help="prepared data directory (held-out prompts)")
    a("--out", help="report directory (offline_eval.json, acceptance.png)")
    a("--num-tokens", type=positive_int, default=3, help="chain length k (serving num_assistant_tokens)")
    a("--tree", help="also evaluate trees WIDTHxDEPTH, e.g. 8x4 (per window, slower)")
    a("--tree-budget", type=positive_int, help="keep this many nodes of each tree (highest path probability; default: all)")
    a("--max-tree-windows", type=positive_int, default=512, help="evaluate trees on at most this many windows")
    a("--num-flow-steps", type=positive_int, help="Euler steps (default: the drafter's serving setting)")
    a("--batch-size", type=positive_int, default=64, help="windows per batched drafter pass")
    a("--max-windows", type=positive_int, help="evaluate a seeded random subset of this many windows")
    a("--shards", type=parse_shards, help="evaluate only these finished shards, e.g. a held-out `7-25`")
    a("--reference", action="store_true", help="one drafter.draft call per window instead of the batched path")
    a("--walk-sequences", type=positive_int, help="also replay the serving walk on this many responses (seeded): the tau a "
                                         "serving loop would measure on them (draft, accept a, jump a + 1 tokens)")
    a("--dtype", choices=("float32", "bfloat16"), default="float32")
    a("--threads", type=positive_int, help="torch.set_num_threads")
    a("--seed", type=int, default=0, help="seed of the window subsets and the walk's responses")
    p.set_defaults(func=run_eval_offline)


def _tree_shape(text: str) -> tuple[int, int]:
    try:
        width, depth = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise usage_error("eval-offline", f"--tree must look like WIDTHxDEPTH (e.g. 8x4), got {text!r}.") from None
    if width < 1 or depth < 1:
        raise usage_error("eval-offline", f"--tree needs a positive width and depth (e.g. 8x4), got {text!r}.")
    return width, depth


def run_eval_offline(args: argparse.Namespace) -> int:
    from hf_chainflow import ChainFlowDrafter
    from hf_chainflow.cli import load_model_and_tokenizer
    from hf_chainflow.evaluation import evaluate_offline, strict_json
    from hf_chainflow.trainer import unwrap_drafter

    tree = _tree_shape(args.tree) if args.tree else None
    if args.tree_budget is not None and tree is None:
        raise usage_error("eval-offline", f"--tree-budget {args.tree_budget} cuts the trees of --tree; give --tree too "
                          f"(e.g. --tree 8x4).")
    check_model_source("--drafter", args.drafter)
    if args.adapter is not None and not Path(args.adapter).is_dir():
        raise ValueError(f"`--adapter` must be a LoRA adapter directory, got {args.adapter!r}, which does not exist.")
    check_output_dir("--out", args.out)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    target, _ = load_model_and_tokenizer(args.target, dtype)
    model = ChainFlowDrafter.from_pretrained(args.drafter, target=target, dtype=dtype)
    if args.adapter:
        from hf_chainflow.adapters import load_language_adapter

        model = load_language_adapter(model, args.adapter, Path(args.adapter).name)
    data = _window_dataset(args.data, unwrap_drafter(model).config, shards=args.shards)
    result = evaluate_offline(model, data, num_tokens=args.num_tokens, batch_size=args.batch_size,
                              max_windows=args.max_windows, tree=tree,
                              tree_budget=args.tree_budget, max_tree_windows=args.max_tree_windows, num_flow_steps=args.num_flow_steps,
                              batched=not args.reference, walk_sequences=args.walk_sequences, output_dir=args.out,
                              seed=args.seed)
    result["drafter"], result["data"] = str(args.drafter), str(args.data)
    if args.out:
        Path(args.out, "offline_eval.json").write_text(strict_json(result, indent=1))
    acc = " ".join(f"{a:.3f}" if a == a else "-" for a in result["acceptance"])  # NaN: no window reached it
    print(f"tau {result['tau']:.3f} over {result['num_windows']} windows (chain k={args.num_tokens}); acc@i {acc}")
    for name, stats in result["per_domain"].items():
        print(f"  {name:>12}: tau {stats['tau']:.3f} ({stats['num_windows']} windows)")
    if "tree" in result:
        budget = f" (budget {args.tree_budget} nodes)" if args.tree_budget else ""
        print(f"tree {args.tree}{budget}: tau {result['tree']['tau']:.3f} over {result['tree']['num_windows']} windows")
    for mode, walk in ((m, result["walk"][m]) for m in ("chain", "tree") if m in result.get("walk", {})):
        domains = ", ".join(f"{name} {stats['tau']:.3f}" for name, stats in walk["per_domain"].items())
        print(f"serving walk, {mode}: tau {walk['tau']:.3f} over {walk['rounds']} rounds of "
              f"{result['walk']['num_sequences']} responses ({domains})")
    return 0


__all__ = ["add_eval_offline_parser", "add_train_parser", "resolve_train_options", "run_eval_offline", "run_train"]
