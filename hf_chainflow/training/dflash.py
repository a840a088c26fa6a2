"""DFlash drafters that stock transformers runs: `target.generate(assistant_model=drafter, speculation_type="dflash")`.

The drafter is transformers' own `MuseGlimmerAssistantModel` (`model_type = "muse_glimmer_assistant"`): a few
decoder layers without embeddings or LM head (it borrows the target's), whose keys and values also cover the
target's hidden states at `target_layer_ids`. What transformers' `DFlashTokenCandidateGenerator` gives it each round
(transformers 5.24, `generation/candidate_generator.py`), with `p` the position of the bonus token (the token the
target has just produced, the block's anchor):

- `context_hidden_states (1, n, F)`: the outputs of the target's decoder layers `target_layer_ids` (transformers'
  `hidden_states[i + 1]`), concatenated (`F = len(target_layer_ids) * hidden_size`), at the positions accepted
  since the last round; the drafter's cache keeps those of earlier rounds: together, positions `0 .. p - 1`;
- `noise_embeds (1, B, H)`: the target's input embeddings of `[x_p, mask, ..., mask]` (`B = block_size`,
  `mask_token_id` repeated `B - 1` times) at positions `p .. p + B - 1`;
- attention: every block position sees the whole block and the context; with `sliding_attention` layers only the
  keys within `sliding_window` positions (`|q - k| <= sliding_window`);
- the candidates are the target's `lm_head` over the drafter's last hidden states at block positions `1 .. B - 1`,
  argmax (greedy): `B - 1` tokens per round, the mask at position `p + j` predicting `x_{p+j}` itself.

Training (`hf_chainflow.training.dflash_trainer`) reproduces exactly that forward from cached windows: the drafters built
here have sliding-window layers only, `sliding_window = C`, so a block sees at most the `C` context states a training
window carries (`dflash_attention_mask`; tests/test_dflash.py checks it against transformers' own generation path).

transformers' DFlash path decodes one prompt at a time (assisted decoding is batch 1) and refuses stateful targets,
the hybrid Qwen3.5 stack among them (`check_dflash_target`).
"""

from __future__ import annotations

import os

import torch
from transformers import MuseGlimmerAssistantConfig, MuseGlimmerAssistantModel, PreTrainedModel

from hf_chainflow.checks import check_positive_int, is_int
from hf_chainflow.generation.settings import is_stateful_target

# The fields of a fresh DFlash drafter that `dflash_config` (and `hf-chainflow train --drafter-type dflash`'s
# `drafter:` mapping) take; everything else follows the target.
DFLASH_DRAFTER_FIELDS = ("target_layer_ids", "mask_token_id", "block_size", "num_hidden_layers", "intermediate_size",
                         "sliding_window", "num_attention_heads", "num_key_value_heads", "head_dim")

# SmolLM2's tokenizer has no mask token; `<empty_output>` (id 16) is a special token of its code pre-training
# (Jupyter cells) that never occurs in its chat responses.
SMOLLM2_MASK_TOKEN_ID = 16


