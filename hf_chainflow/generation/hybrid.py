"""Tree verification for hybrid targets: Gated DeltaNet (GDN) state forking.

A Gated DeltaNet layer (Qwen3.5, Qwen3.5-MoE, Qwen3-Next) keeps, per sequence, a causal-conv window (the last
``K`` pre-conv inputs, newest last) and one recurrent state ``S`` (per value head, ``dk x dv``). Neither can be
cropped back after a multi-token forward, and a flattened draft tree is not a sequence. During a verify forward
the layers installed here therefore:

- READ the cache but never write it;
- give every node the conv window along its own ancestor path (columns above the root come from the cached
  conv state);
- compute every node's recurrent output as if its root-to-node path had been run alone, with either

  * ``"chunk"`` (default): one tree-masked WY/UT chunk, i.e. transformers' ``torch_chunk_gated_delta_rule``
    maths with the causal mask replaced by the ancestor mask and the decay cumsum replaced by a sum along the
    path; no per-node state is stored, the accepted node's state is rebuilt at commit; or
  * ``"fork"`` (reference): per-node recurrent steps ``S(i) = step(S(parent(i)), x_i)``, one level of the tree
    at a time, storing every node's state;
- record, per layer, what a commit needs (all node windows; the means to get any node's state) in the
  per-round `HybridTreeContext`, passed through the model's forward kwargs under `TREE_KWARG`.

`commit_hybrid_states` then copies the last accepted node's window and state into the cache IN PLACE.

Installing: `prepare_hybrid_target(model)` swaps the ``__class__`` of each GDN module of *that* model for a
subclass whose ``forward`` takes the tree path when the `TREE_KWARG` kwarg is present and calls the stock
``forward`` otherwise. Weights, state-dict keys and plain forwards are unchanged; no class is patched globally.

The maths runs on a batch: one tree shared by every row (`parents` `(n,)`, what `hf_chainflow.generation.verification` uses
for batch size 1) or one tree per row (`parents` `(B, n)`, `ancestors` `(B, n, n)`: the batched loop of
`hf_chainflow.generation.verification`, where every row has its own draft); commits then take one accepted input per row.
"""

from __future__ import annotations

import sys
import weakref
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache, CacheLayerMixin, LinearAttentionCacheLayerMixin

try:  # fires accelerate's offload hooks of `conv1d`, whose weight we read directly (as the stock forward does)
    from transformers.integrations.accelerate import force_accelerate_hooks
except ImportError:  # pragma: no cover
    def force_accelerate_hooks(_names):
        return lambda fn: fn

__all__ = [
    "TREE_KWARG",
    "GDN_METHODS",
    "HybridTreeContext",
    "prepare_hybrid_target",
    "check_forkable_target",
    "is_hybrid_target",
    "has_recurrent_state",
    "gdn_layers",
    "commit_hybrid_states",
    "committed_length",
    "sync_linear_lengths",
]

TREE_KWARG = "chainflow_tree"
"""Name of the forward kwarg that carries the `HybridTreeContext` down to the GDN layers."""

GDN_METHODS = ("chunk", "fork")

# Config `layer_types` values that denote a recurrent / linear-attention layer in transformers' hybrid stacks.
_RECURRENT_LAYER_TYPES = ("linear_attention", "mamba", "conv", "hybrid", "hybrid_sliding")
# Those of them whose cache layer keeps a recurrent state (`conv` and the conv + attention `hybrid*` layers keep
# only a conv window).
_RECURRENT_STATE_LAYER_TYPES = ("linear_attention", "mamba")


