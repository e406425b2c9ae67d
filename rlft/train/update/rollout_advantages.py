"""A rollout's advantages by the run's `EstimatorSpec` (rlft/core/advantages.py): the inputs the
spec declares it needs are built once per rollout -- completion lengths, the trained-token mask, the
per-token KL estimate log pi_old - log pi_ref at sampling time (only with beta > 0: no reference
pass otherwise) -- and gathered from every process like the rewards, so batch statistics
(scale_rewards='batch', whitening) see the whole batch on every process (groups never span two); the
advantages are sliced back to this process's rows.
"""

from __future__ import annotations

import torch

from rlft.core import advantages as core
from rlft.core.advantages import ADVANTAGE_ESTIMATORS, EstimatorInputs, EstimatorSpec, estimate
from rlft.errors import ConfigError


def estimator_spec(args, kl_in_reward: bool) -> EstimatorSpec:
    """The config's estimator: `advantage_estimator` from the registry, with the KL penalty moved
    into the reward when `kl_in_reward` (the config's, else the trainer's way: RLOO's)."""
    spec = ADVANTAGE_ESTIMATORS[args.advantage_estimator]
    if not kl_in_reward:
        return spec
    if args.multi_objective_aggregation != "sum_then_normalize":
        raise ConfigError("the KL in the reward penalises the summed reward: use "
                          "multi_objective_aggregation: sum_then_normalize (or kl_in_reward: "
                          "false)")
    try:
        return core.kl_in_reward(spec)
    except ValueError as err:
        raise ConfigError(f"kl_in_reward with advantage_estimator={args.advantage_estimator!r}: "
                          f"{err}; set "
                          "kl_in_reward: false") from err


class Advantages:
    """`advantages(rewards, rollout) -> (advantages, total reward, stats, everyone)` for this
    process's rows; `everyone` holds every process's (rewards, total, lengths, truncated) for the
    rollout's metrics."""

    def __init__(self, spec: EstimatorSpec, args, accelerator, scorer, reward_weights: torch.Tensor):
        self.spec, self.args, self.accelerator = spec, args, accelerator
        self.scorer, self.reward_weights = scorer, reward_weights
        self.plain = ADVANTAGE_ESTIMATORS[args.advantage_estimator]  # evaluation: no KL anywhere

    @property
    def kl_in_loss(self) -> bool:
        """beta weighs a per-token KL term of the loss, unless the estimator puts the KL in the
        reward."""
        return not self.spec.kl_in_reward

    def _gather(self, tensor: torch.Tensor, pad: bool = False) -> torch.Tensor:
        acc = self.accelerator
        if acc.num_processes == 1:
            return tensor.cpu()
        tensor = tensor.to(acc.device)
        return acc.gather(acc.pad_across_processes(tensor, dim=1, pad_index=0.0) if pad else tensor).cpu()

    def _token_inputs(self, rollout) -> dict:
        """The mask and per-token KL of every process's rows, padded to the widest completion
        anywhere."""
        if not {"mask", "token_kl"} & self.spec.needs:
            return {}
        if "token_kl" in self.spec.needs and self.args.kl_coef != 0:
            kl, mask = self.scorer.sampling_kl(rollout)
        else:  # no KL, no reference pass; truncated completions still carry no return when masked
            kl, mask = None, self.scorer.trained_mask(rollout)
        return {"mask": self._gather(mask, pad=True),
                "token_kl": None if kl is None else self._gather(kl, pad=True).float()}

    def __call__(self, rewards: torch.Tensor, rollout):
        args = self.args
        # TRL's: tokens the policy generated (not tool output)
        lengths = rollout.loss_mask.sum(dim=1).float()
        gathered = [self._gather(t) for t in (rewards, lengths, rollout.truncated.float())]
        inputs = EstimatorInputs(gathered[0], args.num_generations, self.reward_weights, args.scale_rewards,
                                 args.multi_objective_aggregation, lengths=gathered[1], beta=args.kl_coef,
                                 clip_range=getattr(args, "reward_clip_range", None),
                                 normalize=getattr(args, "normalize_advantages", False),
                                 **self._token_inputs(rollout))
        advantages, total, stats = estimate(self.spec, inputs)
        index = self.accelerator.process_index
        rows = slice(index * rewards.shape[0], (index + 1) * rewards.shape[0])
        everyone = (gathered[0], total, gathered[1], gathered[2].bool())
        width = rollout.completion_ids.shape[1]  # token-level advantages: this process's columns
        local = advantages[rows] if advantages.ndim == 1 else advantages[rows, :width]
        return local, total[rows], stats, everyone

    def given(self, advantages: torch.Tensor, totals: torch.Tensor, rollout):
        """Advantages the source was given (a rollout worker's), in __call__'s shape: `totals` each
        row's reward as the source knows it; no reward function's column."""
        lengths = rollout.loss_mask.sum(dim=1).float()
        gathered = [self._gather(t) for t in (totals.double(), lengths, rollout.truncated.float())]
        everyone = (gathered[0].new_zeros(gathered[0].shape[0], 0), gathered[0], gathered[1],
                    gathered[2].bool())
        return advantages, totals, {}, everyone

    def local(self, rewards: torch.Tensor, rollout, group: int) -> torch.Tensor:
        """Advantages within each prompt's `group` completions of this process alone (evaluation),
        by the plain estimator, with no KL."""
        token = {"mask": rollout.loss_mask.float().cpu()} if self.plain.token_level else {}
        inputs = EstimatorInputs(rewards.cpu(), group, self.reward_weights, self.args.scale_rewards,
                                 self.args.multi_objective_aggregation,
                                 lengths=rollout.loss_mask.sum(dim=1).float().cpu(), **token)
        return estimate(self.plain, inputs)[0]