def spread_target_layers(num_layers: int, count: int) -> list[int]:
    """`count` decoder layers spread evenly from layer 1 to layer `num_layers - 3` (low, middle and high features,
    the last two layers left out), e.g. `[1, 10, 18, 27]` for 4 of SmolLM2's 30 layers."""
    if not is_int(count) or not 1 <= count <= max(1, num_layers - 3):
        raise ValueError(f"`count` must be an int in [1, {max(1, num_layers - 3)}] for a target of {num_layers} "
                         f"layers, got {count!r}.")
    first, last = 1, max(1, num_layers - 3)
    if count == 1:
        return [(first + last) // 2]
    return [round(first + k * (last - first) / (count - 1)) for k in range(count)]


def check_dflash_target(target: PreTrainedModel) -> None:
    """Raise a `ValueError` unless stock transformers can run a DFlash drafter for `target`: a causal LM with input
    and output embeddings, not stateful (transformers up to 5.24 refuses assisted generation, DFlash included, for
    stateful models such as the hybrid Qwen3.5 stack, whose linear-attention state it could not roll back; the
    rollback 5.25 added is not validated here: `hf_chainflow.generation.settings.is_stateful_target`)."""
    if not isinstance(target, PreTrainedModel):
        raise ValueError(f"`target` must be a transformers causal LM (a PreTrainedModel), got "
                         f"{type(target).__name__}.")
    if is_stateful_target(target):
        raise ValueError(f"`target` is a stateful model ({type(target).__name__}, e.g. a hybrid stack with "
                         f"linear-attention layers): transformers up to 5.24 refuses assisted generation, "
                         f"`speculation_type='dflash'` included, for such targets, and hf_chainflow has not validated "
                         f"the recurrent-state rollback 5.25 added, so a DFlash drafter for it is not supported. Use a "
                         f"ChainFlow drafter (hf_chainflow's own loop verifies hybrid targets).")
    if target.get_output_embeddings() is None or target.get_input_embeddings() is None:
        raise ValueError(f"`target` ({type(target).__name__}) has no LM head or no input embeddings; a DFlash drafter "
                         f"borrows both. Load the target with `AutoModelForCausalLM`.")


def dflash_config(target: PreTrainedModel, *, target_layer_ids, mask_token_id: int, block_size: int = 9,
                  num_hidden_layers: int = 2, intermediate_size: int | None = None, sliding_window: int = 32,
                  num_attention_heads: int | None = None, num_key_value_heads: int | None = None,
                  head_dim: int | None = None) -> MuseGlimmerAssistantConfig:
    """The config of a fresh DFlash drafter for `target`.

    The hidden size, RoPE, norm epsilon, special token ids and (unless given) the attention heads are the target's
    (the drafter reads the target's embeddings and feeds its LM head, so its width is the target's). All layers are
    `sliding_attention` with `sliding_window` (`C`): a block sees the last `C` context states at most, which is what
    a training window holds. `block_size` counts the bonus token: a round drafts `block_size - 1` tokens.
    `intermediate_size` defaults to the target's; `mask_token_id` must lie in the target's vocabulary.
    """
    check_dflash_target(target)
    text = target.config.get_text_config()
    num_layers, vocab = text.num_hidden_layers, text.vocab_size
    layers = list(target_layer_ids) if isinstance(target_layer_ids, (list, tuple)) else None
    if not layers or any(not is_int(i) or not 0 <= i < num_layers for i in layers) or len(set(layers)) != len(layers):
        raise ValueError(f"`target_layer_ids` must be a non-empty list of distinct decoder-layer indices in [0, "
                         f"{num_layers}) of this {num_layers}-layer target, got {target_layer_ids!r}; e.g. "
                         f"{spread_target_layers(num_layers, min(4, max(1, num_layers - 3)))}.")
    if not is_int(mask_token_id) or not 0 <= mask_token_id < vocab:
        raise ValueError(f"`mask_token_id` must be a token id inside the target's vocabulary [0, {vocab}), got "
                         f"{mask_token_id!r}; choose a token that never occurs in the responses (SmolLM2: "
                         f"{SMOLLM2_MASK_TOKEN_ID}, `<empty_output>`).")
    for name, value, low in (("block_size", block_size, 2), ("num_hidden_layers", num_hidden_layers, 1),
                             ("sliding_window", sliding_window, 1)):
        if not is_int(value) or value < low:
            raise ValueError(f"`{name}` must be an int >= {low}, got {value!r}.")
    if sliding_window < block_size - 1:
        raise ValueError(f"`sliding_window` ({sliding_window}) must be >= `block_size - 1` ({block_size - 1}) so that "
                         f"every block position sees the whole block.")
    heads = num_attention_heads or text.num_attention_heads
    kv_heads = num_key_value_heads or getattr(text, "num_key_value_heads", None) or heads
    head_dim = head_dim or getattr(text, "head_dim", None) or text.hidden_size // heads
    for name, value in (("intermediate_size", intermediate_size), ("num_attention_heads", heads),
                        ("num_key_value_heads", kv_heads), ("head_dim", head_dim)):
        check_positive_int(name, value, optional=True, none="the target's")
    if heads % kv_heads:
        raise ValueError(f"`num_attention_heads` ({heads}) must be a multiple of `num_key_value_heads` ({kv_heads}).")
    rope = dict(getattr(text, "rope_parameters", None) or {"rope_type": "default", "rope_theta": 10000.0})
    eos = text.eos_token_id[0] if isinstance(text.eos_token_id, (list, tuple)) else text.eos_token_id
    return MuseGlimmerAssistantConfig(
        hidden_size=text.hidden_size, intermediate_size=intermediate_size or text.intermediate_size,
        num_hidden_layers=num_hidden_layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        head_dim=head_dim, rms_norm_eps=float(getattr(text, "rms_norm_eps", 1e-6)), rope_parameters=rope,
        max_position_embeddings=text.max_position_embeddings, sliding_window=sliding_window,
        layer_types=["sliding_attention"] * num_hidden_layers, hidden_act=getattr(text, "hidden_act", "silu"),
        bos_token_id=text.bos_token_id, eos_token_id=eos, pad_token_id=text.pad_token_id,
        block_size=block_size, mask_token_id=mask_token_id, target_layer_ids=sorted(layers))


def build_dflash_drafter(target: PreTrainedModel, *, seed: int | None = None, **fields) -> MuseGlimmerAssistantModel:
    """A fresh (randomly initialised) DFlash drafter for `target`, in float32 on the CPU; `fields` as for
    `dflash_config` (`DFLASH_DRAFTER_FIELDS`)."""
    unknown = sorted(set(fields) - set(DFLASH_DRAFTER_FIELDS))
    if unknown:
        raise ValueError(f"Unknown DFlash drafter field(s) {unknown}; the fields are {list(DFLASH_DRAFTER_FIELDS)}.")
    config = dflash_config(target, **fields)
    if seed is not None:
        torch.manual_seed(seed)
    return MuseGlimmerAssistantModel(config).float()


def check_dflash_drafter(drafter, target: PreTrainedModel) -> None:
    """Raise a `ValueError` unless `drafter` is a DFlash drafter stock transformers can run for `target`, and one
    hf_chainflow can train (sliding-window layers only)."""
    check_dflash_target(target)
    if not isinstance(drafter, MuseGlimmerAssistantModel):
        raise ValueError(f"`drafter` must be a MuseGlimmerAssistantModel (a DFlash drafter), got "
                         f"{type(drafter).__name__}.")
    c, text = drafter.config, target.config.get_text_config()
    if c.hidden_size != text.hidden_size:
        raise ValueError(f"The DFlash drafter's hidden size {c.hidden_size} differs from the target's "
                         f"{text.hidden_size}: it reads the target's embeddings and feeds its LM head; it was made "
                         f"for another target.")
    if any(not 0 <= i < text.num_hidden_layers for i in c.target_layer_ids):
        raise ValueError(f"The DFlash drafter reads target layers {c.target_layer_ids}, but this target has "
                         f"{text.num_hidden_layers} layers; it was made for another target.")
    if not 0 <= c.mask_token_id < text.vocab_size:
        raise ValueError(f"The DFlash drafter's `mask_token_id` {c.mask_token_id} lies outside the target's "
                         f"vocabulary of {text.vocab_size}; it was made for another target.")
    if set(c.layer_types) != {"sliding_attention"}:
        raise ValueError(f"The DFlash drafter has layer types {sorted(set(c.layer_types))}; hf_chainflow trains "
                         f"`sliding_attention` layers only (the window is the context a training window holds). "
                         f"Build it with `build_dflash_drafter`.")


def load_dflash_drafter(path: str | os.PathLike, target: PreTrainedModel, **kwargs) -> MuseGlimmerAssistantModel:
    """A saved DFlash drafter (a plain transformers model folder), checked against `target` and put in the target's
    dtype and on its device, in eval mode: transformers feeds it the target's embeddings and hidden states as they
    are, so the two must agree. `kwargs` go to `from_pretrained`. A local folder must hold a config.json that parses
    (else a `ValueError` naming the file, line and column, before transformers reads it)."""
    if os.path.isdir(path):
        from hf_chainflow.fileio import check_model_folder

        check_model_folder("path", os.path.join(path, kwargs.get("subfolder") or ""), weights=False)
    drafter = MuseGlimmerAssistantModel.from_pretrained(path, **kwargs)
    check_dflash_drafter(drafter, target)
    return drafter.to(device=target.device, dtype=target.dtype).eval()


def parameter_count(model: torch.nn.Module) -> int:
    """The number of parameters of `model` (shared tensors counted once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def dflash_attention_mask(context_mask: torch.Tensor, block_size: int, sliding_window: int | None,
                          dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """The additive attention masks of a batch of training windows, as the drafter's forward takes them
    (`{"full_attention": m, "sliding_attention": m}`, each `(N, 1, B, C + B)`, 0 where a block position may look,
    the dtype's minimum elsewhere).

    Keys are `C` context slots (positions `p - C .. p - 1`, `context_mask (N, C)` True where a state exists) then the
    `B` block slots (positions `p .. p + B - 1`). Every block position sees the existing context states and the whole
    block; in a sliding layer only the keys with `|q - k| <= sliding_window` (transformers' bidirectional
    sliding-window rule), so the block position `j` sees `C - j` context states when `sliding_window = C`.
    """
    n, C = context_mask.shape
    device = context_mask.device
    keys = torch.cat([context_mask.bool(), torch.ones(n, block_size, dtype=torch.bool, device=device)], 1)  # (N, C+B)
    full = keys[:, None, None, :].expand(n, 1, block_size, C + block_size)  # (N, 1, B, C+B)
    masks = {"full_attention": full}
    if sliding_window is not None:
        q = C + torch.arange(block_size, device=device)  # (B,) slots of the queries
        k = torch.arange(C + block_size, device=device)  # (C+B,)
        masks["sliding_attention"] = full & ((q[:, None] - k[None, :]).abs() <= sliding_window)
    else:
        masks["sliding_attention"] = full
    zero = torch.zeros((), dtype=dtype, device=device)
    low = torch.full((), torch.finfo(dtype).min, dtype=dtype, device=device)
    return {name: torch.where(m, zero, low) for name, m in masks.items()}


def dflash_block_logits(drafter: MuseGlimmerAssistantModel, target: PreTrainedModel, batch: dict) -> torch.Tensor:
    """The target-vocabulary logits `(N, B - 1, V)` a DFlash drafter gives for the `B - 1` masked positions of each
    training window of `batch` (`hf_chainflow.training.dflash_data.DFlashWindowDataset`: `context_states (N, C, F)`,
    `context_mask (N, C)`, `bonus_token (N,)`, `position_ids (N, C + B)`), computed as transformers' DFlash
    candidate generator computes them: the target's input embeddings of `[bonus, mask, ...]`, the drafter, the
    target's LM head. Gradients reach the drafter only (the target's embeddings are read without them)."""
    c = drafter.config
    bonus = batch["bonus_token"]  # (N,)
    noise_ids = torch.cat([bonus[:, None], bonus.new_full((bonus.shape[0], c.block_size - 1), c.mask_token_id)], 1)
    with torch.no_grad():
        noise = target.get_input_embeddings()(noise_ids)  # (N, B, H)
    dtype = next(drafter.parameters()).dtype
    masks = dflash_attention_mask(batch["context_mask"], c.block_size, c.sliding_window, dtype)
    hidden = drafter(noise_embeds=noise.to(dtype), context_hidden_states=batch["context_states"].to(dtype),
                     attention_mask=masks, position_ids=batch["position_ids"]).last_hidden_state  # (N, B, H)
    head = target.get_output_embeddings()
    return head(hidden[:, 1:].to(head.weight.dtype))  # (N, B-1, V)


__all__ = ["DFLASH_DRAFTER_FIELDS", "SMOLLM2_MASK_TOKEN_ID", "build_dflash_drafter", "check_dflash_drafter",
           "check_dflash_target", "dflash_attention_mask", "dflash_block_logits", "dflash_config",
           "load_dflash_drafter", "parameter_count", "spread_target_layers"]