# --------------------------------------------------------------------------------------------------------------
# Per-round context
# --------------------------------------------------------------------------------------------------------------
@dataclass
class _GDNRecord:
    """What one GDN layer's verify left for the commit. `n` = flattened inputs (root + nodes)."""

    window: torch.Tensor  # (B, C, n, K): every node's conv window along its path, oldest first, newest last
    ancestors: torch.Tensor  # (n, n) bool
    method: str
    states: torch.Tensor | None = None  # fork: (B, HV, n, dk, dv) fp32 state after each node
    initial_state: torch.Tensor | None = None  # chunk: (B, HV, dk, dv) fp32 state before the root
    initial_version: int | None = None  # chunk: `_version` of the cached state read (guards against mutation)
    key: torch.Tensor | None = None  # chunk: (B, HV, n, dk) l2-normed keys
    new_value: torch.Tensor | None = None  # chunk: (B, HV, n, dv) the delta-rule corrections ("v_new")
    path_decay: torch.Tensor | None = None  # chunk: (B, HV, n) log-decay summed over each node's path

    def state(self, node: int | torch.LongTensor) -> torch.Tensor:
        """Recurrent state after flattened input `node` (0 = root; an int for every row, or one per row `(B,)`),
        `(B, HV, dk, dv)` in fp32."""
        if not isinstance(node, torch.Tensor) and self.ancestors.dim() == 3:  # one tree per row: the same input in each
            node = torch.full((self.ancestors.shape[0],), node, dtype=torch.long, device=self.ancestors.device)
        if isinstance(node, torch.Tensor):
            return self._row_states(node)
        if self.method == "fork":
            return self.states[:, :, node]
        c = self.path_decay  # (B, HV, n)
        anc = self.ancestors[node]  # (n,)
        # exp(c_a - c_j) on the ancestors j of a only; masked before exp so non-ancestors cannot overflow
        weight = torch.where(anc, c[..., node : node + 1] - c, float("-inf")).exp()  # (B, HV, n)
        update = (self.key * weight[..., None]).transpose(-1, -2) @ self.new_value  # (B, HV, dk, dv)
        return self.initial_state * c[..., node].exp()[..., None, None] + update

    def _row_states(self, node: torch.LongTensor) -> torch.Tensor:
        """`state` with one node per row, `node` `(B,)`."""
        rows = torch.arange(node.shape[0], device=node.device)
        if self.method == "fork":
            return self.states[rows, :, node]  # (B, HV, dk, dv)
        c = self.path_decay  # (B, HV, n)
        anc = self.ancestors[rows, node] if self.ancestors.dim() == 3 else self.ancestors[node]  # (B, n)
        c_a = c.gather(2, node[:, None, None].expand(c.shape[0], c.shape[1], 1))  # (B, HV, 1)
        weight = torch.where(anc[:, None, :], c_a - c, float("-inf")).exp()  # (B, HV, n)
        update = (self.key * weight[..., None]).transpose(-1, -2) @ self.new_value  # (B, HV, dk, dv)
        return self.initial_state * c_a.exp()[..., None] + update

    def windows(self, node: int | torch.LongTensor) -> torch.Tensor:
        """Conv window after flattened input `node` (an int, or one per row `(B,)`), `(B, C, K)`."""
        if isinstance(node, torch.Tensor):
            return self.window[torch.arange(node.shape[0], device=node.device), :, node]
        return self.window[:, :, node]


