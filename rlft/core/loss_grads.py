"""dL/dlog pi(o_it) of the token-separable GRPO-family losses in closed form (rlft/core/losses.py),
so that a trainable LM head can form its gradients while a tile's logits are still there without
running the loss's own code, and autograd, once per tile (rlft/core/fused_head.py).

Notation as in rlft/core/losses.py: log-prob x = log pi(o_it), r = exp(x - log pi_old(o_it)), advantage
A, per-token term l(r), KL estimate k(x) against log pi_ref, beta. The step loss is

    L = sum_it w_it (q_it l(r_it) + beta k_it(x)),      k_it = KL_it, or KL_it r_it (kl_importance_weighted)

with w_it the aggregation's weight of token t of completion i (m_it / (N |o_i|) for sequence_mean,
m_it / T for token_mean, m_it / (N L_max) for constant, m_it / N for sequence_sum) and q_it the constant
factors of the policy term (the sampling correction's weight, an off-policy keep). Since dr/dx = r,

    dL/dx = w q dl/dx + beta w dk/dx,     with, per term:
    clip  (PPO, Schulman et al. 2017, arXiv:1707.06347; GRPO, arXiv:2402.03300), l = -min(u A, c A),
          u = r (INTELLECT-2's cap: min(r, delta), arXiv:2505.07291), c = clip(r, 1 - eps_low, 1 + eps_high):
          dl/dx = -A (a du/dx + b dc/dx), du/dx = r [r <= delta],
          dc/dx = r [1 - eps_low <= r <= 1 + eps_high],
          (a, b) = (1, 0) where u A < c A, (0, 1) where c A < u A, (1/2, 1/2) at a tie (autograd's
          convention for an elementwise min; on-policy r = 1 is one: both branches give r there);
    cispo (MiniMax-M1, arXiv:2506.13585), l = -sg[min(r, 1 + eps_high)] A x:  dl/dx = -min(r, 1 + eps_high) A;
    sapo  (arXiv:2511.20347), l = -(4 / tau) sigmoid(tau (r - 1)) A:  dl/dx = -4 s (1 - s) r A,
          s = sigmoid(tau (r - 1));
    KL (Schulman, "Approximating KL divergence", 2020), d = log pi_ref - x: dk1/dx = 1, dk2/dx = -d,
          dk3/dx = 1 - e^d; with kl_importance_weighted d(KL r)/dx = KL' r + KL r.

`TokenLossGrad` holds the per-token constants (any shape, one entry per token) and evaluates dL/dx at
given log-probs; `token_loss_grad` builds it from `policy_loss`'s own arguments, for the losses whose
terms have a closed form here (`CLOSED_FORMS`); others (a `prepare` step, a sequence-level ratio) have
none. Tested against autograd of `policy_loss` in float64 (tests/test_loss_grads.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields, replace

import torch

from rlft.core.losses import LOSSES, sapo_temperature


def clip_grad(ratio: torch.Tensor, adv: torch.Tensor, opts) -> torch.Tensor:
    """d(-min(u A, c A))/dx for the clipped surrogate (module docstring)."""
    high = 1 + opts.eps_high
    clipped = torch.clamp(ratio, 1 - opts.epsilon_low, high)
    unclipped = ratio if opts.delta is None else torch.clamp(ratio, max=opts.delta)
    d_unclipped = ratio if opts.delta is None else ratio * (ratio <= opts.delta)
    d_clipped = ratio * ((ratio >= 1 - opts.epsilon_low) & (ratio <= high))
    a, c = unclipped * adv, clipped * adv
    take_u = (a < c).to(ratio.dtype) + 0.5 * (a == c)
    return -adv * (take_u * d_unclipped + (1 - take_u) * d_clipped)


def cispo_grad(ratio: torch.Tensor, adv: torch.Tensor, opts) -> torch.Tensor:
    return -torch.clamp(ratio, max=1 + opts.eps_high) * adv


def sapo_grad(ratio: torch.Tensor, adv: torch.Tensor, opts) -> torch.Tensor:
    tau = sapo_temperature(adv, opts)
    s = torch.sigmoid(tau * (ratio - 1))
    return -4.0 * s * (1 - s) * ratio * adv


def kl_and_grad(logps: torch.Tensor, ref_logps: torch.Tensor,
                estimator: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(KL estimate, its derivative in the log-prob) per token (module docstring)."""
    d = ref_logps - logps
    if estimator == "k1":
        return -d, torch.ones_like(d)
    if estimator == "k2":
        return 0.5 * d**2, -d
    return torch.exp(d) - d - 1, 1 - torch.exp(d)


# the loss_types whose per-token term has a closed-form derivative (by their registered term's name)
CLOSED_FORMS: dict[str, Callable] = {"_clip_term": clip_grad, "_cispo_term": cispo_grad,
                                     "_sapo_term": sapo_grad}


