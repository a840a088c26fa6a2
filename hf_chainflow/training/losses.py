"""The ChainFlow training objective, as pure functions of tensors (SPEC.md, "Training objective").

    L = 0.2 L_flow + 0.25 L_hid + 0.3 L_CE + 0.3 L_cov + 0.15 L_acc + 0.5 L_rec

Every term is a masked *mean*, so the scale of a term does not depend on the batch size, the number of draft
positions `K` or the hidden size.  Shapes: B = batch, K = draft positions, N = flow steps, Z = latent, D = target
hidden size, S = draft vocabulary.  `labels` index the draft vocabulary, `-100` = ignore (masked position, or a
token outside the shortlist).  `chainflow_loss` combines the terms from a `ChainFlowDrafterOutput`.

One term outside the SPEC, off by default (`EXTRA_LOSS_WEIGHTS`): `kd`, the KL divergence from the target's own
next-token distribution (its `lm_head` over the cached true states) to the drafter's corrected one.

`dflash_loss` is the objective of the DFlash drafters of `hf_chainflow.training.dflash` (a position-weighted cross-entropy
of the masked block positions).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F

from hf_chainflow.checks import check_positive_int

IGNORE_INDEX = -100
# The SPEC's weights, in the order of the equation; keys are the SPEC's subscripts.
DEFAULT_LOSS_WEIGHTS: dict[str, float] = {"flow": 0.2, "hid": 0.25, "ce": 0.3, "cov": 0.3, "acc": 0.15, "rec": 0.5}
# Terms this project adds to the SPEC's objective; weight 0 (not computed) unless asked for.
EXTRA_LOSS_WEIGHTS: dict[str, float] = {"kd": 0.0}


def _masked_mean(values: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Mean of `values` over the entries where `mask` is true (same shape); 0 when nothing is valid."""
    if mask is None:
        return values.mean()
    mask = mask.to(values.dtype)
    return (values * mask).sum() / mask.sum().clamp(min=1.0)


def flow_matching_loss(velocity: torch.Tensor, velocity_target: torch.Tensor,
                       mask: torch.Tensor | None = None) -> torch.Tensor:
    """`L_flow`: mean over valid positions of `mean_z (v - (z1 - z0))^2`.

    velocity, velocity_target `(B, K, Z)`; mask `(B, K)` (true = valid) or None.
    """
    per_position = (velocity.float() - velocity_target.float()).pow(2).mean(-1)  # (B, K)
    return _masked_mean(per_position, mask)


def hidden_state_loss(predicted_states: torch.Tensor, corrected_states: torch.Tensor | None,
                      target_states: torch.Tensor, mask: torch.Tensor | None = None,
                      eps: float = 1e-6) -> torch.Tensor:
    """`L_hid`: relative squared error `||h_hat - h||^2 / ||h||^2`.

    Averaged over the `N` states of the integrated trajectory and the path-corrected states (`N + 1` predictions
    per position, equally weighted), then over valid positions.

    predicted_states `(B, N, K, D)`; corrected_states `(B, K, D)` or None (no path head: only the trajectory);
    target_states `(B, K, D)`; mask `(B, K)`.  `eps` guards `||h||^2 = 0` (a padded all-zero target).
    """
    preds = predicted_states.float()
    if corrected_states is not None:
        preds = torch.cat([preds, corrected_states.float()[:, None]], 1)  # (B, N+1, K, D)
    target = target_states.float()[:, None]  # (B, 1, K, D)
    err = (preds - target).pow(2).sum(-1) / target.pow(2).sum(-1).clamp(min=eps)  # (B, N+1, K)
    return _masked_mean(err.mean(1), mask)


