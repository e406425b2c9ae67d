"""Bradley-Terry loss: formula, margin, centring, and float16 extremes."""

from __future__ import annotations

import math

import pytest
import torch

from rlft.core.preference import bradley_terry_loss


def test_matches_formula_with_margin_and_centring():
    chosen = torch.tensor([1.0, -0.5, 2.0], dtype=torch.float64)
    rejected = torch.tensor([0.0, 0.5, 2.5], dtype=torch.float64)
    margin = torch.tensor([0.5, 0.0, 1.0], dtype=torch.float64)
    loss, metrics = bradley_terry_loss(chosen, rejected, margin, center_rewards_coefficient=0.01)
    expected = sum(-math.log(1 / (1 + math.exp(-(c - r - m)))) for c, r, m in
                   zip(chosen.tolist(), rejected.tolist(), margin.tolist())) / 3
    expected += 0.01 * sum((c + r) ** 2 for c, r in zip(chosen.tolist(), rejected.tolist())) / 3
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert metrics["accuracy"].item() == pytest.approx(1 / 3)
    assert metrics["margin"].item() == pytest.approx((1.0 - 1.0 - 0.5) / 3)


def test_float16_extreme_scores_stay_finite_and_exact():
    chosen = torch.tensor([1e4, -1e4], dtype=torch.float16, requires_grad=True)
    rejected = torch.tensor([-1e4, 1e4], dtype=torch.float16)
    loss, _ = bradley_terry_loss(chosen, rejected)
    loss.backward()
    assert loss.dtype == torch.float32 and math.isfinite(loss.item())
    assert loss.item() == pytest.approx(2e4 / 2, rel=1e-6)  # (0 + 2e4) / 2
    assert torch.isfinite(chosen.grad).all()
