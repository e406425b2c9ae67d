"""Policy losses against float64 references written straight from each paper's formula."""

from __future__ import annotations

import math

import pytest
import torch

from rlft.core.advantages import group_advantages
from rlft.core.losses import kl_penalty, policy_loss

LOSS_TYPES = ["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo"]
EPS_LOW, EPS_HIGH, L_MAX = 0.2, 0.28, 9


def make_batch(seed=0, batch=6, length=7, equal_lengths=False):
    g = torch.Generator().manual_seed(seed)
    logps = -torch.rand(batch, length, generator=g, dtype=torch.float64) * 3 - 0.05
    old = logps + torch.randn(batch, length, generator=g, dtype=torch.float64) * 0.3
    ref = logps + torch.randn(batch, length, generator=g, dtype=torch.float64) * 0.2
    adv = torch.randn(batch, generator=g, dtype=torch.float64)
    lengths = [length] * batch if equal_lengths else [7, 3, 0, 5, 1, 6][:batch]
    mask = torch.tensor([[1.0] * n + [0.0] * (length - n) for n in lengths], dtype=torch.float64)
    return logps, old, ref, adv, mask


def reference_loss(logps, old, ref, adv, mask, loss_type, level, beta, kl_weighted=False):
    """Token by token, as the papers write it (DeepSeekMath, DAPO, Dr. GRPO, GSPO, CISPO, SAPO); with
    kl_weighted the KL sample is importance-weighted by the same ratio the policy term uses."""
    n_seq = logps.shape[0]
    n_tok = float(mask.sum())
    total, seq_means = 0.0, 0.0
    for i in range(n_seq):
        tokens = [t for t in range(logps.shape[1]) if mask[i, t] > 0]
        if level == "sequence" and tokens:
            s_i = torch.exp(sum(logps[i, t] - old[i, t] for t in tokens) / len(tokens))
        row = 0.0
        for t in tokens:
            r = s_i if level == "sequence" else torch.exp(logps[i, t] - old[i, t])
            a = adv[i]
            if loss_type == "cispo":
                l_it = -torch.clamp(r, max=1 + EPS_HIGH).detach() * a * logps[i, t]
            elif loss_type == "sapo":
                tau = 1.0 if a > 0 else 1.05
                l_it = -(4 / tau) * torch.sigmoid(tau * (r - 1)) * a
            else:
                l_it = -torch.min(r * a, torch.clamp(r, 1 - EPS_LOW, 1 + EPS_HIGH) * a)
            if beta > 0:
                d = ref[i, t] - logps[i, t]
                l_it = l_it + beta * (torch.exp(d) - d - 1) * (r if kl_weighted else 1.0)
            row = row + l_it
        total = total + row
        if tokens:
            seq_means = seq_means + row / len(tokens)
    if loss_type in ("grpo", "sapo"):
        return seq_means / n_seq
    if loss_type == "dr_grpo":
        return total / (n_seq * L_MAX)
    return total / n_tok


def ours(logps, old, ref, adv, mask, loss_type, level, beta, **kw):
    return policy_loss(logps, old, adv, mask, loss_type=loss_type, epsilon_low=EPS_LOW, epsilon_high=EPS_HIGH,
                       ref_logps=ref, beta=beta, importance_sampling_level=level, max_completion_length=L_MAX, **kw)


