"""The ChainFlow drafter: VAE over target states, rectified-flow transport, token-feedback heads.

Reading order: the layers (`layers_chainflow`: attention, block, VAE, velocity network, fused target layers, heads)
-> the output -> `ChainFlowDrafter` (`forward` for training; the target binding in `binding_chainflow`, the loading
checks in `loading_chainflow`). Drafting and serving with it live in `hf_chainflow.generation` (`drafting.draft`,
`serving.serving_tables`); growing its heads in `hf_chainflow.training.resize`. This module imports neither.
Alignment (SPEC.md): with committed tokens `x_1..x_{t+1}` and target states `h_1..h_t`, draft position
`i = 1..K` predicts the state `h_{t+i}` and so the token `x_{t+1+i}`; its parents are `x_{t+i-p+1 .. t+i}`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoConfig, AutoModel, GenerationConfig, PreTrainedModel
from transformers.utils import ModelOutput

from hf_chainflow.models.chainflow.binding_chainflow import ChainFlowTargetBindingMixin
from hf_chainflow.models.chainflow.validation_chainflow import check_num_flow_steps
from hf_chainflow.models.chainflow.configuration_chainflow import ChainFlowConfig
from hf_chainflow.models.chainflow.layers_chainflow import (ChainFlowExpert, ChainFlowLayerFusion, ChainFlowMarkovHead,
                                                            ChainFlowPathHead, ChainFlowVAE, ChainFlowVelocityNet,
                                                            vae_kl, vae_sample)
from hf_chainflow.models.chainflow.loading_chainflow import check_pretrained_source, saved_generation_config


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


class ChainFlowDrafter(ChainFlowTargetBindingMixin, ChainFlowPreTrainedModel):
    """ChainFlow drafter (arXiv 2611.08669). Borrows the target's frozen `lm_head` and embeddings via
    [`~ChainFlowDrafter.bind_target`]; they are never owned or saved.

    Use it as `target.generate(**inputs, assistant_model=drafter)` after `import hf_chainflow`.

    The class holds the layers, `forward`, the serving transport (`predict_states`, `feedback_logits`) and loading;
    one job per class (issue 63): the target binding is the base `ChainFlowTargetBindingMixin`
    (`binding_chainflow`), the loading checks are functions of `loading_chainflow`, drafting and serving are
    functions of `hf_chainflow.generation.drafting` / `.serving` (`draft(drafter, ...)`, `serving_tables(drafter)`,
    `continuation_table(drafter)`) and growing the heads those of `hf_chainflow.training.resize`. What they cache
    for this drafter lives in its `_runtime` dict (by name; see `train`).
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
        # The corpus-lookup table (`hf_chainflow.generation.drafting.continuation_table` reads it; saved; only with
        # one, so that drafters without a table load as before): sorted packed n-grams (E,) and the token that followed
        # each most often (E,).
        E = config.continuation_table_size
        if E:
            self.register_buffer("continuation_keys", torch.zeros(E, dtype=torch.int64))
            self.register_buffer("continuation_next_tokens", torch.zeros(E, dtype=torch.int32))
        self._runtime: dict = {}  # caches of `hf_chainflow.generation` for this drafter (see `train`)
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

        `_runtime` holds, by name, what `hf_chainflow.generation` caches for this drafter; the model only drops
        `_runtime["weights"]`, the tensors derived from the weights (`serving.serving_feedback_weight`, ...): they
        notice in-place updates through `Tensor._version`, which the fused AdamW (transformers' default
        `adamw_torch_fused`) does not bump, so a mode change is the point where training ends. The other entries
        (compiled rounds, the parsed corpus-lookup table, packed products) check their own source.
        """
        self._runtime.pop("weights", None)
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
        serving form `hf_chainflow.generation.serving.serving_velocity(drafter)`)."""
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
        `bonus_embedding`). `velocity`: the velocity network to integrate with (default the module `self.velocity`;
        drafting passes its serving form, `hf_chainflow.generation.serving.serving_velocity(drafter)`, the experts
        stacked: the same velocity, bit for bit on CPU)."""
        check_num_flow_steps(num_flow_steps)
        steps = self.config.num_flow_steps if num_flow_steps is None else num_flow_steps
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
            sample = vae_sample(mean, logvar)
            C = ctx_mean.shape[1]
            recon = torch.cat([self.vae.decode(sample[:, :C]), self.vae.decode(sample[:, C:])], 1)  # standardised
            rmask = torch.cat([context_mask, target_mask], 1)
            kl = vae_kl(mean, logvar, rmask)
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
        download_kwargs = check_pretrained_source(pretrained_model_name_or_path, kwargs)
        # transformers loads a generation config only for `GenerationMixin` models (`adjust_generation_fn`).
        generation_config = None if pretrained_model_name_or_path is None else saved_generation_config(
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



AutoConfig.register("chainflow", ChainFlowConfig)
AutoModel.register(ChainFlowConfig, ChainFlowDrafter)

__all__ = ["ChainFlowDrafter", "ChainFlowPreTrainedModel", "ChainFlowDrafterOutput"]
