"""The layers of the ChainFlow drafter (`modeling_chainflow.ChainFlowDrafter` assembles them): attention and
transformer blocks, the VAE over target states (with its reparameterised sample and KL term, shared by the training
forward and the VAE pre-training), the velocity network of chunk experts, the fused target layers and the token
feedback heads.

A module of its own only to keep each file readable (transformers keeps one modeling file; this drafter's would pass
a thousand lines): `modeling_chainflow` imports every class from here.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from hf_chainflow.models.chainflow.configuration_chainflow import ChainFlowConfig


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


def vae_sample(mean: torch.Tensor, logvar: torch.Tensor) -> torch.Tensor:
    """A reparameterised sample of the posterior `N(mean, exp(logvar))` (`(..., Z)` each; global RNG)."""
    return mean + torch.randn_like(mean) * (0.5 * logvar).exp()


def vae_kl(mean: torch.Tensor, logvar: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """KL of the posterior `N(mean, exp(logvar))` `(B, T, Z)` to `N(0, I)`, averaged over the latent elements of
    each position, then over the valid positions (`mask` `(B, T)`) -> `()`."""
    kl = 0.5 * (mean.pow(2) + logvar.exp() - 1.0 - logvar).mean(-1)  # (B, T)
    return (kl * mask).sum() / mask.sum().clamp(min=1)


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


__all__ = ["ChainFlowAttention", "ChainFlowBlock", "ChainFlowExpert", "ChainFlowLayerFusion", "ChainFlowMarkovHead",
           "ChainFlowPathHead", "ChainFlowVAE", "ChainFlowVelocityNet", "vae_kl", "vae_sample"]