@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_loss_and_gradient_match_float64_reference(loss_type, level, beta):
    logps, old, ref, adv, mask = make_batch()
    mine = logps.clone().requires_grad_()
    loss, _ = ours(mine, old, ref, adv, mask, loss_type, level, beta)
    (grad,) = torch.autograd.grad(loss, mine)
    theirs = logps.clone().requires_grad_()
    expected = reference_loss(theirs, old, ref, adv, mask, loss_type, level, beta)
    (expected_grad,) = torch.autograd.grad(expected, theirs)
    assert math.isclose(loss.item(), expected.item(), rel_tol=1e-6, abs_tol=1e-12)
    assert torch.allclose(grad, expected_grad, rtol=1e-6, atol=1e-12)
    assert torch.all(grad[2] == 0), "a completion with zero tokens contributes nothing"


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_gradcheck_float64(loss_type, level):
    logps, old, ref, adv, mask = make_batch(seed=3)
    if loss_type == "cispo":
        # CISPO's IS weight is stop-gradient by design, so finite differences only agree with
        # autograd where the weight is constant: every ratio truncated at 1 + eps_high.
        old = logps - 1.0
    logps.requires_grad_()
    assert torch.autograd.gradcheck(lambda lp: ours(lp, old, ref, adv, mask, loss_type, level, 0.04)[0], (logps,))


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_importance_weighted_kl_matches_float64_reference(loss_type, level):
    """TRL's use_bias_correction_kl: beta * r_it * k3_it, r_it with its gradient."""
    logps, old, ref, adv, mask = make_batch(seed=5)
    mine = logps.clone().requires_grad_()
    loss, metrics = ours(mine, old, ref, adv, mask, loss_type, level, 0.04, kl_importance_weighted=True)
    (grad,) = torch.autograd.grad(loss, mine)
    theirs = logps.clone().requires_grad_()
    expected = reference_loss(theirs, old, ref, adv, mask, loss_type, level, 0.04, kl_weighted=True)
    (expected_grad,) = torch.autograd.grad(expected, theirs)
    assert math.isclose(loss.item(), expected.item(), rel_tol=1e-6, abs_tol=1e-12)
    assert torch.allclose(grad, expected_grad, rtol=1e-6, atol=1e-12)
    assert torch.all(grad[2] == 0)
    if loss_type != "cispo":
        assert torch.autograd.gradcheck(
            lambda lp: ours(lp, old, ref, adv, mask, loss_type, level, 0.04, kl_importance_weighted=True)[0],
            (logps.clone().requires_grad_(),))


def test_importance_weighted_kl_changes_the_gradient_even_on_policy():
    """With old = current the weight is 1 in value but not in gradient: r * k3 has gradient k3 + grad k3."""
    logps, _, ref, adv, mask = make_batch(seed=6)
    grads = []
    for weighted in (False, True):
        mine = logps.clone().requires_grad_()
        loss, _ = ours(mine, mine.detach(), ref, adv, mask, "dapo", "token", 0.04, kl_importance_weighted=weighted)
        grads.append(torch.autograd.grad(loss, mine)[0])
    d = ref - logps
    k3 = torch.exp(d) - d - 1
    assert torch.allclose(grads[1] - grads[0], 0.04 * k3 * mask / mask.sum(), atol=1e-12)


def test_seed_loss_is_zero_but_gradient_is_not():
    """beta=0, one update per rollout (old = logps.detach()), 'grpo': value 0, gradient clearly not."""
    g = torch.Generator().manual_seed(0)
    rewards = torch.rand(16, generator=g)
    adv, _ = group_advantages(rewards, group_size=4)
    logps = (-torch.rand(16, 5, generator=g) * 2).requires_grad_()
    mask = (torch.rand(16, 5, generator=g) > 0.3).float()
    mask[:, 0] = 1
    loss, metrics = policy_loss(logps, logps.detach(), adv, mask, loss_type="grpo")
    loss.backward()
    assert abs(loss.item()) < 1e-7
    assert logps.grad.norm().item() > 0.1
    assert metrics["ratio_mean"].item() == pytest.approx(1.0)


def test_gradient_really_is_zero_when_every_group_has_equal_rewards():
    rewards = torch.tensor([1.0] * 4 + [0.0] * 4)
    adv, stats = group_advantages(rewards, group_size=4)
    assert stats["frac_reward_zero_std"] == 1.0
    logps = (-torch.rand(8, 5)).requires_grad_()
    loss, _ = policy_loss(logps, logps.detach(), adv, torch.ones(8, 5), loss_type="grpo")
    loss.backward()
    assert loss.item() == 0.0 and logps.grad.abs().max().item() == 0.0


@pytest.mark.parametrize("splits", [2, 3])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_micro_batch_split_with_global_normaliser_equals_full_batch(loss_type, splits):
    logps, old, ref, adv, mask = make_batch(seed=7)
    full = logps.clone().requires_grad_()
    loss, _ = ours(full, old, ref, adv, mask, loss_type, "token", 0.04)
    loss.backward()
    parts = logps.clone().requires_grad_()
    total = 0.0
    for idx in torch.arange(6).chunk(splits):
        part_loss, _ = ours(parts[idx], old[idx], ref[idx], adv[idx], mask[idx], loss_type, "token", 0.04,
                            num_items=mask.sum(), num_sequences=6)
        part_loss.backward()
        total += part_loss.item()
    assert total == pytest.approx(loss.item(), rel=1e-9)
    assert torch.allclose(parts.grad, full.grad, rtol=1e-9, atol=1e-12)


