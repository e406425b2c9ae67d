"""The advantage-estimator registry: every estimator against a float64 reference written element by element from
its paper; NaN (ragged) groups, G = 2, all-equal rewards; RLOO's estimator is unbiased (a bandit with a closed
form); a new estimator or loss is one function and one registration, and the config then accepts its name."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from rlft.config import GRPOConfig
from rlft.core.advantages import ADVANTAGE_ESTIMATORS, group_advantages, register_estimator
from rlft.core.losses import LOSSES, LossOptions, policy_loss, register_loss
from rlft.errors import ConfigError

REWARDS = [1.0, 0.0, 0.5, 0.2, 3.0, 3.0, 1.0, 0.0, 2.0, 2.0, 2.0, 2.0]  # 3 groups of 4; the last all equal
LENGTHS = [5.0, 1.0, 3.0, 8.0, 2.0, 6.0, 4.0, 4.0, 1.0, 2.0, 3.0, 4.0]


def groups(values, g):
    return [values[i:i + g] for i in range(0, len(values), g)]


def ref_rloo(rewards, g, lengths=None):
    return [r - (sum(grp) - r) / (len(grp) - 1) for grp in groups(rewards, g) for r in grp]


def ref_dr_grpo(rewards, g, lengths=None):
    return [r - sum(grp) / len(grp) for grp in groups(rewards, g) for r in grp]


def ref_reinforce_pp_baseline(rewards, g, lengths=None, eps=1e-4):
    centred = ref_dr_grpo(rewards, g)
    mean = sum(centred) / len(centred)
    std = math.sqrt(sum((c - mean) ** 2 for c in centred) / (len(centred) - 1))
    return [(c - mean) / (std + eps) for c in centred]


def ref_opo(rewards, g, lengths):
    out = []
    for grp, lens in zip(groups(rewards, g), groups(lengths, g)):
        baseline = sum(length * r for r, length in zip(grp, lens)) / sum(lens)
        out += [r - baseline for r in grp]
    return out


def ref_grpo(rewards, g, lengths=None, eps=1e-4):
    out = []
    for grp in groups(rewards, g):
        mean = sum(grp) / len(grp)
        std = math.sqrt(sum((r - mean) ** 2 for r in grp) / (len(grp) - 1))
        out += [(r - mean) / (std + eps) for r in grp]
    return out


REFERENCES = {"grpo": ref_grpo, "dr_grpo": ref_dr_grpo, "rloo": ref_rloo,
              "reinforce_pp_baseline": ref_reinforce_pp_baseline, "opo": ref_opo}


@pytest.mark.parametrize("name", sorted(REFERENCES))
@pytest.mark.parametrize("g", [2, 4])
def test_every_estimator_matches_its_float64_reference(name, g):
    rewards = torch.tensor(REWARDS, dtype=torch.float64)
    lengths = torch.tensor(LENGTHS, dtype=torch.float64)
    adv, stats = group_advantages(rewards, g, estimator=name, lengths=lengths)
    assert adv.dtype == torch.float64
    assert adv.tolist() == pytest.approx(REFERENCES[name](REWARDS, g, LENGTHS), rel=1e-12, abs=1e-12)
    assert stats["advantage_abs_mean"] == pytest.approx(adv.abs().mean().item())


SEQUENCE_LEVEL = sorted(n for n, fn in ADVANTAGE_ESTIMATORS.items() if not getattr(fn, "token_level", False))


@pytest.mark.parametrize("name", SEQUENCE_LEVEL)
def test_an_all_equal_group_gets_zero_under_every_estimator_except_batch_whitening(name):
    rewards = torch.tensor(REWARDS, dtype=torch.float64)
    adv, stats = group_advantages(rewards, 4, estimator=name, lengths=torch.tensor(LENGTHS, dtype=torch.float64))
    assert stats["frac_reward_zero_std"] == pytest.approx(1 / 3)
    if name == "reinforce_pp_baseline":  # whitening shifts every centred value by the batch mean (0 here)
        assert adv[8:].abs().max().item() < 1e-12
    else:
        assert adv[8:].tolist() == [0.0] * 4
    everything_equal, _ = group_advantages(torch.full((8,), 3.0), 4, estimator=name, lengths=torch.ones(8))
    assert everything_equal.tolist() == [0.0] * 8


@pytest.mark.parametrize("name", sorted(REFERENCES))
def test_nan_rewards_are_left_out_of_the_statistics_and_get_zero(name):
    """A ragged group (one reward not applicable) equals the same group without that completion."""
    rewards = torch.tensor([1.0, float("nan"), 0.0, 4.0, 2.0, 0.0], dtype=torch.float64)
    lengths = torch.tensor([2.0, 9.0, 1.0, 3.0, 5.0, 7.0], dtype=torch.float64)
    adv, _ = group_advantages(rewards, 3, estimator=name, lengths=lengths)
    assert adv[1].item() == 0.0 and torch.isfinite(adv).all()
    if name in ("grpo", "reinforce_pp_baseline"):
        return  # their statistics span groups of unequal size (std / batch whitening); checked by the next case
    kept = [0, 2]
    first = REFERENCES[name]([1.0, 0.0], 2, [2.0, 1.0])
    assert adv[kept].tolist() == pytest.approx(first, rel=1e-12)


def test_rloo_is_an_unbiased_policy_gradient_on_a_bandit():
    """Softmax bandit, 3 arms, G = 2 samples: the expectation over every ordered sample pair of
    (1/G) sum_i A_i grad log pi(a_i) with RLOO's advantages equals the exact gradient of E[r],
    grad_theta sum_a pi(a) r(a) = pi * (r - pi . r) -- with no baseline bias."""
    theta = torch.tensor([0.3, -0.2, 0.9], dtype=torch.float64, requires_grad=True)
    reward = torch.tensor([1.0, 0.0, 2.5], dtype=torch.float64)
    pi = torch.softmax(theta, 0)
    exact = (pi * (reward - (pi * reward).sum())).detach()
    expected = torch.zeros(3, dtype=torch.float64)
    for pair in itertools.product(range(3), repeat=2):
        prob = pi[list(pair)].prod().detach()
        adv = ADVANTAGE_ESTIMATORS["rloo"](reward[list(pair)], 2)
        surrogate = (adv * torch.log_softmax(theta, 0)[list(pair)]).mean()
        (grad,) = torch.autograd.grad(surrogate, theta)
        expected += prob * grad
    assert torch.allclose(expected, exact, rtol=1e-12, atol=1e-14)


def test_a_new_estimator_is_one_function_and_one_registration(tmp_path):
    def median_baseline(rewards, group_size, *, scale_rewards="group", eps=1e-4, lengths=None):
        grouped = rewards.view(-1, group_size)
        return (grouped - grouped.median(-1, keepdim=True).values).view(-1)

    register_estimator("test_median", median_baseline)
    try:
        cfg = GRPOConfig(output_dir=str(tmp_path), advantage_estimator="test_median")
        adv, _ = group_advantages(torch.tensor([1.0, 2.0, 7.0]), 3, estimator=cfg.advantage_estimator)
        assert adv.tolist() == [-1.0, 0.0, 5.0]
        with pytest.raises(ValueError, match="already registered"):
            register_estimator("test_median", median_baseline)
    finally:
        del ADVANTAGE_ESTIMATORS["test_median"]
    with pytest.raises(ConfigError, match="advantage_estimator='test_median' is not allowed"):
        GRPOConfig(output_dir=str(tmp_path), advantage_estimator="test_median")


def test_a_new_loss_is_one_term_and_one_registration(tmp_path):
    def linear_term(ratio, logps, adv, opts, prepared):  # REINFORCE with the ratio: -r A
        return -ratio * adv

    register_loss("test_linear", linear_term, "token_mean")
    try:
        cfg = GRPOConfig(output_dir=str(tmp_path), loss_type="test_linear")
        logps = torch.tensor([[-1.0, -2.0], [-0.5, 0.0]], dtype=torch.float64)
        mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]], dtype=torch.float64)
        loss, _ = policy_loss(logps, logps, torch.tensor([1.0, -2.0], dtype=torch.float64), mask,
                              loss_type=cfg.loss_type, options=LossOptions.from_config(cfg))
        assert loss.item() == pytest.approx((-1 - 1 + 2) / 3)
    finally:
        del LOSSES["test_linear"]


def test_options_built_once_equal_keyword_arguments():
    torch.manual_seed(0)
    logps, old = torch.randn(3, 5, dtype=torch.float64), torch.randn(3, 5, dtype=torch.float64)
    mask, adv = (torch.rand(3, 5) > 0.3).double(), torch.randn(3, dtype=torch.float64)
    opts = LossOptions(epsilon_low=0.1, epsilon_high=0.3, delta=2.0, vespo_k_pos=1.5)
    for loss_type in LOSSES:
        a, _ = policy_loss(logps, old, adv, mask, loss_type=loss_type, options=opts)
        b, _ = policy_loss(logps, old, adv, mask, loss_type=loss_type, epsilon_low=0.1, epsilon_high=0.3, delta=2.0,
                           vespo={"k_pos": 1.5})
        assert a.item() == b.item()
    with pytest.raises(TypeError, match="unknown loss options"):
        policy_loss(logps, old, adv, mask, epsilon=0.2)


def ref_reinforce_pp(rewards, mask, kl, beta, eps=1e-4):
    """REINFORCE++ element by element: r_t = -beta KL_t, + R at the last token; G_t = sum_{s>=t} r_s; whiten
    over every completion token of rows with a reward."""
    returns, valid = [], []
    for r, m, k in zip(rewards, mask, kl):
        length = int(sum(m))
        token_rewards = [-beta * k[t] if t < length else 0.0 for t in range(len(m))]
        if length and not math.isnan(r):
            token_rewards[length - 1] += r
        returns.append([sum(token_rewards[t:length]) if t < length else 0.0 for t in range(len(m))])
        valid.append([t < length and not math.isnan(r) for t in range(len(m))])
    values = [g for row, ok in zip(returns, valid) for g, v in zip(row, ok) if v]
    mean = sum(values) / len(values)
    std = math.sqrt(sum((g - mean) ** 2 for g in values) / (len(values) - 1))
    return [[(g - mean) / (std + eps) if v else 0.0 for g, v in zip(row, ok)] for row, ok in zip(returns, valid)]


def test_reinforce_pp_matches_its_token_level_float64_reference():
    rewards = torch.tensor([1.0, 0.0, float("nan"), 2.0, 0.5, 0.5], dtype=torch.float64)
    lengths = [3, 1, 2, 0, 4, 2]
    mask = torch.tensor([[1.0] * n + [0.0] * (4 - n) for n in lengths], dtype=torch.float64)
    kl = torch.randn(6, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0)) * mask
    adv, stats = group_advantages(rewards, 2, estimator="reinforce_pp", mask=mask, token_kl=kl, beta=0.1)
    expected = ref_reinforce_pp(rewards.tolist(), mask.tolist(), kl.tolist(), 0.1)
    assert adv.shape == (6, 4) and adv.tolist() == [pytest.approx(row, rel=1e-12, abs=1e-12) for row in expected]
    assert adv[2].abs().sum() == 0 and adv[3].abs().sum() == 0  # no reward, no tokens
    no_kl, _ = group_advantages(rewards, 2, estimator="reinforce_pp", mask=mask)
    assert no_kl.tolist() == [pytest.approx(r, abs=1e-12) for r in ref_reinforce_pp(rewards.tolist(), mask.tolist(),
                                                                                 kl.tolist(), 0.0)]
    with pytest.raises(ValueError, match="needs the completions' mask"):
        group_advantages(rewards, 2, estimator="reinforce_pp")


def test_grpo_with_reinforce_pp_trains_on_token_advantages_with_the_kl_in_the_reward(tmp_path,
                                                                                 shipped_policy_dir):
    from rlft import GRPOTrainer
    from tests.helpers import addition_rows, correct_answer, tiny_grpo_config

    cfg = tiny_grpo_config(tmp_path, advantage_estimator="reinforce_pp", beta=0.05, max_steps=2,
                           max_completion_length=12)
    trainer = GRPOTrainer(str(shipped_policy_dir), [correct_answer], cfg, addition_rows(16))
    assert not trainer.kl_in_loss and trainer.loss_options.beta == 0.0
    batch = trainer._make_rollout(0)
    mask = batch.rollout.loss_mask
    assert batch.advantages.shape == mask.shape and (batch.advantages * (1 - mask)).abs().sum() == 0
    assert batch.ref_logps is None  # the KL went into the returns, not the loss
    assert isinstance(batch.samples[0]["advantage"], float)
    trainer.train()
    rows = [r for r in trainer.state.log_history if "loss" in r]
    assert len(rows) == 2 and all(math.isfinite(r["loss"]) for r in rows)
    with pytest.raises(ConfigError, match="reinforce_pp whitens token-level returns"):
        GRPOConfig(output_dir=str(tmp_path), advantage_estimator="reinforce_pp",
                   multi_objective_aggregation="normalize_then_sum")


def test_reinforce_pp_puts_the_outcome_on_the_last_trained_token_when_tool_output_leaves_holes():
    """A tool loop's loss mask has holes (tool output is not trained): the outcome goes on the last token the
    policy generated, not on position (count - 1)."""
    rewards = torch.tensor([1.0, 0.0], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0, 0, 1, 1, 0], [1, 1, 1, 0, 0, 0, 0]], dtype=torch.float64)
    adv, _ = group_advantages(rewards, 2, estimator="reinforce_pp", mask=mask)
    # returns: row 0 gets 1 on every trained token up to its last (positions 0, 1, 4, 5), row 1 gets 0
    returns = torch.tensor([[1, 1, 0, 0, 1, 1, 0], [0, 0, 0, 0, 0, 0, 0]], dtype=torch.float64)
    valid = mask.bool()
    expected = torch.where(valid, (returns - returns[valid].mean()) / (returns[valid].std() + 1e-4), 0.0)
    assert torch.allclose(adv, expected, atol=1e-12)
