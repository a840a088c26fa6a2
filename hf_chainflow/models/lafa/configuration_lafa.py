"""Lafa drafter configuration."""

from __future__ import annotations

import math

from huggingface_hub.dataclasses import strict
from transformers import AutoConfig, PreTrainedConfig

from hf_chainflow.checks import is_int
from hf_chainflow.models.lafa.binding_lafa import check_attention_only, target_fingerprint_of, text_config_of

# The target linear modules a LoRA may wrap (Llama / Qwen3 names) -> their (in, out) features as functions of the
# target's sizes (D hidden, I intermediate, H heads, K key-value heads, d head dim).
LORA_MODULES = {
    "q_proj": lambda D, I, H, K, d: (D, H * d),
    "k_proj": lambda D, I, H, K, d: (D, K * d),
    "v_proj": lambda D, I, H, K, d: (D, K * d),
    "o_proj": lambda D, I, H, K, d: (H * d, D),
    "gate_proj": lambda D, I, H, K, d: (D, I),
    "up_proj": lambda D, I, H, K, d: (D, I),
    "down_proj": lambda D, I, H, K, d: (I, D),
}


def _positive(name: str, value) -> None:
    if not is_int(value) or value < 1:
        raise ValueError(f"`{name}` must be a positive integer, got {value!r}.")


def _number(name: str, value, *, positive: bool, rule: str) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or (value <= 0 if positive else value < 0):
        raise ValueError(f"`{name}` must be a {'positive' if positive else 'non-negative'} finite number ({rule}), "
                         f"got {value!r}.")


