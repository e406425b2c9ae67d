"""Truncated / masked importance sampling against a float64 reference written from the papers
(rlft/core/importance.py): rho_t = pi_old(y_t) / pi_sampler(y_t); sequence modes use prod_t rho_t."""

from __future__ import annotations

import math

import pytest
import torch

from rlft.core.importance import CORRECTIONS, MODES, correction_stats, sampling_correction
from rlft.core.losses import policy_loss

TRL_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")  # reference() below


def reference(trainer, sampler, mask, mode, low, high):
    out = []
    for row_t, row_s, row_m in zip(trainer, sampler, mask):
        logs = [(t - s) if m else 0.0 for t, s, m in zip(row_t, row_s, row_m)]
        logs = [0.0 if math.isnan(x) else x for x in logs]
        values = [math.exp(sum(logs))] if mode.startswith("sequence") else [math.exp(x) for x in logs]
        bounded = []
        for rho in values:
            if mode.endswith("truncate"):
                rho = min(rho, high) if high is not None else rho
                rho = max(rho, low) if low is not None else rho
            elif (low is not None and rho < low) or (high is not None and rho > high):
                rho = 0.0
            bounded.append(rho)
        out.append(bounded)
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("mode", TRL_MODES)
@pytest.mark.parametrize("low, high", [(None, 3.0), (0.5, 2.0), (0.9, None)])
def test_modes_match_the_float64_reference(mode, low, high):
    gen = torch.Generator().manual_seed(0)
    trainer = -torch.rand(6, 5, generator=gen, dtype=torch.float64) * 3
    sampler = trainer + torch.randn(6, 5, generator=gen, dtype=torch.float64) * 0.6
    sampler[2, 1] = float("nan")  # a token the engine could not score: ratio 1
    mask = torch.ones(6, 5, dtype=torch.float64)
    mask[0, 3:] = 0
    mask[4, 1:] = 0
    got = sampling_correction(trainer, sampler, mask, mode, low, high)
    want = reference(trainer.tolist(), sampler.tolist(), mask.tolist(), mode, low, high)
    assert got.shape == ((6, 1) if mode.startswith("sequence") else (6, 5))
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_no_mismatch_means_weights_of_one_and_an_unchanged_loss():
    logps = -torch.rand(4, 6, dtype=torch.float64)
    mask = torch.ones(4, 6, dtype=torch.float64)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5], dtype=torch.float64)
    for mode in MODES:  # every registered mode: no mismatch, weight 1
        weights = sampling_correction(logps, logps.clone(), mask, mode)
        assert torch.all(weights == 1)
        with_is, _ = policy_loss(logps, logps.detach(), adv, mask, rollout_is_weights=weights)
        plain, _ = policy_loss(logps, logps.detach(), adv, mask)
        assert with_is.item() == pytest.approx(plain.item(), abs=1e-15)


def test_the_policy_term_is_weighted_per_token_and_the_kl_term_is_not():
    """TRL's order: per-token policy loss x weight, then + beta * KL."""
    gen = torch.Generator().manual_seed(1)
    logps = -torch.rand(3, 4, generator=gen, dtype=torch.float64)
    ref = logps + 0.1 * torch.randn(3, 4, generator=gen, dtype=torch.float64)
    mask = torch.ones(3, 4, dtype=torch.float64)
    adv = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
    weights = torch.rand(3, 4, generator=gen, dtype=torch.float64) + 0.5
    loss, _ = policy_loss(logps, logps.detach(), adv, mask, loss_type="dapo", ref_logps=ref, beta=0.1,
                          kl_importance_weighted=False, rollout_is_weights=weights)
    kl = torch.exp(ref - logps) - (ref - logps) - 1
    want = ((-adv[:, None] * weights + 0.1 * kl) * mask).sum() / mask.sum()  # ratio 1, unclipped
    assert loss.item() == pytest.approx(want.item(), rel=1e-12)


