"""Each ChainFlow loss term against a hand computation on tiny tensors."""

import math
from types import SimpleNamespace

import pytest
import torch

from hf_chainflow.training.losses import (
    DEFAULT_LOSS_WEIGHTS,
    acceptance_loss,
    chainflow_loss,
    coverage_loss,
    cross_entropy_loss,
    distillation_loss,
    flow_matching_loss,
    hidden_state_loss,
    reconstruction_loss,
)


def test_flow_matching_masked_mse():
    v = torch.tensor([[[1.0, 2.0], [30.0, 40.0]]])  # (1, 2, 2)
    u = torch.zeros(1, 2, 2)
    mask = torch.tensor([[True, False]])
    assert flow_matching_loss(v, u, mask).item() == pytest.approx((1 + 4) / 2)
    assert flow_matching_loss(v, u).item() == pytest.approx((1 + 4 + 900 + 1600) / 4)


def test_hidden_state_relative_error_over_trajectory_and_corrected():
    h = torch.tensor([[[3.0, 4.0], [1.0, 1.0]]])  # (B=1, K=2, D=2); |h_1|^2 = 25
    pred = torch.tensor([[[[4.0, 4.0], [9.0, 9.0]], [[3.0, 6.0], [9.0, 9.0]]]])  # (1, N=2, 2, 2)
    corr = torch.tensor([[[0.0, 4.0], [9.0, 9.0]]])
    mask = torch.tensor([[True, False]])  # the second position is garbage and masked out
    # errors at position 1: 1/25, 4/25, 9/25 -> mean 14/75
    assert hidden_state_loss(pred, corr, h, mask).item() == pytest.approx(14 / 75)
    assert hidden_state_loss(pred, None, h, mask).item() == pytest.approx(5 / 50)


def test_distillation_is_the_masked_kl_from_the_target_and_leaves_the_teacher_alone():
    teacher = torch.tensor([[[math.log(3.0), 0.0], [5.0, -5.0]]], requires_grad=True)  # p = (3/4, 1/4) at position 1
    logits = torch.zeros(1, 2, 2, requires_grad=True)  # q = (1/2, 1/2)
    mask = torch.tensor([[True, False]])  # the second position is masked out
    expected = 0.75 * math.log(0.75 / 0.5) + 0.25 * math.log(0.25 / 0.5)
    loss = distillation_loss(logits, teacher, mask)
    assert loss.item() == pytest.approx(expected)
    loss.backward()
    assert teacher.grad is None and logits.grad is not None and logits.grad[0, 1].abs().sum() == 0
    assert distillation_loss(teacher.detach(), teacher.detach(), None).item() == pytest.approx(0.0, abs=1e-7)
    # temperature T: the KL of the softened distributions, times T^2
    soft = torch.tensor([[[math.log(3.0) / 2, 0.0]]]).softmax(-1)
    expected_t2 = 4 * (soft * (soft / 0.5).log()).sum().item()
    assert distillation_loss(logits[:, :1].detach(), teacher[:, :1].detach(), None, 2.0).item() == pytest.approx(
        expected_t2)
    with pytest.raises(ValueError, match="temperature"):
        distillation_loss(logits, teacher, mask, 0.0)
    with pytest.raises(ValueError, match="teacher_logits"):
        distillation_loss(logits, teacher[:, :1], mask)


def test_cross_entropy_corrected_plus_marginal_ignores_minus_100():
    logits = torch.tensor([[[0.0, math.log(2.0), 0.0], [9.0, -9.0, 0.0]]])  # p(label 1) = 2/4 at position 1
    marginal = torch.zeros(1, 2, 3)  # uniform: CE = ln 3
    labels = torch.tensor([[1, -100]])
    expected = math.log(2.0) + 0.2 * math.log(3.0)
    assert cross_entropy_loss(logits, marginal, labels).item() == pytest.approx(expected, rel=1e-6)
    assert cross_entropy_loss(logits, marginal, labels, marginal_weight=0.0).item() == pytest.approx(math.log(2))
    everything_ignored = torch.full((1, 2), -100)
    assert cross_entropy_loss(logits, marginal, everything_ignored).item() == 0.0  # not NaN


def test_coverage_hinge_zero_and_nonzero_regions():
    logits = torch.tensor([[[5.0, 3.0, 2.5, 0.0]] * 3])  # (1, 3, 4); b = 2, margin = 1
    # label 0 (5.0): 2nd largest other is 2.5 -> relu(1 + 2.5 - 5) = 0      (covered with margin: zero region)
    # label 1 (3.0): 2nd largest other is 2.5 -> relu(1 + 2.5 - 3) = 0.5    (in the top 2 but inside the margin)
    # label 3 (0.0): 2nd largest other is 3.0 -> relu(1 + 3 - 0) = 4        (outside the top 2)
    per_label = {0: 0.0, 1: 0.5, 3: 4.0}
    for label, value in per_label.items():
        labels = torch.tensor([[label, -100, -100]])
        assert coverage_loss(logits, labels, top_b=2).item() == pytest.approx(value)
    labels = torch.tensor([[0, 1, 3]])
    assert coverage_loss(logits, labels, top_b=2).item() == pytest.approx(4.5 / 3)
    # zero region: no gradient at all; non-zero region: pushes the true logit up and the b-th other down
    x = logits.clone().requires_grad_(True)
    coverage_loss(x, torch.tensor([[0, -100, -100]]), top_b=2).backward()
    assert torch.count_nonzero(x.grad) == 0
    x.grad = None
    coverage_loss(x, torch.tensor([[3, -100, -100]]), top_b=2).backward()
    assert x.grad[0, 0].tolist() == [0.0, 1.0, 0.0, -1.0]
    # a vocabulary no larger than b is always covered
    assert coverage_loss(logits, labels, top_b=4).item() == 0.0
    with pytest.raises(ValueError, match="top_b"):
        coverage_loss(logits, labels, top_b=0)


