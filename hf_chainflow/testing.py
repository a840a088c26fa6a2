"""Targets and test doubles for tests, examples and benchmarks.

- `tiny_target(family)`: tiny random Llama / Qwen3 / Qwen3.5-hybrid causal LMs built in-process (no download).
"""

from __future__ import annotations

import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    Qwen3_5ForCausalLM,
    Qwen3_5TextConfig,
    Qwen3Config,
    Qwen3ForCausalLM,
)

TINY_FAMILIES = ("llama", "qwen3", "qwen3_5")


def tiny_target(family: str = "llama", *, vocab_size: int = 256, hidden_size: int = 64, num_layers: int = 4,
                seed: int = 0, attn_implementation: str = "sdpa") -> PreTrainedModel:
    """A tiny random causal LM of the given family, in float32 eval mode.

    `family` is one of `"llama"`, `"qwen3"`, `"qwen3_5"` (a hybrid stack whose `layer_types` mix
    `linear_attention` (Gated DeltaNet) and `full_attention`).
    """
    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden_size // 4,
        max_position_embeddings=2048,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    if family == "llama":
        config = LlamaConfig(**common)
        cls = LlamaForCausalLM
    elif family == "qwen3":
        config = Qwen3Config(**common)
        cls = Qwen3ForCausalLM
    elif family == "qwen3_5":
        layer_types = ["linear_attention" if (i % 2 == 0) else "full_attention" for i in range(num_layers)]
        config = Qwen3_5TextConfig(
            **common,
            layer_types=layer_types,
            linear_conv_kernel_dim=4,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
        )
        cls = Qwen3_5ForCausalLM
    else:
        raise ValueError(f"`family` must be one of {TINY_FAMILIES}, got {family!r}.")
    config._attn_implementation = attn_implementation
    model = cls(config)
    # Random init gives near-uniform logits; scale the head up so greedy decoding has clear winners and
    # realistic (peaked) distributions, as a trained model would.
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return model.eval()