def test_stats_count_the_mismatch_and_the_zeroed_weights():
    trainer = torch.log(torch.tensor([[0.5, 0.5], [0.5, 0.5]], dtype=torch.float64))
    sampler = torch.log(torch.tensor([[0.25, 0.5], [0.5, 0.05]], dtype=torch.float64))
    mask = torch.ones(2, 2, dtype=torch.float64)
    weights = sampling_correction(trainer, sampler, mask, "token_mask", None, 3.0)  # ratios 2, 1, 1, 10 -> 0
    stats = correction_stats(trainer, sampler, mask, weights)
    assert stats["delta_max"].item() == pytest.approx(math.log(10))
    assert stats["zeroed"].item() == 1 and stats["ratio_count"].item() == 4
    assert stats["ratio_max"].item() == pytest.approx(2.0) and stats["ratio_min"].item() == 0.0


def test_the_mismatch_measures_are_kl_sampler_to_trainer_and_chi_square_in_float64():
    """Tokens drawn in exact proportion to the sampler's distribution p = (1/2, 1/4, 1/4): the per-token
    means of k1 = -log rho and k3 = rho - 1 - log rho (rho = q / p) are KL(p || q) exactly, and the mean of
    rho^2, minus 1, is the chi-square divergence sum q^2 / p - 1 (Schulman 2020; the definitions)."""
    p = torch.tensor([0.5, 0.25, 0.25], dtype=torch.float64)
    q = torch.tensor([0.2, 0.5, 0.3], dtype=torch.float64)
    drawn = torch.tensor([[0, 0, 1, 2]])  # a sample whose token frequencies are p
    sampler, trainer = p.log()[drawn], q.log()[drawn]
    mask = torch.ones(1, 4, dtype=torch.float64)
    stats = correction_stats(trainer, sampler, mask, torch.ones(1, 4, dtype=torch.float64))
    kl = float((p * (p / q).log()).sum())
    chi2 = float((q.square() / p).sum() - 1)
    count = stats["delta_count"].item()
    assert stats["kl_k1_sum"].item() / count == pytest.approx(kl, rel=1e-12)
    assert stats["kl_k3_sum"].item() / count == pytest.approx(kl, rel=1e-12)
    assert stats["rho_squared_sum"].item() / count - 1 == pytest.approx(chi2, rel=1e-12)
    same = correction_stats(trainer, trainer, mask, torch.ones(1, 4, dtype=torch.float64))
    assert same["kl_k1_sum"].item() == 0 and same["kl_k3_sum"].item() == 0  # one policy: no mismatch


def _random_logps(rows: int, width: int, seed: int, spread: float):
    gen = torch.Generator().manual_seed(seed)
    trainer = -torch.rand(rows, width, generator=gen, dtype=torch.float64) * 3
    sampler = trainer + spread * torch.randn(rows, width, generator=gen, dtype=torch.float64)
    mask = (torch.rand(rows, width, generator=gen) > 0.2).to(torch.float64)
    return trainer, sampler, mask


@pytest.mark.parametrize("low, high", [(0.5, 5.0), (None, 2.0)])
def test_icepop_keeps_each_tokens_ratio_inside_two_bounds_and_zeroes_it_outside(low, high):
    """IcePop (Ring-1T): M(k) = k if alpha <= k <= beta else 0, per token; alpha unset is 1 / beta."""
    trainer, sampler, mask = _random_logps(6, 9, 3, spread=1.0)
    got = sampling_correction(trainer, sampler, mask, "icepop", low, high)
    alpha = 1 / high if low is None else low
    want = []
    for row_t, row_s, row_m in zip(trainer.tolist(), sampler.tolist(), mask.tolist()):
        ratios = [math.exp((t - s) * m) for t, s, m in zip(row_t, row_s, row_m)]
        want.append([k if alpha <= k <= high else 0.0 for k in ratios])
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64), rtol=1e-12, atol=0)
    assert 0 < float((got == 0).double().mean()) < 1  # this draw has tokens on both sides of the bounds


