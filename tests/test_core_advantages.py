"""Group advantages: DeepSeekMath's formula, scale_rewards, NaN-aware multi-reward aggregation."""

from __future__ import annotations

import math

import pytest
import torch

from rlft.core.advantages import group_advantages, multi_reward_advantages


def reference(rewards, group_size, eps=1e-4):
    out = []
    for start in range(0, len(rewards), group_size):
        group = rewards[start:start + group_size]
        mean = sum(group) / len(group)
        std = math.sqrt(sum((r - mean) ** 2 for r in group) / (len(group) - 1))
        out += [(r - mean) / (std + eps) for r in group]
    return out


def test_matches_formula_per_group():
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.2, 3.0, 3.0, 1.0, 0.0], dtype=torch.float64)
    adv, stats = group_advantages(rewards, 4)
    assert adv.tolist() == pytest.approx(reference(rewards.tolist(), 4), rel=1e-12)
    assert stats["frac_reward_zero_std"] == 0.0


def test_zero_spread_and_singleton_groups_give_zero_never_nan():
    adv, stats = group_advantages(torch.tensor([2.0, 2.0, 2.0, 1.0, 0.0, 1.0]), 3)
    assert adv[:3].tolist() == [0.0, 0.0, 0.0] and stats["frac_reward_zero_std"] == 0.5
    single, stats = group_advantages(torch.tensor([1.0, 5.0]), 1)
    assert single.tolist() == [0.0, 0.0] and stats["frac_reward_zero_std"] == 1.0


def test_scale_rewards_batch_and_none():
    rewards = torch.tensor([1.0, 0.0, 4.0, 2.0], dtype=torch.float64)
    none, _ = group_advantages(rewards, 2, "none")
    assert none.tolist() == [0.5, -0.5, 1.0, -1.0]
    batch, _ = group_advantages(rewards, 2, "batch")
    assert torch.allclose(batch, none / (rewards.std() + 1e-4))


def test_nan_rewards_are_left_out_and_get_zero_advantage():
    rewards = torch.tensor([1.0, float("nan"), 0.0, 2.0], dtype=torch.float64)
    adv, _ = group_advantages(rewards, 4)
    valid = reference([1.0, 0.0, 2.0], 3)
    assert adv[1] == 0.0 and [adv[0], adv[2], adv[3]] == pytest.approx(valid)


def test_multi_reward_sum_then_normalize_with_weights_and_nan():
    rewards = torch.tensor([[1.0, float("nan")], [0.0, 1.0], [float("nan"), float("nan")], [1.0, 1.0]])
    adv, total, _ = multi_reward_advantages(rewards, torch.tensor([1.0, 0.5]), 4)
    assert total[:2].tolist() == [1.0, 0.5] and math.isnan(total[2]) and total[3] == 1.5
    assert adv[2] == 0.0
    expected = reference([1.0, 0.5, 1.5], 3)
    assert [adv[0].item(), adv[1].item(), adv[3].item()] == pytest.approx(expected, rel=1e-5)


def test_multi_reward_normalize_then_sum_is_gdpo():
    g = torch.Generator().manual_seed(0)
    rewards = torch.rand(8, 2, generator=g, dtype=torch.float64)
    weights = torch.tensor([1.0, 2.0], dtype=torch.float64)
    adv, _, _ = multi_reward_advantages(rewards, weights, 4, aggregation="normalize_then_sum")
    per_f = [torch.tensor(reference(rewards[:, f].tolist(), 4)) for f in range(2)]
    summed = per_f[0] + 2 * per_f[1]
    expected = (summed - summed.mean()) / (summed.std() + 1e-4)
    assert torch.allclose(adv, expected.double(), atol=1e-9)


def test_bad_shapes_are_errors():
    with pytest.raises(ValueError, match="cannot be split into groups of 4"):
        group_advantages(torch.zeros(6), 4)
    with pytest.raises(ValueError, match="scale_rewards='std'"):
        group_advantages(torch.zeros(4), 2, "std")
