"""Self-distillation's objective (SDFTTrainer: rlft/train/sdft.py): the student against itself shown
a privileged context, per TRL 1.16's SDFT loss (rlft/core/self_distill.py).

The loss of one optimiser step: each completion's token mean of the per-token objective over its
trained tokens (the policy's own tokens, less the first `num_loss_tokens_to_skip`), averaged over
every completion of the step on every process (TRL's sequence mean; counted before the first
micro-batch, so neither the micro-batch split nor the process count changes it). Where a rollout
feeds several optimiser steps (steps_per_generation > gradient_accumulation_steps, or
num_iterations > 1) the tokens are weighted by the clipped ratio to the policy that sampled them
(`distillation_is_clip`); a rollout sampled from the teacher's prompt (`generate_from_teacher`) is
not (TRL keeps no old log-probs then).
"""

from __future__ import annotations

import torch

from rlft.core.self_distill import SelfDistillMode, clipped_ratio, sequence_means
from rlft.train.update.distill_objective import DistillationObjective
from rlft.train.update.rollout_batch import RolloutBatch


def skip_first(mask: torch.Tensor, count: int) -> torch.Tensor:
    """`mask` [b, c] with each row's first `count` columns cleared (completions start at column 0)."""
    if count <= 0:
        return mask
    return mask * (torch.arange(mask.shape[1], device=mask.device) >= count)[None, :].to(mask.dtype)


class SelfDistillationObjective(DistillationObjective):
    """The module docstring's loss; the scorer's teacher is the student
    (rlft/train/update/self_teacher.py)."""

    teacher_is_student = True

    def __init__(self, alpha: float, mode: SelfDistillMode, clip: float | None, skip: int, old_logps: bool):
        super().__init__(alpha)
        self.mode, self.clip, self.skip = mode, clip, skip
        self.uses_old_logps = old_logps  # the clip's denominator

    @classmethod
    def build(cls, args, kl_in_reward: bool) -> SelfDistillationObjective:
        mode = SelfDistillMode(args.distillation_mode, args.distillation_topk, args.distillation_add_tail)
        clip = args.distillation_is_clip
        return cls(args.distillation_alpha, mode, clip, args.num_loss_tokens_to_skip,
                   clip is not None and not args.generate_from_teacher)

    def end_step(self, u, metrics: dict[str, float]) -> dict[str, float]:
        metrics = super().end_step(u, metrics)
        if "self_distillation/distillation_loss" in metrics:  # TRL logs it under both names
            metrics["sdft/distillation_loss"] = metrics["self_distillation/distillation_loss"]
        return metrics

    def micro_loss(self, u, batch: RolloutBatch, rows, num_items, num_sequences, corrections: list,
                   keep=None):
        """One micro-batch's share: the sum of its rows' token means / the step's completions."""
        rollout, old = batch.rollout, batch.old_logps if self.uses_old_logps else None
        value, logps, entropy, teacher_entropy = u.scorer.self_divergence(rollout, rows, self.beta, self.mode,
                                                                         with_logps=old is not None)
        width = value.shape[1]
        trained = (rollout.loss_mask if keep is None else keep)[rows, :width]
        mask = skip_first(trained, self.skip).to(value.dtype)
        if old is not None:
            value = value * clipped_ratio(logps, old[rows, :width], self.clip)
        loss = sequence_means(value, mask).sum() / num_sequences
        self._apart = self._apart or bool((value.detach() * mask).ne(0).any())
        tokens = mask.sum().clamp(min=1)
        metrics = {"self_distillation/distillation_loss": (value.detach() * mask).sum() / tokens}
        if teacher_entropy is not None:
            metrics["distill/teacher_entropy"] = (teacher_entropy * mask).sum() / tokens
        return loss, metrics, entropy, mask

    @torch.no_grad()
    def eval_loss(self, u, rollout, advantages: torch.Tensor, kl_in_loss: bool) -> float:
        """The sequence mean of the objective on evaluation completions (TRL's `eval_loss`)."""
        total, count = 0.0, 0
        for rows in u.scorer.micro_batches(rollout):
            value = u.scorer.self_divergence(rollout, rows, self.beta, self.mode, with_logps=False)[0]
            mask = skip_first(rollout.loss_mask[rows, :value.shape[1]], self.skip)
            total += float(sequence_means(value, mask).sum())
            count += value.shape[0]
        return total / max(count, 1)
