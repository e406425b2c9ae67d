"""The GRPO algorithm options against float64 references written element by element from their papers:
LUSPO, VESPO, INTELLECT-2's delta, DeepSeek-V3.2's off-policy mask, the 80/20 entropy mask, the entropy
bonus and its gradient, Skywork-OR1's adaptive coefficient and TR-DPO's reference update."""

from __future__ import annotations

import math

import pytest
import torch

from rlft.core.logprobs import entropy_from_logits
from rlft.core.losses import off_policy_sequence_mask, policy_loss, vespo_weights
from rlft.core.regularizers import (
    adaptive_entropy_coef,
    entropy_bonus,
    entropy_threshold,
    high_entropy_mask,
    mix_reference,
)


def case(batch: int, length: int, seed: int, empty_row: bool = True):
    """Off-policy log-probs, signed advantages and a ragged mask (row 0 empty when asked)."""
    g = torch.Generator().manual_seed(seed)
    logps = (-torch.rand(batch, length, generator=g, dtype=torch.float64) * 3).requires_grad_()
    old = logps.detach() + (torch.rand(batch, length, generator=g, dtype=torch.float64) - 0.5) * 0.8
    adv = torch.randn(batch, generator=g, dtype=torch.float64)
    lengths = torch.randint(1, length + 1, (batch,), generator=g)
    if empty_row:
        lengths[0] = 0
    mask = (torch.arange(length)[None] < lengths[:, None]).double()
    return logps, old, adv, mask


SHAPES = [(4, 5, 0), (7, 3, 1), (2, 9, 2)]


@pytest.mark.parametrize("batch,length,seed", SHAPES)
def test_luspo_is_the_clip_term_summed_per_sequence_and_averaged_over_sequences(batch, length, seed):
    """LUSPO (arXiv:2602.05261): J = (1/N) sum_i sum_t min(r A, clip(r) A): each sequence weighted by its length."""
    logps, old, adv, mask = case(batch, length, seed)
    for level in ("token", "sequence"):
        loss, _ = policy_loss(logps, old, adv, mask, loss_type="luspo", epsilon_low=0.2, epsilon_high=0.28,
                              importance_sampling_level=level)
        total = 0.0
        for i in range(batch):
            n = int(mask[i].sum())
            seq_ratio = math.exp(sum(logps[i, t].item() - old[i, t].item() for t in range(n)) / max(n, 1))
            for t in range(n):
                r = math.exp(logps[i, t].item() - old[i, t].item()) if level == "token" else seq_ratio
                a = adv[i].item()
                total += -min(r * a, min(max(r, 0.8), 1.28) * a)
        assert loss.item() == pytest.approx(total / batch, abs=1e-12)


def phi_reference(log_ratios: list[float], a: float, log_rho: list[float] | None, k_pos=2.0, lam_pos=3.0,
                  k_neg=3.0, lam_neg=2.0) -> float:
    """VESPO (arXiv:2602.10693): phi(w) = e^lam * w^k * e^(-lam w), w the product of the token ratios."""
    low = math.log(1e-8)
    log_w = sum(min(max(x, -20.0), 20.0) for x in log_ratios)
    if log_rho is not None:
        log_w += sum(min(max(x, low), 20.0) for x in log_rho)
    log_w = min(max(log_w, low), 20.0)
    k, lam = (k_pos, lam_pos) if a >= 0 else (k_neg, lam_neg)
    w = math.exp(log_w)
    return math.exp(lam) * w ** k * math.exp(-lam * w)


@pytest.mark.parametrize("batch,length,seed", SHAPES)
def test_vespo_weight_value_and_gradient(batch, length, seed):
    logps, old, adv, mask = case(batch, length, seed)
    g = torch.Generator().manual_seed(seed + 10)
    rho = torch.rand(batch, length, generator=g, dtype=torch.float64) + 0.5  # sampling-correction weights
    for weights in (None, rho):
        loss, metrics = policy_loss(logps, old, adv, mask, loss_type="vespo", rollout_is_weights=weights)
        tokens = max(mask.sum().item(), 1)
        phis, total = [], 0.0
        for i in range(batch):
            n = int(mask[i].sum())
            ratios = [logps[i, t].item() - old[i, t].item() for t in range(n)]
            log_rho = None if weights is None else [math.log(weights[i, t].item()) for t in range(n)]
            phis.append(phi_reference(ratios, adv[i].item(), log_rho))
            total += sum(-phis[-1] * adv[i].item() * logps[i, t].item() for t in range(n))
        assert loss.item() == pytest.approx(total / tokens, abs=1e-12)
        assert metrics["vespo/phi_seq_mean"].item() == pytest.approx(sum(phis) / batch, abs=1e-12)
        # phi is a stop-gradient weight: d loss / d log pi(o_it) = -phi_i A_i m_it / T
        (grad,) = torch.autograd.grad(loss, logps)
        expected = torch.tensor(phis, dtype=torch.float64)[:, None] * -adv[:, None] * mask / tokens
        assert torch.allclose(grad, expected, atol=1e-12)


