"""The drafter as served: tensors derived from its weights and the bound target's, built once and cached.

- `serving_head_weight(drafter)`: the head rows of the draft vocabulary in `config.serving_head_dtype`;
- `serving_feedback_weight(drafter)`: the feedback heads folded through those rows;
- `serving_velocity(drafter)`: the velocity network's experts stacked (`StackedExperts`);
- `serving_tables(drafter)`: all of them (and the packed products, `PackedLinear`) as the `ServingTables` one search
  reads, gathered once per round outside the (compiled) drafting round.

Each function takes a `ChainFlowDrafter` and keeps its caches in the drafter's `_runtime` dict: those derived from
the weights under `_runtime["weights"]`, which the model drops on `train()` / `eval()` and a head resize; the packed
products under `_runtime["packed"]`, checked against their weight. Nothing here is saved with the drafter.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from hf_chainflow.generation.packed_linear import PackedLinear
from hf_chainflow.models.chainflow.layers_chainflow import (ChainFlowAttention, ChainFlowBlock, ChainFlowExpert,
                                                            ChainFlowVelocityNet, _key_mask, _time_features)


class StackedExperts:
    """A `ChainFlowVelocityNet` for serving: every weight stacked over the `E` experts (a derived copy, built by
    `serving_velocity`, never saved), so each layer of all experts is one batched product
    (`torch.baddbmm`, linear weights pre-transposed `(E, in, out)`) and each attention one call over `E * B` rows:
    half the kernel launches of the expert-by-expert forward. The time and bonus embeddings (one row per window)
    stay with each expert's own modules: a one-row batched product rounds apart from the module's. Called like the
    module, it computes the same velocity, bit for bit on CPU (`tests/test_modeling.py`).
    """

    # the module types of a plain expert: anything else (a LoRA wrapper, for example) keeps the module forward
    PLAIN = (ChainFlowExpert, ChainFlowBlock, ChainFlowAttention, nn.Linear, nn.LayerNorm, nn.Sequential,
             nn.ModuleList, nn.GELU, nn.SiLU)

    def __init__(self, weights: dict[str, torch.Tensor], experts: list[ChainFlowExpert]):
        self.weights, self.experts = weights, experts
        first = experts[0]
        self.num_heads, self.is_causal, self.eps = first.blocks[0].self_attn.num_heads, first.is_causal, first.norm.eps

    @classmethod
    @torch.no_grad()
    def from_velocity(cls, net: ChainFlowVelocityNet) -> "StackedExperts | None":
        """The stacked weights of `net`'s experts; `None` when an expert holds another module type than `PLAIN`."""
        experts = list(net.experts)
        if any(type(m) not in cls.PLAIN for e in experts for m in e.modules()):
            return None
        first = experts[0]
        linear = {name for name, m in first.named_modules() if type(m) is nn.Linear}
        weights = {}
        for name, _ in first.named_parameters():
            module, _, kind = name.rpartition(".")
            if module.startswith(("time_mlp.", "bonus_proj.")):
                continue  # one row per window: run by each expert's modules
            parts = [e.get_parameter(name).detach() for e in experts]
            if module in linear and kind == "weight":
                weights[name] = torch.stack([w.t() for w in parts]).contiguous()  # (E, in, out)
            elif module in linear:
                weights[name] = torch.stack(parts)[:, None].contiguous()  # (E, 1, out)
            else:
                weights[name] = torch.stack(parts).contiguous()  # (E, H) norms, (E, P, H) pos_emb
        return cls(weights, experts)

    def _linear(self, name, x):
        """`x` `(E, n, in)` through every expert's linear `name` -> `(E, n, out)`."""
        bias = self.weights.get(f"{name}.bias")
        weight = self.weights[f"{name}.weight"]
        return torch.bmm(x, weight) if bias is None else torch.baddbmm(bias, x, weight)

    def _norm(self, name, x):
        """Each expert's LayerNorm `name` on its rows of `x` `(E, n, H)` (`F.layer_norm` per expert, as the module)."""
        w, b = self.weights[f"{name}.weight"], self.weights[f"{name}.bias"]
        return torch.stack([F.layer_norm(x[e], x.shape[-1:], w[e], b[e], self.eps) for e in range(x.shape[0])])

    def _attention(self, name, x, kv_in, B, mask=None, is_causal=False):
        """`x` `(E, B*T, H)` attends to `kv_in` `(E, B*S, H)` (mask `(E*B, 1, 1, S)`) -> `(E, B*T, H)`."""
        E, H, nh = x.shape[0], x.shape[-1], self.num_heads
        q = self._linear(f"{name}.q_proj", x).view(E * B, -1, nh, H // nh).transpose(1, 2)  # (E*B, nh, T, hd)
        k, v = self._linear(f"{name}.kv_proj", kv_in).view(E * B, -1, 2, nh, H // nh).unbind(2)
        k, v = k.transpose(1, 2), v.transpose(1, 2)  # (E*B, nh, S, hd)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal and mask is None)
        return self._linear(f"{name}.o_proj", y.transpose(1, 2).reshape(E, -1, H))  # (E, B*T, H)

    def __call__(self, z, s, context, context_mask=None, bonus=None):
        """As `ChainFlowVelocityNet.forward`: `z` `(B, K, Z)`, `s` `(B,)`, `context` `(B, C, Z)`, `context_mask`
        `(B, C)`, `bonus` `(B, D)` -> velocity `(B, K, Z)`."""
        w = self.weights
        E, P, H = w["pos_emb"].shape
        B, K, Z = z.shape
        C = context.shape[1]
        zs = z.reshape(B, E, P, Z).transpose(0, 1).reshape(E, B * P, Z)  # (E, B*P, Z): expert e's P positions
        t = _time_features(s, H).to(z.dtype)  # (B, H)
        x = self._linear("in_proj", zs).view(E, B, P, H) + w["pos_emb"][:, None]  # (E, B, P, H)
        x = x + torch.stack([e.time_mlp(t) for e in self.experts])[:, :, None]  # (E, B, 1, H)
        if self.experts[0].bonus_proj is not None:
            x = x + torch.stack([e.bonus_proj(bonus) for e in self.experts])[:, :, None]  # (E, B, 1, H)
        x = x.reshape(E, B * P, H)
        ctx = self._linear("ctx_proj", context.reshape(1, B * C, Z).expand(E, B * C, Z))  # (E, B*C, H)
        key_mask = _key_mask(context_mask)  # (B, 1, 1, C) | None
        if key_mask is not None:
            key_mask = key_mask.repeat(E, 1, 1, 1)  # (E*B, 1, 1, C), row e*B + b
        for i in range(len(self.experts[0].blocks)):
            block = f"blocks.{i}"
            h = self._norm(f"{block}.norm1", x)
            x = x + self._attention(f"{block}.self_attn", h, h, B, is_causal=self.is_causal)
            x = x + self._attention(f"{block}.cross_attn", self._norm(f"{block}.norm2", x), ctx, B, key_mask)
            x = x + self._linear(f"{block}.mlp.2", F.gelu(self._linear(f"{block}.mlp.0",
                                                                       self._norm(f"{block}.norm3", x))))
        v = self._linear("out_proj", self._norm("norm", x))  # (E, B*P, Z)
        if "skip.weight" in w:
            v = v + self._linear("skip", zs)
        return v.view(E, B, P, Z).transpose(0, 1).reshape(B, K, Z)


class ServingTables(NamedTuple):
    """The tensors a search reads besides the drafter's layers, gathered once per round before it runs (so that the
    search itself is a pure tensor function that `torch.compile` can trace; `serving_tables`).

    head (`(S, D)`): `serving_head_weight(drafter)`. folded: `serving_feedback_weight(drafter)` (`None`: term by
    term).
    embed (`(V, D)`): the target's input embeddings. to_draft (`(V,)`): vocabulary id -> draft index (`None`: no
    shortlist). to_token (`(S,)`): draft index -> vocabulary id (`None`: no shortlist). velocity: the velocity network
    the round's transport integrates with (`serving_velocity(drafter)`; `None`: the module `drafter.velocity`).
    head_linear, folded_linear: `head` and `folded`'s matrix as `PackedLinear` (the same products, packed once for
    oneDNN where that is bit for bit the same; `None`: `F.linear` with the tensors).
    """

    head: torch.Tensor
    folded: tuple[torch.Tensor, torch.Tensor] | None
    embed: torch.Tensor
    to_draft: torch.Tensor | None
    to_token: torch.Tensor | None
    dtype: torch.dtype
    velocity: object = None
    head_linear: PackedLinear | None = None
    folded_linear: PackedLinear | None = None

    def embed_tokens(self, tokens):
        """Frozen target embeddings of `tokens` `(...)` -> `(..., D)` in the drafter's dtype."""
        return F.embedding(tokens, self.embed).to(self.dtype)

    def draft_index(self, tokens):
        return tokens if self.to_draft is None else self.to_draft[tokens]

    def token(self, index):
        return index if self.to_token is None else self.to_token[index]



def _weight_caches(drafter) -> dict:
    """The caches derived from `drafter`'s weights (dropped by the model on `train()` / `eval()`)."""
    return drafter._runtime.setdefault("weights", {})


def serving_head_weight(drafter) -> torch.Tensor:
    """`drafter.draft_head_weight()` in `config.serving_head_dtype` (bfloat16 by default: drafting reads these rows
    every round, and halving the bytes halves that cost; what is proposed may change, never what is emitted)."""
    dtype = getattr(torch, drafter.config.serving_head_dtype)
    W = drafter.draft_head_weight()
    if W.dtype == dtype:
        return W
    key = (W.data_ptr(), dtype)
    caches = _weight_caches(drafter)
    cache = caches.get("head")
    if cache is None or cache[0] != key:
        caches["head"] = cache = (key, W.to(dtype).contiguous())
    return cache[1]


def serving_feedback_weight(drafter) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The feedback heads folded through the head rows, for serving: `(F, b)` with `F` `(S, R + r)` and `b` `(S,)`.

    `W·r(parents, ĥ) + U2·U1[x] = F·[m; U1[x]] + b`, where `m = path_head.hidden(parents, ĥ)` `(R,)` and
    `r = out(m)`: one `(R + r)`-wide product per node instead of a `D`-wide one plus the Markov product. Computed
    in float32 from the current weights, stored in `config.serving_head_dtype`, cached until a weight changes
    (an in-place update that bumps `Tensor._version`) or the mode changes (`train()` / `eval()`: the fused AdamW
    updates in place without bumping `_version`).
    `None` without feedback heads, or when `path_head.out` is not a plain `nn.Linear` (a LoRA adapter wraps it);
    the search then evaluates Eq. 3 term by term (same maths, another rounding).
    """
    parts = []
    if drafter.path_head is not None:
        out = drafter.path_head.out
        if type(out) is not nn.Linear:
            return None
        parts += [out.weight, out.bias]
    if drafter.markov_head is not None:
        parts.append(drafter.markov_head.u2)
    if not parts:
        return None
    W = drafter.draft_head_weight()  # (S, D)
    dtype = getattr(torch, drafter.config.serving_head_dtype)
    key = (W.data_ptr(), W.dtype, dtype) + tuple((t.data_ptr(), t._version) for t in parts)
    caches = _weight_caches(drafter)
    cache = caches.get("feedback")
    if cache is None or cache[0] != key:
        with torch.no_grad():
            Wf = W.float()
            blocks, bias = [], Wf.new_zeros(W.shape[0])
            if drafter.path_head is not None:
                blocks.append(Wf @ drafter.path_head.out.weight.float())  # (S, R)
                bias = Wf @ drafter.path_head.out.bias.float()  # (S,)
            if drafter.markov_head is not None:
                blocks.append(drafter.markov_head.u2.float())  # (S, r)
            fused = torch.cat(blocks, 1).to(dtype).contiguous()  # (S, R + r)
        caches["feedback"] = cache = (key, (fused, bias))
    return cache[1]


def serving_velocity(drafter):
    """The velocity network as served: its experts stacked (`StackedExperts`, one batched product per layer),
    built from the current weights and cached until one of them changes (its `data_ptr` or `Tensor._version`)
    or the mode changes (`train()` / `eval()`, which also follows a LoRA adapter's injection or merge); the
    module itself in training mode or when an expert holds another module type (a LoRA adapter)."""
    if drafter.training:
        return drafter.velocity
    key = tuple((p.data_ptr(), p._version) for p in drafter.velocity.parameters())
    caches = _weight_caches(drafter)
    cache = caches.get("velocity")
    if cache is None or cache[0] != key:
        stacked = StackedExperts.from_velocity(drafter.velocity)
        caches["velocity"] = cache = (key, drafter.velocity if stacked is None else stacked)
    return cache[1]


def serving_tables(drafter) -> ServingTables:
    """The tensors one search reads besides the layers (`ServingTables`), from the caches above; gathered once per
    round, outside the (compiled) drafting round."""
    drafter._require_bound()
    embed = drafter._bound["embed"].weight.detach()
    if drafter.config.shortlist is None:
        to_draft = to_token = None
    else:
        to_draft, to_token = drafter._draft_index_lut(embed.device), drafter.shortlist_ids.to(embed.device)
    head, folded = serving_head_weight(drafter), serving_feedback_weight(drafter)
    return ServingTables(head=head, folded=folded, embed=embed, to_draft=to_draft, to_token=to_token,
                         dtype=drafter.dtype, velocity=serving_velocity(drafter),
                         head_linear=_packed(drafter, "head", head),
                         folded_linear=None if folded is None else _packed(drafter, "folded", folded[0]))


def _packed(drafter, name: str, weight: torch.Tensor) -> PackedLinear:
    """`weight` as a `PackedLinear` (packed for oneDNN where that is bit for bit `F.linear`), cached per `name`
    until `weight` is another tensor or is changed in place (its `_version`; an inference tensor has none)."""
    caches = drafter._runtime.setdefault("packed", {})
    version = None if weight.is_inference() else weight._version  # inference tensors keep no version
    cache = caches.get(name)
    if cache is None or cache[0] is not weight or cache[1] != version:
        caches[name] = cache = (weight, version, PackedLinear(weight))
    return cache[2]


__all__ = ["ServingTables", "StackedExperts", "serving_feedback_weight", "serving_head_weight", "serving_tables",
           "serving_velocity"]