@dataclass
class HybridTreeContext:
    """Per-round tree description shared by all GDN layers, and the place they leave their commit records.

    Args:
        parents (`torch.LongTensor` of shape `(n,)`, or `(B, n)` for one tree per row): parent of each flattened
            input; index 0 is the root (parent -1), every other input's parent has a smaller index (topological
            order).
        ancestors (`torch.BoolTensor` of shape `(n, n)`, or `(B, n, n)`): `ancestors[..., i, j]` is True when input
            `j` is `i` or one of its ancestors.
        method (`str`): `"chunk"` (default, tree-masked WY chunk) or `"fork"` (per-node states, reference).
    """

    parents: torch.LongTensor
    ancestors: torch.BoolTensor
    method: str = "chunk"
    records: dict[int, _GDNRecord] = field(default_factory=dict)
    _conv_index: dict[tuple[int, str], torch.LongTensor] = field(default_factory=dict, repr=False)
    _levels: list[torch.LongTensor] | None = field(default=None, repr=False)

    def __post_init__(self):
        if self.method not in GDN_METHODS:
            raise ValueError(f"`method` must be one of {GDN_METHODS}, got {self.method!r}.")

    @property
    def num_inputs(self) -> int:
        return int(self.parents.shape[-1])

    @property
    def per_row(self) -> bool:
        """One tree per row (`parents` `(B, n)`) rather than one shared tree."""
        return self.parents.dim() == 2

    def conv_index(self, kernel_size: int, device: torch.device) -> torch.LongTensor:
        """`(n, K)` (per row: `(B, n, K)`) indices into `cat([conv_state[..., -(K-1):], x], -1)` (length `K-1+n`):
        node i's window along its ancestor path, oldest first. Columns above the root come from the carried conv
        state."""
        key = (kernel_size, str(device))
        if key not in self._conv_index and self.per_row:
            parents = self.parents.to(device)  # (B, n)
            node = torch.arange(parents.shape[1], device=device).expand_as(parents)  # walks up each path
            carried = torch.full_like(parents, kernel_size - 2)  # newest carried column not yet used
            columns = []
            for _ in range(kernel_size):
                inside = node >= 0
                columns.append(torch.where(inside, kernel_size - 1 + node, carried))
                carried = torch.where(inside, carried, carried - 1)
                node = torch.where(inside, parents.gather(1, node.clamp(min=0)), node)
            self._conv_index[key] = torch.stack(columns[::-1], -1)  # (B, n, K)
        if key not in self._conv_index:
            parents = self.parents.tolist()
            rows = []
            for i in range(len(parents)):
                window, node = [], i
                carried = kernel_size - 2  # newest carried column
                for _ in range(kernel_size):
                    if node >= 0:
                        window.append(kernel_size - 1 + node)
                        node = parents[node]
                    else:
                        window.append(carried)
                        carried -= 1
                rows.append(window[::-1])
            self._conv_index[key] = torch.tensor(rows, dtype=torch.long, device=device)
        return self._conv_index[key]

    def levels(self) -> list[torch.LongTensor]:
        """Flattened inputs grouped by depth (root first)."""
        if self._levels is None:
            depth: list[int] = []
            for p in self.parents.tolist():
                depth.append(0 if p < 0 else depth[p] + 1)
            depth_t = torch.tensor(depth)
            self._levels = [
                torch.nonzero(depth_t == d).flatten().to(self.parents.device) for d in range(max(depth) + 1)
            ]
        return self._levels


# --------------------------------------------------------------------------------------------------------------
# Tree-aware GDN forward
# --------------------------------------------------------------------------------------------------------------
def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _project(layer: nn.Module, hidden_states: torch.Tensor):
    """The layer's input projections: pre-conv `(B, C, n)` qkv, gate `z` `(B, n, HV, dv)`, `b`, `a` `(B, n, HV)`."""
    bsz, n, _ = hidden_states.shape
    if hasattr(layer, "in_proj_qkvz"):  # Qwen3-Next layout: fused, head-interleaved projections
        q, k, v, z, b, a = layer.fix_query_key_value_ordering(
            layer.in_proj_qkvz(hidden_states), layer.in_proj_ba(hidden_states)
        )
        mixed_qkv = torch.cat([t.reshape(bsz, n, -1) for t in (q, k, v)], dim=-1)  # (B, n, C)
    else:  # Qwen3.5 layout
        mixed_qkv = layer.in_proj_qkv(hidden_states)  # (B, n, C)
        z = layer.in_proj_z(hidden_states).reshape(bsz, n, -1, layer.head_v_dim)
        b = layer.in_proj_b(hidden_states)
        a = layer.in_proj_a(hidden_states)
    return mixed_qkv.transpose(1, 2), z, b, a


