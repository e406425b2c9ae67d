"""Policy losses for GRPO and its variants: per-token terms, KL estimators, aggregation.

Notation: completion i of N in the optimiser step, token t, mask m_it, |o_i| = sum_t m_it,
r_it = pi(o_it) / pi_old(o_it), advantage A_i, per-token term l_it.

Per-token terms
    clip  (PPO/GRPO):  l = -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)
    cispo (MiniMax-M1, arXiv:2506.13585): l = -sg[min(r, 1 + eps_high)] A log pi(o_it)
    sapo  (arXiv:2511.20347): l = -(4 / tau) sigmoid(tau (r - 1)) A, tau = tau_pos if A > 0 else
          tau_neg
    rloo  (Ahmadian et al. 2024, arXiv:2402.14740, as TRL 1.16's RLOOTrainer): a sequence-level PPO
          clip on
          rho_i = exp(sum_t (log pi(o_it) - log pi_old(o_it))), l_i = -min(rho_i A_i, clip(rho_i) A_i),
          averaged over sequences (the sequence_mean aggregation of a constant-per-sequence term)
    vespo (arXiv:2602.10693): l = -sg[phi(w_i)] A log pi(o_it), phi(w) = e^lam w^k e^(-lam w)
    (phi(1) = 1),
          w_i = prod_t r_it (times the sampling-correction weights), (k, lam) by the sign of A
          (`vespo_weights`)
    delta (INTELLECT-2, arXiv:2505.07291): the unclipped ratio of the clip term is capped too,
          l = -min(min(r, delta) A, clip(r, 1 - eps_low, 1 + eps_high) A): with A < 0 a huge r is bounded.
    keep  (off-policy sequence masking, DeepSeek-V3.2 arXiv:2512.02556, `off_policy_sequence_mask`):
          the
          policy term of a masked sequence is 0; it still counts in the normaliser.
    + beta * KL_it (when beta > 0), added per token BEFORE aggregation, so the KL term is
      normalised exactly like the policy term. With kl_importance_weighted, KL_it is multiplied by the
      importance ratio r_it (with its gradient): the samples come from pi_old, so r_it * KL_it is the
      importance-sampled estimate of KL(pi_theta || pi_ref) (TRL's `use_bias_correction_kl`; the KL
      "unbiased KL estimate" of the DeepSeek-V3.2 report, arXiv:2512.02556).

Aggregations (the normaliser; N and T are counts over the WHOLE optimiser step: all
gradient-accumulation micro-batches and all processes, passed as num_sequences / num_items)
    sequence_mean  (grpo, sapo; DeepSeekMath arXiv:2402.03300):  (1/N) sum_i (1/|o_i|) sum_t l_it
    token_mean     (dapo, bnpo, cispo; DAPO arXiv:2503.14476):    (1/T) sum_it l_it,  T = sum_i
                   |o_i|
    constant       (dr_grpo; Dr. GRPO arXiv:2503.20783):          (1/(N * L_max)) sum_it l_it
    sequence_sum   (luspo; LUSPO arXiv:2602.05261):               (1/N) sum_i sum_t l_it  (each
                   sequence
                   weighted by its length: GSPO's sequence loss without its length bias)
The mask m_it may be narrower than the completion (top_entropy_quantile keeps the high-entropy
tokens only, `high_entropy_mask`): T and |o_i| then count the kept tokens, as they count completion
tokens.

Sequence-level importance sampling (GSPO, arXiv:2507.18071) replaces r_it by
    s_i = exp((1/|o_i|) sum_t (log pi(o_it) - log pi_old(o_it)))   for every t of completion i.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, fields

import torch

KL_ESTIMATORS = ("k1", "k2", "k3")


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
    raise ValueError(f"estimator={estimator!r}: choose one of {KL_ESTIMATORS}")


def _clip_term(ratio, logps, adv, opts, prepared) -> torch.Tensor:
    clipped = torch.clamp(ratio, 1 - opts.epsilon_low, 1 + opts.eps_high)
    unclipped = ratio if opts.delta is None else torch.clamp(ratio, max=opts.delta)
    return -torch.min(unclipped * adv, clipped * adv)


def _cispo_term(ratio, logps, adv, opts, prepared) -> torch.Tensor:
    weight = torch.clamp(ratio, max=1 + opts.eps_high).detach()
    return -weight * adv * logps


def sapo_temperature(adv: torch.Tensor, opts) -> torch.Tensor:
    """SAPO's tau per token: tau_pos where A > 0, else tau_neg, in the advantages' dtype (python floats in
    torch.where would make it float32 and round a float64 loss)."""
    pos, neg = adv.new_tensor(opts.sapo_temperature_pos), adv.new_tensor(opts.sapo_temperature_neg)
    return torch.where(adv > 0, pos, neg)


def _sapo_term(ratio, logps, adv, opts, prepared) -> torch.Tensor:
    tau = sapo_temperature(adv, opts)
    return -(4.0 / tau) * torch.sigmoid(tau * (ratio - 1)) * adv


def _vespo_term(ratio, logps, adv, opts, prepared) -> torch.Tensor:
    return -prepared["phi"] * adv * logps


def _rloo_prepare(logps, old_logps, mask, adv, rollout_is_weights, opts) -> tuple[dict, dict]:
    """RLOO's sequence ratio rho_i = exp(sum_t m_it (log pi(o_it) - log pi_old(o_it))) -- a SUM of
    log-ratios (TRL 1.16's RLOOTrainer), unlike GSPO's mean -- and its clip metrics, counted per
    sequence."""
    ratio = torch.exp(((logps - old_logps) * mask).sum(-1, keepdim=True))  # [B, 1]
    with torch.no_grad():
        low = ((ratio < 1 - opts.epsilon_low) & (adv < 0)).float()
        high = ((ratio > 1 + opts.eps_high) & (adv > 0)).float()
        metrics = {"clip_ratio/low_mean": low.mean(), "clip_ratio/low_min": low.min(),
                   "clip_ratio/high_mean": high.mean(), "clip_ratio/high_max": high.max(),
                   "clip_ratio/region_mean": ((low + high) > 0).float().mean()}
    return {"ratio": ratio}, metrics


def _rloo_term(ratio, logps, adv, opts, prepared) -> torch.Tensor:
    """-min(rho_i A_i, clip(rho_i, 1 - eps_low, 1 + eps_high) A_i), one value per sequence ([B,
    1])."""
    rho = prepared["ratio"]
    term = -torch.min(rho * adv, torch.clamp(rho, 1 - opts.epsilon_low, 1 + opts.eps_high) * adv)
    # inf * 0 where the summed log-ratio overflows
    return torch.where(adv == 0, torch.zeros_like(term), term)


def _vespo_prepare(logps, old_logps, mask, adv, rollout_is_weights, opts) -> tuple[dict, dict]:
    """VESPO's sequence weight phi, computed before the term (it folds in the sampling-correction
    weights)."""
    phi = vespo_weights(logps - old_logps, mask, adv, rollout_is_weights, opts.vespo_k_pos,
                        opts.vespo_lambda_pos, opts.vespo_k_neg, opts.vespo_lambda_neg)
    return {"phi": phi}, {"vespo/phi_seq_mean": phi.mean()}


def vespo_weights(log_ratio: torch.Tensor, mask: torch.Tensor, advantages: torch.Tensor,
                  rollout_is_weights: torch.Tensor | None = None, k_pos: float = 2.0, lambda_pos: float = 3.0,
                  k_neg: float = 3.0, lambda_neg: float = 2.0) -> torch.Tensor:
    """VESPO's gamma weight phi(w) = exp(lam + k log w - lam w) of the sequence ratio w
    (arXiv:2602.10693).

    log w_i = sum_t m_it clamp(log r_it, -20, 20) + sum_t m_it log(rho_it), clamped to [log 1e-8,
    20], where rho are the sampling-correction weights (pi_old / pi_sampler) when another engine
    sampled. (k, lam) are (k_pos, lambda_pos) for A_i >= 0, else (k_neg, lambda_neg); lam is floored
    at 1e-4. phi(1) = 1, it peaks at w = k / lam and falls smoothly on both sides: a soft trust
    region instead of a hard clip. No gradient: it only scales the REINFORCE term. log_ratio, mask:
    [B, L]; advantages: [B] or [B, 1] -> [B, 1].
    """
    low = math.log(1e-8)
    log_w = (torch.clamp(log_ratio.detach(), -20.0, 20.0) * mask).sum(-1, keepdim=True)  # [B, 1]
    if rollout_is_weights is not None:
        log_rho = torch.clamp(torch.log(rollout_is_weights.detach()), low, 20.0)  # [B, L] or [B, 1]
        log_w = log_w + (log_rho * mask).sum(-1, keepdim=True) if log_rho.shape[-1] > 1 else log_w + log_rho
    log_w = torch.clamp(log_w, low, 20.0)
    positive = _sequence_sign(advantages, mask) >= 0  # [B, 1]
    k = torch.where(positive, k_pos, k_neg).to(log_w.dtype)
    lam = torch.where(positive, lambda_pos, lambda_neg).to(log_w.dtype).clamp(min=1e-4)
    phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w))
    return torch.nan_to_num(phi, nan=0.0, posinf=0.0, neginf=0.0)


def _sequence_sign(advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """A completion's advantage as [B, 1]: itself, or per-token advantages' mean over the
    completion."""
    if advantages.ndim == 2 and advantages.shape[1] > 1:
        return (advantages * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)
    return advantages.reshape(-1, 1)


@torch.no_grad()
def off_policy_sequence_mask(advantages: torch.Tensor, logps: torch.Tensor, sampling_logps: torch.Tensor,
                             mask: torch.Tensor, threshold: float) -> torch.Tensor:
    """DeepSeek-V3.2's off-policy sequence mask (arXiv:2512.02556, eq. 9): keep completion i unless
    its advantage is negative AND its mean per-token KL(pi_sampler || pi_theta) estimate exceeds
    `threshold`:

        keep_i = [A_i >= 0] or [(1/|o_i|) sum_t m_it (log pi_sampler(o_it) - log pi_theta(o_it)) <=
        threshold]

    A token the sampler could not score (NaN) adds no evidence (counted as 0). [B], [B, L] x3 -> [B,
    1] (0/1).
    """
    gap = torch.nan_to_num(sampling_logps - logps.detach(), nan=0.0)  # [B, L]
    # [B, 1]
    mean_gap = (gap * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)
    return ((_sequence_sign(advantages, mask) >= 0) | (mean_gap <= threshold)).to(logps.dtype)


def _sequence_mean(per_token, mask, n_seq, n_tok, max_len) -> torch.Tensor:
    per_sequence = (per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1)  # [B]
    return per_sequence.sum() / n_seq


def _token_mean(per_token, mask, n_seq, n_tok, max_len) -> torch.Tensor:
    return (per_token * mask).sum() / n_tok


def _constant(per_token, mask, n_seq, n_tok, max_len) -> torch.Tensor:
    return (per_token * mask).sum() / (n_seq * max_len)


def _sequence_sum(per_token, mask, n_seq, n_tok, max_len) -> torch.Tensor:
    return (per_token * mask).sum() / n_seq


AGGREGATIONS: dict[str, Callable] = {
    "sequence_mean": _sequence_mean,
    "token_mean": _token_mean,
    "constant": _constant,
    "sequence_sum": _sequence_sum,
}


@dataclass(frozen=True)
class LossOptions:
    """Every setting of the GRPO-family loss, built once per run (`from_config`), read by the terms.

    epsilon_low / epsilon_high: the clip range (epsilon_high None: symmetric); delta: INTELLECT-2's
    cap; beta, kl_estimator, kl_importance_weighted: the KL term; importance_sampling_level: token
    or sequence (GSPO); max_completion_length: Dr. GRPO's constant normaliser; sapo_*: SAPO's
    temperatures; vespo_*: VESPO's (k, lam).
    """

    epsilon_low: float = 0.2
    epsilon_high: float | None = None
    delta: float | None = None
    beta: float = 0.0
    kl_estimator: str = "k3"
    kl_importance_weighted: bool = False
    importance_sampling_level: str = "token"
    max_completion_length: int | None = None
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0

    @property
    def eps_high(self) -> float:
        return self.epsilon_low if self.epsilon_high is None else self.epsilon_high

    @classmethod
    def from_config(cls, args) -> LossOptions:
        """From a GRPOConfig (TRL's field names: epsilon, use_bias_correction_kl, ...; the KL weight
        is `kl_coef`: GRPO's beta)."""
        return cls(epsilon_low=args.epsilon, epsilon_high=args.epsilon_high, delta=args.delta,
                   beta=args.kl_coef,
                   kl_estimator=args.kl_estimator, kl_importance_weighted=args.use_bias_correction_kl,
                   importance_sampling_level=args.importance_sampling_level,
                   max_completion_length=args.max_completion_length,
                   sapo_temperature_pos=args.sapo_temperature_pos,
                   sapo_temperature_neg=args.sapo_temperature_neg,
                   vespo_k_pos=args.vespo_k_pos, vespo_lambda_pos=args.vespo_lambda_pos,
                   vespo_k_neg=args.vespo_k_neg, vespo_lambda_neg=args.vespo_lambda_neg)

    @classmethod
    def of(cls, vespo: dict[str, float] | None = None, **values) -> LossOptions:
        """From keyword arguments (`policy_loss(..., epsilon_low=0.2, vespo={"k_pos": 2.0})`)."""
        values.update({f"vespo_{k}": v for k, v in (vespo or {}).items()})
        unknown = sorted(set(values) - {f.name for f in fields(cls)})
        if unknown:
            raise TypeError(f"unknown loss options {unknown}")
        return cls(**values)


@dataclass(frozen=True)
class LossSpec:
    """One loss_type: its per-token term `term(ratio, logps, adv, options, prepared) -> [B, L] or
    [B, 1]`, its aggregation (a key of AGGREGATIONS), and an optional `prepare(logps, old_logps,
    mask, adv, rollout_is_weights, options) -> (prepared, metrics)` run before the term.
    `folds_sampling_weights`: the loss takes the sampling-correction weights in `prepare` instead of
    having them multiply its term. `clip_per_sequence`: its clip_ratio means are fractions of
    sequences (a step combines micro-batches by their sequence counts, not their token counts).
    `level` / `level_note`: the importance_sampling_level its paper uses, and what to say when a
    config picks the other (`notes`)."""

    name: str
    term: Callable
    aggregation: str
    prepare: Callable | None = None
    folds_sampling_weights: bool = False
    clip_per_sequence: bool = False
    level: str | None = None
    level_note: str = ""

    @property
    def aggregate(self) -> Callable:
        return AGGREGATIONS[self.aggregation]

    def notes(self, level: str) -> list[str]:
        """What the loss's paper did not combine it with, at importance_sampling_level `level`."""
        if self.level is not None and level != self.level:
            return [f"loss_type {self.name} {self.level_note} (now {level})"]
        if level == "sequence" and self.aggregation in ("token_mean", "constant"):
            return [f"importance_sampling_level: sequence with loss_type {self.name!r}: the loss "
                    "sums per-token contributions, which effectively weights each sequence by its "
                    "completion length instead of the per-sequence objective; GSPO's setup is "
                    "loss_type: grpo"]
        return []


LOSSES: dict[str, LossSpec] = {}


def register_loss(name: str, term: Callable, aggregation: str, prepare: Callable | None = None,
                  folds_sampling_weights: bool = False, clip_per_sequence: bool = False,
                  level: str | None = None, level_note: str = "") -> LossSpec:
    """Add a loss_type: `loss_type: <name>` in a config then selects it (the config's allowed values
    are this registry's keys). A new variant is its term, this one call, and its float64 reference
    test."""
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation={aggregation!r}: choose one of {sorted(AGGREGATIONS)}")
    if name in LOSSES:
        raise ValueError(f"loss_type {name!r} is already registered")
    LOSSES[name] = spec = LossSpec(name, term, aggregation, prepare, folds_sampling_weights,
                                   clip_per_sequence, level, level_note)
    return spec


register_loss("grpo", _clip_term, "sequence_mean")
register_loss("bnpo", _clip_term, "token_mean")
register_loss("dapo", _clip_term, "token_mean")
register_loss("dr_grpo", _clip_term, "constant")
register_loss("cispo", _cispo_term, "token_mean")
register_loss("sapo", _sapo_term, "sequence_mean")
register_loss("luspo", _clip_term, "sequence_sum", level="sequence",
              level_note="is GSPO's sequence-level loss weighted by length: the paper uses "
                         "importance_sampling_level: sequence")
register_loss("vespo", _vespo_term, "token_mean", prepare=_vespo_prepare, folds_sampling_weights=True,
              level="token", level_note="computes its own sequence weight from token ratios; "
                                        "importance_sampling_level only changes the clip metrics: "
                                        "leave it at token")
register_loss("rloo", _rloo_term, "sequence_mean", prepare=_rloo_prepare, clip_per_sequence=True)
LOSS_TYPES = LOSSES  # the name tests and older code import


def _ratio(logps, old_logps, mask, level: str) -> torch.Tensor:
    """r_it (token level) or GSPO's s_i (sequence level, [B, 1])."""
    log_ratio = logps - old_logps  # [B, L]
    if level == "sequence":
        log_ratio = ((log_ratio * mask).sum(-1, keepdim=True)
                     / mask.sum(-1, keepdim=True).clamp(min=1))  # [B, 1]
    return torch.exp(log_ratio)


def policy_loss(logps: torch.Tensor, old_logps: torch.Tensor, advantages: torch.Tensor,
                completion_mask: torch.Tensor, *, loss_type: str = "dapo", options: LossOptions | None = None,
                ref_logps: torch.Tensor | None = None, num_items: float | torch.Tensor | None = None,
                num_sequences: float | torch.Tensor | None = None,
                rollout_is_weights: torch.Tensor | None = None, keep: torch.Tensor | None = None,
                with_metrics: bool = True, **option_values) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The GRPO-family loss for one micro-batch, scaled so that micro-batch losses SUM to the step
    loss.

    logps, old_logps, ref_logps, completion_mask: [B, L]; advantages: [B]. `options` (LossOptions,
    built once per run) or its fields as keyword arguments (epsilon_low=..., beta=...,
    vespo={"k_pos": ...}). num_items: completion tokens in the whole optimiser step (default: this
    micro-batch's count). num_sequences: completions in the whole optimiser step (default: B).
    bnpo and dapo are the same aggregation here: with a global num_items, normalising "per
    batch" and "per step" coincide (TRL's bnpo normalises per micro-batch instead).
    rollout_is_weights: [B, L] or [B, 1] importance weights pi_old / pi_sampler for completions
    sampled by another engine (rlft/core/importance.py); they multiply the policy term, not the KL
    term (TRL's order); under vespo they enter the sequence weight w instead. keep: [B, 1] or [B, L]
    0/1 multiplying the policy term (`off_policy_sequence_mask`).
    Returns (loss, metrics) with metrics as detached masked means over this micro-batch ({} without
    `with_metrics`: the loss alone, as a prediction of its gradient needs it).
    """
    if loss_type not in LOSSES:
        raise ValueError(f"loss_type={loss_type!r}: choose one of {sorted(LOSSES)}")
    opts = options if options is not None else LossOptions.of(**option_values)
    if opts.importance_sampling_level not in ("token", "sequence"):
        raise ValueError(f"importance_sampling_level={opts.importance_sampling_level!r}: "
                         "'token' or 'sequence'")
    if opts.beta > 0 and ref_logps is None:
        raise ValueError("beta > 0 needs ref_logps (log-probs of the reference policy)")
    spec = LOSSES[loss_type]
    mask = completion_mask.to(logps.dtype)  # [B, L]
    ratio = _ratio(logps, old_logps, mask, opts.importance_sampling_level)  # [B, L] or [B, 1]
    adv = advantages.to(logps.dtype)  # [B, 1], or [B, L] per token (REINFORCE++)
    adv = adv[:, None] if adv.ndim == 1 else adv
    prepared, extra_metrics = ({}, {}) if spec.prepare is None else \
        spec.prepare(logps, old_logps, mask, adv, rollout_is_weights, opts)
    per_token = spec.term(ratio, logps, adv, opts, prepared).expand_as(logps)  # [B, L]
    if rollout_is_weights is not None and not spec.folds_sampling_weights:
        per_token = per_token * rollout_is_weights.to(logps.dtype)  # [B, L] x [B, L] or [B, 1]
    if keep is not None:
        per_token = per_token * keep.to(logps.dtype)
    kl = None
    if opts.beta > 0:
        kl = kl_penalty(logps, ref_logps, opts.kl_estimator)  # [B, L]
        if opts.kl_importance_weighted:
            kl = kl * ratio  # [B, L]; ratio is [B, L] or [B, 1] (sequence level)
        per_token = per_token + opts.beta * kl
    n_tok = mask.sum().clamp(min=1) if num_items is None else num_items
    n_seq = logps.shape[0] if num_sequences is None else num_sequences
    max_len = logps.shape[1] if opts.max_completion_length is None else opts.max_completion_length
    loss = spec.aggregate(per_token, mask, n_seq, n_tok, max_len)
    if not with_metrics:
        return loss, {}
    metrics = {**_metrics(ratio.expand_as(logps).detach(), adv, mask, opts, kl), **extra_metrics}
    # the KL share of `loss`, aggregated the same way (policy part = loss - kl_loss)
    if kl is not None:
        metrics["kl_loss"] = spec.aggregate(opts.beta * kl.detach(), mask, n_seq, n_tok, max_len)
    return loss, metrics


@torch.no_grad()
def _metrics(ratio, adv, mask, opts: LossOptions, kl) -> dict[str, torch.Tensor]:
    tokens = mask.sum().clamp(min=1)
    low = ((ratio < 1 - opts.epsilon_low) & (adv < 0)).to(mask.dtype)
    high = ((ratio > 1 + opts.eps_high) & (adv > 0)).to(mask.dtype)
    # [B]; TRL's low_min / high_max: extremes over completions of their clipped fraction
    lengths = mask.sum(-1)
    rows = lengths > 0
    seq_low = ((low * mask).sum(-1) / lengths.clamp(min=1))[rows]
    seq_high = ((high * mask).sum(-1) / lengths.clamp(min=1))[rows]
    metrics = {
        "clip_ratio/low_min": seq_low.min() if rows.any() else torch.tensor(math.inf),
        "clip_ratio/high_max": seq_high.max() if rows.any() else torch.tensor(-math.inf),
        "clip_ratio/low_mean": (low * mask).sum() / tokens,
        "clip_ratio/high_mean": (high * mask).sum() / tokens,
        "clip_ratio/region_mean": (((low + high) > 0).to(mask.dtype) * mask).sum() / tokens,
        "ratio_mean": (ratio * mask).sum() / tokens,
    }
    if opts.delta is not None:
        capped = ((ratio > opts.delta) & (adv < 0)).to(mask.dtype)
        metrics["clip_ratio/delta_mean"] = (capped * mask).sum() / tokens
    if kl is not None:
        metrics["kl"] = (kl.detach() * mask).sum() / tokens
    return metrics