def test_local_normaliser_per_micro_batch_is_not_split_invariant():
    """The OpenRLHF #1249 bug class, shown: without the global count the gradient changes."""
    logps, old, ref, adv, mask = make_batch(seed=7)
    full = logps.clone().requires_grad_()
    ours(full, old, ref, adv, mask, "dapo", "token", 0.0)[0].backward()
    parts = logps.clone().requires_grad_()
    for idx in torch.arange(6).chunk(2):
        ours(parts[idx], old[idx], ref[idx], adv[idx], mask[idx], "dapo", "token", 0.0)[0].backward()
    assert not torch.allclose(parts.grad, full.grad)


def test_dapo_equals_bnpo_on_one_micro_batch():
    logps, old, ref, adv, mask = make_batch()
    dapo = ours(logps, old, ref, adv, mask, "dapo", "token", 0.04)[0]
    bnpo = ours(logps, old, ref, adv, mask, "bnpo", "token", 0.04)[0]
    assert dapo.item() == bnpo.item()


def test_dapo_equals_grpo_when_lengths_are_equal_and_differs_otherwise():
    logps, old, ref, adv, mask = make_batch(equal_lengths=True)
    assert ours(logps, old, ref, adv, mask, "dapo", "token", 0.04)[0].item() == pytest.approx(
        ours(logps, old, ref, adv, mask, "grpo", "token", 0.04)[0].item(), rel=1e-12)
    logps, old, ref, adv, mask = make_batch()
    dapo = ours(logps, old, ref, adv, mask, "dapo", "token", 0.04)[0].item()
    grpo = ours(logps, old, ref, adv, mask, "grpo", "token", 0.04)[0].item()
    assert abs(dapo - grpo) > 1e-3


def test_kl_term_is_normalised_like_the_policy_term():
    """With A = 0 the loss is beta * KL aggregated by the loss type's own normaliser."""
    logps, old, ref, adv, mask = make_batch()
    zero = torch.zeros_like(adv)
    kl = kl_penalty(logps, ref)
    grpo = policy_loss(logps, old, zero, mask, loss_type="grpo", ref_logps=ref, beta=0.5)[0]
    per_seq = (kl * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    assert grpo.item() == pytest.approx(0.5 * per_seq.sum().item() / 6, rel=1e-12)
    dapo = policy_loss(logps, old, zero, mask, loss_type="dapo", ref_logps=ref, beta=0.5)[0]
    assert dapo.item() == pytest.approx(0.5 * (kl * mask).sum().item() / mask.sum().item(), rel=1e-12)


def test_kl_estimators_match_schulman_definitions():
    logps = torch.tensor([-1.0, -2.0]).double()
    ref = torch.tensor([-1.5, -1.0]).double()
    d = ref - logps
    assert torch.allclose(kl_penalty(logps, ref, "k1"), -d)
    assert torch.allclose(kl_penalty(logps, ref, "k2"), d**2 / 2)
    assert torch.allclose(kl_penalty(logps, ref, "k3"), d.exp() - d - 1)
    assert torch.all(kl_penalty(logps, ref, "k3") >= 0)
    assert kl_penalty(logps, logps, "k3").abs().max() == 0


def test_clip_metrics_count_clipped_tokens():
    logps = torch.log(torch.tensor([[0.5, 0.5, 0.5, 0.5]]))
    old = torch.log(torch.tensor([[0.5, 0.3, 0.9, 0.5]]))  # ratios 1, 1.67, 0.56, 1
    _, pos = policy_loss(logps, old, torch.tensor([1.0]), torch.ones(1, 4), loss_type="dapo")
    _, neg = policy_loss(logps, old, torch.tensor([-1.0]), torch.ones(1, 4), loss_type="dapo")
    assert pos["clip_ratio/high_mean"].item() == 0.25 and pos["clip_ratio/low_mean"].item() == 0.0
    assert neg["clip_ratio/low_mean"].item() == 0.25 and neg["clip_ratio/region_mean"].item() == 0.25


def test_unknown_loss_type_and_missing_ref_are_errors():
    logps, old, ref, adv, mask = make_batch()
    with pytest.raises(ValueError, match="loss_type='ppo'"):
        policy_loss(logps, old, adv, mask, loss_type="ppo")
    with pytest.raises(ValueError, match="beta > 0 needs ref_logps"):
        policy_loss(logps, old, adv, mask, beta=0.1)