def _tree_conv(layer: nn.Module, mixed_qkv: torch.Tensor, conv_state: torch.Tensor | None, ctx: HybridTreeContext):
    """Causal depthwise conv along each node's ancestor path. Returns activated `(B, C, n)` and windows
    `(B, C, n, K)` (a node's window is exactly the conv state after that node)."""
    bsz, channels, _ = mixed_qkv.shape
    kernel = layer.conv_kernel_size
    if conv_state is None:  # no prefix: like the stock prefill, the left context is zeros
        carried = mixed_qkv.new_zeros(bsz, channels, kernel - 1)
    else:
        carried = conv_state[..., conv_state.shape[-1] - (kernel - 1) :].to(mixed_qkv.dtype)  # (B, C, K-1)
    extended = torch.cat([carried, mixed_qkv], dim=-1)  # (B, C, K-1+n)
    index = ctx.conv_index(kernel, mixed_qkv.device)  # (n, K), or (B, n, K) with one tree per row
    if index.dim() == 3:
        n = index.shape[1]
        flat = index.reshape(bsz, 1, n * kernel).expand(bsz, channels, n * kernel)
        window = extended.gather(2, flat).reshape(bsz, channels, n, kernel)  # (B, C, n, K)
    else:
        window = extended[..., index]  # (B, C, n, K)
    weight = layer.conv1d.weight.squeeze(1)  # (C, K)
    out = torch.einsum("bcnk,ck->bcn", window.to(weight.dtype), weight)  # (B, C, n)
    if layer.conv1d.bias is not None:
        out = out + layer.conv1d.bias[:, None]
    out = ACT2FN[layer.activation](out)
    return out.to(mixed_qkv.dtype), window


def _chunk_core(q, k, v, g, beta, s0, anc):
    """Tree-masked WY/UT chunk. q, k `(B, H, n, dk)`, v `(B, H, n, dv)`, g, beta `(B, H, n)`, s0 `(B, H, dk, dv)`,
    all fp32; `anc` `(n, n)` (one tree) or `(B, n, n)` (one per row). Returns outputs `(B, H, n, dv)` and what a
    commit needs to rebuild any node's state."""
    if anc.dim() == 3:  # one tree per row
        anc = anc[:, None]  # (B, 1, n, n)
        path_decay = (anc.to(g.dtype) @ g[..., None])[..., 0]  # (B, H, n): c_i = sum of g over i's path
    else:
        path_decay = g @ anc.to(g.dtype).T  # (B, H, n): c_i = sum of g over i's path (root..i)
    pair = path_decay[..., :, None] - path_decay[..., None, :]  # (B, H, n, n): c_i - c_j
    decay = pair.masked_fill(~anc, float("-inf")).exp()  # exp(c_i - c_j) on ancestors only, 0 elsewhere
    k_beta = k * beta[..., None]
    v_beta = v * beta[..., None]
    system = (k_beta @ k.transpose(-1, -2)) * decay  # (B, H, n, n), lower-triangular (topological order)
    u = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)  # (B, H, n, dv)
    w = torch.linalg.solve_triangular(
        system, k_beta * path_decay.exp()[..., None], upper=False, unitriangular=True
    )  # (B, H, n, dk)
    new_value = u - w @ s0  # (B, H, n, dv)
    out = (q * path_decay.exp()[..., None]) @ s0 + ((q @ k.transpose(-1, -2)) * decay) @ new_value
    return out, new_value, path_decay