def test_vespo_weight_is_one_on_policy_and_peaks_at_k_over_lambda():
    mask = torch.ones(2, 1, dtype=torch.float64)
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    assert vespo_weights(torch.zeros(2, 1, dtype=torch.float64), mask, adv).flatten().tolist() == [1.0, 1.0]
    grid = torch.linspace(-3, 3, 6001, dtype=torch.float64)
    phi = vespo_weights(grid[:, None], torch.ones(6001, 1, dtype=torch.float64), torch.ones(6001)).flatten()
    assert math.exp(grid[phi.argmax()].item()) == pytest.approx(2.0 / 3.0, rel=2e-3)  # k_pos / lambda_pos


@pytest.mark.parametrize("batch,length,seed", SHAPES)
def test_delta_caps_the_unclipped_ratio(batch, length, seed):
    """INTELLECT-2 (arXiv:2505.07291): l = -min(min(r, delta) A, clip(r, 1 - eps, 1 + eps_h) A)."""
    logps, old, adv, mask = case(batch, length, seed)
    old = old - 0.6 * mask  # ratios up to e^1 so that delta bites
    adv[1] = -abs(adv[1])  # at least one negative-advantage completion
    loss, metrics = policy_loss(logps, old, adv, mask, loss_type="dapo", epsilon_low=0.2, epsilon_high=0.28,
                                delta=1.5)
    total, capped = 0.0, 0
    for i in range(batch):
        for t in range(int(mask[i].sum())):
            r, a = math.exp(logps[i, t].item() - old[i, t].item()), adv[i].item()
            total += -min(min(r, 1.5) * a, min(max(r, 0.8), 1.28) * a)
            capped += r > 1.5 and a < 0
    assert loss.item() == pytest.approx(total / mask.sum().item(), abs=1e-12)
    assert capped > 0 and metrics["clip_ratio/delta_mean"].item() == pytest.approx(capped / mask.sum().item())
    # without delta a negative advantage with a huge ratio is unbounded
    unbounded, _ = policy_loss(logps, old - 10 * mask, -adv.abs(), mask, loss_type="dapo")
    bounded, _ = policy_loss(logps, old - 10 * mask, -adv.abs(), mask, loss_type="dapo", delta=1.5)
    assert unbounded.item() > 1000 * bounded.item() > 0


@pytest.mark.parametrize("batch,length,seed", SHAPES)
def test_off_policy_mask_drops_negative_advantage_sequences_whose_kl_exceeds_the_threshold(batch, length, seed):
    """DeepSeek-V3.2 (arXiv:2512.02556, eq. 9): keep unless A < 0 and mean_t (log pi_old - log pi) > delta."""
    logps, old, adv, mask = case(batch, length, seed)
    sampler = old.clone()
    sampler[-1, 0] = float("nan")  # a token the sampler could not score counts as 0
    keep = off_policy_sequence_mask(adv, logps, sampler, mask, 0.05)
    for i in range(batch):
        n = int(mask[i].sum())
        gaps = [0.0 if math.isnan(sampler[i, t].item()) else sampler[i, t].item() - logps[i, t].item()
                for t in range(n)]
        expected = adv[i].item() >= 0 or (sum(gaps) / max(n, 1)) <= 0.05
        assert keep[i, 0].item() == float(expected)
    loss, _ = policy_loss(logps, old, adv, mask, loss_type="dapo", keep=keep)
    kept_only, _ = policy_loss(logps, old, adv, mask * keep, loss_type="dapo", num_items=mask.sum())
    assert loss.item() == pytest.approx(kept_only.item(), abs=1e-12)  # masked out, still in the normaliser


def quantile_reference(values: list[float], q: float) -> float:
    """Linear interpolation between order statistics (the definition torch.quantile and NumPy use)."""
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


@pytest.mark.parametrize("rho", [0.0, 0.2, 0.5, 1.0])
def test_high_entropy_mask_keeps_the_top_rho_quantile_of_valid_tokens(rho):
    """80/20 (arXiv:2506.01939): e_it = [H_it >= quantile_{1 - rho}(H over completion tokens)] m_it."""
    g = torch.Generator().manual_seed(4)
    entropy = torch.rand(5, 6, generator=g, dtype=torch.float64) * 4
    _, _, _, mask = case(5, 6, 4)
    valid = [entropy[i, t].item() for i in range(5) for t in range(6) if mask[i, t]]
    threshold = entropy_threshold(entropy[mask.bool()], rho)
    assert threshold.item() == pytest.approx(quantile_reference(valid, 1 - rho), abs=1e-12)
    keep = high_entropy_mask(entropy, mask, threshold)
    for i in range(5):
        for t in range(6):
            assert keep[i, t].item() == float(bool(mask[i, t]) and entropy[i, t].item() >= threshold.item())
    assert keep.sum() >= 1  # rho = 0 keeps the highest-entropy token
    assert entropy_threshold(torch.empty(0), 0.2).item() == math.inf
    with pytest.raises(ValueError, match=r"top_entropy_quantile=1.5 must be in \[0, 1\]"):
        entropy_threshold(entropy, 1.5)


