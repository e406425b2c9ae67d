"""A trainable LM head's gradients formed in the forward from the loss's predicted dL/dlog p
(rlft/core/fused_head.py, rlft/train/update/updater.py): the same GRPO step as the recomputing backward, for the
token-separable losses; the others keep the recomputing backward."""

from __future__ import annotations

import warnings

import pytest
import torch

from rlft.core import fused_head, loss_grads
from rlft.train.update.objectives import PolicyObjective
from tests import test_microbatches
from tests.dist.grpo_step import off_policy
from tests.test_microbatches import one_step


class Fusion:
    """Counts the forwards whose head gradients came from a prediction, the backwards that used them, and the
    tiles whose prediction was the loss's closed form (rlft/core/loss_grads.py)."""

    def __init__(self, monkeypatch):
        self.formed = self.used = self.closed = 0
        closed_call = loss_grads.TokenLossGrad.__call__

        def counted_call(grad, logps):
            self.closed += 1
            return closed_call(grad, logps)

        monkeypatch.setattr(loss_grads.TokenLossGrad, "__call__", counted_call)
        init, result = fused_head.FusedLoss.__init__, fused_head.FusedLoss.result

        def counted_init(fused, *args):
            self.formed += 1
            init(fused, *args)

        def counted_result(fused, actual):
            grads = result(fused, actual)
            self.used += grads is not None
            return grads

        monkeypatch.setattr(fused_head.FusedLoss, "__init__", counted_init)
        monkeypatch.setattr(fused_head.FusedLoss, "result", counted_result)


@pytest.mark.parametrize("overrides", [
    dict(loss_type="grpo"), dict(loss_type="dapo", beta=0.04, padding_free=True),
    dict(loss_type="dr_grpo", num_iterations=2), dict(loss_type="cispo", top_p=0.8),
    dict(loss_type="sapo", beta=0.04, use_bias_correction_kl=True, padding_free=True),
    dict(loss_type="bnpo", delta=1.1, advantage_estimator="reinforce_pp")])
def test_the_fused_step_is_the_recomputing_step(tmp_path, tiny_causal_dir, monkeypatch, overrides):
    """Full fine-tuning (the head trains), 8 micro-batches of 2 rows: each micro-batch's loss arrives
    scaled by the accumulation, so the backward scales the forward's gradients."""
    fusion = Fusion(monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback: every prediction was the loss's gradient
        fused, fused_metrics, _, _ = one_step(tiny_causal_dir, tmp_path / "fused", 2, 8, **overrides)
    assert fusion.formed == fusion.used == 8
    assert fusion.closed >= 8  # each tile's prediction was the closed form, not the loss's code under autograd
    monkeypatch.setattr(PolicyObjective, "_token_separable", lambda self, u, batch: False)
    plain, plain_metrics, _, _ = one_step(tiny_causal_dir, tmp_path / "plain", 2, 8, **overrides)
    assert fusion.formed == 8  # the recomputing step formed nothing in its forwards
    for name, param in fused.items():
        torch.testing.assert_close(param, plain[name], atol=2e-6, rtol=0, msg=name)
    assert fused_metrics["loss"] == pytest.approx(plain_metrics["loss"], abs=1e-7)


@pytest.mark.parametrize("overrides", [
    dict(loss_type="grpo", importance_sampling_level="sequence"), dict(loss_type="vespo"),
    dict(off_policy_mask_threshold=0.02), dict(entropy_coef=0.05)])
def test_losses_that_are_not_token_separable_keep_the_recomputing_backward(tmp_path, tiny_causal_dir,
                                                                           monkeypatch, overrides):
    fusion = Fusion(monkeypatch)
    one_step(tiny_causal_dir, tmp_path, 2, 8, **overrides)
    assert fusion.formed == 0



@pytest.mark.parametrize("with_old", [True, False], ids=["pi_old", "no pi_old"])
def test_sampling_weights_take_the_closed_form_only_where_they_are_constants(tmp_path, tiny_causal_dir,
                                                                             monkeypatch, with_old):
    """Completions another engine sampled, weighted per token (token_truncate). With pi_old the weights are
    constants and the closed form predicts; without it each token's weight reads its own log-prob, so the
    loss's own code predicts under autograd. Either way the step is the recomputing step."""
    def sampled_elsewhere(trainer, batch):
        off_policy(trainer, batch)
        mask = batch.rollout.completion_mask
        batch.rollout.sampling_logps = (batch.old_logps + 0.2 * torch.cos(torch.arange(mask.numel()).view_as(
            mask).to(batch.old_logps.dtype))) * mask
        if not with_old:
            batch.old_logps = None

    monkeypatch.setattr(test_microbatches, "off_policy", sampled_elsewhere)
    overrides = dict(loss_type="dapo", beta=0.04, vllm_importance_sampling_mode="token_truncate",
                     vllm_importance_sampling_cap=1.1)
    fusion = Fusion(monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fused, fused_metrics, _, _ = one_step(tiny_causal_dir, tmp_path / "fused", 2, 8, **overrides)
    assert fusion.formed == fusion.used == 8 and (fusion.closed >= 8 if with_old else fusion.closed == 0)
    monkeypatch.setattr(PolicyObjective, "_token_separable", lambda self, u, batch: False)
    plain, plain_metrics, _, _ = one_step(tiny_causal_dir, tmp_path / "plain", 2, 8, **overrides)
    for name, param in fused.items():
        torch.testing.assert_close(param, plain[name], atol=2e-6, rtol=0, msg=name)
    assert fused_metrics["loss"] == pytest.approx(plain_metrics["loss"], abs=1e-7)
