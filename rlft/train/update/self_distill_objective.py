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
from rlft.train.update.objectives import PolicyObjective
from rlft.train.update.rollout_batch import RolloutBatch


def distilled(rollout, rows, trained: torch.Tensor, value: torch.Tensor, logps, old, clip, num_sequences):
    """(the self-distillation share of a micro-batch: the sum of its rows' token means of `value`
    [b, c] over `trained` (less rows whose teacher adds nothing: `Rollout.teacher_rows`) / the step's
    completions, the mask it was over, `value` as weighted). `old`: the sampling policy's log-probs
    [b, c] of a reused rollout, whose tokens are weighted by the clipped ratio."""
    mask = trained.to(value.dtype)
    if rollout.teacher_rows is not None:
        mask = mask * rollout.teacher_rows[rows].to(value.dtype)[:, None]
    if old is not None:
        value = value * clipped_ratio(logps, old, clip)
    return sequence_means(value, mask).sum() / num_sequences, mask, value


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
        trained = skip_first((rollout.loss_mask if keep is None else keep)[rows, :width], self.skip)
        loss, mask, value = distilled(rollout, rows, trained, value, logps,
                                      None if old is None else old[rows, :width], self.clip, num_sequences)
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


class SDPOObjective(PolicyObjective):
    """SDPO's loss (rlft/train/sdpo.py): (1 - w) x GRPO's policy loss + w x the self-distillation
    share (`distilled`) over the rows whose teacher's prompt holds a sibling's success or feedback,
    both from one forward of the policy (w = distillation_weight; at 0 the teacher is never run)."""

    teacher_is_student = True

    def __init__(self, loss_options, loss_type: str, weight: float, alpha: float, mode: SelfDistillMode,
                 clip: float | None):
        super().__init__(loss_options, loss_type)
        self.weight, self.alpha, self.mode, self.clip = weight, alpha, mode, clip
        self._apart = False  # some taught token of this step has a nonzero objective (this process)

    def begin_step(self, u, batch: RolloutBatch) -> None:
        self._apart = False

    def weighted(self, u, kept: bool) -> bool:
        """With the policy term off (w = 1) the gradient is the self-distillation term's alone: zero,
        rightly, on a step where no row was reprompted or every teacher agrees with the student."""
        if self.weight < 1.0:
            return kept
        return DistillationObjective.weighted(self, u, kept)

    @classmethod
    def build(cls, args, kl_in_reward: bool) -> SDPOObjective:
        base = PolicyObjective.build(args, kl_in_reward)
        mode = SelfDistillMode(args.distillation_mode, args.distillation_topk, args.distillation_add_tail)
        return cls(base.loss_options, args.loss_type, args.distillation_weight, args.distillation_alpha, mode,
                   args.distillation_is_clip)

    def micro_loss(self, u, batch: RolloutBatch, rows, num_items, num_sequences, corrections: list,
                   keep=None):
        if self.weight == 0.0 or batch.rollout.teacher_prompt_ids is None:
            return super().micro_loss(u, batch, rows, num_items, num_sequences, corrections, keep)
        rollout, w = batch.rollout, self.weight
        value, logps, entropy, teacher_entropy = u.scorer.self_divergence(rollout, rows, self.alpha,
                                                                         self.mode, with_logps=True)
        policy, metrics, mask = self._policy_loss(u, batch, rows, logps, num_items, num_sequences, keep,
                                                  corrections)
        width, old = logps.shape[1], batch.old_logps
        clip_old = None if old is None or self.clip is None else old[rows, :width]
        share, taught, value = distilled(rollout, rows, mask, value, logps, clip_old, self.clip,
                                         num_sequences)
        loss = (1 - w) * policy + w * share if w < 1 else share + 0.0 * policy
        tokens = taught.sum().clamp(min=1)
        self._apart = self._apart or bool((value.detach() * taught).ne(0).any())
        metrics["distill_loss"] = (w * share).detach()
        metrics["self_distillation/distillation_loss"] = (value.detach() * taught).sum() / tokens
        if teacher_entropy is not None:
            metrics["distill/teacher_entropy"] = (teacher_entropy * taught).sum() / tokens
        return loss, metrics, entropy, mask

    @torch.no_grad()
    def eval_loss(self, u, rollout, advantages: torch.Tensor, kl_in_loss: bool) -> float:
        """(1 - w) x the policy term on-policy + w x the self-distillation term, on evaluation
        completions whose teacher prompts are built (SDPOSource.eval_scored)."""
        policy = super().eval_loss(u, rollout, advantages, kl_in_loss) if self.weight < 1 else 0.0
        if self.weight == 0.0 or rollout.teacher_prompt_ids is None:
            return policy
        total, count = 0.0, 0
        for rows in u.scorer.micro_batches(rollout):
            value = u.scorer.self_divergence(rollout, rows, self.alpha, self.mode, with_logps=False)[0]
            trained = rollout.loss_mask[rows, :value.shape[1]]
            share = distilled(rollout, rows, trained, value, None, None, None, 1)
            total, count = total + float(share[0]), count + value.shape[0]
        return (1 - self.weight) * policy + self.weight * total / max(count, 1)
