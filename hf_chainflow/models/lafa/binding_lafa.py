"""Which target a Lafa drafter fits, and which of the target's modules its noise-row weights act on.

- `LafaTargetError` (a `ValueError`): a target Lafa cannot run on (a hybrid stack with Gated DeltaNet layers, a
  model without the Llama-style decoder modules) or another target than the drafter was made for; the message names
  the value, the reason and the fix.
- `check_attention_only(target_config)`: refuses recurrent layers before anything is built or run.
- `target_fingerprint_of(target_config)`: the fields that must match between a drafter and its target.
- `find_target_modules(target, config)`: the input embeddings, the linear modules that get a LoRA and the RMSNorms
  that get a time-conditioned modulation, each checked against the drafter's shapes (`LafaTargetModules`).

Nothing here holds weights or imports `hf_chainflow.generation`: the drafter (`modeling_lafa.LafaDrafter`) binds
with it, the fused forward (`hf_chainflow.generation.lafa`) takes the bound drafter.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

# The layer types of a recurrent (linear-attention / state-space) layer, as transformers' configs spell them in
# `layer_types` (the same list as `hf_chainflow.generation.hybrid`, which this layer may not import).
RECURRENT_LAYER_TYPES = ("linear_attention", "mamba", "conv", "hybrid", "hybrid_sliding")
# The decoder layer's RMSNorms a time-conditioned modulation wraps (Llama, Qwen3, Mistral, ... names).
LAYER_NORMS = ("input_layernorm", "post_attention_layernorm")


class LafaTargetError(ValueError):
    """A target a Lafa drafter cannot run on, or not the one it was made for (see the message: value, reason,
    fix)."""


def text_config_of(target_config):
    """The decoder's text config of a (possibly multimodal) model config."""
    if hasattr(target_config, "get_text_config"):
        return target_config.get_text_config(decoder=True)
    return target_config


def check_attention_only(target_config) -> None:
    """Refuse a target with recurrent layers (Qwen3.5 / Qwen3-Next Gated DeltaNet, Mamba, ...): a recurrent layer
    runs its inputs in order, so a noise block cannot see itself bidirectionally, and the verify rows would have to
    run after the noise rows they must never see."""
    cfg = text_config_of(target_config)
    layer_types = list(getattr(cfg, "layer_types", None) or [])
    recurrent = sorted({t for t in layer_types if t in RECURRENT_LAYER_TYPES})
    if recurrent:
        indices = [i for i, t in enumerate(layer_types) if t in RECURRENT_LAYER_TYPES]
        raise LafaTargetError(
            f"Lafa needs an attention-only target, but this {getattr(cfg, 'model_type', None)!r} target has "
            f"recurrent layers {recurrent} (layers {indices[:8]}{' ...' if len(indices) > 8 else ''} of "
            f"`layer_types`): a Gated DeltaNet (or other recurrent) layer reads its inputs in order, so a noise block "
            f"cannot see itself bidirectionally and the verify rows cannot be kept from seeing the noise rows. Use a "
            f"dense attention target (Llama, Qwen3, SmolLM2, ...), or the ChainFlow drafter, which serves hybrids."
        )


def target_fingerprint_of(target_config) -> dict:
    """What a Lafa drafter's shapes depend on, read from a target's config (`LafaConfig.target_fingerprint()` is
    the drafter's side)."""
    cfg = text_config_of(target_config)
    heads = getattr(cfg, "num_attention_heads", None)
    hidden = getattr(cfg, "hidden_size", None)
    head_dim = getattr(cfg, "head_dim", None)
    if head_dim is None and isinstance(hidden, int) and isinstance(heads, int) and heads:
        head_dim = hidden // heads
    return {
        "model_type": getattr(cfg, "model_type", None),
        "hidden_size": hidden,
        "vocab_size": getattr(cfg, "vocab_size", None),
        "num_hidden_layers": getattr(cfg, "num_hidden_layers", None),
        "intermediate_size": getattr(cfg, "intermediate_size", None),
        "num_attention_heads": heads,
        "num_key_value_heads": getattr(cfg, "num_key_value_heads", None) or heads,
        "head_dim": head_dim,
    }


@dataclass
class LafaTargetModules:
    """The target's modules a bound Lafa drafter hooks during a fused forward (borrowed, never owned or saved).

    embeddings: the input embeddings (the noise rows' inputs are replaced at their output).
    linears: `"layers.{i}.{name}"` -> the linear module that gets the LoRA of the same key.
    norms: `"layers.{i}.{norm}"` and `"norm"` (the final norm) -> the RMSNorm that gets the modulation of the same
        key (empty without `time_conditioned_norms`).
    """

    embeddings: nn.Module
    linears: dict[str, nn.Module]
    norms: dict[str, nn.Module]


