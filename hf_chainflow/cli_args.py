"""Argument types and up-front checks shared by the `hf-chainflow` subcommands.

Each check raises `ValueError` naming the option, the value received, the rule and the fix; the `hf-chainflow` command
(`hf_chainflow.commands.main`) prints such errors as `hf-chainflow <command>: error: <message>` (exit status 1)
instead of a traceback.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from hf_chainflow.fileio import HUB_ID, check_local_or_hub, check_model_folder, check_writable



def usage_error(command: str, message: str) -> SystemExit:
    """A usage mistake found while reading options, printed as `main` prints the `ValueError`s of the checks."""
    return SystemExit(f"hf-chainflow {command}: error: {message}")


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def check_output_dir(flag: str, path: str | Path | None) -> None:
    """An output directory may exist (runs resume into it) but must not be a file."""
    if path is not None and Path(path).exists() and not Path(path).is_dir():
        raise ValueError(f"`{flag}` must name a directory, got {str(path)!r}, which is an existing file; choose "
                         f"another path.")


def check_writable_output(flag: str, path: str | Path) -> None:
    """An output folder (`--out`) must be a folder this process can write to (`check_output_dir`, then
    `fileio.check_writable`), checked before any model loads."""
    check_output_dir(flag, path)
    check_writable(flag, path)


def check_model_source(flag: str, value: str, known: tuple[str, ...] = ()) -> None:
    """A model argument must be a known name, a saved model's folder (`check_model_folder`), or a Hub repo id
    (`namespace/name`) that is in the local Hub cache or reachable (`fileio.check_local_or_hub`).

    Without this check a mistyped local path is sent to the Hub, which retries for about a minute before failing, and
    an empty folder fails with an `OSError` only after the other models have loaded.
    """
    if value in known:
        return
    if Path(value).is_dir():
        check_model_folder(flag, value)
        return
    if Path(value).exists():
        raise ValueError(f"`{flag}` must be a model directory, got {value!r}, which is a file; give the directory "
                         f"that holds its config.json.")
    if not HUB_ID.match(value):
        names = f"a known name ({', '.join(known)}), " if known else ""
        raise ValueError(f"`{flag}` must be {names}an existing local directory or a Hub repo id `namespace/name`, "
                         f"got {value!r}, which is none of these; check the path.")
    check_local_or_hub(flag, value)


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


__all__ = ["check_model_source", "check_output_dir", "check_writable_output", "parse_shards", "positive_int",
           "usage_error"]
