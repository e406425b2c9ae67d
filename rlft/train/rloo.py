"""RLOO under TRL 1.16's names (`RLOOTrainer`, `RLOOConfig`): GRPO's machinery -- generation, rewards, LoRA,
vLLM, sharded engines, tools, exact resume -- with RLOO's reward, advantage and loss (Ahmadian et al. 2024,
arXiv:2402.14740, as TRL computes them):

    reward     r_i = clip(sum_f w_f r_if, reward_clip_range)
               - beta * sum_t (log pi_old(o_it) - log pi_ref(o_it))
    advantage  A_i = r_i - mean of the other completions' r_j of the same prompt (leave-one-out), whitened
               over the batch with normalize_advantages
    loss       mean_i -min(rho_i A_i, clip(rho_i, 1 - epsilon, 1 + epsilon_high) A_i),
               rho_i = exp(sum_t (log pi(o_it) - log pi_old(o_it)))
               (loss_type "rloo", rlft/core/losses.py)

The KL term is in the reward, not in the loss (the loss's beta is 0).
"""

from __future__ import annotations

import torch

from rlft.config import RLOOConfig
from rlft.core.advantages import group_advantages, kl_shaped_rewards, whiten
from rlft.train.grpo import GRPOTrainer, default_output_dir
from rlft.train.token_advantages import sampling_kl


class RLOOTrainer(GRPOTrainer):
    """TRL-compatible RLOO: `RLOOTrainer(model, reward_funcs, args, train_dataset, ...).train()`."""

    _tag_names = ["trl", "rloo", "rlft"]
    _name = "RLOO"
    kl_in_loss = False  # beta shapes the reward instead

    def __init__(self, model, reward_funcs=None, args: RLOOConfig | None = None, train_dataset=None,
                 **kwargs):
        super().__init__(model, reward_funcs,
                         args or RLOOConfig(output_dir=default_output_dir(model, "RLOO")), train_dataset,
                         **kwargs)

    def _sequence_kl(self, rollout) -> tuple[torch.Tensor, torch.Tensor]:
        """Per completion sum_t (log pi_old - log pi_ref) over its trained tokens, and the per-token sum and
        count for the `kl` metric; the policy as it sampled is pi_old."""
        per_token, mask = sampling_kl(self, rollout)
        return per_token.sum(dim=1), torch.stack([per_token.sum(), mask.sum()])

    def _advantages(self, rewards: torch.Tensor, rollout):
        """RLOO's advantages from the rewards of ALL processes, sliced back to this process's rows."""
        acc, args = self.accelerator, self.args
        lengths = rollout.loss_mask.sum(dim=1).float()
        kl, kl_stats = self._sequence_kl(rollout) if args.beta != 0 else (torch.zeros(len(lengths)), None)
        gathered = [acc.gather(t.to(acc.device)).cpu() if acc.num_processes > 1 else t.cpu()
                    for t in (rewards, lengths, rollout.truncated.float(), kl.float())]
        unscorable = torch.isnan(gathered[0]).all(dim=1)
        total = torch.nansum(gathered[0] * self.reward_weights, dim=1)
        total[unscorable] = float("nan")
        shaped = kl_shaped_rewards(total, gathered[3], args.beta, args.reward_clip_range)
        advantages, stats = group_advantages(shaped, args.num_generations, estimator="rloo")
        # over the rows that have a leave-one-out baseline (TRL's nanmean/nanstd)
        if args.normalize_advantages:
            scorable = ~torch.isnan(shaped).view(-1, args.num_generations)
            baseline = (scorable & (scorable.sum(dim=1, keepdim=True) > 1)).view(-1)
            advantages = whiten(torch.where(baseline, advantages, float("nan")))
        if kl_stats is not None:
            kl_stats = acc.reduce(kl_stats.to(acc.device), "sum") if acc.num_processes > 1 else kl_stats
            stats["kl"] = (kl_stats[0] / kl_stats[1].clamp(min=1)).item()
        rows = slice(acc.process_index * rewards.shape[0], (acc.process_index + 1) * rewards.shape[0])
        everyone = (gathered[0], total, gathered[1], gathered[2].bool())
        return advantages[rows], total[rows], stats, everyone
