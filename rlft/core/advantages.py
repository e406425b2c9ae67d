"""Group-relative advantages (GRPO), with NaN-aware multi-reward aggregation.

DeepSeekMath (Shao et al., 2024, arXiv:2402.03300), outcome supervision:

    A_i = (r_i - mean(r_group)) / (std(r_group) + eps)

`std` is the unbiased (Bessel-corrected) sample standard deviation, as in TRL. Rewards come
as [N] with N = prompts x group_size and each prompt's completions contiguous. NaN means
"not applicable" and is left out of every statistic; a completion whose reward is NaN gets
advantage 0. Groups with zero spread (all rewards equal) carry no signal and give exactly 0.
"""

from __future__ import annotations

import torch


def _group_mean_std(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """values [groups, size] with NaN -> (mean, unbiased std, valid count), each [groups, 1]."""
    valid = ~torch.isnan(values)
    count = valid.sum(-1, keepdim=True)
    filled = torch.where(valid, values, torch.zeros_like(values))
    mean = filled.sum(-1, keepdim=True) / count.clamp(min=1)
    sq = torch.where(valid, (values - mean) ** 2, torch.zeros_like(values)).sum(-1, keepdim=True)
    std = torch.sqrt(sq / (count - 1).clamp(min=1))
    std = torch.where(count > 1, std, torch.zeros_like(std))
    return mean, std, count


def _batch_std(values: torch.Tensor) -> torch.Tensor:
    valid = values[~torch.isnan(values)]
    return valid.std() if valid.numel() > 1 else values.new_zeros(())


def group_advantages(rewards: torch.Tensor, group_size: int, scale_rewards: str = "group",
                     eps: float = 1e-4) -> tuple[torch.Tensor, dict[str, float]]:
    """Advantages for rewards [N] (groups contiguous). Returns (advantages [N], stats).

    scale_rewards: "group" divides by the group's std, "batch" by the std of all rewards in the
    batch (Dr. GRPO argues for not dividing per group), "none" only centres.
    stats: reward_std_within_group (mean of the groups' stds), frac_reward_zero_std (fraction of groups whose rewards
    are all equal, i.e. no learning signal), advantage_abs_mean.
    """
    if rewards.ndim != 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards of shape {tuple(rewards.shape)} cannot be split into groups of {group_size}")
    grouped = rewards.view(-1, group_size)  # [groups, G]
    mean, std, count = _group_mean_std(grouped)
    centred = grouped - mean
    if scale_rewards == "group":
        scale = std
    elif scale_rewards == "batch":
        scale = _batch_std(rewards).expand_as(std)
    elif scale_rewards == "none":
        scale = None
    else:
        raise ValueError(f"scale_rewards={scale_rewards!r}: choose 'group', 'batch' or 'none'")
    advantages = centred if scale is None else centred / (scale + eps)
    advantages = torch.nan_to_num(advantages, nan=0.0).view(-1)  # NaN rewards -> 0
    zero_spread = (std.squeeze(-1) == 0) | (count.squeeze(-1) < 2)
    stats = {
        "reward_std_within_group": std.mean().item(),
        "frac_reward_zero_std": zero_spread.float().mean().item(),
        "advantage_abs_mean": advantages.abs().mean().item(),
    }
    return advantages, stats


def multi_reward_advantages(rewards: torch.Tensor, weights: torch.Tensor | None, group_size: int,
                            scale_rewards: str = "group", aggregation: str = "sum_then_normalize",
                            eps: float = 1e-4) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """Advantages from per-function rewards [N, F] (NaN = not applicable) and weights [F].

    sum_then_normalize (GRPO/TRL): r_i = sum_f w_f r_if over the non-NaN entries (NaN if all are
        NaN), then `group_advantages(r)`.
    normalize_then_sum (GDPO, group reward-decoupled normalisation): A_i = sum_f w_f A_if with
        A_if the group advantage of reward f alone, then normalised over the batch:
        (A - mean_batch(A)) / (std_batch(A) + eps).
    Returns (advantages [N], total reward [N] used for logging, stats). A row whose rewards are all
    NaN gets advantage 0 under both aggregations.
    """
    if rewards.ndim != 2:
        raise ValueError(f"rewards must be [N, F], got {tuple(rewards.shape)}")
    weights = torch.ones(rewards.shape[1], dtype=rewards.dtype, device=rewards.device) if weights is None else weights
    all_nan = torch.isnan(rewards).all(dim=1)  # [N]
    total = torch.nansum(rewards * weights, dim=1)  # [N]
    total = torch.where(all_nan, torch.full_like(total, float("nan")), total)
    if aggregation == "sum_then_normalize":
        advantages, stats = group_advantages(total, group_size, scale_rewards, eps)
    elif aggregation == "normalize_then_sum":
        per_function = [group_advantages(rewards[:, f], group_size, scale_rewards, eps)[0]
                        for f in range(rewards.shape[1])]
        summed = (torch.stack(per_function, dim=1) * weights).sum(dim=1)  # [N]
        valid = summed[~all_nan]
        std = valid.std() if valid.numel() > 1 else summed.new_zeros(())
        mean = valid.mean() if valid.numel() else summed.new_zeros(())
        advantages = torch.where(all_nan, torch.zeros_like(summed), (summed - mean) / (std + eps))
        _, stats = group_advantages(total, group_size, scale_rewards, eps)
        stats["advantage_abs_mean"] = advantages.abs().mean().item()
    else:
        raise ValueError(f"aggregation={aggregation!r}: choose 'sum_then_normalize' or 'normalize_then_sum'")
    return advantages, total, stats
