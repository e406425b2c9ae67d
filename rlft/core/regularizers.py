"""What GRPO trains on and what keeps it exploring: the high-entropy token mask, the entropy bonus
and its adaptive coefficient, and the moving reference model.

    high-entropy mask ("Beyond the 80/20 Rule", Wang et al. 2025, arXiv:2506.01939): only tokens
    whose entropy
        is in the top rho quantile of the step's completion tokens are trained:
            e_it = [H_it >= tau_rho] m_it,  tau_rho = quantile_{1 - rho}({H_js : m_js = 1})
        over every completion token of the optimiser step (all micro-batches, all processes), so the mask
        does not depend on how the step is split.
    entropy bonus: loss -= c * (1/T) sum_it e_it H_it, T = sum_it e_it over the step (the tokens the
    policy
        term trains on), with the gradient of H (rlft/core/logprobs.py).
    adaptive coefficient (Skywork-OR1, arXiv:2505.22312, sec. 3.2.3): after each step with entropy
    H_k,
        c_{k+1} = clip(c_k + delta, c_min, c_max) if H_k <= H_target else clip(c_k - delta, c_min, c_max),
        and step k+1 applies the bonus only when H_k <= H_target.
    moving reference (TR-DPO, Gorbatovski et al. 2024, arXiv:2404.09656, "soft update"):
        every tau steps, theta_ref <- alpha theta + (1 - alpha) theta_ref.
"""

from __future__ import annotations

import torch


def entropy_threshold(entropies: torch.Tensor, quantile: float) -> torch.Tensor:
    """tau_rho: the `1 - quantile` quantile (linear interpolation, torch.quantile) of a 1-D tensor
    of the step's completion-token entropies. No tokens: +inf (nothing is kept)."""
    if not 0.0 <= quantile <= 1.0:
        raise ValueError(f"top_entropy_quantile={quantile!r} must be in [0, 1]")
    values = entropies.detach().reshape(-1).to(torch.promote_types(entropies.dtype, torch.float32))
    if values.numel() == 0:
        return torch.tensor(float("inf"), device=entropies.device)
    return torch.quantile(values, 1.0 - quantile)


def high_entropy_mask(entropies: torch.Tensor, mask: torch.Tensor,
                      threshold: torch.Tensor | float) -> torch.Tensor:
    """e = [H >= tau] * m: [B, L], [B, L] -> [B, L] in mask's dtype (padding never kept)."""
    return ((entropies.detach() >= threshold) & mask.bool()).to(mask.dtype)


def entropy_bonus(entropies: torch.Tensor, mask: torch.Tensor, coef: float,
                  num_items: float | torch.Tensor | None = None) -> torch.Tensor:
    """This micro-batch's share of -c * (1/T) sum_it m_it H_it (T: trained tokens of the whole step,
    default this micro-batch's). Added to the policy loss; differentiable through `entropies`."""
    tokens = mask.sum().clamp(min=1) if num_items is None else num_items
    return -coef * (entropies * mask).sum() / tokens


def adaptive_entropy_coef(coef: float, entropy: float, target: float, delta: float, low: float,
                          high: float) -> float:
    """Skywork-OR1's controller: raise c by delta when the step's entropy is at or below the target,
    else lower it; kept in [low, high]."""
    moved = coef + delta if entropy <= target else coef - delta
    return min(max(moved, low), high)


@torch.no_grad()
def mix_reference(reference: torch.Tensor, policy: torch.Tensor, alpha: float) -> torch.Tensor:
    """TR-DPO's soft update, in place on `reference`: alpha * policy + (1 - alpha) * reference."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"ref_model_mixup_alpha={alpha!r} must be in [0, 1]")
    return reference.mul_(1.0 - alpha).add_(policy.to(reference.dtype), alpha=alpha)