def entropy_reference(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """H = -sum_v p_v log p_v of softmax(z / T), straight from the definition."""
    logp = torch.log_softmax(logits / temperature, dim=-1)
    return -(logp.exp() * logp).sum(-1)


@pytest.mark.parametrize("chunk", [1, 4, 100])
def test_entropy_value_and_gradient_match_the_definition(chunk):
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(3, 5, 11, generator=g, dtype=torch.float64, requires_grad=True)
    weights = torch.randn(3, 5, generator=g, dtype=torch.float64)
    ours = entropy_from_logits(logits, 0.7, chunk)
    (ours * weights).sum().backward()
    grad = logits.grad.clone()
    logits.grad = None
    (entropy_reference(logits, 0.7) * weights).sum().backward()
    assert torch.allclose(ours, entropy_reference(logits.detach(), 0.7), atol=1e-12)
    assert torch.allclose(grad, logits.grad, atol=1e-12)
    assert torch.autograd.gradcheck(lambda z: entropy_from_logits(z, 1.3, chunk), (logits.detach().requires_grad_(),))


def test_entropy_bonus_is_minus_coef_times_the_mean_over_trained_tokens_of_the_step():
    entropy = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]], dtype=torch.float64)
    assert entropy_bonus(entropy, mask, 0.1).item() == pytest.approx(-0.1 * (1 + 2 + 4) / 3)
    # a micro-batch's share with the step's token count: shares of the step sum to the step's bonus
    assert entropy_bonus(entropy, mask, 0.1, num_items=10).item() == pytest.approx(-0.1 * 7 / 10)


def test_adaptive_coefficient_follows_skywork_or1():
    """c_{k+1} = clip(c_k + d) if H_k <= target else clip(c_k - d), in [c_min, c_max]."""
    coefs, coef = [], 0.01
    for entropy in (0.1, 0.1, 0.3, 0.3, 0.3, 0.2):
        coef = adaptive_entropy_coef(coef, entropy, 0.2, 0.005, 0.0, 0.018)
        coefs.append(round(coef, 10))
    assert coefs == [0.015, 0.018, 0.013, 0.008, 0.003, 0.008]
    assert adaptive_entropy_coef(0.002, 1.0, 0.2, 0.005, 0.0, 1.0) == 0.0


def test_reference_soft_update():
    """TR-DPO (arXiv:2404.09656): theta_ref <- alpha theta + (1 - alpha) theta_ref, in place."""
    ref = torch.tensor([1.0, 2.0, -4.0], dtype=torch.float64)
    out = mix_reference(ref, torch.tensor([3.0, 2.0, 0.0], dtype=torch.float64), 0.25)
    assert out is ref and ref.tolist() == [1.5, 2.0, -3.0]
    with pytest.raises(ValueError, match="ref_model_mixup_alpha"):
        mix_reference(ref, ref, 1.5)


@pytest.mark.parametrize("batch,length,seed", SHAPES)
def test_luspo_and_delta_gradients_match_the_elementwise_reference(batch, length, seed):
    """Autograd through the element-by-element formulas above gives the same gradient as policy_loss."""
    logps, old, adv, mask = case(batch, length, seed)
    old = old - 0.6 * mask
    for loss_type, delta in (("luspo", None), ("luspo", 1.5), ("dapo", 1.5)):
        loss, _ = policy_loss(logps, old, adv, mask, loss_type=loss_type, epsilon_low=0.2, epsilon_high=0.28,
                              delta=delta)
        (ours,) = torch.autograd.grad(loss, logps)
        total = logps.new_zeros(())
        for i in range(batch):
            for t in range(int(mask[i].sum())):
                r = torch.exp(logps[i, t] - old[i, t])
                unclipped = r if delta is None else torch.clamp(r, max=delta)
                total = total - torch.min(unclipped * adv[i], torch.clamp(r, 0.8, 1.28) * adv[i])
        total = total / (batch if loss_type == "luspo" else mask.sum())
        (expected,) = torch.autograd.grad(total, logps)
        assert torch.allclose(ours, expected, atol=1e-12), (loss_type, delta)
