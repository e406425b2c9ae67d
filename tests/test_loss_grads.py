"""The closed-form dL/dlog p of the token-separable GRPO-family losses (rlft/core/loss_grads.py) against
float64 autograd of the loss itself (rlft/core/losses.py: policy_loss), over every option that keeps the
loss token-separable; the losses without a closed form say so."""

from __future__ import annotations

import pytest
import torch

from rlft.core.loss_grads import ClosedFormGrad, token_loss_grad
from rlft.core.losses import LossOptions, policy_loss

B, L = 5, 7


def batch(seed: int, per_token_advantages: bool = False):
    g = torch.Generator().manual_seed(seed)
    logps = -torch.rand(B, L, generator=g, dtype=torch.float64) * 3
    # log-ratios up to +-0.5: inside the clip range, beyond it on both sides, past delta
    old = logps + (torch.rand(B, L, generator=g, dtype=torch.float64) - 0.5)
    adv = torch.randn((B, L) if per_token_advantages else (B,), generator=g, dtype=torch.float64)
    mask = (torch.rand(B, L, generator=g) > 0.2).double()
    mask[0] = 0  # a completion without trained tokens
    ref = logps + 0.3 * torch.randn(B, L, generator=g, dtype=torch.float64)
    weights = torch.rand(B, L, generator=g, dtype=torch.float64) * 2
    keep = (torch.rand(B, 1, generator=g) > 0.3).double()
    return logps, old, adv, mask, ref, weights, keep


def autograd_of_the_loss(logps, old, adv, mask, **kwargs):
    x = logps.clone().requires_grad_()
    loss, _ = policy_loss(x, x.detach() if old is None else old, adv, mask, with_metrics=False, **kwargs)
    (grad,) = torch.autograd.grad(loss, x)
    return grad


CASES = [
    ("grpo", {}), ("dapo", {"epsilon_high": 0.28}), ("bnpo", {"delta": 1.3}),
    ("dr_grpo", {"max_completion_length": 12}), ("dr_grpo", {}), ("cispo", {"epsilon_high": 0.25}),
    ("sapo", {}), ("luspo", {}), ("grpo", {"beta": 0.04}), ("dapo", {"beta": 0.1, "kl_estimator": "k1"}),
    ("grpo", {"beta": 0.1, "kl_estimator": "k2", "kl_importance_weighted": True}),
    ("sapo", {"beta": 0.2, "kl_importance_weighted": True, "sapo_temperature_neg": 2.0}),
]


@pytest.mark.parametrize("loss_type, options", CASES, ids=[f"{n}-{'-'.join(o) or 'plain'}" for n, o in CASES])
@pytest.mark.parametrize("on_policy", [False, True], ids=["off-policy", "on-policy"])
def test_the_closed_form_equals_autograd_of_the_loss_in_float64(loss_type, options, on_policy):
    """Random ratios (clipped low and high, capped, inside), normalisers of a whole step, sampling weights and
    an off-policy keep; on-policy (old = the log-probs themselves: r = 1, a tie of the clip's two branches)."""
    logps, old, adv, mask, ref, weights, keep = batch(0)
    opts = LossOptions.of(**options)
    old = None if on_policy else old
    kwargs = dict(loss_type=loss_type, options=opts, ref_logps=ref, num_items=40.0, num_sequences=9.0,
                  rollout_is_weights=weights, keep=keep)
    want = autograd_of_the_loss(logps, old, adv, mask, **kwargs)
    closed = token_loss_grad(old, adv, mask, **kwargs)
    got = closed(logps)
    assert want.abs().max() > 1e-3  # something to compare
    torch.testing.assert_close(got, want, rtol=0, atol=1e-14)
    # read at the scored positions only (the scorer's order), a slice at a time
    scored = mask.bool()
    at = closed.select(lambda t: t[scored])
    torch.testing.assert_close(at.select(lambda t: t[3:9])(logps[scored][3:9]), want[scored][3:9], rtol=0, atol=1e-14)


def test_per_token_advantages_and_default_normalisers():
    """REINFORCE++'s advantages per token; the micro-batch's own token and sequence counts."""
    logps, old, adv, mask, ref, _, _ = batch(1, per_token_advantages=True)
    for loss_type in ("grpo", "dapo", "dr_grpo"):
        kwargs = dict(loss_type=loss_type, options=LossOptions.of(beta=0.05), ref_logps=ref)
        want = autograd_of_the_loss(logps, old, adv, mask, **kwargs)
        torch.testing.assert_close(token_loss_grad(old, adv, mask, **kwargs)(logps), want, rtol=0, atol=1e-14)


def test_a_closed_form_grad_reads_its_width_from_the_log_probs():
    """`ClosedFormGrad` builds the constants for the scorer's width (Dr. GRPO's constant normaliser is the
    width when max_completion_length is unset)."""
    logps, old, adv, mask, _, _, _ = batch(2)
    opts = LossOptions.of()
    closed = ClosedFormGrad(lambda width: token_loss_grad(old[:, :width], adv, mask[:, :width],
                                                          loss_type="dr_grpo", options=opts))
    want = autograd_of_the_loss(logps[:, :5], old[:, :5], adv, mask[:, :5], loss_type="dr_grpo", options=opts)
    torch.testing.assert_close(closed(logps[:, :5]), want, rtol=0, atol=1e-14)


@pytest.mark.parametrize("loss_type, options", [("rloo", {}), ("vespo", {}),
                                                ("luspo", {"importance_sampling_level": "sequence"}),
                                                ("grpo", {"importance_sampling_level": "sequence"})])
def test_losses_that_are_not_token_separable_have_no_closed_form(loss_type, options):
    logps, old, adv, mask, _, _, _ = batch(3)
    assert token_loss_grad(old, adv, mask, loss_type=loss_type, options=LossOptions.of(**options)) is None