def _ce(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over non-ignored labels; 0 (not NaN) when every label is ignored."""
    flat = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1),
                           ignore_index=IGNORE_INDEX, reduction="sum")
    return flat / (labels != IGNORE_INDEX).sum().clamp(min=1)


def cross_entropy_loss(logits: torch.Tensor, marginal_logits: torch.Tensor | None, labels: torch.Tensor,
                       marginal_weight: float = 0.2) -> torch.Tensor:
    """`L_CE = CE(logits, labels) + marginal_weight * CE(marginal_logits, labels)`.

    logits (Eq. 3, teacher-forced parents) and marginal_logits (`W h`) `(B, K, S)`; labels `(B, K)`, -100 ignored.
    Each CE is a mean over the non-ignored labels.
    """
    loss = _ce(logits, labels)
    if marginal_logits is not None and marginal_weight:
        loss = loss + marginal_weight * _ce(marginal_logits, labels)
    return loss


def distillation_loss(logits: torch.Tensor, teacher_logits: torch.Tensor, mask: torch.Tensor | None,
                      temperature: float = 1.0) -> torch.Tensor:
    """`L_kd = T^2 KL(softmax(teacher / T) || softmax(logits / T))`, a masked mean over draft positions.

    logits (the drafter's corrected logits) and teacher_logits (the target's logits at the same positions, over the
    same draft vocabulary) `(B, K, S)`; mask `(B, K)`.  The teacher gets no gradient.  `T^2` keeps the gradient's
    scale independent of the temperature (Hinton et al., 2015).
    """
    if not temperature > 0:
        raise ValueError(f"`temperature` must be > 0, got {temperature!r}.")
    if teacher_logits.shape != logits.shape:
        raise ValueError(f"`teacher_logits` must have the shape of `logits` {tuple(logits.shape)}, got "
                         f"{tuple(teacher_logits.shape)}.")
    log_q = torch.log_softmax(logits.float() / temperature, -1)  # (B, K, S) drafter
    log_p = torch.log_softmax(teacher_logits.detach().float() / temperature, -1)  # (B, K, S) target
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)  # (B, K)
    return _masked_mean(kl, mask) * temperature ** 2


def coverage_loss(logits: torch.Tensor, labels: torch.Tensor, top_b: int = 8, margin: float = 1.0) -> torch.Tensor:
    """`L_cov`: hinge pushing the true token into the top `b` logits.

        L_cov = mean over valid positions of  relu(margin + l_(b) - l_true)

    where `l_true` is the true token's logit and `l_(b)` the `b`-th largest logit among the *other* tokens.  The
    true token is in the top `b` exactly when `l_true > l_(b)`; the hinge is zero once it leads `l_(b)` by
    `margin`, so well-covered positions stop contributing.  With `S <= b` every token is in the top `b` (0).

    logits `(B, K, S)`, labels `(B, K)` with -100 ignored.
    """
    check_positive_int("top_b", top_b, meaning="tokens kept per tree node")
    S = logits.shape[-1]
    valid = labels != IGNORE_INDEX
    if S <= top_b or not bool(valid.any()):
        return logits.float().sum() * 0.0  # keeps the graph (and the device) without contributing
    logits = logits.float()
    index = labels.clamp(min=0)[..., None]  # (B, K, 1)
    true = logits.gather(-1, index)[..., 0]  # (B, K)
    others = logits.scatter(-1, index, float("-inf"))  # (B, K, S): the true token removed
    kth_other = others.topk(top_b, -1).values[..., -1]  # (B, K)
    return _masked_mean(F.relu(margin + kth_other - true), valid)


def acceptance_loss(logits: torch.Tensor, labels: torch.Tensor, gamma: float = 0.8) -> torch.Tensor:
    """`L_acc`: differentiable surrogate of the expected accepted length.

        L_acc = -(1/G) * sum_{i=1..K} gamma^i * prod_{j<=i} p(x*_j | x*_<j),   G = sum_{i=1..K} gamma^i

    averaged over windows.  `p` is the softmax of the (teacher-forced) corrected `logits` at the true token.  An
    ignored label (masked position, or a token outside the draft vocabulary, which can never be drafted) has
    `p = 0`: the chain stops there, so it and every later position contribute nothing.  Normalising by `G` puts
    `L_acc` in `[-1, 0]` whatever `K` and `gamma` are (-1 = every window certain to be fully accepted); windows
    whose labels are all ignored are left out of the average (0 when there are none).

    logits `(B, K, S)`, labels `(B, K)`.
    """
    if not 0.0 < gamma <= 1.0:
        raise ValueError(f"`gamma` must lie in (0, 1] (discount per draft position), got {gamma!r}.")
    valid = labels != IGNORE_INDEX  # (B, K)
    logp = torch.log_softmax(logits.float(), -1).gather(-1, labels.clamp(min=0)[..., None])[..., 0]  # (B, K)
    logp = logp.masked_fill(~valid, 0.0)  # no -inf in the graph; `alive` zeroes the stopped chain instead
    alive = valid.long().cumprod(-1).to(logp.dtype)  # (B, K): 1 while every position so far is valid
    chain = logp.cumsum(-1).exp() * alive  # (B, K): prod_{j<=i} p_j
    K = labels.shape[-1]
    discount = gamma ** torch.arange(1, K + 1, device=logits.device, dtype=logp.dtype)  # (K,)
    per_window = -(chain * discount).sum(-1) / discount.sum()  # (B,)
    return _masked_mean(per_window, valid.any(-1))


def reconstruction_loss(reconstructed: torch.Tensor | None, targets: torch.Tensor | None,
                        mask: torch.Tensor | None = None, kl: torch.Tensor | None = None,
                        beta: float = 3e-5) -> torch.Tensor:
    """`L_rec = masked MSE(reconstructed, targets) + beta * KL`.

    The MSE is `mean_d (x_hat - x)^2` averaged over valid states; `kl` is the drafter's mean KL per latent element
    (a scalar).  reconstructed, targets `(B, T, D)`; mask `(B, T)`.  Without a VAE (`reconstructed is None`) the
    term is 0.
    """
    if reconstructed is None:
        return torch.zeros((), device=kl.device if kl is not None else None)
    mse = _masked_mean((reconstructed.float() - targets.float()).pow(2).mean(-1), mask)
    return mse + beta * kl.float() if kl is not None else mse


def chainflow_loss(output, weights: Mapping[str, float] | None = None, *, gamma: float = 0.8, top_b: int = 8,
                   coverage_margin: float = 1.0, kl_beta: float = 3e-5, marginal_weight: float = 0.2,
                   kd_temperature: float = 1.0) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The full objective from a `ChainFlowDrafterOutput`.

    Args:
        output: the drafter's training forward output.
        weights: term weights by name (`flow`, `hid`, `ce`, `cov`, `acc`, `rec`, and `kd`); missing names take the
            SPEC defaults `DEFAULT_LOSS_WEIGHTS` (`kd`: 0); a zero weight skips the term (it is not computed).  A
            nonzero `kd` needs `output.teacher_logits` (the drafter's forward with `return_teacher_logits=True`).
        gamma, top_b, coverage_margin, kl_beta, marginal_weight, kd_temperature: see the term functions.

    Returns:
        `(total, terms)`: the weighted sum and each *unweighted* term (scalars).
    """
    weights = dict(weights or {})
    known = {**DEFAULT_LOSS_WEIGHTS, **EXTRA_LOSS_WEIGHTS}
    unknown = sorted(set(weights) - set(known))
    if unknown:
        raise ValueError(f"`weights` has unknown term(s) {unknown}; valid names are {list(known)}.")
    w = {**known, **weights}
    o = output
    if w["kd"] and o.teacher_logits is None:
        raise ValueError(f"The `kd` loss weight is {w['kd']!r} but the drafter output has no `teacher_logits`: run "
                         "the drafter's forward with `return_teacher_logits=True`, or set the `kd` weight to 0.")
    compute = {
        "flow": lambda: flow_matching_loss(o.velocity, o.velocity_target, o.target_mask),
        "hid": lambda: hidden_state_loss(o.predicted_states, o.corrected_states, o.target_states, o.target_mask),
        "ce": lambda: cross_entropy_loss(o.logits, o.marginal_logits, o.labels, marginal_weight),
        "cov": lambda: coverage_loss(o.logits, o.labels, top_b, coverage_margin),
        "acc": lambda: acceptance_loss(o.logits, o.labels, gamma),
        "rec": lambda: reconstruction_loss(o.reconstructed_states, o.reconstruction_targets, o.reconstruction_mask,
                                           o.kl, kl_beta),
        "kd": lambda: distillation_loss(o.logits, o.teacher_logits, o.target_mask, kd_temperature),
    }
    if not any(w.values()):
        raise ValueError(f"Every loss weight is zero ({w}); at least one term must train the drafter.")
    terms = {name: fn() for name, fn in compute.items() if w[name] != 0}
    total = sum(w[name] * value for name, value in terms.items())
    return total, terms


# ----------------------------------------------------------------------------------------------------------------
# DFlash (hf_chainflow.training.dflash): block-diffusion cross-entropy of a drafter that fills B - 1 masks in one forward
# ----------------------------------------------------------------------------------------------------------------

def block_acceptance_lengths(predictions: torch.Tensor, labels: torch.Tensor, label_mask: torch.Tensor) -> torch.Tensor:
    """Per block `(N,)`: how many of its drafted tokens greedy verification would accept, the length of the leading
    run of `predictions == labels` over positions where `label_mask` holds (a block ends at the first wrong or
    missing token). predictions, labels, label_mask `(N, K)`."""
    hit = (predictions == labels) & label_mask.bool()  # (N, K)
    return hit.long().cumprod(-1).sum(-1)


def dflash_loss(logits: torch.Tensor, labels: torch.Tensor, label_mask: torch.Tensor, *,
                decay_gamma: float | None = 4.0) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The DFlash training objective: cross-entropy of the target tokens at the `K = B - 1` masked block positions,
    position `j` (1-based) weighted by `exp(-(j - 1) / decay_gamma)` (a token after an early mistake is never
    accepted, so early positions matter more; `None`: equal weights), a weighted mean over the valid positions.

    logits `(N, K, V)` (target vocabulary), labels `(N, K)`, label_mask `(N, K)` True where the token exists.
    Returns `(loss, terms)`; `terms` (detached): `ce` (the loss), `accuracy` (top-1 over valid positions) and `tau`
    (1 + the mean accepted length of greedy verification, `block_acceptance_lengths`: the offline acceptance
    length of these blocks).
    """
    if logits.dim() != 3 or labels.shape != logits.shape[:2] or label_mask.shape != labels.shape:
        raise ValueError(f"`logits` must be (N, K, V) with `labels` and `label_mask` (N, K); got "
                         f"{tuple(logits.shape)}, {tuple(labels.shape)}, {tuple(label_mask.shape)}.")
    if decay_gamma is not None and not decay_gamma > 0:
        raise ValueError(f"`decay_gamma` must be > 0 (or None for equal weights), got {decay_gamma!r}.")
    n, k, v = logits.shape
    mask = label_mask.bool()
    ce = F.cross_entropy(logits.float().reshape(-1, v), labels.masked_fill(~mask, 0).reshape(-1),
                         reduction="none").view(n, k)  # (N, K)
    weight = torch.ones(k, device=logits.device)
    if decay_gamma is not None:
        weight = torch.exp(-torch.arange(k, device=logits.device, dtype=torch.float32) / decay_gamma)  # (K,)
    weight = weight[None] * mask.float()  # (N, K)
    loss = (ce * weight).sum() / weight.sum().clamp(min=1e-12)
    with torch.no_grad():
        predictions = logits.argmax(-1)  # (N, K)
        accuracy = ((predictions == labels) & mask).sum() / mask.sum().clamp(min=1)
        tau = 1.0 + block_acceptance_lengths(predictions, labels, mask).float().mean()
    return loss, {"ce": loss.detach(), "accuracy": accuracy.float(), "tau": tau}


__all__ = [
    "DEFAULT_LOSS_WEIGHTS",
    "EXTRA_LOSS_WEIGHTS",
    "IGNORE_INDEX",
    "acceptance_loss",
    "block_acceptance_lengths",
    "chainflow_loss",
    "coverage_loss",
    "cross_entropy_loss",
    "dflash_loss",
    "distillation_loss",
    "flow_matching_loss",
    "hidden_state_loss",
    "reconstruction_loss",
]
