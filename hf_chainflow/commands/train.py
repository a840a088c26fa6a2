"""`hf-chainflow train` trains a ChainFlow drafter (or a LoRA adapter) on a prepared data directory
(`hf_chainflow.training.workflows.train_drafter`); `hf-chainflow eval-offline` measures its τ (`eval_offline.py`).

    hf-chainflow train --target smollm2-135m-instruct --data DATA_DIR --out DRAFTER_DIR [--config train.yaml]
    hf-chainflow train --init-from EN_DRAFTER --data TR_DATA --out TR_DRAFTER --lr 1.2e-4 --replay EN_DATA
    hf-chainflow train --init-from D1 --data NEW --replay OLD1 --replay-shards 0-20 --replay OLD2 --replay-shards all
    hf-chainflow train --init-from EN_DRAFTER --data TR_DATA --out TR_ADAPTER --lora tr
    hf-chainflow eval-offline --drafter DRAFTER_DIR --data HELD_OUT_DIR --out REPORT_DIR [--tree 8x4]
    hf-chainflow train --drafter-type dflash --data DATA_DIR --out DFLASH_DIR [--config train_dflash.yaml]

`--config` reads a YAML mapping whose keys are the long option names (with `_` or `-`); options given on the
command line win over the file.  Two keys take mappings: `drafter` (ChainFlowConfig fields for a fresh drafter) and
`training_args` (any `ChainFlowTrainingArguments` field, e.g. the loss weights); on the command line they are the
repeatable `--drafter-arg KEY=VALUE` and `--training-arg KEY=VALUE` (values parsed as YAML).

`--drafter-type dflash` trains a DFlash drafter instead (`hf_chainflow.training.dflash_workflow`), a plain transformers
`muse_glimmer_assistant` folder that stock transformers runs with `generate(..., speculation_type="dflash")`: data
prepared with `--target-layers`; `drafter` holds `hf_chainflow.training.dflash.DFLASH_DRAFTER_FIELDS`, `training_args`
`DFlashTrainingArguments` fields; the ChainFlow-only options (`--lora`, `--vae-*`, `--train-flow-steps`) are refused.
"""

from __future__ import annotations

import argparse
import functools
from pathlib import Path

from hf_chainflow.checks import is_int, is_number
from hf_chainflow.cli_args import (check_model_source, check_output_dir, check_writable_output, parse_shards,
                                   usage_error)

# Built-in defaults of `train`; the parser's defaults are None so that a YAML value can fill any option not given.
TRAIN_DEFAULTS = {
    "target": "smollm2-135m-instruct", "data": None, "out": None, "init_from": None, "lora": None, "lora_rank": 8,
    "epochs": 15.0, "max_steps": -1, "batch_size": 64, "lr": 5e-4, "grad_accum": 1, "seed": 0,
    "logging_steps": 50, "save_steps": 500, "save_total_limit": 2, "vae_pretrain_steps": 0, "vae_lr_ratio": 1 / 20,
    "train_flow_steps": None, "max_windows": None, "shards": None, "replay": None, "replay_shards": None, "replay_fraction": 0.2, "num_workers": 0,
    "resume": None, "threads": None, "dtype": "float32", "drafter": {}, "training_args": {},
    "drafter_type": "chainflow",
}
DRAFTER_TYPES = ("chainflow", "dflash")


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
    a("--drafter-type", choices=DRAFTER_TYPES,
      help="chainflow (default) or dflash: a DFlash drafter for stock transformers' speculation_type='dflash'")
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
    if opts["drafter_type"] not in DRAFTER_TYPES:
        raise usage_error("train", f"--drafter-type must be one of {list(DRAFTER_TYPES)}, got "
                          f"{opts['drafter_type']!r}.")
    if opts["drafter_type"] == "dflash":
        from hf_chainflow.training.dflash_workflow import CHAINFLOW_ONLY_OPTIONS

        given = [k for k in CHAINFLOW_ONLY_OPTIONS if opts[k] != TRAIN_DEFAULTS[k]]
        if given:
            raise usage_error("train", f"{['--' + k.replace('_', '-') for k in given]} train ChainFlow drafters; a "
                              f"DFlash drafter (--drafter-type dflash) has no VAE, flow or adapters: drop them.")
    if opts["lora"] and not opts["init_from"]:
        raise usage_error("train", "--lora adapts an existing drafter; give it with --init-from.")
    _check_train_numbers(opts)
    _check_field_names(opts)
    check_output_dir("--out", opts["out"])
    if opts["init_from"]:
        check_model_source("--init-from", opts["init_from"])
    if opts["resume"] not in (None, "last"):  # a folder; `last` is looked up with the data, before the target loads
        from hf_chainflow.training.checkpointing import check_resume_folder

        check_resume_folder(opts["resume"], flags=("--resume", "--out"))
    return opts


