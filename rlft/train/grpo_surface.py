"""What scripts and TRL's tests call on a GRPO trainer beyond `train()`: TRL's GRPOTrainer helper
methods under their names and signatures (thin wrappers over rlft/core/, where the maths lives), and
the attributes TRL users and older rlft code read off the trainer, each a view of the part that owns
it."""

from __future__ import annotations

import torch

from rlft.core.losses import off_policy_sequence_mask, vespo_weights
from rlft.core.regularizers import entropy_threshold, high_entropy_mask
from rlft.train.surface import TrainerSurface


def _counter(name: str) -> property:
    """The trainer's attribute of the same name reads and writes the policy update's counter."""
    return property(lambda self: getattr(self.updater.counters, name),
                    lambda self, value: setattr(self.updater.counters, name, value))


class GRPOSurface(TrainerSurface):
    """`get_high_entropy_mask`, `get_off_policy_mask`, `get_gamma_weights`; `aux_loss_enabled`,
    `generator`,
    ..."""

    entropy_coef, last_entropy, ref_syncs = _counter("entropy_coef"), _counter("last_entropy"), \
        _counter("ref_syncs")

    def get_high_entropy_mask(
        self, entropies: torch.Tensor, mask: torch.Tensor, threshold: float
    ) -> torch.Tensor:
        """TRL's: True where a token's entropy reaches the `threshold` quantile of every process's
        unpadded entropies (threshold = 1 - top_entropy_quantile); padding is never True. [B, T] x2
        -> [B, T] bool."""
        local = entropies[mask.bool()].float()
        gathered = self.accelerator.gather(
            self.accelerator.pad_across_processes(local, dim=0, pad_index=-1.0)
        )
        values = gathered[
            gathered >= 0
        ]  # entropies are >= 0: -1 marks the padding that evened out the lengths
        if values.numel() == 0:
            return torch.zeros_like(entropies, dtype=torch.bool)
        return high_entropy_mask(entropies, mask, entropy_threshold(values, 1.0 - threshold)).bool()

    @staticmethod
    def get_off_policy_mask(
        advantages: torch.Tensor,
        per_token_logps: torch.Tensor,
        sampling_per_token_logps: torch.Tensor,
        mask: torch.Tensor,
        off_policy_threshold: float,
    ) -> torch.Tensor:
        """TRL's DeepSeek-V3.2 sequence mask: [B, 1], 1 keeps a completion (rlft/core/losses.py)."""
        return off_policy_sequence_mask(
            advantages, per_token_logps, sampling_per_token_logps, mask, off_policy_threshold
        ).to(mask.dtype)

    @staticmethod
    def get_gamma_weights(
        advantages: torch.Tensor,
        log_ratio_per_token: torch.Tensor,
        mask: torch.Tensor,
        importance_sampling_ratio: torch.Tensor | None,
        k_pos: float = 2.0,
        lambda_pos: float = 3.0,
        k_neg: float = 3.0,
        lambda_neg: float = 2.0,
    ) -> torch.Tensor:
        """TRL's VESPO gamma weights phi(w): [B, 1] (rlft/core/losses.py: vespo_weights)."""
        return vespo_weights(
            log_ratio_per_token,
            mask,
            advantages,
            importance_sampling_ratio,
            k_pos,
            lambda_pos,
            k_neg,
            lambda_neg,
        )

    @property
    def aux_loss_enabled(self) -> bool:
        """A Mixture-of-Experts policy whose router load-balancing loss is added (TRL's
        attribute)."""
        return self.router_aux_loss_coef != 0.0

    @property
    def reward_func_names(self) -> list[str]:
        return list(self.reward_names)

    @property
    def _logs(self) -> dict:
        """TRL's view of the latest generation batch (what its completions table shows): prompt,
        completion, rewards per function, advantages, and the `log_extra` columns reward functions
        added."""
        samples = getattr(self, "_latest_samples", [])
        known = {"prompt", "completion", "reward", "advantage", *self.reward_names}
        extra = {k: [s[k] for s in samples] for k in (samples[0] if samples else {}) if k not in known}
        return {"prompt": [s["prompt"] for s in samples], "completion": [s["completion"] for s in samples],
                "rewards": {n: [s[n] for s in samples] for n in self.reward_names},
                "advantages": [s["advantage"] for s in samples], "extra": extra}

    @property
    def _environment_pool(self) -> dict:
        """TRL's name: each environment's reusable instances (a single factory's under None)."""
        return {} if self.environments is None else self.environments.pools

    # ---- views of the parts
    # --------------------------------------------------------------------------------
    @property
    def generator(self):
        """The rollout engine the source generates with (settable: a test stub, a user's own
        engine)."""
        return self.source.engine

    @generator.setter
    def generator(self, engine) -> None:
        self.source.engine = engine

    @property
    def token_level_advantages(self) -> bool:
        """The advantage estimator gives each token its own advantage (REINFORCE++)."""
        return self.estimator.token_level

    @property
    def kl_in_loss(self) -> bool:
        """beta weighs a per-token KL term of the loss, unless the estimator puts the KL in the
        reward."""
        return self.advantages.kl_in_loss

    @property
    def counters(self):
        return self.updater.counters

    @property
    def steps_skipped(self) -> int:
        return self.optim.skipped

    @property
    def loss_options(self):
        """The policy loss's options (None for an objective without one: distillation's)."""
        return getattr(self.updater.objective, "loss_options", None)