def _fork_core(q, k, v, g, beta, s0, ctx: HybridTreeContext):
    """Per-node recurrent steps, one tree level at a time. Same shapes as `_chunk_core`; returns outputs and every
    node's state `(B, H, n, dk, dv)`."""
    bsz, heads, n, dk = k.shape
    dv = v.shape[-1]
    states = s0.new_zeros(bsz, heads, n, dk, dv)
    out = v.new_zeros(bsz, heads, n, dv)
    parents = ctx.parents.to(q.device)
    if ctx.per_row:  # one tree per row: node by node (topological order), each from its own row's parent
        rows = torch.arange(bsz, device=q.device)
        for i in range(n):
            par = parents[:, i]  # (B,)
            state = torch.where((par < 0)[:, None, None, None], s0, states[rows, :, par.clamp(min=0)])
            state = state * g[..., i].exp()[..., None, None]  # (B, H, dk, dv)
            kv_mem = (state * k[:, :, i, :, None]).sum(-2)  # (B, H, dv)
            delta = (v[:, :, i] - kv_mem) * beta[..., i, None]
            state = state + k[:, :, i, :, None] * delta[..., None, :]
            out[:, :, i] = (state * q[:, :, i, :, None]).sum(-2)
            states[:, :, i] = state
        return out, states
    for level in ctx.levels():
        level = level.to(q.device)
        par = parents[level]
        if bool((par < 0).all()):
            state = s0[:, :, None].expand(bsz, heads, level.numel(), dk, dv)  # (B, H, m, dk, dv)
        else:
            state = states[:, :, par]
        state = state * g[..., level].exp()[..., None, None]
        k_t, v_t, q_t = k[:, :, level], v[:, :, level], q[:, :, level]  # (B, H, m, d)
        kv_mem = (state * k_t[..., None]).sum(-2)  # (B, H, m, dv)
        delta = (v_t - kv_mem) * beta[..., level][..., None]
        state = state + k_t[..., None] * delta[..., None, :]
        out[:, :, level] = (state * q_t[..., None]).sum(-2)
        states[:, :, level] = state
    return out, states


@force_accelerate_hooks("conv1d")
def _tree_forward(layer: nn.Module, hidden_states: torch.Tensor, cache: Cache | None, ctx: HybridTreeContext):
    """Verify forward of one GDN layer over the flattened tree `hidden_states` `(B, n, D)`. Reads `cache`, never
    writes it; leaves a `_GDNRecord` in `ctx.records[layer.layer_idx]`."""
    bsz, n, _ = hidden_states.shape
    if n != ctx.num_inputs:
        raise ValueError(
            f"The tree context describes {ctx.num_inputs} inputs but layer {layer.layer_idx} received {n}; the "
            "`HybridTreeContext` must be built for this very forward."
        )
    conv_state = recurrent_state = None
    if cache is not None:
        conv_state = cache.get_conv_state(layer.layer_idx, state_idx=0)
        recurrent_state = cache.get_recurrent_state(layer.layer_idx, state_idx=0)

    mixed_qkv, z, b, a = _project(layer, hidden_states)
    mixed_qkv, window = _tree_conv(layer, mixed_qkv, conv_state, ctx)
    mixed_qkv = mixed_qkv.transpose(1, 2)  # (B, n, C)
    query, key, value = torch.split(mixed_qkv, [layer.key_dim, layer.key_dim, layer.value_dim], dim=-1)
    query = query.reshape(bsz, n, -1, layer.head_k_dim)  # (B, n, Hk, dk)
    key = key.reshape(bsz, n, -1, layer.head_k_dim)
    value = value.reshape(bsz, n, -1, layer.head_v_dim)  # (B, n, HV, dv)
    beta = b.sigmoid()  # (B, n, HV)
    g = -layer.A_log.float().exp() * F.softplus(a.float() + layer.dt_bias)  # (B, n, HV), fp32 log-decay

    # Per-token maths (no tree involved): GQA, fp32, l2-norm, query scaling; then (B, HV, n, d) layout
    rep = layer.num_v_heads // layer.num_k_heads
    if rep > 1:
        query = query.repeat_interleave(rep, dim=2)
        key = key.repeat_interleave(rep, dim=2)
    query, key, value = (t.transpose(1, 2).float() for t in (query, key, value))
    beta, g = beta.transpose(1, 2).float(), g.transpose(1, 2)  # (B, HV, n)
    query = _l2norm(query) * layer.head_k_dim**-0.5
    key = _l2norm(key)

    heads, dk, dv = value.shape[1], key.shape[-1], value.shape[-1]
    if recurrent_state is None:
        s0 = value.new_zeros(bsz, heads, dk, dv)
        version = None
    else:
        s0 = recurrent_state.float()  # no copy when already fp32; never written here
        # the chunk commit rebuilds from s0: guard it against later writes (inference tensors have no counter)
        version = None if s0.is_inference() else s0._version

    anc = ctx.ancestors.to(query.device)
    record = _GDNRecord(window=window, ancestors=anc, method=ctx.method)
    if ctx.method == "chunk":
        core, new_value, path_decay = _chunk_core(query, key, value, g, beta, s0, anc)
        record.initial_state, record.initial_version = s0, version
        record.key, record.new_value, record.path_decay = key, new_value, path_decay
    else:
        core, record.states = _fork_core(query, key, value, g, beta, s0, ctx)
    ctx.records[layer.layer_idx] = record

    core = core.transpose(1, 2).to(hidden_states.dtype)  # (B, n, HV, dv)
    core = layer.norm(core.reshape(-1, layer.head_v_dim), z.reshape(-1, layer.head_v_dim))
    return layer.out_proj(core.reshape(bsz, n, -1))  # (B, n, D)


