"""The Lafa drafter: position-masked weights that make a target draft its own next block.

A fused forward (`hf_chainflow.generation.lafa.fused_verify_forward`) runs the bound target once over two kinds of
rows: the verify rows (the previous draft, scored as plain verification) and the noise rows (candidate blocks, one per
possible accepted length). `LafaDrafter` holds the weights that act on the noise rows only:

- a LoRA (`A`, `B`) per target linear module of `config.lora_target_modules` in every decoder layer;
- the noise rows' inputs: a learned mask embedding plus the projected flow-time embedding (plus seeded Gaussian
  noise with `config.noise_std > 0`), in place of the token embedding;
- with `config.time_conditioned_norms`, a modulation `y * (1 + gamma(tau)) + beta(tau)` of each decoder layer's two
  RMSNorms and of the final norm, zero-initialised (the identity).

`LafaDrafter.noise_rows(noise_mask)` is the context in which they act: it registers forward hooks on the target's
modules that compute `torch.where(noise_row, base(x) + lora(x), base(x))` (the verify rows' outputs are the base
outputs themselves, not `base + 0 * lora`), and removes them on exit, so outside it the target's modules, weights,
state-dict keys and plain forwards are untouched. `forward` is the target's forward inside that context. The model
imports nothing of `hf_chainflow.generation` (layering rule): the fused forward takes the drafter as an argument.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoModel, GenerationConfig, PreTrainedModel
from transformers import initialization as init
from transformers.utils import ModelOutput

from hf_chainflow.models.chainflow.loading_chainflow import check_pretrained_source
from hf_chainflow.models.lafa.binding_lafa import (LAYER_NORMS, LafaTargetError, LafaTargetModules,
                                                   check_attention_only, find_target_modules, target_fingerprint_of)
from hf_chainflow.models.lafa.configuration_lafa import LafaConfig


# ----------------------------------------------------------------------------------------------------------------
# Output and layers
# ----------------------------------------------------------------------------------------------------------------
@dataclass
class LafaDrafterOutput(ModelOutput):
    """
    The target's output of a forward with the noise rows active (B = batch, T = inputs, V = vocabulary).

    logits (`(B, T, V)`): every input's logits; a verify row's are the bare target's, a noise row's are its block
        prediction (the token at the noise row's own position).
    noise_mask (`(B, T)`): which inputs were noise rows.
    cache (`Cache`, *optional*): the target's cache, grown by `T` columns (the noise rows' included: a commit keeps
        only the accepted verify rows).
    hidden_states (`tuple`, *optional*): the target's hidden states, as it returns them.
    """

    logits: torch.FloatTensor | None = None
    noise_mask: torch.BoolTensor | None = None
    cache: object | None = None
    hidden_states: tuple | None = None


class LafaLoRA(nn.Module):
    """`x -> (alpha / r) * B A x` for one target linear module (`lora_A` `(r, in)`, `lora_B` `(out, r)`, zero at
    init, so that a fresh LoRA adds nothing)."""

    def __init__(self, in_features: int, out_features: int, rank: int, scaling: float):
        super().__init__()
        self.lora_A = nn.Parameter(torch.empty(rank, in_features))
        self.lora_B = nn.Parameter(torch.zeros(out_features, rank))
        self.scaling = scaling

    def forward(self, x):  # (..., in) -> (..., out)
        return F.linear(F.linear(x, self.lora_A), self.lora_B) * self.scaling


class LafaTimeEmbedding(nn.Module):
    """Flow time `tau` in [0, 1] `(...)` -> `(..., S)`: sine / cosine features of `1000 tau`, then a SiLU MLP."""

    def __init__(self, size: int):
        super().__init__()
        self.size = size
        self.mlp = nn.Sequential(nn.Linear(size, size), nn.SiLU(), nn.Linear(size, size))

    def forward(self, tau):
        half = self.size // 2
        freqs = torch.exp(-math.log(10000.0) * torch.arange(half, device=tau.device, dtype=torch.float32) / half)
        args = 1000.0 * tau.float()[..., None] * freqs  # (..., S / 2)
        features = torch.cat([torch.cos(args), torch.sin(args)], -1).to(self.mlp[0].weight.dtype)
        return self.mlp(features)  # (..., S)


class LafaNormModulation(nn.Module):
    """`y -> y * (1 + gamma) + beta` with `(gamma, beta)` a linear map (`weight` `(2 D, S)`, `bias` `(2 D,)`, zero at
    init: the identity) of `silu(time embedding)`."""

    def __init__(self, time_size: int, hidden_size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(2 * hidden_size, time_size))
        self.bias = nn.Parameter(torch.zeros(2 * hidden_size))

    def forward(self, y, time_embedding):  # (..., D), (..., S) -> (..., D)
        gamma, beta = F.linear(F.silu(time_embedding), self.weight, self.bias).chunk(2, -1)
        return y * (1 + gamma) + beta


class LafaLayer(nn.Module):
    """One decoder layer's noise-row weights: a LoRA per module of `lora_target_modules`, the norm modulations."""

    def __init__(self, config: LafaConfig):
        super().__init__()
        self.lora = nn.ModuleDict({name: LafaLoRA(i, o, config.lora_rank, config.lora_scaling)
                                   for name, (i, o) in config.lora_shapes().items()})
        self.norms = nn.ModuleDict({name: LafaNormModulation(config.time_embedding_size, config.target_hidden_size)
                                    for name in (LAYER_NORMS if config.time_conditioned_norms else ())})