@strict
class LafaConfig(PreTrainedConfig):
    r"""
    Configuration of a [`LafaDrafter`]: the weights that turn a target into its own block drafter (Lafa,
    self-speculative block flow), applied only to the noise rows of a fused verification forward, so that the
    verify rows compute exactly the target. Build one for a target with `LafaConfig.for_target(target.config)`.

    target_model_type / target_name (`str`, *optional*): the target's fingerprint (its name is recorded, not checked).
    target_hidden_size / vocab_size / target_num_layers / target_intermediate_size / target_num_attention_heads /
        target_num_key_value_heads / target_head_dim (`int`): the target's sizes, which fix the LoRA shapes; checked
        when binding (a drafter made for another target is refused, both fingerprints named).
    block_size (`int`): `B`, the tokens of one drafted block (>= 2): the first is the next bonus token, which the
        verify rows compute exactly, so a fused round commits at most `B` tokens.
    lora_rank (`int`) / lora_alpha (`float`): the LoRA of each target linear module in `lora_target_modules`
        (`delta = (alpha / rank) * B A x`, `B` zero-initialised so that a fresh drafter drafts as the bare target).
    lora_target_modules (`list[str]`, *optional*): which of `q_proj`, `k_proj`, `v_proj`, `o_proj`, `gate_proj`,
        `up_proj`, `down_proj` get a LoRA in every decoder layer; default all seven.
    time_embedding_size (`int`): width of the flow-time embedding (even: sine and cosine halves).
    time_conditioned_norms (`bool`): modulate each decoder layer's two RMSNorms and the final norm on the noise rows,
        `y * (1 + gamma(tau)) + beta(tau)`, zero-initialised (the identity).
    noise_std (`float`): the noise rows' inputs are a learned mask embedding plus the projected time embedding; with
        `noise_std > 0` seeded Gaussian noise of that std is added (the flow's `x0`), 0 (default) drafts from the
        learned embedding alone (a mask-token multi-token predictor).
    initializer_range (`float`): std of the normal initialiser (LoRA `A`, time MLP, mask embedding).
    pad_token_id / bos_token_id / eos_token_id (`int`, *optional*): the target's special-token ids (`for_target`).
    """

    model_type = "lafa"

    target_model_type: str | None = None
    target_name: str | None = None
    target_hidden_size: int = 576
    vocab_size: int = 49152
    target_num_layers: int = 30
    target_intermediate_size: int = 1536
    target_num_attention_heads: int = 9
    target_num_key_value_heads: int = 3
    target_head_dim: int = 64
    block_size: int = 4
    lora_rank: int = 16
    lora_alpha: float = 32.0
    lora_target_modules: list[str] | None = None
    time_embedding_size: int = 128
    time_conditioned_norms: bool = True
    noise_std: float = 0.0
    initializer_range: float = 0.02
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    tie_word_embeddings: bool = False

    def __post_init__(self, **kwargs):
        if self.lora_target_modules is None:
            self.lora_target_modules = list(LORA_MODULES)
        self.check_fields()  # plain `ValueError`s, raised before anything else is set up
        super().__post_init__(**kwargs)

    def validate_architecture(self):
        """Part of `@strict` validation (`config.validate()`)."""
        self.check_fields()

    def check_fields(self):
        """Every size positive, `block_size >= 2`, the LoRA modules known; raises `ValueError` otherwise."""
        for name in ("target_hidden_size", "vocab_size", "target_num_layers", "target_intermediate_size",
                     "target_num_attention_heads", "target_num_key_value_heads", "target_head_dim", "lora_rank",
                     "time_embedding_size"):
            _positive(name, getattr(self, name))
        if not is_int(self.block_size) or self.block_size < 2:
            raise ValueError(
                f"`block_size` must be an integer >= 2 (a block's first token is the bonus token the verify rows "
                f"already give, so a block of 1 drafts nothing), got {self.block_size!r}. Use e.g. `block_size=4`."
            )
        if self.time_embedding_size % 2:
            raise ValueError(f"`time_embedding_size` must be even (sine and cosine halves), got "
                             f"{self.time_embedding_size}; use e.g. {self.time_embedding_size + 1}.")
        _number("lora_alpha", self.lora_alpha, positive=True, rule="the LoRA scale is alpha / rank")
        _number("noise_std", self.noise_std, positive=False, rule="0: the learned mask embedding alone")
        _number("initializer_range", self.initializer_range, positive=True, rule="std of the normal initialiser")
        modules = self.lora_target_modules
        if not isinstance(modules, list) or not modules or any(m not in LORA_MODULES for m in modules) \
                or len(set(modules)) != len(modules):
            raise ValueError(
                f"`lora_target_modules` must be a non-empty list of distinct names among {list(LORA_MODULES)}, got "
                f"{modules!r}. Leave it unset for all seven."
            )
        for name in ("time_conditioned_norms", "tie_word_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ValueError(f"`{name}` must be True or False, got {value!r} ({type(value).__name__}).")
        if self.target_num_attention_heads % self.target_num_key_value_heads:
            raise ValueError(
                f"`target_num_attention_heads` ({self.target_num_attention_heads}) must be a multiple of "
                f"`target_num_key_value_heads` ({self.target_num_key_value_heads}); read both from the target with "
                f"`LafaConfig.for_target(target.config)`."
            )

    @property
    def lora_scaling(self) -> float:
        return float(self.lora_alpha) / self.lora_rank

    def lora_shapes(self) -> dict[str, tuple[int, int]]:
        """`(in_features, out_features)` of each module of `lora_target_modules` in the target."""
        sizes = (self.target_hidden_size, self.target_intermediate_size, self.target_num_attention_heads,
                 self.target_num_key_value_heads, self.target_head_dim)
        return {name: LORA_MODULES[name](*sizes) for name in self.lora_target_modules}

    def target_fingerprint(self) -> dict:
        """The target this drafter was made for (compare `binding_lafa.target_fingerprint_of(target.config)`)."""
        return {"model_type": self.target_model_type, "hidden_size": self.target_hidden_size,
                "vocab_size": self.vocab_size, "num_hidden_layers": self.target_num_layers,
                "intermediate_size": self.target_intermediate_size,
                "num_attention_heads": self.target_num_attention_heads,
                "num_key_value_heads": self.target_num_key_value_heads, "head_dim": self.target_head_dim}

    @classmethod
    def for_target(cls, target_config, **overrides) -> "LafaConfig":
        """Size a drafter for `target_config` (a target model's config) and record its fingerprint; any field can be
        overridden, e.g. `LafaConfig.for_target(model.config, block_size=3, lora_rank=8)`. A target with recurrent
        layers (Qwen3.5, Qwen3-Next) is refused (`binding_lafa.LafaTargetError`)."""
        check_attention_only(target_config)
        found = target_fingerprint_of(target_config)
        missing = [k for k, v in found.items() if k != "model_type" and not is_int(v)]
        if missing:
            raise ValueError(
                f"`target_config` must describe a Llama-style causal LM with integer {missing}, got "
                f"{type(target_config).__name__} with {found}."
            )
        cfg = text_config_of(target_config)
        vocab = found["vocab_size"]
        pad = getattr(cfg, "pad_token_id", None)
        fields = dict(
            target_model_type=found["model_type"],
            target_name=getattr(target_config, "name_or_path", None) or None,
            target_hidden_size=found["hidden_size"],
            vocab_size=vocab,
            target_num_layers=found["num_hidden_layers"],
            target_intermediate_size=found["intermediate_size"],
            target_num_attention_heads=found["num_attention_heads"],
            target_num_key_value_heads=found["num_key_value_heads"],
            target_head_dim=found["head_dim"],
            pad_token_id=pad if pad is not None and 0 <= pad < vocab else None,
            bos_token_id=getattr(cfg, "bos_token_id", None),
            eos_token_id=getattr(cfg, "eos_token_id", None),
        )
        fields.update(overrides)
        return cls(**fields)


AutoConfig.register("lafa", LafaConfig, exist_ok=True)

__all__ = ["LORA_MODULES", "LafaConfig"]