def _decoder(target: nn.Module) -> nn.Module | None:
    decoder = target.get_decoder() if hasattr(target, "get_decoder") else None
    if decoder is None or not hasattr(decoder, "layers"):
        decoder = getattr(target, "model", None)
    return decoder if decoder is not None and isinstance(getattr(decoder, "layers", None), nn.ModuleList) else None


def _unique_child(layer: nn.Module, name: str) -> nn.Module | None:
    """The one submodule of `layer` whose last name is `name` (`self_attn.q_proj` for `q_proj`), else None."""
    found = [m for path, m in layer.named_modules() if path.rpartition(".")[2] == name]
    return found[0] if len(found) == 1 else None


def find_target_modules(target: nn.Module, config) -> LafaTargetModules:
    """The modules of `target` that a drafter with `config` (a `LafaConfig`) hooks, each checked against the
    drafter's shapes; `LafaTargetError` naming the module, its shape and the drafter's otherwise."""
    kind = type(target).__name__
    decoder = _decoder(target)
    if decoder is None:
        raise LafaTargetError(
            f"`target` ({kind}) has no decoder with a `layers` ModuleList (`target.get_decoder().layers` or "
            f"`target.model.layers`): Lafa hooks the decoder layers of a Llama-style causal LM. Pass a "
            f"`...ForCausalLM` model such as `LlamaForCausalLM` or `Qwen3ForCausalLM`."
        )
    if len(decoder.layers) != config.target_num_layers:
        raise LafaTargetError(
            f"`target` ({kind}) has {len(decoder.layers)} decoder layers, but this drafter was made for "
            f"{config.target_num_layers} ({config.target_fingerprint()}). Load or train a drafter for this target "
            f"(`LafaConfig.for_target(target.config)`)."
        )
    shapes = config.lora_shapes()
    linears, norms = {}, {}
    for i, layer in enumerate(decoder.layers):
        for name in config.lora_target_modules:
            module = _unique_child(layer, name)
            want = shapes[name]
            got = (getattr(module, "in_features", None), getattr(module, "out_features", None))
            if module is None or got != want:
                what = "no unique module" if module is None else f"a module of (in, out) = {got}"
                raise LafaTargetError(
                    f"`lora_target_modules` names {name!r}, but decoder layer {i} of `target` ({kind}) has {what} of "
                    f"that name; the drafter's LoRA for it is (in, out) = {want}. Use a target of the family the "
                    f"drafter was made for ({config.target_fingerprint()}), or leave {name!r} out of "
                    f"`lora_target_modules`."
                )
            linears[f"layers.{i}.{name}"] = module
        if config.time_conditioned_norms:
            for name in LAYER_NORMS:
                module = getattr(layer, name, None)
                if not isinstance(module, nn.Module):
                    raise LafaTargetError(
                        f"`time_conditioned_norms=True` modulates each decoder layer's {LAYER_NORMS}, but decoder "
                        f"layer {i} of `target` ({kind}) has no `{name}`. Use a Llama-style target, or a drafter "
                        f"with `time_conditioned_norms=False`."
                    )
                norms[f"layers.{i}.{name}"] = module
    if config.time_conditioned_norms:
        final = getattr(decoder, "norm", None)
        if not isinstance(final, nn.Module):
            raise LafaTargetError(
                f"`time_conditioned_norms=True` modulates the decoder's final norm, but `target` ({kind}) has no "
                f"`norm` on its decoder. Use a Llama-style target, or a drafter with `time_conditioned_norms=False`."
            )
        norms["norm"] = final
    embeddings = target.get_input_embeddings()
    if embeddings is None or getattr(embeddings, "weight", None) is None \
            or tuple(embeddings.weight.shape) != (config.vocab_size, config.target_hidden_size):
        weight = getattr(embeddings, "weight", None)
        shape = None if weight is None else tuple(weight.shape)
        raise LafaTargetError(
            f"`target` ({kind}) has input embeddings of shape {shape}; the drafter was made for "
            f"({config.vocab_size}, {config.target_hidden_size}). Use the target the drafter was made for."
        )
    return LafaTargetModules(embeddings=embeddings, linears=linears, norms=norms)


__all__ = ["LAYER_NORMS", "RECURRENT_LAYER_TYPES", "LafaTargetError", "LafaTargetModules", "check_attention_only",
           "find_target_modules", "target_fingerprint_of", "text_config_of"]
