"""Correcting for the gap between the engine that sampled and the model that trains.

A fast inference engine (vLLM, a bfloat16 engine, other kernels) samples completions from a
distribution pi_sampler that differs slightly from the trainer's pi_theta_old at the same weights.
The policy-gradient terms are then off-policy; weighting each token's term by
rho = pi_theta_old / pi_sampler corrects it, and bounding rho keeps the variance finite.

- Truncated importance sampling (TIS): rho <- clamp(rho, C_min, C_max).
  F. Yao, L. Liu, D. Zhang, C. Dong, J. Shang, J. Gao, "Your Efficient RL Framework Secretly Brings
  You Off-Policy RL Training", 2025.
- Masked importance sampling (MIS), and the sequence-level ratio rho_seq = prod_t rho_t, which is
  the correct weight for a sequence-level objective: rho <- rho * 1[C_min <= rho <= C_max].
  J. Liu, Y. Li, Y. Fu, J. Wang, Q. Liu, Y. Shen, "When Speed Kills Stability: Demystifying RL
  Collapse from the Training-Inference Mismatch", 2025.

How far apart the two are, per trained token t sampled from pi_sampler, with rho_t = pi_trainer /
pi_sampler: KL(pi_sampler || pi_trainer) estimated by k1 = -log rho_t (unbiased, can be negative)
and by k3 = rho_t - 1 - log rho_t (unbiased because E_sampler[rho] = 1, and never negative; J.
Schulman, "Approximating KL Divergence", 2020), and the chi-square divergence chi2 =
E_sampler[rho^2] - 1, which bounds the variance of an importance-weighted estimate (the measures
verl logs as rollout_corr/kl, k3_kl, chi2_token).

The modes form a registry (`CORRECTIONS`, chosen by `vllm_importance_sampling_mode`), each a
statistic of the per-token ratios (the token's own, the sequence's product, or the sequence's
geometric mean) and a bound (truncate: clamp into [C_min, C_max]; mask: set to 0 outside it). TRL's
four: token_truncate, token_mask, sequence_truncate, sequence_mask (the last is MIS). And two more:

- `icepop`: each token's ratio kept where C_min <= rho_t <= C_max and 0 outside (the two-sided token
  mask); C_min left unset is 1 / C_max. IcePop, from inclusionAI's Ring-1T report (Ling Team, 2025),
  which uses [0.5, 5].
- `sequence_geometric_mask`: a sequence is kept (weight 1 on each of its tokens) where its
  geometric-mean ratio exp(mean_t log rho_t) lies in [C_min, C_max] and dropped (0) outside; no
  reweighting. The geometric mean does not grow with length as the product does, so the bounds are
  tight: verl's preset keeps [0.999, 1.001]; C_min left unset is 1 / C_max. Liu, Li et al. 2025
  (above), part 3 ("geometric-level RS").

Tokens the engine could not score (NaN) get a ratio of exactly 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Correction:
    """One mode: `statistic` "token" (each token's ratio), "product" (the sequence's prod_t rho_t)
    or "geometric" (the sequence's exp(mean_t log rho_t)); `bound` "truncate" or "mask";
    `two_sided`: an unset C_min is 1 / C_max; `reweights`: the kept weight is the ratio (else 1: a
    rejection, no reweighting)."""

    name: str
    statistic: str
    bound: str
    two_sided: bool = False
    reweights: bool = True

    @property
    def per_sequence(self) -> bool:
        return self.statistic != "token"


CORRECTIONS: dict[str, Correction] = {}


def register_correction(correction: Correction) -> Correction:
    """Add a mode: `vllm_importance_sampling_mode: <name>` then selects it."""
    if correction.name in CORRECTIONS:
        raise ValueError(f"importance sampling mode {correction.name!r} is already registered")
    CORRECTIONS[correction.name] = correction
    return correction


for _correction in (
        Correction("token_truncate", "token", "truncate"), Correction("token_mask", "token", "mask"),
        Correction("sequence_truncate", "product", "truncate"),
        Correction("sequence_mask", "product", "mask"),
        Correction("icepop", "token", "mask", two_sided=True),
        Correction("sequence_geometric_mask", "geometric", "mask", two_sided=True, reweights=False)):
    register_correction(_correction)
MODES = tuple(CORRECTIONS)  # the name older code imports: TRL's four and rlft's


def correction_bounds(mode: str, clip_min: float | None, clip_max: float | None) -> tuple[float, float]:
    """[C_min, C_max] of `mode` (an unset bound is open; a two-sided mode's unset C_min is 1 /
    C_max)."""
    if CORRECTIONS[mode].two_sided and clip_min is None and clip_max:
        clip_min = 1.0 / clip_max
    return (float("-inf") if clip_min is None else clip_min, float("inf") if clip_max is None else clip_max)


def sampling_correction(trainer_logps: torch.Tensor, sampler_logps: torch.Tensor, mask: torch.Tensor,
                        mode: str, clip_min: float | None = None,
                        clip_max: float | None = 3.0) -> torch.Tensor:
    """Importance weights pi_theta_old / pi_sampler, bounded as `mode` says.

    trainer_logps, sampler_logps, mask: [B, T]. Returns [B, T] for per-token modes, [B, 1] for
    per-sequence modes (one weight per completion). Differences at masked positions count as 0; no
    gradient flows (the weights are constants of the loss)."""
    if mode not in CORRECTIONS:
        raise ValueError(f"importance sampling mode {mode!r}: choose one of {tuple(CORRECTIONS)}")
    spec = CORRECTIONS[mode]
    diff = torch.nan_to_num((trainer_logps - sampler_logps).detach() * mask, nan=0.0)  # [B, T]
    if spec.statistic == "product":
        diff = diff.sum(dim=-1, keepdim=True)  # [B, 1]: log prod_t rho_t
    elif spec.statistic == "geometric":
        # mean log rho
        diff = diff.sum(dim=-1, keepdim=True) / mask.sum(dim=-1, keepdim=True).clamp(min=1)
    ratio = torch.exp(diff)
    low, high = correction_bounds(mode, clip_min, clip_max)
    if spec.bound == "truncate":
        return torch.clamp(ratio, min=low, max=high)
    kept = ratio if spec.reweights else torch.ones_like(ratio)
    return kept.masked_fill((ratio < low) | (ratio > high), 0.0)


@torch.no_grad()
def correction_stats(trainer_logps: torch.Tensor, sampler_logps: torch.Tensor, mask: torch.Tensor,
                     weights: torch.Tensor, unbounded: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Sums/extremes of the mismatch for one micro-batch (combined over a step by the caller):
    |delta log-prob| over scored completion tokens and how many of their unbounded ratios lie outside
    [0.9, 1.1], and the importance weights (per token or per sequence), including how many were
    zeroed by a *_mask mode and, given the same mode's `unbounded` weights (no clip bounds), how
    many a bound clipped."""
    valid = mask.bool() & ~torch.isnan(sampler_logps)
    signed = (trainer_logps - sampler_logps)[valid]  # log rho per scored token
    clipped = torch.tensor(0.0, device=mask.device)
    if unbounded is not None:  # a bound moved the weight, and did not zero it (that is `zeroed`)
        moved = (weights != unbounded) & (weights != 0)
        kept = mask.bool().any(dim=-1, keepdim=True) if weights.shape[-1] == 1 else mask.bool()
        clipped = (moved & kept).sum().float()
    delta, ratio = signed.abs(), signed.exp()
    outside = ((ratio < 0.9) | (ratio > 1.1)).sum().float()
    flat = weights.flatten() if weights.shape[-1] == 1 else weights[mask.bool()]
    if weights.shape[-1] == 1:
        flat = flat[mask.bool().any(dim=-1)]
    empty = torch.tensor(0.0, device=mask.device)
    return {
        "delta_sum": delta.sum() if delta.numel() else empty,
        "delta_count": torch.tensor(float(delta.numel())),
        "delta_max": delta.max() if delta.numel() else empty,
        "ratio_sum": flat.sum() if flat.numel() else empty, "ratio_count": torch.tensor(float(flat.numel())),
        "ratio_min": flat.min() if flat.numel() else empty,
        "ratio_max": flat.max() if flat.numel() else empty,
        "zeroed": (flat == 0).sum().float(), "outside": outside, "clipped": clipped,
        # KL(sampler || trainer) by k1 and k3, and E[rho^2] for the chi-square divergence (module
        # docstring)
        "kl_k1_sum": -signed.sum() if delta.numel() else empty,
        "kl_k3_sum": (ratio - 1 - signed).sum() if delta.numel() else empty,
        "rho_squared_sum": ratio.square().sum() if delta.numel() else empty,
    }
