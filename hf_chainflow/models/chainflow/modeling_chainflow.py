"""The ChainFlow drafter: VAE over target states, rectified-flow transport, token-feedback heads, candidate search.

Reading order: small layers (attention, block) -> VAE -> velocity network -> fused target layers -> heads ->
`ChainFlowDrafter`
(`forward` for training, `draft` for serving).  Alignment (SPEC.md): with committed tokens `x_1..x_{t+1}` and
target states `h_1..h_t`, draft position `i = 1..K` predicts the state `h_{t+i}` and so the token `x_{t+1+i}`;
its parents are `x_{t+i-p+1 .. t+i}`.
"""

from __future__ import annotations

import copy
import math
import os
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoConfig, AutoModel, GenerationConfig, PreTrainedModel
from transformers.utils import ModelOutput

from hf_chainflow.models.chainflow.configuration_chainflow import ChainFlowConfig
from hf_chainflow.generation.corpus_lookup import ContinuationTable
from hf_chainflow.generation.drafting_round import CompiledDraftingRound, drafting_round
from hf_chainflow.generation.packed_linear import PackedLinear
from hf_chainflow.generation.search import DraftBatch, ServingTables, candidate_search, committed_tails, search_levels
from hf_chainflow.generation.settings import SearchSettings, check_num_flow_steps
from hf_chainflow.generation.tree import DraftTree


