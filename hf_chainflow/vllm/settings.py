"""The proposer's settings and the `speculative_config` dict that carries them into vLLM (no vLLM import here).

vLLM builds a custom proposer as `cls(vllm_config)`: nothing but the speculative config reaches it. Its typed,
free-form field for a drafter's loading options is `draft_load_config.model_loader_extra_config` (vLLM reads
`draft_load_config` only for draft models it loads itself, never for `custom_class`), so the drafter path and the
drafting settings travel there, under the key `"chainflow"`:

    {"method": "custom_class", "model": "hf_chainflow.vllm.proposer.ChainFlowProposer",
     "num_speculative_tokens": 3,
     "draft_load_config": {"model_loader_extra_config": {"chainflow": {"drafter_path": "...", ...}}}}
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from hf_chainflow.checks import check_positive_int, is_int
from hf_chainflow.generation.settings import check_trust_ngram

PROPOSER_CLASS = "hf_chainflow.vllm.proposer.ChainFlowProposer"
SETTINGS_KEY = "chainflow"
DRAFTER_DTYPES = ("float32", "bfloat16")


@dataclass(frozen=True)
class ProposerSettings:
    """What the ChainFlow proposer reads from vLLM's speculative config.

    drafter_path: folder of a saved ChainFlow drafter (`save_pretrained`); default: the shipped one.
    num_flow_steps: Euler steps per drafter pass (None: the drafter's `generation_config.num_flow_steps`).
    dtype: the drafter's weights, `"float32"` (default) or `"bfloat16"`; never changes what is emitted.
    lookup_trust_ngram: None (off) or `n`: when the last `n..lookup_ngram` tokens occurred earlier in the request,
        propose the tokens that followed that occurrence instead of a ChainFlow draft (prompt lookup first).
    lookup_ngram: the longest n-gram looked up (default 3).
    """

    drafter_path: str
    num_flow_steps: int | None = None
    dtype: str = "float32"
    lookup_trust_ngram: int | None = None
    lookup_ngram: int = 3

    def to_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items()}


FIELDS = tuple(ProposerSettings.__dataclass_fields__)


def _positive_int(name: str, value, allow_none: bool) -> None:
    check_positive_int(name, value, optional=allow_none, none="off", owner="ChainFlow vLLM setting ")


def check_settings(raw: dict) -> ProposerSettings:
    """Validate a settings dict (from `speculative_config` or a hand-written `vllm serve --speculative-config`)."""
    if not isinstance(raw, dict):
        raise ValueError(f"The ChainFlow settings (`draft_load_config.model_loader_extra_config[{SETTINGS_KEY!r}]`) "
                         f"must be a dict, got {type(raw).__name__}.")
    mode = raw.get("draft_mode", "chain")
    if mode != "chain":
        raise ValueError(
            f"ChainFlow vLLM setting `draft_mode` must be 'chain', got {mode!r}: vLLM verifies one chain of draft "
            "tokens per request (it has no tree attention), so a ChainFlow tree cannot be verified there. Use "
            "`draft_mode='chain'` (the default) with `num_speculative_tokens` as the chain length, or "
            "`target.generate(..., assistant_model=drafter)` for tree drafting.")
    unknown = sorted(set(raw) - set(FIELDS) - {"draft_mode"})
    if unknown:
        raise ValueError(f"Unknown ChainFlow vLLM setting(s) {unknown}; the settings are {list(FIELDS)} "
                         "(and `draft_mode`, which must be 'chain').")
    path = raw.get("drafter_path")
    if not isinstance(path, (str, os.PathLike)) or not (Path(path) / "config.json").is_file():
        raise ValueError(f"ChainFlow vLLM setting `drafter_path` must be the folder of a saved ChainFlow drafter "
                         f"(with config.json), got {path!r}. Use `hf_chainflow.checkpoints.default_drafter_path()` "
                         "for the shipped one, or the `--out` folder of `hf-chainflow train`.")
    settings = ProposerSettings(**{k: raw[k] for k in FIELDS if k in raw})
    _positive_int("num_flow_steps", settings.num_flow_steps, allow_none=True)
    _positive_int("lookup_trust_ngram", settings.lookup_trust_ngram, allow_none=True)
    _positive_int("lookup_ngram", settings.lookup_ngram, allow_none=False)
    if settings.dtype not in DRAFTER_DTYPES:
        raise ValueError(f"ChainFlow vLLM setting `dtype` must be one of {DRAFTER_DTYPES}, got {settings.dtype!r}.")
    check_trust_ngram(settings.lookup_trust_ngram, settings.lookup_ngram, "ChainFlow vLLM setting `")
    return ProposerSettings(**{**settings.to_dict(), "drafter_path": str(Path(path).resolve())})


def speculative_config(drafter_path: str | os.PathLike | None = None, num_speculative_tokens: int = 3,
                       **settings) -> dict:
    """The `speculative_config` dict that runs a ChainFlow drafter in vLLM, as chains of `num_speculative_tokens`.

        llm = vllm.LLM(model=target_folder, speculative_config=hf_chainflow.vllm.speculative_config())

    `drafter_path`: a saved drafter's folder (default: the drafter shipped for SmolLM2-135M-Instruct).
    `settings`: `num_flow_steps`, `dtype`, `lookup_trust_ngram`, `lookup_ngram` (see `ProposerSettings`), and
    `draft_mode`, which can only be `"chain"`. Raises `ValueError` naming the setting when one is wrong.
    """
    from hf_chainflow import ChainFlowConfig

    if drafter_path is None:
        from hf_chainflow.checkpoints import default_drafter_path

        drafter_path = default_drafter_path()
    checked = check_settings({"drafter_path": str(drafter_path), **settings})
    K = ChainFlowConfig.from_pretrained(checked.drafter_path).num_draft_positions
    if not is_int(num_speculative_tokens) or not (
            1 <= num_speculative_tokens <= K):
        raise ValueError(f"`num_speculative_tokens` must be an integer in [1, {K}] (the drafter at "
                         f"{checked.drafter_path} predicts K={K} positions per pass), got {num_speculative_tokens!r}.")
    return {
        "method": "custom_class",
        "model": PROPOSER_CLASS,
        "num_speculative_tokens": num_speculative_tokens,
        "draft_load_config": {"model_loader_extra_config": {SETTINGS_KEY: checked.to_dict()}},
    }


def speculative_config_json(*args, **kwargs) -> str:
    """`speculative_config(...)` as the JSON that `vllm serve --speculative-config` takes."""
    return json.dumps(speculative_config(*args, **kwargs))