# --------------------------------------------------------------------------------------------------------------
# Installing the tree path on a target
# --------------------------------------------------------------------------------------------------------------
class _TreeGDNMixin:
    """Takes the tree path when the `TREE_KWARG` kwarg is given, the stock forward otherwise."""

    def forward(self, hidden_states, *args, **kwargs):
        ctx = kwargs.pop(TREE_KWARG, None)
        if ctx is None:
            return super().forward(hidden_states, *args, **kwargs)
        cache = kwargs.get("cache", kwargs.get("cache_params", args[0] if args else None))
        return _tree_forward(self, hidden_states, cache, ctx)


# The Gated DeltaNet layers hf_chainflow can fork: (transformers modeling module, class). Their modules are not
# imported here: a model can only hold such a layer once its module is imported, so dense targets never load them.
_GDN_CLASSES = (
    ("transformers.models.qwen3_5.modeling_qwen3_5", "Qwen3_5GatedDeltaNet"),
    ("transformers.models.qwen3_5_moe.modeling_qwen3_5_moe", "Qwen3_5MoeGatedDeltaNet"),
    ("transformers.models.qwen3_next.modeling_qwen3_next", "Qwen3NextGatedDeltaNet"),
)
_GDN_NAMES = ", ".join(name for _, name in _GDN_CLASSES)


def _supported_gdn() -> tuple[type, ...]:
    """The supported GDN classes whose modeling modules are loaded (the only ones a model can hold)."""
    modules = ((sys.modules.get(module), name) for module, name in _GDN_CLASSES)
    return tuple(getattr(module, name) for module, name in modules if hasattr(module, name))


# Tree-aware subclass per GDN class (`TreeQwen3_5GatedDeltaNet`, ...), built on first use by `_tree_class`.
_TREE_CLASSES: dict[type, type] = {}

_PREPARED: "weakref.WeakKeyDictionary[nn.Module, dict[int, nn.Module]]" = weakref.WeakKeyDictionary()


def _recurrent_layer_indices(model: nn.Module) -> list[int]:
    config = getattr(model, "config", None)
    if config is None:
        return []
    if hasattr(config, "get_text_config"):
        config = config.get_text_config(decoder=True)
    layer_types = getattr(config, "layer_types", None) or []
    return [i for i, t in enumerate(layer_types) if t in _RECURRENT_LAYER_TYPES]


_IS_HYBRID: "weakref.WeakKeyDictionary[nn.Module, bool]" = weakref.WeakKeyDictionary()


def is_hybrid_target(model: nn.Module) -> bool:
    """True when `model` has recurrent / linear-attention layers (by `config.layer_types` or by module type)."""
    if model in _PREPARED:
        return True
    if model not in _IS_HYBRID:
        supported = _supported_gdn()
        _IS_HYBRID[model] = bool(_recurrent_layer_indices(model)) or any(
            isinstance(m, supported) for m in model.modules()
        )
    return _IS_HYBRID[model]


