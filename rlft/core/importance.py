"""Correcting for the gap between the engine that sampled and the model that trains.

A fast inference engine (vLLM, a bfloat16 engine, other kernels) samples completions from a
distribution pi_sampler that differs slightly from the trainer's pi_theta_old at the same weights.
The policy-gradient terms are then off-policy; weighting each token's term by
rho = pi_theta_old / pi_sampler corrects it, and bounding rho keeps the variance finite.

- Truncated importance sampling (TIS): rho <- clamp(rho, C_min, C_max).
  F. Yao, L. Liu, D. Zhang, C. Dong, J. Shang, J. Gao, "Your Efficient RL Framework Secretly Brings
  You Off-Policy RL Training", 2025.
- Masked importance sampling (MIS), and the sequence-level ratio rho_seq = prod_t rho_t, which is the
  correct weight for a sequence-level objective: rho <- rho * 1[C_min <= rho <= C_max].
  J. Liu, Y. Li, Y. Fu, J. Wang, Q. Liu, Y. Shen, "When Speed Kills Stability: Demystifying RL
  Collapse from the Training-Inference Mismatch", 2025.

How far apart the two are, per trained token t sampled from pi_sampler, with rho_t = pi_trainer / pi_sampler:
KL(pi_sampler || pi_trainer) estimated by k1 = -log rho_t (unbiased, can be negative) and by
k3 = rho_t - 1 - log rho_t (unbiased because E_sampler[rho] = 1, and never negative; J. Schulman,
"Approximating KL Divergence", 2020), and the chi-square divergence chi2 = E_sampler[rho^2] - 1, which bounds
the variance of an importance-weighted estimate (the measures verl logs as rollout_corr/kl, k3_kl,
chi2_token).

The four modes carry TRL's names (`vllm_importance_sampling_mode`): token_truncate, token_mask,
sequence_truncate, sequence_mask. Tokens the engine could not score (NaN) get a ratio of exactly 1.
"""

from __future__ import annotations

import torch

MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


def sampling_correction(trainer_logps: torch.Tensor, sampler_logps: torch.Tensor, mask: torch.Tensor,
                        mode: str, clip_min: float | None = None,
                        clip_max: float | None = 3.0) -> torch.Tensor:
    """Importance weights pi_theta_old / pi_sampler, bounded as `mode` says.

    trainer_logps, sampler_logps, mask: [B, T]. Returns [B, T] for token_* modes, [B, 1] for sequence_*
    modes (one ratio per completion, the product of its tokens' ratios). Differences at masked
    positions count as 0; no gradient flows (the weights are constants of the loss)."""
    if mode not in MODES:
        raise ValueError(f"importance sampling mode {mode!r}: choose one of {MODES}")
    diff = torch.nan_to_num((trainer_logps - sampler_logps).detach() * mask, nan=0.0)  # [B, T]
    if mode.startswith("sequence"):
        diff = diff.sum(dim=-1, keepdim=True)  # [B, 1]: log prod_t rho_t
    ratio = torch.exp(diff)
    if mode.endswith("truncate"):
        return torch.clamp(ratio, min=clip_min, max=clip_max)
    low = float("-inf") if clip_min is None else clip_min
    high = float("inf") if clip_max is None else clip_max
    return ratio.masked_fill((ratio < low) | (ratio > high), 0.0)


@torch.no_grad()
def correction_stats(trainer_logps: torch.Tensor, sampler_logps: torch.Tensor, mask: torch.Tensor,
                     weights: torch.Tensor) -> dict[str, torch.Tensor]:
    """Sums/extremes of the mismatch for one micro-batch (combined over a step by the caller):
    |delta log-prob| over scored completion tokens and how many of their unbounded ratios lie outside
    [0.9, 1.1], and the importance weights (per token or per sequence), including how many were zeroed by a
    *_mask mode."""
    valid = mask.bool() & ~torch.isnan(sampler_logps)
    signed = (trainer_logps - sampler_logps)[valid]  # log rho per scored token
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
        "zeroed": (flat == 0).sum().float(), "outside": outside,
        # KL(sampler || trainer) by k1 and k3, and E[rho^2] for the chi-square divergence (module docstring)
        "kl_k1_sum": -signed.sum() if delta.numel() else empty,
        "kl_k3_sum": (ratio - 1 - signed).sum() if delta.numel() else empty,
        "rho_squared_sum": ratio.square().sum() if delta.numel() else empty,
    }
