"""AsyncGRPOTrainer: generation overlapped with training, on a reproducible schedule
(docs/async.md).

GRPOTrainer with the producer source (`rollout_source` left at null, or `producer`;
rlft/train/sources/async_source.py): a producer process holds its own copy of the policy and
generates the rollouts of later steps while the trainer trains; step t trains on completions sampled
rollout_lag rollouts earlier, requested with seeds that depend on (seed, rollout) only, so runs
repeat and resume exactly.

Each completion carries the sampler's per-token log-probs. The loss is GRPO's with the trainer's
current policy as pi_old (ratio 1 at the first update, as in synchronous GRPO) and each token
weighted by pi_old / pi_sampler, truncated (`vllm_importance_sampling_*`, rlft/core/importance.py;
decoupled PPO, Hilton et al. 2021, as AReaL uses it): the staleness is corrected, not ignored.
"""

from __future__ import annotations

from rlft.config import AsyncGRPOConfig
from rlft.errors import ConfigError
from rlft.train.grpo import GRPOTrainer, default_output_dir
from rlft.train.sources.worker_source import worker_parts


class AsyncGRPOTrainer(GRPOTrainer):
    """TRL 1.16's `trl.experimental.async_grpo.AsyncGRPOTrainer` names: `AsyncGRPOTrainer(model,
    reward_funcs, args=AsyncGRPOConfig(...), train_dataset=...).train()`; everything GRPOTrainer
    takes (tools and environments: rlft/train/sources/agent_driver.py) except rollout_func. TRL's
    `rollout_worker=` (the user's worker
    samples and scores; rlft trains on its samples) and `weight_transfer=` (how the weights reach
    it) replace the producer (rlft/train/sources/worker_source.py)."""

    _tag_names = ["trl", "async-grpo", "rlft"]
    _name = "AsyncGRPO"
    default_rollout_source = "producer"

    def __init__(self, model, reward_funcs=None, args: AsyncGRPOConfig | None = None, train_dataset=None,
                 rollout_worker=None, weight_transfer=None, **kwargs):
        args = args or AsyncGRPOConfig(output_dir=default_output_dir(model, "AsyncGRPO"))
        if not isinstance(args, AsyncGRPOConfig):
            raise ConfigError("AsyncGRPOTrainer takes an AsyncGRPOConfig, got "
                              f"{type(args).__name__}")
        # TRL's rollout_worker= / weight_transfer=: the user's worker replaces the producer
        self._worker = worker_parts(args, rollout_worker, weight_transfer, kwargs.get("eval_dataset"))
        if self._worker is not None:
            self.default_rollout_source = "worker"
        super().__init__(model, reward_funcs, args, train_dataset, **kwargs)
