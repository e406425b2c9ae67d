"""RLOO under TRL 1.16's names (`RLOOTrainer`, `RLOOConfig`): GRPO's machinery -- generation,
rewards, LoRA, vLLM, sharded engines, tools, exact resume -- with RLOO's reward, advantage and loss
(Ahmadian et al. 2024, arXiv:2402.14740, as TRL computes them): RLOOConfig's defaults, and the KL in
the reward (the config's `kl_in_reward` left at null):

    reward     r_i = clip(sum_f w_f r_if, reward_clip_range)
               - beta * sum_t (log pi_old(o_it) - log pi_ref(o_it))          (the KL in the reward)
    advantage  A_i = r_i - mean of the other completions' r_j of the same prompt
               (advantage_estimator: rloo),
               whitened over the batch with normalize_advantages
    loss       mean_i -min(rho_i A_i, clip(rho_i, 1 - epsilon, 1 + epsilon_high) A_i),
               rho_i = exp(sum_t (log pi(o_it) - log pi_old(o_it)))          (loss_type: rloo)

The KL term is in the reward, not in the loss (the loss's beta is 0): rlft/core/advantages.py,
kl_in_reward.
"""

from __future__ import annotations

from rlft.config import RLOOConfig
from rlft.train.grpo import GRPOTrainer, default_output_dir


class RLOOTrainer(GRPOTrainer):
    """TRL-compatible RLOO: `RLOOTrainer(model, reward_funcs, args, train_dataset, ...).train()`."""

    _tag_names = ["trl", "rloo", "rlft"]
    _name = "RLOO"
    default_kl_in_reward = True  # TRL's RLOO: beta's KL penalty in the reward

    def __init__(self, model, reward_funcs=None, args: RLOOConfig | None = None, train_dataset=None,
                 **kwargs):
        super().__init__(model, reward_funcs,
                         args or RLOOConfig(output_dir=default_output_dir(model, "RLOO")), train_dataset,
                         **kwargs)
