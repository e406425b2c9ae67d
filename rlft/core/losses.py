"""Policy losses for GRPO and its variants: per-token terms, KL estimators, aggregation.

Notation: completion i of N in the optimiser step, token t, mask m_it, |o_i| = sum_t m_it,
r_it = pi(o_it) / pi_old(o_it), advantage A_i, per-token term l_it.

Per-token terms
    clip  (PPO/GRPO):  l = -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)
    cispo (MiniMax-M1, arXiv:2506.13585): l = -sg[min(r, 1 + eps_high)] A log pi(o_it)
    sapo  (arXiv:2511.20347): l = -(4 / tau) sigmoid(tau (r - 1)) A, tau = tau_pos if A > 0 else tau_neg
    + beta * KL_it (when beta > 0), added per token BEFORE aggregation, so the KL term is
      normalised exactly like the policy term. With kl_importance_weighted, KL_it is multiplied by the
      importance ratio r_it (with its gradient): the samples come from pi_old, so r_it * KL_it is the
      importance-sampled estimate of KL(pi_theta || pi_ref) (TRL's `use_bias_correction_kl`; the KL
      "unbiased KL estimate" of the DeepSeek-V3.2 report, arXiv:2512.02556).

Aggregations (the normaliser; N and T are counts over the WHOLE optimiser step: all
gradient-accumulation micro-batches and all processes, passed as num_sequences / num_items)
    sequence_mean  (grpo, sapo; DeepSeekMath arXiv:2402.03300):  (1/N) sum_i (1/|o_i|) sum_t l_it
    token_mean     (dapo, bnpo, cispo; DAPO arXiv:2503.14476):    (1/T) sum_it l_it,  T = sum_i |o_i|
    constant       (dr_grpo; Dr. GRPO arXiv:2503.20783):          (1/(N * L_max)) sum_it l_it

Sequence-level importance sampling (GSPO, arXiv:2507.18071) replaces r_it by
    s_i = exp((1/|o_i|) sum_t (log pi(o_it) - log pi_old(o_it)))   for every t of completion i.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def kl_penalty(logps: torch.Tensor, ref_logps: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi (Schulman, "Approximating KL
    divergence", 2020). With d = log pi_ref(o_t) - log pi(o_t):

        k1 = -d           (unbiased, high variance, can be negative)
        k2 = d^2 / 2      (biased, low variance)
        k3 = exp(d) - d - 1   (unbiased, low variance, always >= 0; DeepSeekMath's choice)

    Shapes: [B, L] -> [B, L].
    """
    d = ref_logps - logps
    if estimator == "k1":
        return -d
    if estimator == "k2":
        return 0.5 * d**2
    if estimator == "k3":
        return torch.exp(d) - d - 1
    raise ValueError(f"estimator={estimator!r}: choose 'k1', 'k2' or 'k3'")


def _clip_term(ratio, logps, adv, ctx) -> torch.Tensor:
    clipped = torch.clamp(ratio, 1 - ctx["epsilon_low"], 1 + ctx["epsilon_high"])
    return -torch.min(ratio * adv, clipped * adv)


def _cispo_term(ratio, logps, adv, ctx) -> torch.Tensor:
    weight = torch.clamp(ratio, max=1 + ctx["epsilon_high"]).detach()
    return -weight * adv * logps


def _sapo_term(ratio, logps, adv, ctx) -> torch.Tensor:
    tau = torch.where(adv > 0, ctx["sapo_temperature_pos"], ctx["sapo_temperature_neg"])
    return -(4.0 / tau) * torch.sigmoid(tau * (ratio - 1)) * adv


def _sequence_mean(per_token, mask, n_seq, n_tok, max_len) -> torch.Tensor:
    per_sequence = (per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1)  # [B]
    return per_sequence.sum() / n_seq


def _token_mean(per_token, mask, n_seq, n_tok, max_len) -> torch.Tensor:
    return (per_token * mask).sum() / n_tok


def _constant(per_token, mask, n_seq, n_tok, max_len) -> torch.Tensor:
    return (per_token * mask).sum() / (n_seq * max_len)


# loss_type -> (per-token term, aggregation). A new variant is one line here (+ its term).
LOSS_TYPES: dict[str, tuple[Callable, Callable]] = {
    "grpo": (_clip_term, _sequence_mean),
    "bnpo": (_clip_term, _token_mean),
    "dapo": (_clip_term, _token_mean),
    "dr_grpo": (_clip_term, _constant),
    "cispo": (_cispo_term, _token_mean),
    "sapo": (_sapo_term, _sequence_mean),
}