class _NoiseRows:
    """What the hooks of one `LafaDrafter.noise_rows` context share: the noise rows and their time embedding.

    Only the columns from `start` (the first column holding a noise row in any batch row) are touched; in them a
    hook returns `torch.where(mask, modified, base)`, so every verify row keeps the base output bit for bit."""

    def __init__(self, drafter: "LafaDrafter", noise_mask: torch.BoolTensor, tau, generator):
        self.drafter, self.shape = drafter, tuple(noise_mask.shape)
        columns = noise_mask.any(0).nonzero()
        self.start = int(columns[0]) if len(columns) else self.shape[1]
        self.mask = noise_mask[:, self.start:, None]  # (B, T - start, 1)
        tau = torch.as_tensor(tau, dtype=torch.float32, device=noise_mask.device)
        try:
            tau = tau.expand(self.shape)
        except RuntimeError:
            raise ValueError(f"`tau` must be a number or a tensor broadcastable to the inputs {self.shape} (one flow "
                             f"time per input; read on the noise rows only), got shape {tuple(tau.shape)}.") from None
        self.time = drafter.time_embedding(tau[:, self.start:])  # (B, T - start, S)
        self.generator = generator

    def _tail(self, output, name):
        if tuple(output.shape[:2]) != self.shape:
            raise ValueError(f"A forward inside `LafaDrafter.noise_rows` ran {name} over inputs "
                             f"{tuple(output.shape[:2])}, but the noise mask is {self.shape}: run exactly the forward "
                             f"the mask describes inside the context.")
        return output[:, self.start:]

    def _merge(self, output, tail, modified):
        new = torch.where(self.mask, modified.to(output.dtype), tail)
        return new if self.start == 0 else torch.cat([output[:, : self.start], new], 1)

    def embeddings(self, module, args, output):  # (B, T, D): the noise rows' inputs replace the token embedding
        tail = self._tail(output, "the input embeddings")
        d = self.drafter
        inputs = d.mask_embedding + d.time_to_input(self.time)  # (B, T - start, D)
        if d.config.noise_std > 0:
            inputs = inputs + d.config.noise_std * torch.randn(inputs.shape, generator=self.generator,
                                                               device=inputs.device, dtype=inputs.dtype)
        return self._merge(output, tail, inputs)

    def lora(self, lora: LafaLoRA, name: str):
        def hook(module, args, output):  # (B, T, out) <- x (B, T, in)
            tail = self._tail(output, name)
            x = args[0][:, self.start:]
            return self._merge(output, tail, tail + lora(x.to(lora.lora_A.dtype)).to(tail.dtype))
        return hook

    def norm(self, modulation: LafaNormModulation, name: str):
        def hook(module, args, output):  # (B, T, D)
            tail = self._tail(output, name)
            return self._merge(output, tail, modulation(tail.to(modulation.weight.dtype), self.time))
        return hook


# ----------------------------------------------------------------------------------------------------------------
# The drafter
# ----------------------------------------------------------------------------------------------------------------
class LafaPreTrainedModel(PreTrainedModel):
    config_class = LafaConfig
    config: LafaConfig
    base_model_prefix = "lafa"
    main_input_name = "input_ids"
    supports_gradient_checkpointing = False

    @torch.no_grad()
    def _init_weights(self, module):
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            init.normal_(module.weight, std=std)
            if module.bias is not None:
                init.zeros_(module.bias)
        if isinstance(module, LafaLoRA):  # a fresh LoRA adds nothing
            init.normal_(module.lora_A, std=std)
            init.zeros_(module.lora_B)
        if isinstance(module, LafaNormModulation):  # the identity
            init.zeros_(module.weight)
            init.zeros_(module.bias)
        if isinstance(module, LafaDrafter):
            init.normal_(module.mask_embedding, std=std)
            init.zeros_(module.time_to_input.weight)
            init.zeros_(module.time_to_input.bias)