def has_recurrent_state(model: nn.Module) -> bool:
    """True when `model` keeps recurrent state: a `linear_attention` / `mamba` entry in `config.layer_types`, or a
    supported GDN module. What transformers <= 5.24 marked `_is_stateful` (see `hf_chainflow.generation.settings.
    is_stateful_target`, which asks this on 5.25 and later, where the attribute is gone)."""
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "get_text_config"):
        config = config.get_text_config(decoder=True)
    layer_types = getattr(config, "layer_types", None) or []
    supported = _supported_gdn()
    return any(t in _RECURRENT_STATE_LAYER_TYPES for t in layer_types) or any(
        isinstance(m, supported) for m in model.modules()
    )


def gdn_layers(model: nn.Module) -> dict[int, nn.Module]:
    """`{layer_idx: GDN module}` of `model` (after `prepare_hybrid_target`, the tree-aware modules)."""
    if model in _PREPARED:
        return _PREPARED[model]
    supported = _supported_gdn()
    return {m.layer_idx: m for m in model.modules() if isinstance(m, supported)}


def check_forkable_target(model: nn.Module) -> None:
    """Raise `ValueError` unless every recurrent layer of `model` is a Gated DeltaNet layer that can be forked.

    Pure (changes nothing): for the up-front checks of a `generate` call on a stateful target
    (`hf_chainflow.generation.settings.is_stateful_target`), so that Mamba, LFM2 conv layers and the like are refused before
    any forward runs."""
    supported = _supported_gdn()
    forkable = {m.layer_idx for m in model.modules() if isinstance(m, supported)}
    other = sorted(set(_recurrent_layer_indices(model)) - forkable)
    if other or not forkable:
        where = f"layers {other} (config.layer_types)" if other else "layers that are not Gated DeltaNet"
        raise ValueError(
            f"{type(model).__name__} keeps recurrent state in {where}, which hf_chainflow cannot fork per draft "
            f"node. ChainFlow speculative generation supports attention targets and Gated DeltaNet hybrids "
            f"({_GDN_NAMES}); call `generate` without `assistant_model` here."
        )


def prepare_hybrid_target(model: nn.Module) -> dict[int, nn.Module]:
    """Install the tree-verify path on the GDN layers of `model` (this instance only). Idempotent.

    Each `Qwen3_5GatedDeltaNet` / `Qwen3_5MoeGatedDeltaNet` / `Qwen3NextGatedDeltaNet` module gets a subclass as
    its `__class__`: parameters, buffers, state-dict keys and plain forwards are unchanged. Returns
    `{layer_idx: module}`. Raises `ValueError` when the model has recurrent layers of another kind.
    """
    if model in _PREPARED:
        return _PREPARED[model]
    layers: dict[int, nn.Module] = {}
    supported = _supported_gdn()
    for module in model.modules():
        if isinstance(module, _TreeGDNMixin):
            layers[module.layer_idx] = module
        elif isinstance(module, supported):
            module.__class__ = _tree_class(type(module))
            layers[module.layer_idx] = module
    expected = _recurrent_layer_indices(model)
    missing = sorted(set(expected) - set(layers))
    if missing:
        raise ValueError(
            f"{type(model).__name__} has recurrent layers {missing} (config.layer_types) that are not Gated "
            f"DeltaNet layers hf_chainflow can fork; supported layer modules: "
            f"{_GDN_NAMES}."
        )
    _PREPARED[model] = layers
    return layers


def _tree_class(cls: type) -> type:
    """Tree-aware subclass of a supported GDN class (or of a user subclass of one; built once per class)."""
    if cls not in _TREE_CLASSES:
        _TREE_CLASSES[cls] = type(f"Tree{cls.__name__}", (_TreeGDNMixin, cls),
                                  {"__module__": __name__, "__doc__": f"`{cls.__name__}` with the tree-verify path."})
    return _TREE_CLASSES[cls]