def policy_loss(
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    advantages: torch.Tensor,
    completion_mask: torch.Tensor,
    *,
    loss_type: str = "dapo",
    epsilon_low: float = 0.2,
    epsilon_high: float | None = None,
    ref_logps: torch.Tensor | None = None,
    beta: float = 0.0,
    kl_estimator: str = "k3",
    kl_importance_weighted: bool = False,
    importance_sampling_level: str = "token",
    max_completion_length: int | None = None,
    num_items: float | torch.Tensor | None = None,
    num_sequences: float | torch.Tensor | None = None,
    sapo_temperature_pos: float = 1.0,
    sapo_temperature_neg: float = 1.05,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The GRPO-family loss for one micro-batch, scaled so that micro-batch losses SUM to the step loss.

    logps, old_logps, ref_logps, completion_mask: [B, L]; advantages: [B].
    num_items: completion tokens in the whole optimiser step (default: this micro-batch's count).
    num_sequences: completions in the whole optimiser step (default: B).
    bnpo and dapo are the same aggregation here: with a global num_items, normalising "per
    batch" and "per step" coincide (TRL's bnpo normalises per micro-batch instead).
    rollout_is_weights: [B, L] or [B, 1] importance weights pi_old / pi_sampler for completions sampled by
    another engine (rlft/core/importance.py); they multiply the policy term, not the KL term (TRL's order).
    Returns (loss, metrics) with metrics as detached masked means over this micro-batch.
    """
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type={loss_type!r}: choose one of {sorted(LOSS_TYPES)}")
    if importance_sampling_level not in ("token", "sequence"):
        raise ValueError(f"importance_sampling_level={importance_sampling_level!r}: 'token' or 'sequence'")
    if beta > 0 and ref_logps is None:
        raise ValueError("beta > 0 needs ref_logps (log-probs of the reference policy)")
    term, aggregate = LOSS_TYPES[loss_type]
    mask = completion_mask.to(logps.dtype)  # [B, L]
    log_ratio = logps - old_logps  # [B, L]
    if importance_sampling_level == "sequence":
        log_ratio = ((log_ratio * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1))  # [B, 1]
    ratio = torch.exp(log_ratio)  # [B, L] or [B, 1]
    adv = advantages.to(logps.dtype)[:, None]  # [B, 1]
    eps_high = epsilon_low if epsilon_high is None else epsilon_high
    ctx = {"epsilon_low": epsilon_low, "epsilon_high": eps_high,
           "sapo_temperature_pos": sapo_temperature_pos, "sapo_temperature_neg": sapo_temperature_neg}
    per_token = term(ratio, logps, adv, ctx).expand_as(logps)  # [B, L]
    if rollout_is_weights is not None:
        per_token = per_token * rollout_is_weights.to(logps.dtype)  # [B, L] x [B, L] or [B, 1]
    kl = None
    if beta > 0:
        kl = kl_penalty(logps, ref_logps, kl_estimator)  # [B, L]
        if kl_importance_weighted:
            kl = kl * ratio  # [B, L]; ratio is [B, L] or [B, 1] (sequence level)
        per_token = per_token + beta * kl
    n_tok = mask.sum().clamp(min=1) if num_items is None else num_items
    n_seq = logps.shape[0] if num_sequences is None else num_sequences
    max_len = logps.shape[1] if max_completion_length is None else max_completion_length
    loss = aggregate(per_token, mask, n_seq, n_tok, max_len)
    metrics = _metrics(ratio.expand_as(logps).detach(), adv, mask, ctx, kl)
    if kl is not None:  # the KL share of `loss`, aggregated the same way (policy part = loss - kl_loss)
        metrics["kl_loss"] = aggregate(beta * kl.detach(), mask, n_seq, n_tok, max_len)
    return loss, metrics


@torch.no_grad()
def _metrics(ratio, adv, mask, ctx, kl) -> dict[str, torch.Tensor]:
    tokens = mask.sum().clamp(min=1)
    low = ((ratio < 1 - ctx["epsilon_low"]) & (adv < 0)).to(mask.dtype)
    high = ((ratio > 1 + ctx["epsilon_high"]) & (adv > 0)).to(mask.dtype)
    metrics = {
        "clip_ratio/low_mean": (low * mask).sum() / tokens,
        "clip_ratio/high_mean": (high * mask).sum() / tokens,
        "clip_ratio/region_mean": (((low + high) > 0).to(mask.dtype) * mask).sum() / tokens,
        "ratio_mean": (ratio * mask).sum() / tokens,
    }
    if kl is not None:
        metrics["kl"] = (kl.detach() * mask).sum() / tokens
    return metrics
