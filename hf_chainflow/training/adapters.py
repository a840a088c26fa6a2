"""Per-language LoRA adapters for a ChainFlow drafter, with `peft`.

One base drafter (e.g. English) stays loaded; each language is a small LoRA adapter over

- the velocity network's linear layers (input/context/output projections, time MLP, self- and cross-attention
  projections, feed-forward), which carry the transport from context to future latents;
- the path head's linear layers (`state_proj`, `mlp.1`, `out`), which carry the prefix correction;
- the Markov head's `u1` embedding (a low-rank update of the first-order transition bias, which is largely
  language-specific).

The VAE is left out: it defines the latent space shared by every language's flow, and the lm_head/embeddings
belong to the target.  The path head's per-offset tensor `offset_proj` and the Markov `u2` factor are raw
parameters, not layers, so LoRA does not reach them.

    model = add_language_adapter(drafter, "tr")          # a PeftModel; train it with ChainFlowTrainer
    model.save_pretrained("adapters")                    # adapters/tr/adapter_model.safetensors (+ config)
    model = load_language_adapter(drafter, "adapters/tr", "tr")   # or onto an existing PeftModel
    model.set_adapter("de")                              # switch, no reload of the base drafter
    with model.disable_adapter(): ...                    # the base drafter
    drafting.draft(unwrap_drafter(model), ...)           # drafts with the active adapter
"""

from __future__ import annotations

import os

from peft import LoraConfig, PeftModel, get_peft_model

from hf_chainflow.checks import check_positive_int
from hf_chainflow.models.chainflow.modeling_chainflow import ChainFlowDrafter
from hf_chainflow.training.trainer import unwrap_drafter

# Full-match regex over module names (peft matches a string `target_modules` with `re.fullmatch`).
LORA_TARGET_MODULES = (
    r"(.*\.)?velocity\.experts\.\d+\.("
    r"in_proj|ctx_proj|out_proj|time_mlp\.[02]|blocks\.\d+\.(self_attn|cross_attn)\.(q_proj|kv_proj|o_proj)"
    r"|blocks\.\d+\.mlp\.[02])"
    r"|(.*\.)?path_head\.(state_proj|mlp\.1|out)"
    r"|(.*\.)?markov_head\.u1"
)


def lora_config(r: int = 8, lora_alpha: int = 16, lora_dropout: float = 0.0,
                target_modules: str | list[str] = LORA_TARGET_MODULES, **kwargs) -> LoraConfig:
    """A `LoraConfig` for a ChainFlow drafter (see the module docstring for what it adapts)."""
    check_positive_int("r", r, meaning="the LoRA rank")
    return LoraConfig(r=r, lora_alpha=lora_alpha, lora_dropout=lora_dropout, target_modules=target_modules,
                      **kwargs)


def add_language_adapter(model: ChainFlowDrafter | PeftModel, name: str, config: LoraConfig | None = None
                         ) -> PeftModel:
    """Add a trainable LoRA adapter `name` and make it active.

    `model` is a bound `ChainFlowDrafter` (wrapped into a `PeftModel`; its own weights are frozen) or a
    `PeftModel` that already holds other adapters (added alongside them).
    """
    config = config or lora_config()
    if isinstance(model, PeftModel):
        if name in model.peft_config:
            raise ValueError(f"The model already has an adapter named {name!r} (adapters: "
                             f"{sorted(model.peft_config)}); choose another name.")
        model.add_adapter(name, config)
        model.set_adapter(name)
        return model
    unwrap_drafter(model)._require_bound()
    return get_peft_model(model, config, adapter_name=name)


def load_language_adapter(model: ChainFlowDrafter | PeftModel, path: str | os.PathLike, name: str,
                          is_trainable: bool = False) -> PeftModel:
    """Load the adapter saved at `path` under `name` (onto a bound drafter, or next to a `PeftModel`'s adapters),
    and make it active."""
    if isinstance(model, PeftModel):
        model.load_adapter(str(path), adapter_name=name, is_trainable=is_trainable)
        model.set_adapter(name)
        return model
    unwrap_drafter(model)._require_bound()
    return PeftModel.from_pretrained(model, str(path), adapter_name=name, is_trainable=is_trainable)


__all__ = ["LORA_TARGET_MODULES", "add_language_adapter", "load_language_adapter", "lora_config"]