# --------------------------------------------------------------------------------------------------------------
# Commit
# --------------------------------------------------------------------------------------------------------------
# transformers >= 5.25: linear-attention cache layers count the tokens they have seen (`cumulative_length_linear`,
# advanced by `update_conv_state` / `increase_count`) and answer `get_seq_length()` with that count, so that
# `DynamicCache.get_seq_length()` (which reads layer 0) reads a GDN layer of a Qwen3.5 stack. Up to 5.24 they kept no
# count and `get_seq_length()` skipped them for the first attention layer.
LINEAR_LAYERS_COUNT_TOKENS = "get_seq_length" in vars(LinearAttentionCacheLayerMixin)


def committed_length(cache: Cache) -> int:
    """Columns held by the attention layers of `cache` (what `DynamicCache.get_seq_length()` returned up to
    transformers 5.24 on any cache): the length verification reasons about. From 5.25 `get_seq_length()` reads
    layer 0 even when it is a linear-attention layer, whose token count a tree verify forward does not advance (it
    never writes the GDN states; `sync_linear_lengths` sets it after a commit). 0 for a cache with no layers yet;
    `ValueError` for a cache without attention layers."""
    if not cache.layers:
        return 0
    for layer in cache.layers:
        if isinstance(layer, CacheLayerMixin):
            return int(layer.get_seq_length())
    raise ValueError(f"The {type(cache).__name__} holds no attention layer (only "
                     f"{sorted({type(layer).__name__ for layer in cache.layers})}); verification needs one.")


def sync_linear_lengths(cache: Cache) -> None:
    """transformers >= 5.25: set every linear-attention layer's token count to `committed_length(cache)`, in place
    (its address stays static), so that `cache.get_seq_length()` and transformers' own forwards (default position
    ids, `generate`'s input slicing) see the committed length after a commit or a column cut. No-op before 5.25
    (the layers keep no count)."""
    if not LINEAR_LAYERS_COUNT_TOKENS:
        return
    length = committed_length(cache)
    for layer in cache.layers:
        if isinstance(layer, LinearAttentionCacheLayerMixin):
            layer.cumulative_length_linear.fill_(length)


def commit_hybrid_states(cache: Cache, ctx: HybridTreeContext, last: int | torch.LongTensor) -> None:
    """Make every GDN layer's cached conv window and recurrent state those after flattened input `last` (0 = the
    root, `i + 1` = tree node `i`; an int for every row, or one per row `(B,)`). Copies in place (`copy_`) when the
    cache already holds states."""
    if not ctx.records:
        raise ValueError("The `HybridTreeContext` holds no layer records: run the verify forward with it first.")
    for layer_idx, record in ctx.records.items():  # validate everything before writing anything
        layer = cache.layers[layer_idx]
        if not isinstance(layer, LinearAttentionCacheLayerMixin):
            raise ValueError(f"Cache layer {layer_idx} is a {type(layer).__name__}, not a linear-attention layer.")
        if record.method == "chunk" and record.initial_version is not None:
            if record.initial_state._version != record.initial_version:
                raise ValueError(
                    f"The recurrent state of layer {layer_idx} changed between the verify forward and the commit; "
                    "commit right after verify_forward, with no other forward on this cache in between."
                )
    for layer_idx, record in ctx.records.items():
        layer = cache.layers[layer_idx]
        window = record.windows(last)  # (B, C, K)
        state = record.state(last)  # (B, HV, dk, dv)
        if layer.has_previous_state[0]:
            layer.conv_states[0].copy_(window)
        else:  # empty prefix: let the cache allocate its (static-address) tensors
            cache.update_conv_state(window.contiguous(), layer_idx, conv_kernel_size=window.shape[-1])
        if layer.is_recurrent_states_initialized[0]:
            layer.recurrent_states[0].copy_(state)
        else:
            cache.update_recurrent_state(state.contiguous(), layer_idx)