class LafaDrafter(LafaPreTrainedModel):
    """The noise-row weights of a Lafa self-speculative target (see the module docstring). Bind it to its target
    (`bind_target`, or `from_pretrained(path, target=target)`); the target's modules are borrowed, never owned or
    saved. `noise_rows(mask)` is the context in which the weights act; `forward` runs the target in it."""

    is_lafa_drafter = True  # `generate(assistant_model=...)` routes it to hf_chainflow's loop by this flag

    def __init__(self, config: LafaConfig):
        super().__init__(config)
        D, S = config.target_hidden_size, config.time_embedding_size
        self.layers = nn.ModuleList([LafaLayer(config) for _ in range(config.target_num_layers)])
        self.final_norm = LafaNormModulation(S, D) if config.time_conditioned_norms else None
        self.mask_embedding = nn.Parameter(torch.zeros(D))
        self.time_embedding = LafaTimeEmbedding(S)
        self.time_to_input = nn.Linear(S, D)
        self._bound: dict = {}
        self._active = None
        self.post_init()
        # What `generate(assistant_model=lafa)` reads (not saved: `can_generate()` is False): a chain of at most
        # block_size - 1 tokens per round, the candidate block of the accepted length (`num_assistant_tokens` may
        # cut it); the tree fields only fit the drafting settings' common checks (a tree is refused).
        depth = config.block_size - 1
        self.generation_config = GenerationConfig(num_assistant_tokens=depth, num_assistant_tokens_schedule="constant",
                                                  draft_mode="chain", tree_width=1, tree_depth=depth,
                                                  tree_budget=None)
        self.last_stats = None  # the last `generate` call's statistics (`SpeculativeStats`)

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def max_draft_depth(self) -> int:
        """The longest draft a round verifies: a candidate block's rows `1 .. block_size - 1`."""
        return self.config.block_size - 1

    # ------------------------------------------------------------------ the target
    def bind_target(self, target: PreTrainedModel) -> "LafaDrafter":
        """Borrow `target`'s modules (`binding_lafa.find_target_modules`). A target with recurrent layers, or
        another target than the drafter was made for, raises `LafaTargetError` naming both fingerprints."""
        if self._active is not None:
            raise ValueError("`bind_target` inside `noise_rows`: leave the fused forward first.")
        check_attention_only(target.config)
        mine, theirs = self.config.target_fingerprint(), target_fingerprint_of(target.config)
        mismatched = [k for k in mine if k != "model_type" and mine[k] != theirs[k]]
        if mine["model_type"] is not None and mine["model_type"] != theirs["model_type"]:
            mismatched.insert(0, "model_type")
        if mismatched:
            raise LafaTargetError(
                f"This Lafa drafter was made for target {mine} (name {self.config.target_name!r}) but was given "
                f"{type(target).__name__} {theirs}; mismatched: {mismatched}. Load or train a drafter for this target "
                f"(`LafaConfig.for_target(target.config)`)."
            )
        self._bound = {"target": target, "modules": find_target_modules(target, self.config)}
        return self

    def unbind_target(self) -> "LafaDrafter":
        self._bound = {}
        return self

    @property
    def is_bound(self) -> bool:
        return bool(self._bound)

    def check_target(self, target: PreTrainedModel) -> None:
        """Raise a `ValueError` unless this drafter is bound to `target` itself."""
        modules = self._modules_of_target()
        if modules.embeddings is not target.get_input_embeddings():
            raise ValueError(f"This Lafa drafter is bound to another target than the {type(target).__name__} given "
                             f"(fingerprint {self.config.target_fingerprint()}); call `drafter.bind_target(target)`.")

    def _modules_of_target(self) -> LafaTargetModules:
        if not self._bound:
            raise ValueError("This LafaDrafter is not bound to a target: call `drafter.bind_target(target)` or load "
                             "it with `LafaDrafter.from_pretrained(path, target=target)` first.")
        return self._bound["modules"]

    # ------------------------------------------------------------------ the noise rows
    @contextmanager
    def noise_rows(self, noise_mask: torch.BoolTensor, tau: float | torch.Tensor = 0.0,
                   generator: torch.Generator | None = None):
        """Within this context every forward of the bound target over inputs `(B, T)` treats the inputs where
        `noise_mask` `(B, T)` is True as noise rows: their input is the drafter's noise input (the token ids there
        are ignored), and the LoRAs and norm modulations act on them; every other input computes exactly the bare
        target (its outputs are the base modules' outputs, selected with `torch.where`). `tau`: the flow time of
        each input (a number, or a tensor broadcastable to `(B, T)`; 0: pure noise, one flow step). `generator`:
        the Gaussian noise's (with `config.noise_std > 0`). The hooks are removed on exit, also on an error."""
        modules = self._modules_of_target()
        if self._active is not None:
            raise ValueError("`noise_rows` is already active on this drafter: contexts do not nest.")
        if not isinstance(noise_mask, torch.Tensor) or noise_mask.dtype != torch.bool or noise_mask.dim() != 2:
            raise ValueError(f"`noise_mask` must be a bool tensor (B, T) over the forward's inputs, got "
                             f"{type(noise_mask).__name__} {getattr(noise_mask, 'dtype', '')} of shape "
                             f"{tuple(getattr(noise_mask, 'shape', ()))}.")
        state = _NoiseRows(self, noise_mask.to(self.mask_embedding.device), tau, generator)
        handles = []
        try:
            handles.append(modules.embeddings.register_forward_hook(state.embeddings))
            for key, module in modules.linears.items():
                _, i, name = key.split(".")
                handles.append(module.register_forward_hook(state.lora(self.layers[int(i)].lora[name], key)))
            for key, module in modules.norms.items():
                modulation = self.final_norm if key == "norm" else self.layers[int(key.split(".")[1])].norms[
                    key.split(".")[2]]
                handles.append(module.register_forward_hook(state.norm(modulation, key)))
            self._active = state
            yield state
        finally:
            for handle in handles:
                handle.remove()
            self._active = None

    def forward(self, input_ids: torch.LongTensor, noise_mask: torch.BoolTensor, tau: float | torch.Tensor = 0.0,
                generator: torch.Generator | None = None, **target_kwargs) -> LafaDrafterOutput:
        """The bound target's forward over `input_ids` `(B, T)` with the noise rows `noise_mask` `(B, T)` active
        (see `noise_rows`); `target_kwargs` go to the target as they are (`attention_mask` (a 4-D mask for blocks
        that see themselves bidirectionally), `position_ids`, `cache`, `use_cache`, `output_hidden_states`)."""
        target = self._bound.get("target") if self._bound else None
        self._modules_of_target()
        if tuple(noise_mask.shape) != tuple(input_ids.shape):
            raise ValueError(f"`noise_mask` must have the shape of `input_ids` {tuple(input_ids.shape)}, got "
                             f"{tuple(noise_mask.shape)}.")
        with self.noise_rows(noise_mask, tau, generator):
            out = target(input_ids=input_ids, **target_kwargs)
        return LafaDrafterOutput(logits=out.logits, noise_mask=noise_mask, cache=getattr(out, "cache", None),
                                 hidden_states=getattr(out, "hidden_states", None))

    # ------------------------------------------------------------------ save / load
    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, target: PreTrainedModel | None = None, **kwargs):
        """Load a drafter saved with `save_pretrained` (a folder, a `subfolder` or a Hub repo; safetensors, no
        remote code); with `target=`, check and bind it first-thing after loading (`bind_target`). Weights load in
        the target's dtype when a target is given, else float32, unless `dtype=` says otherwise."""
        check_pretrained_source(pretrained_model_name_or_path, kwargs, LafaConfig, "a Lafa drafter")
        if target is not None:
            check_attention_only(target.config)  # before loading anything
        if kwargs.get("dtype") is None:
            kwargs["dtype"] = kwargs.pop("torch_dtype", None) or (target.dtype if target is not None
                                                                  else torch.float32)
        loaded = super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)
        model = loaded[0] if kwargs.get("output_loading_info") else loaded
        if target is not None:
            model.bind_target(target)
        return loaded


AutoModel.register(LafaConfig, LafaDrafter, exist_ok=True)

__all__ = ["LafaDrafter", "LafaDrafterOutput", "LafaPreTrainedModel", "LafaTargetError"]
