"""Drafters shipped inside the package: the ChainFlow drafter of each target (`config.json`, `model.safetensors`,
`generation_config.json`; `ChainFlowDrafter.from_pretrained(path, target=target)`) in the folder named after the target,
and comparison drafters beside it: `<target>-flashmap` (a ChainFlow drafter configured as the FlashMap-style variant)
and `<target>-dflash` (a stock transformers DFlash drafter: `AutoModel.from_pretrained(path, dtype=target.dtype)`,
docs/dflash.md)."""

from __future__ import annotations

from pathlib import Path

DEFAULT_TARGET = "smollm2-135m-instruct"


def default_drafter_path(target: str = DEFAULT_TARGET) -> Path:
    """The folder of the drafter shipped for `target`; a `FileNotFoundError` saying what to do when absent."""
    path = Path(__file__).parent / target
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"No drafter is shipped for target {target!r} in this installation (expected {path}/config.json). "
            f"Train one (`hf-chainflow train ... --out DIR`) and pass its directory with `--drafter-path DIR`."
        )
    return path


__all__ = ["DEFAULT_TARGET", "default_drafter_path"]
