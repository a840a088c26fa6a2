"""ChainFlow drafter configuration."""

from __future__ import annotations

import math
from collections import Counter

from huggingface_hub.dataclasses import strict
from transformers import PreTrainedConfig

from hf_chainflow.models.chainflow.validation_chainflow import check_table_shape

SOURCES = ("extrapolate", "repeat", "noise")
FEEDBACK = ("none", "markov", "markov+path")
ATTENTION = ("causal", "bidirectional")


def _choice(name: str, value, allowed) -> None:
    if value not in allowed:
        raise ValueError(f"`{name}` must be one of {allowed}, got {value!r}.")


def _positive(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"`{name}` must be a positive integer, got {value!r}.")


@strict
class ChainFlowConfig(PreTrainedConfig):
    r"""
    Configuration of a [`ChainFlowDrafter`]: a flow-matching drafter over a VAE latent of a target model's last
    hidden states (ChainFlow, arXiv 2611.08669). Every size and choice of the method is a field, so the paper's
    ablations and the FlashMap-style variant are configurations rather than forks of the code.

    target_hidden_size (`int`): hidden size `D` of the target (width of its `lm_head` input).
    vocab_size (`int`): vocabulary size `V` of the target's `lm_head`.
    target_model_type / target_name (`str`, *optional*): the target's fingerprint, checked when binding.
    latent_size (`int`, *optional*): VAE latent width `Z`; defaults to `D // 4` (to `D` when `use_vae=False`).
    use_vae (`bool`): encode states into a latent; `False` gives the identity latent (`Z = D`).
    vae_num_layers / vae_num_heads / vae_window (`int`): bidirectional transformer VAE sizes; windows of at most
        `vae_window` states.
    context_size (`int`): number of context states `C` (the paper's 8).
    num_draft_positions (`int`): draft positions `K` predicted by one drafter pass.
    num_experts (`int`): chunk experts; expert `e` handles positions `e*K/E+1 .. (e+1)*K/E` (no routing).
    num_blocks / num_heads / ffn_multiplier (`int`): per-expert velocity-network sizes.
    flow_hidden_size (`int`, *optional*): width of the velocity network; defaults to `latent_size`.
    attention (`str`): self-attention over draft positions, `"causal"` or `"bidirectional"`.
    source (`str`): flow source, `"extrapolate"` (`z_t + i (z_t - z_{t-1})`), `"repeat"` (`z_t`) or `"noise"`.
    num_flow_steps (`int`): Euler steps at serving time (paper: 1).
    train_flow_steps (`int`): Euler steps of the trajectory the training forward integrates (paper: 2).
    feedback (`str`): token feedback, `"none"`, `"markov"` or `"markov+path"`.
    path_order (`int`): number `p` of parent tokens the path head reads.
    path_hidden_size (`int`): width of the path head.
    markov_rank (`int`): rank of the factorised first-order transition bias.
    shortlist (`list[int]`, *optional*): vocabulary shortlist (tokens seen in the training responses), distinct ids.
    candidate_budget (`int`): `M`, candidate ids kept by the two-pass head (shared across positions).
    tree_branching (`int`): `b`, children expanded per kept node during tree search.
    bonus_embedding (`bool`): also feed the transport the bonus token `x_{t+1}` (the last committed token, the
        target's own choice from `h_t`): its frozen target embedding, through a learned norm and a zero-initialised
        projection, is added to every chunk expert's input beside the flow time, so a fresh drafter starts as the
        paper's transport. `False` (default): the paper's transport, which reads the bonus token only in the heads.
    target_layer_ids (`list[int]`, *optional*): decoder layers (0-based, before the last; increasing) whose outputs
        the drafter reads beside the final states (EAGLE-3-style fused target layers): the context that conditions
        the velocity network becomes `Enc(h) + W [std(h^(l_1)); ...; std(h^(l_n))]`, each layer standardised per
        dimension with statistics of the training data and `W` a zero-initialised linear map to the latent, so a
        fresh drafter starts as the final-states-only one. The flow source and the VAE still read the final states.
        The drafter's context states are then `(..., (1 + n) * D)`: the final state, then each layer's output.
        `None` (default): the final states only.
    continuation_table_size (`int`): entries of the drafter's corpus-lookup table
        (`hf_chainflow.generation.corpus_lookup`: the target's most frequent next token after each n-gram of its
        responses), saved as the buffers `continuation_keys` / `continuation_next_tokens`; 0 (default): no table.
        Set by `hf_chainflow.generation.drafting.set_continuation_table(drafter, table)`.
    continuation_min_ngram / continuation_max_ngram (`int`): the n-gram lengths the table holds (2 and 4 by
        default; written by `set_continuation_table`); with a table, `continuation_max_ngram` times the bits of a
        token id must fit in 64.
    serving_head_dtype (`str`): dtype of the candidate-head products while drafting, `"bfloat16"` (default) or
        `"float32"`; training always uses the drafter's dtype. It changes what may be proposed, never the output.
    initializer_range (`float`): std of the normal initialiser.
    pad_token_id / bos_token_id / eos_token_id (`int`, *optional*): the target's special-token ids, copied by
        `for_target` (a pad outside the vocabulary is left unset); transformers' pipelines compare them with the
        target's to accept the drafter as an assistant that shares its tokenizer.
    """

    model_type = "chainflow"

    target_hidden_size: int = 576
    vocab_size: int = 49152
    target_model_type: str | None = None
    target_name: str | None = None
    latent_size: int | None = None
    use_vae: bool = True
    vae_num_layers: int = 2
    vae_num_heads: int = 4
    vae_window: int = 16
    context_size: int = 8
    num_draft_positions: int = 8
    num_experts: int = 2
    num_blocks: int = 8
    num_heads: int = 8
    ffn_multiplier: int = 6
    flow_hidden_size: int | None = None
    attention: str = "causal"
    source: str = "extrapolate"
    num_flow_steps: int = 1
    train_flow_steps: int = 2
    feedback: str = "markov+path"
    path_order: int = 8
    path_hidden_size: int = 256
    markov_rank: int = 256
    shortlist: list[int] | None = None
    candidate_budget: int = 8192
    tree_branching: int = 8
    bonus_embedding: bool = False
    target_layer_ids: list[int] | None = None
    serving_head_dtype: str = "bfloat16"
    continuation_table_size: int = 0
    continuation_min_ngram: int = 2
    continuation_max_ngram: int = 4
    initializer_range: float = 0.02
    pad_token_id: int | None = 0
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    tie_word_embeddings: bool = False

    def __post_init__(self, **kwargs):
        if self.latent_size is None:
            self.latent_size = self.target_hidden_size // 4 if self.use_vae else self.target_hidden_size
        if self.flow_hidden_size is None:
            self.flow_hidden_size = self.latent_size
        self.check_fields()  # plain `ValueError`s, raised before anything else is set up
        super().__post_init__(**kwargs)

    def validate_architecture(self):
        """Part of `@strict` validation (`config.validate()`)."""
        self.check_fields()

    def check_fields(self):
        """Every size positive, every choice known, shapes compatible; raises `ValueError` otherwise."""
        for name in ("target_hidden_size", "vocab_size", "latent_size", "vae_num_layers", "vae_num_heads",
                     "vae_window", "context_size", "num_draft_positions", "num_experts", "num_blocks", "num_heads",
                     "ffn_multiplier", "flow_hidden_size", "num_flow_steps", "train_flow_steps", "path_order",
                     "path_hidden_size", "markov_rank", "candidate_budget", "tree_branching"):
            _positive(name, getattr(self, name))
        size = self.continuation_table_size
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise ValueError(f"`continuation_table_size` must be a non-negative integer (0: no corpus-lookup table), "
                             f"got {size!r}.")
        if size:
            check_table_shape(self.vocab_size, self.continuation_min_ngram, self.continuation_max_ngram,
                              prefix="continuation_")
        _choice("source", self.source, SOURCES)
        _choice("feedback", self.feedback, FEEDBACK)
        _choice("attention", self.attention, ATTENTION)
        _choice("serving_head_dtype", self.serving_head_dtype, ("bfloat16", "float32"))
        for name in ("use_vae", "bonus_embedding", "tie_word_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ValueError(f"`{name}` must be True or False, got {value!r} ({type(value).__name__}).")
        std = self.initializer_range
        if not isinstance(std, (int, float)) or isinstance(std, bool) or not (math.isfinite(std) and std > 0):
            raise ValueError(
                f"`initializer_range` is the std of the normal initialiser and must be a positive number (default "
                f"0.02), got {std!r}."
            )
        if self.num_draft_positions % self.num_experts != 0:
            raise ValueError(
                f"`num_draft_positions` ({self.num_draft_positions}) must be divisible by `num_experts` "
                f"({self.num_experts}): each chunk expert handles an equal block of draft positions."
            )
        if not self.use_vae and self.latent_size != self.target_hidden_size:
            raise ValueError(
                f"With `use_vae=False` the latent is the hidden state itself, so `latent_size` must equal "
                f"`target_hidden_size` ({self.target_hidden_size}), got {self.latent_size}. Leave it unset."
            )
        if self.flow_hidden_size % self.num_heads != 0:
            raise ValueError(
                f"`flow_hidden_size` ({self.flow_hidden_size}) must be divisible by `num_heads` ({self.num_heads})."
            )
        if self.use_vae and self.latent_size % self.vae_num_heads != 0:
            raise ValueError(
                f"`latent_size` ({self.latent_size}) must be divisible by `vae_num_heads` ({self.vae_num_heads})."
            )
        if self.use_vae and max(self.context_size, self.num_draft_positions) > self.vae_window:
            raise ValueError(
                f"The VAE encodes windows of at most `vae_window` ({self.vae_window}) states, but "
                f"`context_size` is {self.context_size} and `num_draft_positions` {self.num_draft_positions}."
            )
        if self.source == "extrapolate" and self.context_size < 2:
            raise ValueError(
                f"`source='extrapolate'` needs two context latents (`z_t - z_(t-1)`), but `context_size` is "
                f"{self.context_size}. Use `source='repeat'` or `'noise'`, or a larger `context_size`."
            )
        if self.shortlist is not None:
            if not isinstance(self.shortlist, list):
                raise ValueError(
                    f"`shortlist` must be None (the whole vocabulary) or a list of integer token ids, got "
                    f"{type(self.shortlist).__name__} {self.shortlist!r:.60}. Pass e.g. `sorted(set(ids))` or "
                    f"`tensor.tolist()`."
                )
            odd = [(i, t) for i, t in enumerate(self.shortlist) if not isinstance(t, int) or isinstance(t, bool)]
            if odd:
                i, t = odd[0]
                raise ValueError(
                    f"`shortlist` must hold integer token ids, got {t!r} ({type(t).__name__}) at index {i}. Pass "
                    f"plain Python ints, e.g. `tensor.tolist()`."
                )
            if len(self.shortlist) == 0:
                raise ValueError("`shortlist` must hold at least one token id, got an empty list. Use None for all.")
            bad = [t for t in self.shortlist if not (0 <= t < self.vocab_size)]
            if bad:
                raise ValueError(
                    f"`shortlist` ids must lie in [0, vocab_size={self.vocab_size}), got e.g. {bad[:5]}."
                )
            duplicated = sorted(t for t, n in Counter(self.shortlist).items() if n > 1)
            if duplicated:
                raise ValueError(
                    f"`shortlist` ids must be distinct (each is one row of the draft vocabulary), got "
                    f"{duplicated[:5]} more than once. Pass `sorted(set(shortlist))`."
                )
        layers = self.target_layer_ids
        if layers is not None:
            if not isinstance(layers, list) or not layers or any(not isinstance(i, int) or isinstance(i, bool)
                                                                 or i < 0 for i in layers):
                raise ValueError(
                    f"`target_layer_ids` must be None (the final states only) or a non-empty list of decoder-layer "
                    f"indices (non-negative ints, 0-based), got {layers!r}; e.g. `[2, 15, 27]` for a 30-layer target."
                )
            if layers != sorted(set(layers)):
                raise ValueError(
                    f"`target_layer_ids` must be distinct and increasing (the order the layers' outputs are stacked "
                    f"in the context states), got {layers!r}. Pass `sorted(set(ids))` = {sorted(set(layers))}."
                )
        if self.pad_token_id is not None and not (0 <= self.pad_token_id < self.vocab_size):
            raise ValueError(f"`pad_token_id` must lie in [0, {self.vocab_size}), got {self.pad_token_id}.")

    @property
    def expert_size(self) -> int:
        """Draft positions per chunk expert."""
        return self.num_draft_positions // self.num_experts

    @property
    def state_layers(self) -> tuple[int, ...]:
        """The decoder layers read beside the final states (`target_layer_ids`), `()` for the final states only."""
        return tuple(self.target_layer_ids or ())

    @property
    def context_state_size(self) -> int:
        """Width of one context state the drafter reads: `(1 + len(target_layer_ids)) * target_hidden_size`."""
        return (1 + len(self.state_layers)) * self.target_hidden_size

    @classmethod
    def for_target(cls, target_config, **overrides) -> "ChainFlowConfig":
        """Size a drafter for `target_config` (a target model's config) and record its fingerprint.

        Any field can be overridden, e.g. `ChainFlowConfig.for_target(model.config, num_blocks=4)`.
        """
        text_config = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
        hidden = getattr(text_config, "hidden_size", None)
        vocab = getattr(text_config, "vocab_size", None)
        if not isinstance(hidden, int) or not isinstance(vocab, int):
            raise ValueError(
                f"`target_config` must describe a causal LM with integer `hidden_size` and `vocab_size`, got "
                f"{type(target_config).__name__} with hidden_size={hidden!r}, vocab_size={vocab!r}."
            )
        # The target's special-token ids, as the target states them: transformers' pipelines compare them (with
        # `vocab_size`) to decide whether an assistant shares the target's tokenizer.  The drafter pads a short
        # parent window with `pad_token_id or 0`.
        pad = getattr(text_config, "pad_token_id", None)
        if pad is not None and not (0 <= pad < vocab):
            pad = None
        fields = dict(
            target_hidden_size=hidden,
            vocab_size=vocab,
            target_model_type=getattr(text_config, "model_type", None),
            target_name=getattr(target_config, "name_or_path", None) or None,
            pad_token_id=pad,
            bos_token_id=getattr(text_config, "bos_token_id", None),
            eos_token_id=getattr(text_config, "eos_token_id", None),
        )
        fields.update(overrides)
        return cls(**fields)

    def target_fingerprint(self) -> dict:
        return {"model_type": self.target_model_type, "hidden_size": self.target_hidden_size,
                "vocab_size": self.vocab_size, "name": self.target_name}


__all__ = ["ChainFlowConfig"]