def test_geometric_masking_drops_a_sequence_whose_geometric_mean_ratio_leaves_the_bounds():
    """The geometric-mean ratio exp(mean over the sequence's tokens of log rho): weight 1 inside [C_min, C_max]
    (C_min unset: 1 / C_max), 0 outside, one weight per sequence; no reweighting."""
    trainer, sampler, mask = _random_logps(8, 7, 5, spread=0.05)
    got = sampling_correction(trainer, sampler, mask, "sequence_geometric_mask", None, 1.01)
    want = []
    for row_t, row_s, row_m in zip(trainer.tolist(), sampler.tolist(), mask.tolist()):
        logs = [t - s for t, s, m in zip(row_t, row_s, row_m) if m]
        geometric = math.exp(sum(logs) / max(len(logs), 1))
        want.append([1.0 if 1 / 1.01 <= geometric <= 1.01 else 0.0])
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64), rtol=0, atol=0)
    assert got.shape == (8, 1) and 0 < float(got.mean()) < 1


def test_the_modes_are_a_registry_the_config_reads():
    from rlft.config import ConfigError, GRPOConfig
    from rlft.core.importance import CORRECTIONS

    assert set(MODES) == set(CORRECTIONS) >= {"token_truncate", "token_mask", "sequence_truncate",
                                              "sequence_mask", "icepop", "sequence_geometric_mask"}
    GRPOConfig(vllm_importance_sampling_mode="icepop", vllm_importance_sampling_clip_min=0.5,
               vllm_importance_sampling_clip_max=5.0)
    with pytest.raises(ConfigError, match=r"vllm_importance_sampling_mode='tis' is not allowed; choose one of "
                                          r"'token_truncate'.*'icepop', 'sequence_geometric_mask'"):
        GRPOConfig(vllm_importance_sampling_mode="tis")
    with pytest.raises(ConfigError, match="token_truncate or token_mask .or icepop; not sequence_geometric"):
        GRPOConfig(loss_type="vespo", use_vllm=True, vllm_importance_sampling_mode="sequence_geometric_mask")


def test_the_stats_count_what_a_bound_clipped_apart_from_what_it_zeroed():
    """Ratios 2, 1, 1, 10 (module reference): token_truncate at [0.5, 3] clips one (10 -> 3); token_mask zeroes
    it instead, and clips none."""
    trainer = torch.log(torch.tensor([[0.5, 0.5], [0.5, 0.5]], dtype=torch.float64))
    sampler = torch.log(torch.tensor([[0.25, 0.5], [0.5, 0.05]], dtype=torch.float64))
    mask = torch.ones(2, 2, dtype=torch.float64)
    for mode, clipped, zeroed in (("token_truncate", 1, 0), ("token_mask", 0, 1)):
        weights = sampling_correction(trainer, sampler, mask, mode, 0.5, 3.0)
        unbounded = sampling_correction(trainer, sampler, mask, mode, None, None)
        stats = correction_stats(trainer, sampler, mask, weights, unbounded)
        assert (stats["clipped"].item(), stats["zeroed"].item()) == (clipped, zeroed), mode


@pytest.mark.parametrize("mode", MODES)
def test_stale_long_samples_keep_finite_bounded_weights_in_float32(mode):
    """Samples 4 optimiser steps stale over 2,048 tokens: the per-sequence log ratio reaches +-400, past
    float32's exp range (TRL threads #6945 / #7120: its sequence modes break here). Every weight stays finite
    and within [0, C_max] (a truncated one within [C_min, C_max])."""
    gen = torch.Generator().manual_seed(7)
    trainer = -torch.rand(4, 2048, generator=gen) * 4
    drift = torch.tensor([0.2, -0.2, 0.02, 0.0])[:, None]  # per-token log ratio of each sequence
    sampler = trainer - drift
    mask = torch.ones(4, 2048)
    weights = sampling_correction(trainer, sampler, mask, mode, 0.5, 3.0)
    assert torch.isfinite(weights).all() and weights.min() >= 0 and weights.max() <= 3.0
    if CORRECTIONS[mode].bound == "truncate":
        assert weights.min() >= 0.5
    assert weights.flatten()[-1] == 1.0  # the fresh sequence keeps weight 1