@dataclass(frozen=True)
class TokenLossGrad:
    """Per-token constants of a token-separable loss -- all of one shape, one entry per token --
    and dL/dx from them (`__call__`). `old`: log pi_old, None where the log-probs themselves stand for
    it (on-policy: r = 1). `policy_weight`: w q; `kl_weight`: beta w (None without a KL term)."""

    term_grad: Callable
    opts: object
    adv: torch.Tensor
    policy_weight: torch.Tensor
    old: torch.Tensor | None = None
    kl_weight: torch.Tensor | None = None
    ref: torch.Tensor | None = None

    def select(self, index: Callable[[torch.Tensor], torch.Tensor]) -> TokenLossGrad:
        """The same constants at other positions: `index` applied to each tensor (a mask, a packing's
        rows and columns, a tile's slice)."""
        tensors = {f.name: index(getattr(self, f.name)) for f in fields(self)
                   if isinstance(getattr(self, f.name), torch.Tensor)}
        return replace(self, **tensors)

    def __call__(self, logps: torch.Tensor) -> torch.Tensor:
        """dL/dlog p at `logps` (the constants' shape), in logps' dtype."""
        dtype = logps.dtype
        log_ratio = torch.zeros_like(logps) if self.old is None else logps - self.old.to(dtype)
        ratio = torch.exp(log_ratio)
        grad = self.term_grad(ratio, self.adv.to(dtype), self.opts) * self.policy_weight.to(dtype)
        if self.kl_weight is not None:
            kl, d_kl = kl_and_grad(logps, self.ref.to(dtype), self.opts.kl_estimator)
            if self.opts.kl_importance_weighted:
                d_kl = (d_kl + kl) * ratio
            grad = grad + self.kl_weight.to(dtype) * d_kl
        return grad


def aggregation_weights(aggregation: str, mask: torch.Tensor, n_seq, n_tok, max_len) -> torch.Tensor:
    """w [B, L]: each token's weight in the step loss under an aggregation of rlft/core/losses.py."""
    if aggregation == "sequence_mean":
        return mask / (mask.sum(-1, keepdim=True).clamp(min=1) * n_seq)
    if aggregation == "token_mean":
        return mask / n_tok
    if aggregation == "constant":
        return mask / (n_seq * max_len)
    if aggregation == "sequence_sum":
        return mask / n_seq
    raise ValueError(f"aggregation={aggregation!r} has no per-token weight")


def has_closed_form(loss_type: str, options) -> bool:
    """Whether `token_loss_grad` gives the closed form of this loss (module docstring)."""
    spec = LOSSES[loss_type]
    return spec.term.__name__ in CLOSED_FORMS and spec.prepare is None \
        and options.importance_sampling_level == "token"


def token_loss_grad(old_logps: torch.Tensor | None, advantages: torch.Tensor, completion_mask: torch.Tensor,
                    *, loss_type: str, options, ref_logps: torch.Tensor | None = None,
                    num_items=None, num_sequences=None, rollout_is_weights: torch.Tensor | None = None,
                    keep: torch.Tensor | None = None) -> TokenLossGrad | None:
    """The closed form of `policy_loss`'s dL/dlog p for the same arguments (old_logps None: the
    log-probs themselves), every constant [B, L]; None where the loss has none (a prepared or
    sequence-level loss)."""
    if not has_closed_form(loss_type, options):
        return None
    spec = LOSSES[loss_type]
    term_grad = CLOSED_FORMS[spec.term.__name__]
    # the constants in float64 whatever the model's dtype (a few per token): rounded once, when read
    mask = completion_mask.to(torch.float64)
    shape = mask.shape
    adv = advantages[:, None] if advantages.ndim == 1 else advantages
    n_tok = mask.sum().clamp(min=1) if num_items is None else num_items
    n_seq = shape[0] if num_sequences is None else num_sequences
    max_len = shape[1] if options.max_completion_length is None else options.max_completion_length
    w = aggregation_weights(spec.aggregation, mask, n_seq, n_tok, max_len)
    q = w
    if rollout_is_weights is not None and not spec.folds_sampling_weights:
        q = q * rollout_is_weights.to(w.dtype)
    if keep is not None:
        q = q * keep.to(w.dtype)
    kl = options.beta * w if options.beta > 0 else None
    return TokenLossGrad(term_grad, options, adv.to(w.dtype).expand(shape), q.expand(shape),
                         None if old_logps is None else old_logps.expand(shape), kl,
                         None if kl is None else ref_logps.expand(shape))


class ClosedFormGrad:
    """A loss's dL/dlog p as a function of log-probs [b, c] (Score.loss_grad, rlft/model/scoring.py)
    that has a closed form: `build(c)` gives its `TokenLossGrad` for c columns, which the scorer
    reads at the positions it scores, a tile's rows at a time."""

    def __init__(self, build: Callable[[int], TokenLossGrad]):
        self.build = build

    def __call__(self, logps: torch.Tensor) -> torch.Tensor:
        return self.build(logps.shape[1])(logps)