# ----------------------------------------------------------------------------------------------------------------
# Small layers
# ----------------------------------------------------------------------------------------------------------------
class ChainFlowAttention(nn.Module):
    """Multi-head attention; self-attention when `context` is None, cross-attention otherwise."""

    def __init__(self, hidden_size: int, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = hidden_size // num_heads
        self.q_proj = nn.Linear(hidden_size, hidden_size)
        self.kv_proj = nn.Linear(hidden_size, 2 * hidden_size)
        self.o_proj = nn.Linear(hidden_size, hidden_size)

    def forward(self, x, context=None, attn_mask=None, is_causal=False):
        B, T, H = x.shape
        kv_in = x if context is None else context
        q = self.q_proj(x).view(B, T, self.num_heads, self.head_dim).transpose(1, 2)  # (B, nh, T, hd)
        k, v = self.kv_proj(kv_in).view(B, kv_in.shape[1], 2, self.num_heads, self.head_dim).unbind(2)
        k, v = k.transpose(1, 2), v.transpose(1, 2)  # (B, nh, S, hd)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal and attn_mask is None)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, H))  # (B, T, H)


class ChainFlowBlock(nn.Module):
    """Pre-norm block: self-attention -> (optional) cross-attention to the context -> feed-forward."""

    def __init__(self, hidden_size: int, num_heads: int, ffn_multiplier: int, cross_attention: bool):
        super().__init__()
        self.norm1 = nn.LayerNorm(hidden_size)
        self.self_attn = ChainFlowAttention(hidden_size, num_heads)
        self.cross_attention = cross_attention
        if cross_attention:
            self.norm2 = nn.LayerNorm(hidden_size)
            self.cross_attn = ChainFlowAttention(hidden_size, num_heads)
        self.norm3 = nn.LayerNorm(hidden_size)
        self.mlp = nn.Sequential(
            nn.Linear(hidden_size, ffn_multiplier * hidden_size),
            nn.GELU(),
            nn.Linear(ffn_multiplier * hidden_size, hidden_size),
        )

    def forward(self, x, self_mask=None, is_causal=False, context=None, context_mask=None):
        x = x + self.self_attn(self.norm1(x), attn_mask=self_mask, is_causal=is_causal)
        if self.cross_attention:
            x = x + self.cross_attn(self.norm2(x), context=context, attn_mask=context_mask)
        return x + self.mlp(self.norm3(x))


def _key_mask(mask: torch.Tensor | None) -> torch.Tensor | None:
    """`(B, S)` bool validity -> `(B, 1, 1, S)` attention mask; rows with no valid key attend to everything."""
    if mask is None:
        return None
    mask = mask.bool()
    mask = mask | ~mask.any(-1, keepdim=True)
    return mask[:, None, None, :]


# ----------------------------------------------------------------------------------------------------------------
# VAE over target hidden states
# ----------------------------------------------------------------------------------------------------------------
class ChainFlowVAE(nn.Module):
    """Bidirectional transformer VAE mapping windows of target states `(B, T, D)` to latents `(B, T, Z)`."""

    def __init__(self, config: ChainFlowConfig):
        super().__init__()
        D, Z, W = config.target_hidden_size, config.latent_size, config.latent_size
        self.enc_in = nn.Linear(D, W)
        self.enc_pos = nn.Parameter(torch.zeros(config.vae_window, W))
        self.encoder = nn.ModuleList(
            ChainFlowBlock(W, config.vae_num_heads, 4, cross_attention=False) for _ in range(config.vae_num_layers)
        )
        self.enc_norm = nn.LayerNorm(W)
        self.to_mean = nn.Linear(W, Z)
        self.to_logvar = nn.Linear(W, Z)
        self.dec_in = nn.Linear(Z, W)
        self.dec_pos = nn.Parameter(torch.zeros(config.vae_window, W))
        self.decoder = nn.ModuleList(
            ChainFlowBlock(W, config.vae_num_heads, 4, cross_attention=False) for _ in range(config.vae_num_layers)
        )
        self.dec_norm = nn.LayerNorm(W)
        self.dec_out = nn.Linear(W, D)

    def encode(self, states, mask=None):
        """`(B, T, D)` -> posterior mean and log-variance, each `(B, T, Z)`."""
        T = states.shape[1]
        x = self.enc_in(states) + self.enc_pos[-T:]  # (B, T, W), positions right-aligned
        key_mask = _key_mask(mask)
        for block in self.encoder:
            x = block(x, self_mask=key_mask)
        x = self.enc_norm(x)
        return self.to_mean(x), self.to_logvar(x).clamp(-30.0, 20.0)

    def decode(self, latents):
        """`(B, T, Z)` -> reconstructed states `(B, T, D)`."""
        T = latents.shape[1]
        x = self.dec_in(latents) + self.dec_pos[:T]  # (B, T, W)
        for block in self.decoder:
            x = block(x)
        return self.dec_out(self.dec_norm(x))


# ----------------------------------------------------------------------------------------------------------------
# Velocity network: chunk experts (no routing)
# ----------------------------------------------------------------------------------------------------------------
def _time_features(s: torch.Tensor, dim: int) -> torch.Tensor:
    """Sinusoidal features of flow time `s` `(B,)` -> `(B, dim)`."""
    half = dim // 2
    freqs = torch.exp(-math.log(1000.0) * torch.arange(half, device=s.device, dtype=torch.float32) / half)
    angles = s.float()[:, None] * freqs[None] * 1000.0
    feats = torch.cat([angles.sin(), angles.cos()], -1)
    if dim % 2:
        feats = F.pad(feats, (0, 1))
    return feats


class ChainFlowExpert(nn.Module):
    """One chunk expert: blocks of self-attention over its draft positions, cross-attention to the context."""

    def __init__(self, config: ChainFlowConfig):
        super().__init__()
        Z, H = config.latent_size, config.flow_hidden_size
        self.in_proj = nn.Linear(Z, H)
        self.ctx_proj = nn.Linear(Z, H)
        self.pos_emb = nn.Parameter(torch.zeros(config.expert_size, H))
        self.time_mlp = nn.Sequential(nn.Linear(H, H), nn.SiLU(), nn.Linear(H, H))
        self.blocks = nn.ModuleList(
            ChainFlowBlock(H, config.num_heads, config.ffn_multiplier, cross_attention=True)
            for _ in range(config.num_blocks)
        )
        self.norm = nn.LayerNorm(H)
        self.out_proj = nn.Linear(H, Z)
        # `bonus_embedding`: the bonus token's frozen embedding, normalised and projected, beside the flow time (the
        # projection is zero-initialised in `_init_weights`: a fresh drafter starts as the paper's transport).
        D = config.target_hidden_size
        self.bonus_proj = nn.Sequential(nn.LayerNorm(D), nn.Linear(D, H)) if config.bonus_embedding else None
        # A network narrower than the latent cannot pass its input through at full rank; a full-rank linear skip
        # lets it (e.g. cancel a noise source, whose ideal velocity contains `-z0`). Initialised in `_init_weights`.
        self.skip = nn.Linear(Z, Z, bias=False) if H < Z else None
        self.source_is_noise = config.source == "noise"
        self.is_causal = config.attention == "causal"

    def forward(self, z, s, context, context_mask, bonus=None):
        """`z` `(B, P, Z)`, `s` `(B,)`, `context` `(B, C, Z)`, `bonus` `(B, D)` (the bonus token's embedding, read
        with `bonus_embedding`) -> velocity `(B, P, Z)`."""
        H = self.pos_emb.shape[-1]
        x = self.in_proj(z) + self.pos_emb + self.time_mlp(_time_features(s, H).to(z.dtype))[:, None]  # (B, P, H)
        if self.bonus_proj is not None:
            x = x + self.bonus_proj(bonus)[:, None]  # (B, 1, H)
        ctx = self.ctx_proj(context)  # (B, C, H)
        for block in self.blocks:
            x = block(x, is_causal=self.is_causal, context=ctx, context_mask=context_mask)
        v = self.out_proj(self.norm(x))
        return v if self.skip is None else v + self.skip(z)


class ChainFlowVelocityNet(nn.Module):
    """`v(z_s, s, c)` for all `K` draft positions; expert `e` always handles positions `e*P+1 .. (e+1)*P`."""

    def __init__(self, config: ChainFlowConfig):
        super().__init__()
        self.expert_size = config.expert_size
        self.experts = nn.ModuleList(ChainFlowExpert(config) for _ in range(config.num_experts))

    def forward(self, z, s, context, context_mask=None, bonus=None):
        key_mask = _key_mask(context_mask)
        chunks = z.split(self.expert_size, dim=1)  # E x (B, P, Z)
        return torch.cat([expert(c, s, context, key_mask, bonus) for expert, c in zip(self.experts, chunks)], 1)


class StackedExperts:
    """A `ChainFlowVelocityNet` for serving: every weight stacked over the `E` experts (a derived copy, built by
    `ChainFlowDrafter.serving_velocity`, never saved), so each layer of all experts is one batched product
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


# ----------------------------------------------------------------------------------------------------------------
# Fused target layers
# ----------------------------------------------------------------------------------------------------------------
class ChainFlowLayerFusion(nn.Module):
    """`W [std(h^(l_1)); ...; std(h^(l_n))]`: the outputs of the decoder layers `target_layer_ids` `(B, T, n*D)` ->
    `(B, T, Z)`, added to the context latents that condition the velocity network.

    Each layer is standardised per dimension with statistics of the training data (`layer_mean`, `layer_std`
    `(n, D)`, saved with the drafter; `ChainFlowDrafter.set_layer_statistics`): intermediate residual streams have
    dimensions hundreds of times larger than the rest. `W` is zero-initialised, so a fresh drafter starts as the
    final-states-only one.
    """

    def __init__(self, config: ChainFlowConfig):
        super().__init__()
        n, D = len(config.state_layers), config.target_hidden_size
        self.register_buffer("layer_mean", torch.zeros(n, D))
        self.register_buffer("layer_std", torch.ones(n, D))
        self.proj = nn.Linear(n * D, config.latent_size)

    def forward(self, layers):
        """`layers` `(B, T, n*D)` (layer `l_1`'s output, then `l_2`'s, ...) -> `(B, T, Z)`."""
        B, T, _ = layers.shape
        n, D = self.layer_mean.shape
        x = (layers.reshape(B, T, n, D) - self.layer_mean) / self.layer_std  # (B, T, n, D)
        return self.proj(x.reshape(B, T, n * D))


# ----------------------------------------------------------------------------------------------------------------
# Token feedback heads
# ----------------------------------------------------------------------------------------------------------------
class ChainFlowPathHead(nn.Module):
    """`r(parents, h)`: per-offset projections of the frozen parent embeddings, summed, mixed with `h`, MLP.

    The output layer is zero-initialised, so training starts from the marginal flow.
    """

    def __init__(self, config: ChainFlowConfig):
        super().__init__()
        D, R, p = config.target_hidden_size, config.path_hidden_size, config.path_order
        self.offset_proj = nn.Parameter(torch.empty(p, D, R))
        self.state_proj = nn.Linear(D, R)
        self.mlp = nn.Sequential(nn.GELU(), nn.Linear(R, R), nn.GELU())
        self.out = nn.Linear(R, D)

    def hidden(self, parent_embeds, states):
        """`parent_embeds` `(..., p, D)`, `states` `(..., D)` -> the MLP features before `out`, `(..., R)`."""
        p, D, R = self.offset_proj.shape
        flat = parent_embeds.reshape(*parent_embeds.shape[:-2], p * D)  # (..., p*D)
        x = flat @ self.offset_proj.reshape(p * D, R) + self.state_proj(states)  # (..., R): sum of per-offset maps
        return self.mlp(x)

    def forward(self, parent_embeds, states):
        """`parent_embeds` `(..., p, D)`, `states` `(..., D)` -> correction `(..., D)`."""
        return self.out(self.hidden(parent_embeds, states))


class ChainFlowMarkovHead(nn.Module):
    """Rank-`r` first-order transition bias `U2 U1[x_prev]` over the draft vocabulary (zero-initialised `U2`)."""

    def __init__(self, num_prev: int, num_out: int, rank: int):
        super().__init__()
        self.u1 = nn.Embedding(num_prev, rank)
        self.u2 = nn.Parameter(torch.zeros(num_out, rank))

    def forward(self, prev_index, u2=None):
        """`prev_index` `(...)` indices into the draft vocabulary (+1 "other" row) -> bias `(..., S or M)`.

        `u2`: the output rows to score (default: all `S`; the search passes the candidate rows `u2[rows]`).
        """
        return F.linear(self.u1(prev_index), self.u2 if u2 is None else u2)


# ----------------------------------------------------------------------------------------------------------------
# Outputs
# ----------------------------------------------------------------------------------------------------------------
@dataclass
class ChainFlowDrafterOutput(ModelOutput):
    """
    Everything the ChainFlow loss needs (B = batch, C = context, K = draft positions, N = flow steps, Z = latent,
    D = target hidden size, S = draft vocabulary: the shortlist, or the full vocabulary without one).

    velocity (`(B, K, Z)`): predicted velocity at the sampled flow time `flow_time`.
    velocity_target (`(B, K, Z)`): `z1 - z0`.
    flow_time (`(B,)`): sampled `s`.
    predicted_states (`(B, N, K, D)`): decoded states after each Euler step of the `N`-step trajectory from `z0`.
    corrected_states (`(B, K, D)`): final states plus the path correction `r`.
    target_states (`(B, K, D)`): the true future states.
    target_mask (`(B, K)`): which positions are valid.
    marginal_logits (`(B, K, S)`): `W_S h_N`.
    logits (`(B, K, S)`): `W_S (h_N + r) + markov` (teacher-forced parents).
    labels (`(B, K)`): true tokens as indices into the draft vocabulary, `-100` where masked or outside it.
    reconstructed_states (`(B, C + K, D)`): VAE reconstruction of context and target windows (sampled latents),
        in standardised units (`drafter.normalize`), so every dimension weighs alike in `L_rec`.
    reconstruction_targets (`(B, C + K, D)`): the standardised states; reconstruction_mask (`(B, C + K)`).
    kl (`()`): mean KL of the VAE posterior to `N(0, I)` per latent element (0 without a VAE).
    teacher_logits (`(B, K, S)`, only with `return_teacher_logits=True`): the target's own logits `W_S h_{t+k}` from
        the true states, no gradient (the `kd` loss term's teacher).
    """

    velocity: torch.FloatTensor | None = None
    velocity_target: torch.FloatTensor | None = None
    flow_time: torch.FloatTensor | None = None
    predicted_states: torch.FloatTensor | None = None
    corrected_states: torch.FloatTensor | None = None
    target_states: torch.FloatTensor | None = None
    target_mask: torch.BoolTensor | None = None
    marginal_logits: torch.FloatTensor | None = None
    logits: torch.FloatTensor | None = None
    labels: torch.LongTensor | None = None
    reconstructed_states: torch.FloatTensor | None = None
    reconstruction_targets: torch.FloatTensor | None = None
    reconstruction_mask: torch.BoolTensor | None = None
    kl: torch.FloatTensor | None = None
    teacher_logits: torch.FloatTensor | None = None


# ----------------------------------------------------------------------------------------------------------------
# The drafter
# ----------------------------------------------------------------------------------------------------------------
class ChainFlowPreTrainedModel(PreTrainedModel):
    config_class = ChainFlowConfig
    config: ChainFlowConfig
    base_model_prefix = "chainflow"
    main_input_name = "context_states"
    supports_gradient_checkpointing = False
    _supports_sdpa = True

    @torch.no_grad()
    def _init_weights(self, module):
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=std)
        elif isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)
        if isinstance(module, (ChainFlowVAE,)):
            nn.init.normal_(module.enc_pos, std=std)
            nn.init.normal_(module.dec_pos, std=std)
        if isinstance(module, ChainFlowExpert):
            nn.init.normal_(module.pos_emb, std=std)
            if module.bonus_proj is not None:
                nn.init.zeros_(module.bonus_proj[1].weight)
                nn.init.zeros_(module.bonus_proj[1].bias)
            if module.skip is not None:  # -I for a noise source (v = z1 - z0), 0 otherwise
                nn.init.zeros_(module.skip.weight)
                if module.source_is_noise:
                    module.skip.weight.fill_diagonal_(-1.0)
        if isinstance(module, ChainFlowLayerFusion):
            nn.init.zeros_(module.proj.weight)
            nn.init.zeros_(module.proj.bias)
        if isinstance(module, ChainFlowPathHead):
            nn.init.normal_(module.offset_proj, std=std)
            nn.init.zeros_(module.out.weight)
            nn.init.zeros_(module.out.bias)
        if isinstance(module, ChainFlowMarkovHead):
            nn.init.zeros_(module.u2)
        if isinstance(module, ChainFlowDrafter) and module.config.shortlist is not None:
            # Non-persistent buffer: `from_pretrained` builds the model on the meta device and leaves such buffers
            # uninitialised unless `_init_weights` sets them (garbage ids otherwise).
            module.shortlist_ids.copy_(torch.tensor(module.config.shortlist, dtype=torch.long))


class ChainFlowDrafter(ChainFlowPreTrainedModel):
    """ChainFlow drafter (arXiv 2611.08669). Borrows the target's frozen `lm_head` and embeddings via
    [`~ChainFlowDrafter.bind_target`]; they are never owned or saved.

    Use it as `target.generate(**inputs, assistant_model=drafter)` after `import hf_chainflow`.
    """

    def __init__(self, config: ChainFlowConfig):
        super().__init__(config)
        self.vae = ChainFlowVAE(config) if config.use_vae else None
        self.velocity = ChainFlowVelocityNet(config)
        self.layer_fusion = ChainFlowLayerFusion(config) if config.target_layer_ids else None
        self.path_head = ChainFlowPathHead(config) if config.feedback == "markov+path" else None
        shortlist = torch.tensor(config.shortlist if config.shortlist is not None else [], dtype=torch.long)
        S = len(config.shortlist) if config.shortlist is not None else config.vocab_size
        self.draft_vocab_size = S
        self.markov_head = ChainFlowMarkovHead(S + 1, S, config.markov_rank) if config.feedback != "none" else None
        # Draft vocabulary: shortlist ids (S,) and the map vocab id -> draft index (S = "other").
        self.register_buffer("shortlist_ids", shortlist, persistent=False)
        # Per-dimension statistics of the target's states (set from the training data; saved).
        self.register_buffer("state_mean", torch.zeros(config.target_hidden_size))
        self.register_buffer("state_std", torch.ones(config.target_hidden_size))
        # The corpus-lookup table (`hf_chainflow.generation.corpus_lookup`; saved; only with one, so that drafters without a
        # table load as before): sorted packed n-grams (E,) and the token that followed each most often (E,).
        E = config.continuation_table_size
        if E:
            self.register_buffer("continuation_keys", torch.zeros(E, dtype=torch.int64))
            self.register_buffer("continuation_next_tokens", torch.zeros(E, dtype=torch.int32))
        self._continuation_table = None
        self._bound: dict = {}
        self.generation_config = GenerationConfig(
            num_assistant_tokens=3,
            num_assistant_tokens_schedule="constant",
            draft_mode="chain",
            tree_width=8,
            tree_depth=4,
            tree_budget=None,
            num_flow_steps=config.num_flow_steps,
        )
        self.last_stats = None
        self.post_init()

    is_chainflow_drafter = True  # `generate(assistant_model=...)` routes ChainFlow drafters by this flag

    @classmethod
    def can_generate(cls) -> bool:
        # Like SpeechT5 and Bark: the drafter has no `generate` of its own (it drafts inside the target's), but it has
        # a `generation_config` (draft mode, tree shape, flow steps), and transformers saves it with the weights only
        # for models that "can generate" (on the main process, before a `push_to_hub` upload).
        return True

    def train(self, mode: bool = True):
        """`nn.Module.train` (`eval()` calls it); also drops the serving caches derived from the weights.

        `serving_feedback_weight` notices in-place updates through `Tensor._version`, which the fused AdamW
        (transformers' default `adamw_torch_fused`) does not bump: a mode change is the point where training ends.
        """
        self._serving_head_cache = None
        self._serving_feedback_cache = None
        self._serving_velocity_cache = None
        return super().train(mode)

    @property
    def context_size(self) -> int:
        return self.config.context_size

    @property
    def max_draft_depth(self) -> int:
        return self.config.num_draft_positions

    @property
    def state_layers(self) -> tuple[int, ...]:
        """Decoder layers (0-based) whose outputs this drafter reads beside the target's final states
        (`config.target_layer_ids`; `()`: the final states only). The speculative loops hand it
        `hf_chainflow.generation.verification.select_target_states(outputs.hidden_states, drafter.state_layers)`."""
        return self.config.state_layers

    # ------------------------------------------------------------------ binding the target
    def bind_target(self, target: PreTrainedModel) -> "ChainFlowDrafter":
        """Borrow `target`'s frozen `lm_head` and input embeddings (shared, not copied into the state dict).

        Raises a `ValueError` naming both fingerprints when the target does not match the one the drafter was
        configured for.
        """
        cfg = target.config.get_text_config() if hasattr(target.config, "get_text_config") else target.config
        mine = self.config.target_fingerprint()
        theirs = {"model_type": getattr(cfg, "model_type", None), "hidden_size": getattr(cfg, "hidden_size", None),
                  "vocab_size": getattr(cfg, "vocab_size", None)}
        out_emb = target.get_output_embeddings()
        in_emb = target.get_input_embeddings()
        if out_emb is None or in_emb is None:
            raise ValueError(f"`target` ({type(target).__name__}) must have input and output embeddings (an LM head).")
        mismatched = [k for k in ("hidden_size", "vocab_size") if mine[k] != theirs[k]]
        if mine["model_type"] is not None and mine["model_type"] != theirs["model_type"]:
            mismatched.append("model_type")
        if out_emb.weight.shape != (self.config.vocab_size, self.config.target_hidden_size):
            mismatched.append("lm_head shape")
        num_layers = getattr(cfg, "num_hidden_layers", None)
        if self.state_layers and (not isinstance(num_layers, int) or self.state_layers[-1] >= num_layers - 1):
            raise ValueError(
                f"This drafter reads the outputs of decoder layers `target_layer_ids={list(self.state_layers)}`, but "
                f"the target has num_hidden_layers={num_layers!r}: the layers must lie in [0, num_hidden_layers - 1) "
                f"(the last layer's output is the final state, always read). Train a drafter whose "
                f"`target_layer_ids` fit this target."
            )
        if mismatched:
            raise ValueError(
                f"This drafter was built for target {mine} but was given {theirs} "
                f"(lm_head {tuple(out_emb.weight.shape)}); mismatched: {mismatched}. Train or load a drafter for "
                f"this target (`ChainFlowConfig.for_target(target.config)`)."
            )
        self._bound = {"lm_head": out_emb, "embed": in_emb, "target_config": target.config}
        self._draft_head_cache = None
        self.shortlist_ids = self.shortlist_ids.to(out_emb.weight.device)
        return self

    def unbind_target(self) -> "ChainFlowDrafter":
        """Forget the borrowed target layers (the inverse of `bind_target`)."""
        self._bound = {}
        self._draft_head_cache = None
        return self

    def check_target(self, target: PreTrainedModel) -> None:
        """Raise a `ValueError` unless this drafter is bound to `target` itself."""
        self._require_bound()
        if self._bound["lm_head"] is not target.get_output_embeddings():
            cfg = target.config.get_text_config() if hasattr(target.config, "get_text_config") else target.config
            raise ValueError(
                f"This drafter is bound to another target ({self._bound['target_config'].__class__.__name__}, "
                f"fingerprint {self.config.target_fingerprint()}) than the one generating "
                f"({type(target).__name__}, hidden_size={getattr(cfg, 'hidden_size', None)}, "
                f"vocab_size={getattr(cfg, 'vocab_size', None)}). Call `drafter.bind_target(target)` first."
            )

    @property
    def is_bound(self) -> bool:
        return bool(self._bound)

    def _require_bound(self):
        if not self._bound:
            raise ValueError(
                "This ChainFlowDrafter is not bound to a target: call `drafter.bind_target(target)` or load it with "
                "`ChainFlowDrafter.from_pretrained(path, target=target)` before drafting or training."
            )

    # ------------------------------------------------------------------ corpus lookup
    @property
    def continuation_table(self) -> ContinuationTable | None:
        """The corpus-lookup table saved with this drafter (`hf_chainflow.generation.corpus_lookup`), or None without one."""
        if not self.config.continuation_table_size:
            return None
        cached = self._continuation_table  # (the buffer it was read from, the table): once per loaded/moved buffer
        if cached is None or cached[0] is not self.continuation_keys:
            table = ContinuationTable(self.continuation_keys.cpu(), self.continuation_next_tokens.cpu(),
                                      vocab_size=self.config.vocab_size,
                                      min_ngram=self.config.continuation_min_ngram,
                                      max_ngram=self.config.continuation_max_ngram)
            cached = self._continuation_table = (self.continuation_keys, table)
        return cached[1]

    def set_continuation_table(self, table: ContinuationTable | None) -> "ChainFlowDrafter":
        """Keep `table` (a `ContinuationTable` of this drafter's target's responses; None removes it) in this
        drafter: its buffers and sizes are saved by `save_pretrained` and loaded by `from_pretrained`. Turn the
        branch on with `drafter.generation_config.corpus_lookup_num_tokens`."""
        if table is not None:
            if not isinstance(table, ContinuationTable):
                raise ValueError(f"`table` must be a `hf_chainflow.ContinuationTable` or None, got "
                                 f"{type(table).__name__}.")
            if table.vocab_size != self.config.vocab_size:
                raise ValueError(f"`table` was built for a {table.vocab_size}-token vocabulary, but this drafter's "
                                 f"target has {self.config.vocab_size}; build it from this target's responses.")
            if len(table) == 0:
                raise ValueError("`table` is empty (no n-gram was seen `min_count` times); build it from more "
                                 "responses or with a smaller `min_count`, or pass None to remove the table.")
        for name in ("continuation_keys", "continuation_next_tokens"):
            self._buffers.pop(name, None)
        self._continuation_table = None
        if table is None:  # the config's defaults again
            self.config.continuation_table_size = 0
            self.config.continuation_min_ngram = ChainFlowConfig.continuation_min_ngram
            self.config.continuation_max_ngram = ChainFlowConfig.continuation_max_ngram
            return self
        device = self.state_mean.device
        self.register_buffer("continuation_keys", table.keys.to(device))
        self.register_buffer("continuation_next_tokens", table.next_tokens.to(device=device, dtype=torch.int32))
        self.config.continuation_table_size = len(table)
        self.config.continuation_min_ngram, self.config.continuation_max_ngram = table.min_ngram, table.max_ngram
        return self

    # ------------------------------------------------------------------ growing a trained drafter
    def _check_resize(self, method: str, head: nn.Module | None, what: str, arg: str, value, field: str,
                      plain: dict[str, type]) -> None:
        """Checks shared by the `resize_*_head` methods; `ValueError` before anything changes.

        `head` must exist, `value` must be an int larger than `config.<field>`, and each submodule of `head` named
        in `plain` must still be of its plain type (not wrapped by an adapter).
        """
        if head is None:
            raise ValueError(
                f"`{method}` needs a {what}, but this drafter has `feedback={self.config.feedback!r}`: 'markov+path' "
                f"has both feedback heads, 'markov' only the Markov head, 'none' neither. Grow a head it has."
            )
        current = getattr(self.config, field)
        if not isinstance(value, int) or isinstance(value, bool) or value <= current:
            raise ValueError(
                f"`{arg}` must be an int larger than the current `{field}` ({current}), got {value!r}. Only growing "
                f"a head keeps the drafter's outputs; for a smaller one, train a new drafter."
            )
        found = {name: type(head.get_submodule(name)) for name in plain}
        wrapped = {name: kind.__name__ for name, kind in found.items() if kind is not plain[name]}
        if wrapped:
            raise ValueError(
                f"The {what}'s layers {wrapped} are wrapped, e.g. by a LoRA adapter. Merge the adapter "
                f"(`merge_and_unload()`) before `{method}`."
            )

    @torch.no_grad()
    def resize_path_head(self, new_width: int) -> "ChainFlowDrafter":
        """Widen the path head `r` to `new_width` hidden units without changing what the drafter computes.

        Like `resize_token_embeddings`, for warm-starting a larger head from a trained drafter. The old units keep
        their weights; the new ones are initialised as in `post_init` (normal, std `initializer_range`) and reach
        the output through zero columns of `out`, and no old unit reads a new one, so every output is unchanged
        until training moves those columns. Sets `config.path_hidden_size`. Raises a `ValueError` (and changes
        nothing) without a path head, when `new_width` is not larger than the current width, or when a LoRA
        adapter wraps the head's layers (merge it first).
        """
        head = self.path_head
        self._check_resize("resize_path_head", head, "path head", "new_width", new_width, "path_hidden_size",
                           {"state_proj": nn.Linear, "mlp.1": nn.Linear, "out": nn.Linear})
        R, std = self.config.path_hidden_size, self.config.initializer_range
        ref = head.offset_proj
        new_cfg = copy.copy(self.config)  # a shallow copy: only the width differs, the head reads no list
        new_cfg.path_hidden_size = new_width
        new = ChainFlowPathHead(new_cfg).to(device=ref.device, dtype=ref.dtype)
        new.offset_proj.normal_(std=std)
        new.offset_proj[:, :, :R] = head.offset_proj  # (p, D, R') ← old units first
        new.state_proj.weight.normal_(std=std)
        new.state_proj.weight[:R] = head.state_proj.weight  # (R', D)
        new.state_proj.bias.zero_()
        new.state_proj.bias[:R] = head.state_proj.bias
        hidden, old_hidden = new.mlp[1], head.mlp[1]
        hidden.weight.normal_(std=std)  # (R', R'): rows are outputs, columns inputs
        hidden.weight[:R, :R] = old_hidden.weight
        hidden.weight[:R, R:] = 0.0  # old units do not read new ones
        hidden.bias.zero_()
        hidden.bias[:R] = old_hidden.bias
        new.out.weight.zero_()
        new.out.weight[:, :R] = head.out.weight  # (D, R'): new columns zero, so `r` is unchanged
        new.out.bias.copy_(head.out.bias)
        for p_new, p_old in zip(new.parameters(), head.parameters()):
            p_new.requires_grad_(p_old.requires_grad)
        self.path_head = new
        self.config.path_hidden_size = new_width
        self._serving_feedback_cache = None
        return self

    @torch.no_grad()
    def resize_markov_head(self, new_rank: int) -> "ChainFlowDrafter":
        """Raise the Markov head's rank to `new_rank` without changing what the drafter computes.

        The bias is `U2·U1[x]`: the new columns of `U1` are initialised as in `post_init` (normal, std
        `initializer_range`) and those of `U2` are zero, so every output is unchanged until training moves them.
        Sets `config.markov_rank`. Raises a `ValueError` (and changes nothing) without a Markov head, when
        `new_rank` is not larger than the current rank, or when a LoRA adapter wraps `U1` (merge it first).
        """
        head = self.markov_head
        self._check_resize("resize_markov_head", head, "Markov head", "new_rank", new_rank, "markov_rank",
                           {"u1": nn.Embedding})
        old = self.config.markov_rank
        ref = head.u2
        new = ChainFlowMarkovHead(head.u1.num_embeddings, ref.shape[0], new_rank).to(device=ref.device,
                                                                                      dtype=ref.dtype)
        new.u1.weight.normal_(std=self.config.initializer_range)
        new.u1.weight[:, :old] = head.u1.weight  # (S + 1, r') ← old columns first
        new.u2.zero_()
        new.u2[:, :old] = head.u2  # (S, r'): new columns zero, so `U2·U1[x]` is unchanged
        new.u1.weight.requires_grad_(head.u1.weight.requires_grad)
        new.u2.requires_grad_(head.u2.requires_grad)
        self.markov_head = new
        self.config.markov_rank = new_rank
        self._serving_feedback_cache = None
        return self

    def draft_head_weight(self) -> torch.Tensor:
        """The target's `lm_head` rows of the draft vocabulary `(S, D)`, detached, in the drafter's dtype.

        A derived cache of the bound target's weight (recomputed on bind and dtype/device change; never saved).
        """
        self._require_bound()
        W = self._bound["lm_head"].weight
        key = (W.data_ptr(), W.dtype, W.device, self.dtype)
        cache = getattr(self, "_draft_head_cache", None)
        if cache is None or cache[0] != key:
            Wd = W.detach()
            if self.config.shortlist is not None:
                Wd = Wd.index_select(0, self.shortlist_ids.to(W.device))
            self._draft_head_cache = (key, Wd.to(self.dtype).contiguous())
        return self._draft_head_cache[1]

    def serving_head_weight(self) -> torch.Tensor:
        """`draft_head_weight()` in `config.serving_head_dtype` (bfloat16 by default: drafting reads these rows
        every round, and halving the bytes halves that cost; what is proposed may change, never what is emitted)."""
        dtype = getattr(torch, self.config.serving_head_dtype)
        W = self.draft_head_weight()
        if W.dtype == dtype:
            return W
        key = (W.data_ptr(), dtype)
        cache = getattr(self, "_serving_head_cache", None)
        if cache is None or cache[0] != key:
            self._serving_head_cache = (key, W.to(dtype).contiguous())
        return self._serving_head_cache[1]

    def serving_feedback_weight(self) -> tuple[torch.Tensor, torch.Tensor] | None:
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
        if self.path_head is not None:
            out = self.path_head.out
            if type(out) is not nn.Linear:
                return None
            parts += [out.weight, out.bias]
        if self.markov_head is not None:
            parts.append(self.markov_head.u2)
        if not parts:
            return None
        W = self.draft_head_weight()  # (S, D)
        dtype = getattr(torch, self.config.serving_head_dtype)
        key = (W.data_ptr(), W.dtype, dtype) + tuple((t.data_ptr(), t._version) for t in parts)
        cache = getattr(self, "_serving_feedback_cache", None)
        if cache is None or cache[0] != key:
            with torch.no_grad():
                Wf = W.float()
                blocks, bias = [], Wf.new_zeros(W.shape[0])
                if self.path_head is not None:
                    blocks.append(Wf @ self.path_head.out.weight.float())  # (S, R)
                    bias = Wf @ self.path_head.out.bias.float()  # (S,)
                if self.markov_head is not None:
                    blocks.append(self.markov_head.u2.float())  # (S, r)
                fused = torch.cat(blocks, 1).to(dtype).contiguous()  # (S, R + r)
            self._serving_feedback_cache = (key, (fused, bias))
        return self._serving_feedback_cache[1]

    def serving_velocity(self):
        """The velocity network as served: its experts stacked (`StackedExperts`, one batched product per layer),
        built from the current weights and cached until one of them changes (its `data_ptr` or `Tensor._version`)
        or the mode changes (`train()` / `eval()`, which also follows a LoRA adapter's injection or merge); the
        module itself in training mode or when an expert holds another module type (a LoRA adapter)."""
        if self.training:
            return self.velocity
        key = tuple((p.data_ptr(), p._version) for p in self.velocity.parameters())
        cache = getattr(self, "_serving_velocity_cache", None)
        if cache is None or cache[0] != key:
            stacked = StackedExperts.from_velocity(self.velocity)
            self._serving_velocity_cache = (key, self.velocity if stacked is None else stacked)
        return self._serving_velocity_cache[1]

    def serving_tables(self) -> ServingTables:
        """The tensors one search reads besides the layers (`hf_chainflow.generation.search.ServingTables`), from the caches
        above; gathered once per round, outside the (compiled) drafting round."""
        self._require_bound()
        embed = self._bound["embed"].weight.detach()
        if self.config.shortlist is None:
            to_draft = to_token = None
        else:
            to_draft, to_token = self._draft_index_lut(embed.device), self.shortlist_ids.to(embed.device)
        head, folded = self.serving_head_weight(), self.serving_feedback_weight()
        return ServingTables(head=head, folded=folded, embed=embed, to_draft=to_draft, to_token=to_token,
                             dtype=self.dtype, velocity=self.serving_velocity(), head_linear=self._packed("head", head),
                             folded_linear=None if folded is None else self._packed("folded", folded[0]))

    def _packed(self, name: str, weight: torch.Tensor) -> PackedLinear:
        """`weight` as a `PackedLinear` (packed for oneDNN where that is bit for bit `F.linear`), cached per `name`
        until `weight` is another tensor or is changed in place (its `_version`; an inference tensor has none)."""
        caches = self.__dict__.setdefault("_packed_cache", {})
        version = None if weight.is_inference() else weight._version  # inference tensors keep no version
        cache = caches.get(name)
        if cache is None or cache[0] is not weight or cache[1] != version:
            caches[name] = cache = (weight, version, PackedLinear(weight))
        return cache[2]

    def _token_to_draft_index(self, tokens: torch.Tensor) -> torch.Tensor:
        """Vocabulary ids -> draft-vocabulary indices (`S` for ids outside the shortlist)."""
        if self.config.shortlist is None:
            return tokens
        return self._draft_index_lut(tokens.device)[tokens]

    def _draft_index_lut(self, device) -> torch.Tensor:
        """`(V,)` vocabulary id -> draft index (`S` outside the shortlist), cached per device."""
        lut = getattr(self, "_lut", None)
        if lut is None or lut.device != device:
            lut = torch.full((self.config.vocab_size,), self.draft_vocab_size, dtype=torch.long, device=device)
            lut[self.shortlist_ids.to(device)] = torch.arange(self.draft_vocab_size, device=device)
            self._lut = lut
        return lut

    def _draft_index_to_token(self, index: torch.Tensor) -> torch.Tensor:
        if self.config.shortlist is None:
            return index
        return self.shortlist_ids.to(index.device)[index]

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Frozen target embeddings of `tokens` `(...)` -> `(..., D)` in the drafter's dtype."""
        return F.embedding(tokens, self._bound["embed"].weight.detach()).to(self.dtype)

    # ------------------------------------------------------------------ latent transport
    def normalize(self, states):
        """Target states -> standardised states `(h - mean) / std` (per dimension, statistics of the training data)."""
        return (states - self.state_mean) / self.state_std

    def denormalize(self, states):
        return states * self.state_std + self.state_mean

    @torch.no_grad()
    def set_state_statistics(self, mean: torch.Tensor, std: torch.Tensor) -> None:
        """Set the per-dimension mean and std `(D,)` of the target's states (saved with the drafter).

        Target states have outlier dimensions (means and scales of ~15 next to ~1); the VAE and the flow work on
        standardised states and the decoder's output is mapped back, so no layer has to learn those scales.
        """
        D = self.config.target_hidden_size
        if not isinstance(mean, torch.Tensor) or not isinstance(std, torch.Tensor):
            raise ValueError(f"`mean` and `std` must be tensors of shape ({D},), got {type(mean).__name__} and "
                             f"{type(std).__name__}; e.g. `torch.as_tensor(values)`.")
        if mean.shape != (D,) or std.shape != (D,):
            raise ValueError(f"`mean` and `std` must have shape ({D},), got {tuple(mean.shape)} and {tuple(std.shape)}.")
        if not bool(torch.isfinite(mean).all() and torch.isfinite(std).all()):
            raise ValueError("`mean` and `std` must be finite in every dimension (NaN or inf would make every "
                             "standardised state NaN); recompute them with `hf_chainflow.training.data.state_statistics`.")
        if not bool((std > 0).all()):
            raise ValueError("`std` must be positive in every dimension.")
        self.state_mean.copy_(mean.to(self.state_mean))
        self.state_std.copy_(std.to(self.state_std))

    @torch.no_grad()
    def set_layer_statistics(self, mean: torch.Tensor, std: torch.Tensor) -> None:
        """Set the per-dimension mean and std `(n, D)` of the outputs of the fused layers `target_layer_ids` (saved
        with the drafter; `hf_chainflow.training.data.layer_statistics` computes them from prepared data). Raises a
        `ValueError`, and changes nothing, for a drafter without fused layers or statistics of another shape."""
        fusion = self.layer_fusion
        if fusion is None:
            raise ValueError("`set_layer_statistics` sets the statistics of fused target layers, but this drafter has "
                             "`target_layer_ids=None`; use `set_state_statistics` for the final states.")
        shape = tuple(fusion.layer_mean.shape)
        if not isinstance(mean, torch.Tensor) or not isinstance(std, torch.Tensor):
            raise ValueError(f"`mean` and `std` must be tensors of shape {shape} (one row per layer of "
                             f"`target_layer_ids={list(self.state_layers)}`), got {type(mean).__name__} and "
                             f"{type(std).__name__}.")
        if tuple(mean.shape) != shape or tuple(std.shape) != shape:
            raise ValueError(f"`mean` and `std` must have shape {shape} (one row per layer of "
                             f"`target_layer_ids={list(self.state_layers)}`), got {tuple(mean.shape)} and "
                             f"{tuple(std.shape)}.")
        if not bool(torch.isfinite(mean).all() and torch.isfinite(std).all()) or not bool((std > 0).all()):
            raise ValueError("`mean` and `std` must be finite and `std` positive in every dimension; recompute them "
                             "with `hf_chainflow.training.data.layer_statistics`.")
        fusion.layer_mean.copy_(mean.to(fusion.layer_mean))
        fusion.layer_std.copy_(std.to(fusion.layer_std))

    def encode(self, states, mask=None):
        """Posterior mean and log-variance `(B, T, Z)` of standardised states (identity latent without a VAE)."""
        x = self.normalize(states)
        if self.vae is None:
            return x, torch.zeros_like(x)
        return self.vae.encode(x, mask)

    def decode(self, latents):
        """Latents `(B, T, Z)` -> target states `(B, T, D)`."""
        return self.denormalize(latents if self.vae is None else self.vae.decode(latents))

    def source(self, context_latents, context_mask=None):
        """Flow source `z0` `(B, K, Z)` from the context latents `(B, C, Z)`.

        `extrapolate` needs `z_(t-1)`: where it does not exist (a single context state, or a padded one) the slope
        is zero, i.e. the first round after a one-token prompt starts from `z_t` as `repeat` would.
        """
        B, _, Z = context_latents.shape
        K = self.config.num_draft_positions
        z_t = context_latents[:, -1]  # (B, Z)
        if self.config.source == "noise":
            return torch.randn(B, K, Z, device=z_t.device, dtype=z_t.dtype, generator=self._noise_generator())
        if self.config.source == "repeat" or context_latents.shape[1] < 2:
            return z_t[:, None].expand(B, K, Z)
        delta = z_t - context_latents[:, -2]  # (B, Z)
        if context_mask is not None:
            delta = delta * context_mask[:, -2, None].to(delta.dtype)  # no slope from a padded state
        steps = torch.arange(1, K + 1, device=z_t.device, dtype=z_t.dtype)
        return z_t[:, None] + steps[None, :, None] * delta[:, None]  # (B, K, Z)

    def _noise_generator(self):
        if self.training:
            return None  # training draws from the global RNG
        gen = getattr(self, "_serving_generator", None)
        if gen is None or gen.device != self.device:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(0)
            self._serving_generator = gen
        return gen

    def integrate(self, z0, context, context_mask=None, num_steps: int = 1, return_trajectory: bool = False,
                  bonus=None, velocity=None):
        """`num_steps` Euler steps `z <- z + v(z, s, c)/N` from `z0` `(B, K, Z)` (`bonus` `(B, D)`: the bonus
        token's embedding, with `bonus_embedding`; `velocity`: `v`, default the module `self.velocity`, or its
        serving form `serving_velocity()`)."""
        velocity = self.velocity if velocity is None else velocity
        z = z0
        trajectory = []
        for n in range(num_steps):
            s = torch.full((z.shape[0],), n / num_steps, device=z.device, dtype=z.dtype)
            z = z + velocity(z, s, context, context_mask, bonus) / num_steps
            trajectory.append(z)
        return torch.stack(trajectory, 1) if return_trajectory else z  # (B, N, K, Z) or (B, K, Z)

    def _condition(self, latents, context_states):
        """What the velocity network attends to: the context latents `(B, C, Z)`, plus the fused target layers of
        `context_states` `(B, C, (1 + n) D)` with `target_layer_ids`."""
        if self.layer_fusion is None:
            return latents
        return latents + self.layer_fusion(context_states[..., self.config.target_hidden_size:])

    def _final(self, context_states):
        """The final states `(..., D)` of context states `(..., (1 + n) D)` (the tensor itself without fused layers)."""
        return context_states if self.layer_fusion is None else context_states[..., :self.config.target_hidden_size]

    def _bonus(self, bonus_tokens):
        """The bonus tokens' frozen embeddings `(B, D)` for a drafter with `bonus_embedding`, else None."""
        if not self.config.bonus_embedding:
            return None
        if bonus_tokens is None:
            raise ValueError("This drafter feeds the bonus token to its transport (`bonus_embedding=True`): pass "
                             "`bonus_tokens` `(B,)`, the last committed token of each row.")
        return self._embed(bonus_tokens)

    def _context(self, hidden_states, context_mask=None):
        """Context states `(B, T, (1 + n) D)` (last `C` used) -> the context latents `(B, <=C, Z)` (the flow
        source), the velocity network's conditioning (`_condition`) and the mask."""
        C = self.config.context_size
        states = hidden_states[:, -C:].to(self.dtype)  # (B, <=C, (1 + n) D)
        mask = None if context_mask is None else context_mask[:, -C:]
        mean, _ = self.encode(self._final(states), mask)
        return mean, self._condition(mean, states), mask

    @torch.no_grad()
    def predict_states(self, hidden_states, context_mask=None, num_flow_steps: int | None = None,
                       bonus_tokens: torch.LongTensor | None = None, velocity=None):
        """Serving transport: target states `(B, T, (1 + n) D)` (last `C` used; `n = len(target_layer_ids)`) ->
        predicted states `(B, K, D)`. `bonus_tokens` `(B,)`: each row's last committed token (read with
        `bonus_embedding`). `velocity`: the velocity network to integrate with (default `serving_velocity()`; the
        compiled round passes the one its `ServingTables` hold)."""
        check_num_flow_steps(num_flow_steps)
        steps = self.config.num_flow_steps if num_flow_steps is None else num_flow_steps
        velocity = self.serving_velocity() if velocity is None else velocity
        latents, condition, mask = self._context(hidden_states, context_mask)
        z0 = self.source(latents, mask)
        z1 = self.integrate(z0, condition, mask, steps, bonus=self._bonus(bonus_tokens), velocity=velocity)
        return self.decode(z1)

    # ------------------------------------------------------------------ token feedback
    def feedback_logits(self, states, parents, weight=None, markov_u2=None, head_logits=None):
        """Eq. 3 over the draft vocabulary (or a subset of its rows), in float32.

        `states` `(..., D)`, `parents` `(..., p)` vocabulary ids (the last one is the previous token).
        `weight` `(S or M, D)`: the head rows (default: the whole draft vocabulary, training dtype); the products
        run in `weight`'s dtype. `markov_u2` `(M, r)`: the Markov head's output rows for that subset.
        `head_logits` `(..., S or M)`: precomputed `weight @ states`. Returns `(..., S or M)`.
        """
        W = self.draft_head_weight() if weight is None else weight
        logits = head_logits if head_logits is not None else F.linear(states.to(W.dtype), W).float()
        if self.path_head is not None:
            r = self.path_head(self._embed(parents), states)  # (..., D)
            logits = logits + F.linear(r.to(W.dtype), W).float()
        if self.markov_head is not None:
            logits = logits + self.markov_head(self._token_to_draft_index(parents[..., -1]), markov_u2).float()
        return logits

    # ------------------------------------------------------------------ training forward
    def forward(
        self,
        context_states: torch.FloatTensor,
        target_states: torch.FloatTensor,
        target_tokens: torch.LongTensor,
        prev_tokens: torch.LongTensor,
        context_mask: torch.BoolTensor | None = None,
        target_mask: torch.BoolTensor | None = None,
        return_teacher_logits: bool = False,
        **kwargs,
    ) -> ChainFlowDrafterOutput:
        """Training forward over windows (see `hf_chainflow.training.data`).

        Args:
            context_states (`(B, C, (1 + n) D)`): `h_{t-C+1..t}` (left-padded), `context_mask` `(B, C)`; with
                `target_layer_ids` (`n` layers) each state is followed by those layers' outputs at that position.
            target_states (`(B, K, D)`): `h_{t+1..t+K}`, `target_mask` `(B, K)`.
            target_tokens (`(B, K)`): `x_{t+2..t+K+1}`.
            prev_tokens (`(B, p-1+K)`): `x_{t+2-p..t+K}`; the parents of position `i` are `prev_tokens[:, i-1:i-1+p]`.
            return_teacher_logits: also return the target's logits `W_S h_{t+k}` (for the `kd` loss term).
        """
        self._require_bound()
        cfg = self.config
        B, K, D = target_states.shape
        if K != cfg.num_draft_positions:
            raise ValueError(f"`target_states` must hold K={cfg.num_draft_positions} positions, got {K}.")
        if context_states.shape[-1] != cfg.context_state_size:
            raise ValueError(
                f"`context_states` must have {cfg.context_state_size} features per state (the final state"
                f"{f' and the outputs of layers {list(self.state_layers)}' if self.state_layers else ''}), got "
                f"{tuple(context_states.shape)}; build the windows with "
                f"`ChainFlowWindowDataset.for_drafter(data_dir, drafter.config)`."
            )
        context_states = context_states.to(self.dtype)
        target_states = target_states.to(self.dtype)
        if context_mask is None:
            context_mask = torch.ones(context_states.shape[:2], dtype=torch.bool, device=self.device)
        if target_mask is None:
            target_mask = torch.ones((B, K), dtype=torch.bool, device=self.device)

        # 1. VAE: posterior over context and target windows (encoded separately, as at serving time).
        final_context = self._final(context_states)  # (B, C, D)
        ctx_mean, ctx_logvar = self.encode(final_context, context_mask)  # (B, C, Z)
        tgt_mean, tgt_logvar = self.encode(target_states, target_mask)  # (B, K, Z)
        if self.vae is not None:
            mean = torch.cat([ctx_mean, tgt_mean], 1)
            logvar = torch.cat([ctx_logvar, tgt_logvar], 1)  # (B, C+K, Z)
            sample = mean + torch.randn_like(mean) * (0.5 * logvar).exp()
            C = ctx_mean.shape[1]
            recon = torch.cat([self.vae.decode(sample[:, :C]), self.vae.decode(sample[:, C:])], 1)  # standardised
            rmask = torch.cat([context_mask, target_mask], 1)
            kl_el = 0.5 * (mean.pow(2) + logvar.exp() - 1.0 - logvar).mean(-1)  # (B, C+K)
            kl = (kl_el * rmask).sum() / rmask.sum().clamp(min=1)
            recon_targets = self.normalize(torch.cat([final_context, target_states], 1))
        else:
            recon = recon_targets = rmask = None
            kl = context_states.new_zeros(())

        # 2. Flow matching at a random time s.
        p = cfg.path_order
        z0 = self.source(ctx_mean, context_mask)  # (B, K, Z)
        z1 = tgt_mean
        condition = self._condition(ctx_mean, context_states)  # (B, C, Z)
        bonus = self._bonus(prev_tokens[:, p - 1])  # the bonus token x_{t+1}, with `bonus_embedding`
        s = torch.rand(B, device=self.device, dtype=self.dtype)
        z_s = (1 - s)[:, None, None] * z0 + s[:, None, None] * z1
        velocity = self.velocity(z_s, s, condition, context_mask, bonus)

        # 3. The N-step trajectory used at serving time, decoded.
        traj = self.integrate(z0, condition, context_mask, cfg.train_flow_steps, return_trajectory=True,
                              bonus=bonus)  # (B, N, K, Z)
        N = traj.shape[1]
        predicted = self.decode(traj.reshape(B * N, K, -1)).reshape(B, N, K, D)
        final = predicted[:, -1].contiguous()  # (B, K, D); contiguous so the head products fold into one GEMM

        # 4. Heads with teacher-forced parents.
        parents = prev_tokens.unfold(1, p, 1)  # (B, K, p)
        W = self.draft_head_weight()  # (S, D)
        marginal = F.linear(final, W)  # (B, K, S)
        logits = self.feedback_logits(final, parents, head_logits=marginal)
        corrected = final
        if self.path_head is not None:
            corrected = final + self.path_head(self._embed(parents), final)
        labels = self._token_to_draft_index(target_tokens)
        labels = labels.masked_fill(~target_mask | (labels >= self.draft_vocab_size), -100)
        teacher = None
        if return_teacher_logits:
            with torch.no_grad():
                teacher = F.linear(target_states, W)  # (B, K, S): the target's own next-token logits

        return ChainFlowDrafterOutput(
            velocity=velocity, velocity_target=z1 - z0, flow_time=s, predicted_states=predicted,
            corrected_states=corrected, target_states=target_states, target_mask=target_mask,
            marginal_logits=marginal, logits=logits, labels=labels, reconstructed_states=recon,
            reconstruction_targets=recon_targets, reconstruction_mask=rmask, kl=kl, teacher_logits=teacher,
        )

    # ------------------------------------------------------------------ serving
    @torch.no_grad()
    def draft(
        self,
        hidden_states: torch.FloatTensor,
        input_ids: torch.LongTensor,
        *,
        mode: str = "chain",
        num_tokens: int = 3,
        tree_width: int = 8,
        tree_depth: int = 4,
        tree_budget: int | None = None,
        num_flow_steps: int | None = None,
        do_sample: bool = False,
        temperature: float = 1.0,
        compile: bool | None = None,
    ) -> DraftTree:
        """One drafting round (batch size 1): one drafter pass, then candidate search (`hf_chainflow.generation.search`).

        Args:
            hidden_states (`(1, T, D)`): the target's last states `h_{..t}` (the last `C` are used); `(1, T, (1 + n) D)`
                with `target_layer_ids` (`select_target_states`).
            input_ids (`(1, L)`): committed tokens `x_{..t+1}`; the last one is the bonus token (the tree root).
            mode: `"chain"` (`num_tokens` nodes) or `"tree"` (`tree_width x tree_depth`).
            tree_budget: trees only; keep the `tree_budget` nodes of highest path probability (`None`: all).
            do_sample: chains only; sample each token from the draft distribution (at `temperature`) and return
                the per-position distributions in `DraftTree.draft_probs`.
            compile: run the round compiled (`hf_chainflow.generation.drafting_round`; greedy drafts from a full context of
                `C` states); `None`: `generation_config.compile_drafting` (default False).
        """
        self._require_bound()
        settings = SearchSettings(mode=mode, num_tokens=num_tokens, tree_width=tree_width, tree_depth=tree_depth,
                                  tree_budget=tree_budget, do_sample=do_sample, temperature=temperature,
                                  max_depth=self.max_draft_depth)
        D = self.config.context_state_size
        if not isinstance(hidden_states, torch.Tensor) or hidden_states.dim() != 3 or hidden_states.shape[0] != 1 \
                or hidden_states.shape[1] < 1 or hidden_states.shape[2] != D:
            shape = tuple(hidden_states.shape) if isinstance(hidden_states, torch.Tensor) else type(hidden_states)
            raise ValueError(f"`hidden_states` must be the target's last states of shape (1, T, {D}) with T >= 1 "
                             f"(batch size 1){self._layers_hint()}, got {shape}.")
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.shape[0] != 1 \
                or input_ids.shape[1] < 1 or input_ids.is_floating_point():
            shape = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids)
            raise ValueError(f"`input_ids` must be the committed token ids of shape (1, L) with L >= 1 (batch size "
                             f"1; the last id is the bonus token), got {shape}; e.g. `ids[None]` for a 1-D `ids`.")
        if compile is None:
            compile = getattr(self.generation_config, "compile_drafting", False)
        if not isinstance(compile, bool):
            raise ValueError(f"`compile` (or `drafter.generation_config.compile_drafting`) must be True or False, got "
                             f"{compile!r}.")
        C, p = self.config.context_size, self.config.path_order
        tails = committed_tails(input_ids, p, self.config.pad_token_id or 0)  # (1, p)
        if compile and not do_sample and hidden_states.shape[1] >= C:
            if getattr(self, "_compiled_round", None) is None:
                self._compiled_round = CompiledDraftingRound()
            # fresh copies: a view's strides are guards of the compiled graph (a window of a longer buffer would
            # recompile on every new buffer length), and `contiguous()` keeps the stride of a size-1 batch dim
            window = hidden_states[:, -C:]
            out = self._compiled_round(self, self.serving_tables(), window.new_empty(window.shape).copy_(window),
                                       tails.new_empty(tails.shape).copy_(tails), settings, num_flow_steps)
        else:
            out = drafting_round(self, self.serving_tables(), hidden_states, tails, settings, num_flow_steps)
        return DraftBatch(*out).tree(0)

    @torch.no_grad()
    def draft_batch(self, hidden_states: torch.FloatTensor, committed: list[torch.LongTensor],
                    context_mask: torch.BoolTensor | None = None, *, mode: str = "chain", num_tokens: int = 3,
                    tree_width: int = 8, tree_depth: int = 4, tree_budget: int | None = None,
                    num_flow_steps: int | None = None, do_sample: bool = False,
                    temperature: float = 1.0) -> list[DraftTree]:
        """One drafting round for `B` rows in one drafter pass (the batched speculative loop).

        Args:
            hidden_states (`(B, T, D)`): each row's last committed target states, left-padded where a row has fewer
                than `T` (`context_mask` `(B, T)`, True = a state; `None`: every state is one).
            committed: each row's committed tokens `(L_b,)`, unpadded; the last one is the row's root.
            The other arguments are `draft`'s, shared by every row. Returns one `DraftTree` per row.
        """
        self._require_bound()
        settings = SearchSettings(mode=mode, num_tokens=num_tokens, tree_width=tree_width, tree_depth=tree_depth,
                                  tree_budget=tree_budget, do_sample=do_sample, temperature=temperature,
                                  max_depth=self.max_draft_depth)
        B, D = len(committed), self.config.context_state_size
        if hidden_states.dim() != 3 or hidden_states.shape[0] != B or hidden_states.shape[2] != D:
            raise ValueError(f"`hidden_states` must have shape ({B}, T, {D}) (one row per committed sequence"
                             f"{self._layers_hint()}), got {tuple(hidden_states.shape)}.")
        if context_mask is not None and tuple(context_mask.shape) != tuple(hidden_states.shape[:2]):
            raise ValueError(f"`context_mask` must have shape {tuple(hidden_states.shape[:2])}, got "
                             f"{tuple(context_mask.shape)}.")
        p, pad = self.config.path_order, self.config.pad_token_id or 0
        tails = torch.cat([committed_tails(ids[None], p, pad) for ids in committed])  # (B, p)
        tables = self.serving_tables()
        states = self.predict_states(hidden_states, context_mask=context_mask, num_flow_steps=num_flow_steps,
                                     bonus_tokens=tails[:, -1], velocity=tables.velocity)
        batch = DraftBatch(*search_levels(self, tables, states, tails, settings))
        return [batch.tree(i) for i in range(B)]

    def _layers_hint(self) -> str:
        if not self.state_layers:
            return ""
        return (f"; each state is the final state followed by the outputs of decoder layers {list(self.state_layers)} "
                f"(`hf_chainflow.generation.verification.select_target_states(outputs.hidden_states, drafter.state_layers)`)")

    @property
    def compiled_round(self):
        """The compiled drafting rounds of this drafter (`hf_chainflow.generation.drafting_round.CompiledDraftingRound`: its
        `compile_time` and keys), `None` before the first compiled round."""
        return getattr(self, "_compiled_round", None)

    def warm_up_drafting(self, settings) -> float:
        """Compile the drafting round for `settings` (a `SpeculativeSettings` or `SearchSettings`-like object with
        `draft_kwargs`) at a full context and every depth a round can be capped to, outside any timed region;
        returns the seconds it took (0 when `compile_drafting` is off)."""
        if not getattr(self.generation_config, "compile_drafting", False):
            return 0.0
        start = time.perf_counter()
        C, D = self.config.context_size, self.config.context_state_size
        self._require_bound()
        # The states arrive in the target's dtype (a key of the compiled round).
        states = torch.zeros(1, C, D, device=self.device, dtype=self._bound["lm_head"].weight.dtype)
        ids = torch.zeros(1, self.config.path_order + 1, dtype=torch.long, device=self.device)
        kwargs = settings.draft_kwargs(10 ** 6)
        if not kwargs["do_sample"]:
            depth = kwargs["num_tokens"] if kwargs["mode"] == "chain" else kwargs["tree_depth"]
            for room in range(1, depth + 1):
                self.draft(states, ids, **settings.draft_kwargs(room), compile=True)
        return time.perf_counter() - start

    @torch.no_grad()
    def search(self, states, committed, *, mode="chain", num_tokens=3, tree_width=8, tree_depth=4,
               tree_budget=None, do_sample=False, temperature=1.0) -> DraftTree:
        """Candidate search alone over predicted states `(K, D)` given committed tokens `(L,)` (last = root); the
        arguments are `draft`'s."""
        settings = SearchSettings(mode=mode, num_tokens=num_tokens, tree_width=tree_width, tree_depth=tree_depth,
                                  tree_budget=tree_budget, do_sample=do_sample, temperature=temperature,
                                  max_depth=self.max_draft_depth)
        return candidate_search(self, states[None], committed[None], settings).tree(0)

    # ------------------------------------------------------------------ save / load
    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, target: PreTrainedModel | None = None, **kwargs):
        """Load a drafter and its `generation_config.json` (also from a `subfolder` or a Hub repo); with `target=`,
        bind it (see `bind_target`).

        Weights are loaded in float32 unless `dtype=` (or its deprecated alias `torch_dtype=`) says otherwise
        (shipped checkpoints are stored in float16 to stay small; drafting on a CPU wants float32 layers).
        Only a missing `generation_config.json` gives the default drafting settings; one that does not parse, like a
        damaged `config.json`, raises a `ValueError` naming the file and line. A path that is neither a folder nor a
        Hub repo in the local cache fails within seconds when the Hub cannot be reached.
        """
        hub_keys = ("cache_dir", "force_download", "proxies", "local_files_only", "token", "revision", "subfolder")
        download_kwargs = {k: kwargs[k] for k in hub_keys if k in kwargs}
        config = kwargs.get("config")
        if pretrained_model_name_or_path is not None:
            cls._check_source(pretrained_model_name_or_path, download_kwargs, has_config=config is not None)
        source = pretrained_model_name_or_path if config is None else config
        if isinstance(source, (str, os.PathLike)):  # not for `config=` given as a config object
            cls._check_model_type(source, "pretrained_model_name_or_path" if config is None else "config",
                                  download_kwargs)
        # transformers loads a generation config only for `GenerationMixin` models (`adjust_generation_fn`).
        generation_config = None if pretrained_model_name_or_path is None else cls._saved_generation_config(
            pretrained_model_name_or_path, download_kwargs)
        if kwargs.get("dtype") is None:
            kwargs["dtype"] = kwargs.pop("torch_dtype", None) or torch.float32
        loaded = super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)
        model = loaded[0] if kwargs.get("output_loading_info") else loaded  # (model, loading info) as transformers
        if generation_config is not None:  # else no generation_config.json: the defaults built from the config stay
            model.generation_config = generation_config
        if target is not None:
            model.bind_target(target)
        return loaded

    @staticmethod
    def _check_source(source, download_kwargs: dict, *, has_config: bool) -> None:
        """Before transformers: a local folder must hold a config.json (unless `config=` is given) and its JSON files
        must parse; a Hub id that is neither cached nor reachable is refused within seconds (not after a minute of
        retries). With `cache_dir`, `revision` or `local_files_only` the Hub case is left to transformers."""
        from hf_chainflow.fileio import check_local_or_hub, check_model_folder, check_model_json

        if not isinstance(source, (str, os.PathLike)):
            return
        name = "pretrained_model_name_or_path"
        if os.path.isdir(source):
            folder = os.path.join(source, download_kwargs.get("subfolder") or "")
            if has_config:
                check_model_json(name, folder)
            else:
                check_model_folder(name, folder, weights=False)  # transformers names the weight files it missed
        elif not any(key in download_kwargs for key in ("cache_dir", "revision", "local_files_only")):
            check_local_or_hub(name, source)

    @staticmethod
    def _saved_generation_config(source, download_kwargs: dict) -> GenerationConfig | None:
        """The drafter's saved generation config, or None when the folder / repo has no generation_config.json (or
        the Hub cannot be reached and it is not cached, which transformers cannot tell apart from missing). A file
        that is there but does not parse raises a `ValueError` naming it (transformers' `OSError` for it reads as
        'missing')."""
        from transformers.utils import cached_file

        from hf_chainflow.fileio import read_json

        resolved = cached_file(source, "generation_config.json", _raise_exceptions_for_missing_entries=False,
                               **download_kwargs)
        if resolved is None:
            return None
        read_json(resolved, what=f"generation config of the drafter {str(source)!r}",
                  fix="Copy or download the drafter again, or save its settings again "
                      "(`drafter.generation_config.save_pretrained(folder)`); delete the file only to load the "
                      "default drafting settings (a chain of 3) instead.")
        return GenerationConfig.from_pretrained(os.path.dirname(resolved))

    @staticmethod
    def _check_model_type(source, name: str, download_kwargs: dict) -> None:
        """Refuse a folder / Hub repo whose config is another model type (transformers would only warn, then
        build a drafter with random weights)."""
        try:
            config_dict, _ = ChainFlowConfig.get_config_dict(source, **download_kwargs)
        except OSError:
            return  # no readable config there: transformers' own loading raises its error for this path
        model_type = config_dict.get("model_type")
        if model_type is not None and model_type != ChainFlowConfig.model_type:
            raise ValueError(
                f"`{name}` ({str(source)!r}) holds a config with model_type={model_type!r}, "
                f"not {ChainFlowConfig.model_type!r}: it is not a ChainFlow drafter. Give the folder (or Hub id) of "
                f"a drafter saved with `save_pretrained`; bind the target model with `target=`."
            )


AutoConfig.register("chainflow", ChainFlowConfig)
AutoModel.register(ChainFlowConfig, ChainFlowDrafter)

__all__ = ["ChainFlowDrafter", "ChainFlowPreTrainedModel", "ChainFlowDrafterOutput"]
