"""Bradley-Terry loss for pairwise reward models.

    P(chosen > rejected) = sigmoid(s_c - s_r - m)
    loss = -mean_i log sigmoid(s_c,i - s_r,i - m_i)  [+ c * mean_i (s_c,i + s_r,i)^2]

Bradley & Terry (1952); InstructGPT (Ouyang et al., 2022, arXiv:2203.02155) for reward models;
the margin m is Llama 2's (Touvron et al., 2023, arXiv:2307.09288); the centring term c is
Eisenstein et al. (2023, arXiv:2312.09244), TRL's `center_rewards_coefficient`.
Computed in float32 whatever the scores' dtype; `logsigmoid` keeps it finite for any score.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def bradley_terry_loss(chosen_scores: torch.Tensor, rejected_scores: torch.Tensor,
                       margin: torch.Tensor | None = None,
                       center_rewards_coefficient: float | None = None
                       ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """chosen_scores, rejected_scores, margin: [B] -> (loss, {accuracy, margin, ...}); `margin` in
    the metrics is TRL's: the mean score difference chosen - rejected (not the margin column)."""
    # float32 (float64 stays float64)
    work = torch.promote_types(chosen_scores.dtype, torch.float32)
    chosen = chosen_scores.to(work).reshape(-1)  # [B]
    rejected = rejected_scores.to(work).reshape(-1)  # [B]
    diff = chosen - rejected
    shifted = diff if margin is None else diff - margin.to(work).reshape(-1)
    loss = -F.logsigmoid(shifted).mean()
    if center_rewards_coefficient:
        loss = loss + center_rewards_coefficient * ((chosen + rejected) ** 2).mean()
    with torch.no_grad():
        metrics = {
            "accuracy": (diff > 0).float().mean(),
            "margin": diff.mean(),
            "reward_chosen_mean": chosen.mean(),
            "reward_rejected_mean": rejected.mean(),
        }
    return loss, metrics