# option: (smallest value, whether it must be an integer, whether None is allowed)
_TRAIN_NUMBERS = {
    "epochs": (0, False, False), "batch_size": (1, True, False), "lr": (0, False, False), "grad_accum": (1, True, False),
    "logging_steps": (1, True, False), "save_steps": (1, True, False), "save_total_limit": (1, True, False),
    "lora_rank": (1, True, False), "vae_pretrain_steps": (0, True, False), "vae_lr_ratio": (0, False, False),
    "num_workers": (0, True, False), "max_windows": (1, True, True),
    "threads": (1, True, True), "seed": (None, True, False),
}


def _check_train_numbers(opts: dict) -> None:
    """Numbers from the command line or the YAML file, checked before anything loads."""
    for key, (low, integer, optional) in _TRAIN_NUMBERS.items():
        value = opts[key]
        if value is None and optional:
            continue
        kind = "an integer" if integer else "a number"
        ok = is_int(value) if integer else is_number(value)
        if ok and low is not None:
            ok = value >= low if integer or low else value > 0
        if not ok:
            rule = "" if low is None else (f" >= {low}" if integer else " > 0")
            raise usage_error("train", f"--{key.replace('_', '-')} must be {kind}{rule}, got {value!r}.")
    from hf_chainflow.training.arguments import check_train_flow_steps

    try:  # the rule `ChainFlowTrainingArguments` applies, checked here before anything loads
        check_train_flow_steps(opts["train_flow_steps"], "--train-flow-steps")
    except ValueError as err:
        raise usage_error("train", str(err)) from None
    steps = opts["max_steps"]
    if not is_int(steps) or (steps != -1 and steps < 1):
        raise usage_error("train", f"--max-steps must be a positive integer (or -1: train for --epochs), got "
                          f"{steps!r}.")


def _check_field_names(opts: dict) -> None:
    """`--drafter-arg` / `--training-arg` keys must name fields, or a typo would be ignored (or fail after loading)."""
    import dataclasses

    from hf_chainflow.models.chainflow.configuration_chainflow import ChainFlowConfig
    from hf_chainflow.training.arguments import ChainFlowTrainingArguments

    checks = (("--drafter-arg", "drafter", set(ChainFlowConfig.__annotations__), "ChainFlowConfig"),
              ("--training-arg", "training_args", {f.name for f in dataclasses.fields(ChainFlowTrainingArguments)},
               "ChainFlowTrainingArguments"))
    if opts["drafter_type"] == "dflash":
        from hf_chainflow.training.dflash import DFLASH_DRAFTER_FIELDS
        from hf_chainflow.training.dflash_trainer import DFlashTrainingArguments

        checks = (("--drafter-arg", "drafter", set(DFLASH_DRAFTER_FIELDS), "hf_chainflow.training.dflash.dflash_config"),
                  ("--training-arg", "training_args", {f.name for f in dataclasses.fields(DFlashTrainingArguments)},
                   "DFlashTrainingArguments"))
    for flag, key, fields, owner in checks:
        unknown = sorted(set(opts[key]) - fields)
        if unknown:
            raise usage_error("train", f"{flag} (or `{key}` in --config) names {unknown}, which are not "
                              f"{owner} fields; check the spelling (see `help({owner})`).")


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


def run_train(args: argparse.Namespace) -> int:
    o = resolve_train_options(args)
    check_writable_output("--out", o["out"])  # before any model loads
    out = Path(o["out"])
    created = not out.exists()
    if o["drafter_type"] == "dflash":
        from hf_chainflow.training.dflash_workflow import train_dflash_drafter

        train_drafter = functools.partial(train_dflash_drafter, defaults=TRAIN_DEFAULTS)
    else:
        from hf_chainflow.training.workflows import train_drafter

    try:
        return train_drafter(o)
    except BaseException:
        if created and out.is_dir() and not any(out.iterdir()):
            out.rmdir()  # a run that failed before writing anything leaves no empty --out behind
        raise


__all__ = ["DRAFTER_TYPES", "TRAIN_DEFAULTS", "add_train_parser", "parse_shard_selection", "replay_sources",
           "resolve_train_options", "run_train"]