def test_acceptance_by_hand_with_stopped_chains():
    logits = torch.zeros(3, 3, 2)  # every p = 1/2
    labels = torch.tensor([[0, 1, 0], [1, -100, 0], [-100, -100, -100]])
    g = 0.8
    G = g + g**2 + g**3
    full = g * 0.5 + g**2 * 0.25 + g**3 * 0.125  # window 1: the chain runs to the end
    stopped = g * 0.5  # window 2: stops at the masked 2nd position, the valid 3rd one does not count
    expected = -(full + stopped) / G / 2  # window 3 (nothing valid) is left out of the mean
    assert acceptance_loss(logits, labels, gamma=g).item() == pytest.approx(expected, rel=1e-6)
    assert acceptance_loss(logits, labels[2:], gamma=g).item() == 0.0


def test_acceptance_matches_the_product_formula_and_is_bounded():
    torch.manual_seed(0)
    logits = torch.randn(4, 5, 7, requires_grad=True)
    labels = torch.randint(0, 7, (4, 5))
    p = torch.softmax(logits, -1).gather(-1, labels[..., None])[..., 0].detach()
    g = 0.8
    want = 0.0
    for b in range(4):
        prod, total = 1.0, 0.0
        for i in range(5):
            prod *= p[b, i].item()
            total += g ** (i + 1) * prod
        want += -total / sum(g ** (i + 1) for i in range(5))
    loss = acceptance_loss(logits, labels, gamma=g)
    assert loss.item() == pytest.approx(want / 4, rel=1e-5)
    loss.backward()
    assert torch.isfinite(logits.grad).all()
    certain = torch.full((2, 5, 7), -50.0).scatter(-1, labels[:2, :, None], 50.0)
    assert acceptance_loss(certain, labels[:2], gamma=g).item() == pytest.approx(-1.0)
    with pytest.raises(ValueError, match="gamma"):
        acceptance_loss(logits, labels, gamma=1.5)


def test_reconstruction_masked_mse_plus_beta_kl():
    recon = torch.tensor([[[1.0, 3.0], [100.0, 100.0]]])
    target = torch.zeros(1, 2, 2)
    mask = torch.tensor([[True, False]])
    assert reconstruction_loss(recon, target, mask, torch.tensor(2.0), beta=0.5).item() == pytest.approx(5 + 1)
    assert reconstruction_loss(None, None, None, torch.tensor(0.0)).item() == 0.0


def _fake_output():
    torch.manual_seed(0)
    B, K, N, Z, D, S = 2, 3, 2, 4, 6, 5
    return SimpleNamespace(
        velocity=torch.randn(B, K, Z), velocity_target=torch.randn(B, K, Z),
        predicted_states=torch.randn(B, N, K, D), corrected_states=torch.randn(B, K, D),
        target_states=torch.randn(B, K, D), target_mask=torch.tensor([[1, 1, 0], [1, 1, 1]]).bool(),
        logits=torch.randn(B, K, S), marginal_logits=torch.randn(B, K, S),
        labels=torch.tensor([[1, 4, -100], [0, 2, 3]]),
        reconstructed_states=torch.randn(B, 2 + K, D), reconstruction_targets=torch.randn(B, 2 + K, D),
        reconstruction_mask=torch.ones(B, 2 + K, dtype=torch.bool), kl=torch.tensor(0.7), teacher_logits=None,
    )


def test_chainflow_loss_is_the_weighted_sum_of_its_terms():
    out = _fake_output()
    total, terms = chainflow_loss(out, top_b=2)
    assert set(terms) == set(DEFAULT_LOSS_WEIGHTS) == {"flow", "hid", "ce", "cov", "acc", "rec"}
    assert DEFAULT_LOSS_WEIGHTS == {"flow": 0.2, "hid": 0.25, "ce": 0.3, "cov": 0.3, "acc": 0.15, "rec": 0.5}
    assert total.item() == pytest.approx(sum(DEFAULT_LOSS_WEIGHTS[k] * v.item() for k, v in terms.items()))
    assert terms["acc"].item() == pytest.approx(acceptance_loss(out.logits, out.labels, 0.8).item())
    assert terms["cov"].item() == pytest.approx(coverage_loss(out.logits, out.labels, 2).item())
    total2, terms2 = chainflow_loss(out, {"cov": 0.0, "ce": 1.0}, top_b=2)
    assert "cov" not in terms2
    assert total2.item() == pytest.approx(total.item() - 0.3 * terms["cov"].item() + 0.7 * terms["ce"].item())
    with pytest.raises(ValueError, match="unknown term"):
        chainflow_loss(out, {"kl": 1.0})
    with pytest.raises(ValueError, match="zero"):
        chainflow_loss(out, {k: 0.0 for k in DEFAULT_LOSS_WEIGHTS})


def test_chainflow_loss_adds_the_distillation_term_only_when_asked():
    out = _fake_output()
    total, terms = chainflow_loss(out, top_b=2)
    assert "kd" not in terms  # off by default: the SPEC's objective
    with pytest.raises(ValueError, match="return_teacher_logits=True"):
        chainflow_loss(out, {"kd": 0.5}, top_b=2)
    out.teacher_logits = torch.randn_like(out.logits)
    total_kd, terms_kd = chainflow_loss(out, {"kd": 0.5}, top_b=2, kd_temperature=2.0)
    expected = distillation_loss(out.logits, out.teacher_logits, out.target_mask, 2.0)
    assert terms_kd["kd"].item() == pytest.approx(expected.item())
    assert total_kd.item() == pytest.approx(total.item() + 0.5 * expected.item())
