"""What an update optimises: an `Objective` gives the loss of each micro-batch from the scorer's
forwards (rlft/train/update/rollout_logprobs.py) and says what it needs; `PolicyUpdater`
(rlft/train/update/updater.py) runs the step around it (the step's normalisers, the micro-batches,
the gradient-flow check, the guarded optimiser step) and never looks inside it. A trainer names its
objective (`objective = PolicyObjective`); a new objective (a value model's loss, a supervised
warm-up) is a new class here and a trainer that names it.

`PolicyObjective`: GRPO's, RLOO's and async GRPO's: the clipped policy loss the config picks
(rlft/core/losses.py) on each completion's advantage, with the sampling correction of completions
another engine sampled, the entropy bonus, a MoE router's loss and the teacher term where asked.
Distillation's divergence is `DistillationObjective` (rlft/train/update/distill_objective.py).
"""

from __future__ import annotations

import dataclasses

import torch

from rlft.core.importance import CORRECTIONS, correction_stats, sampling_correction
from rlft.core.loss_grads import ClosedFormGrad, has_closed_form, token_loss_grad
from rlft.core.losses import LOSSES, LossOptions, off_policy_sequence_mask, policy_loss
from rlft.core.regularizers import entropy_bonus
from rlft.train.update.metrics import CLIP_MEAN_KEYS
from rlft.train.update.rollout_batch import RolloutBatch


class Objective:
    """The loss of an update and what it needs. Subclasses give `micro_loss` and `eval_loss`; the
    rest has defaults. Every method gets the updater `u` (its scorer, args, accelerator,
    counters)."""

    needs_rewards = True  # its loss reads advantages computed from reward functions' scores
    # a teacher is required (else GRPO's optional teacher term, teacher_coef > 0)
    needs_teacher = False
    teacher_is_student = False  # the trainer makes the teacher from the policy (self-distillation)
    progress_metric = "reward"  # the logged value the progress bar shows
    uses_old_logps = True  # the importance ratio's denominator when a rollout feeds several steps
    sequence_means: tuple[str, ...] = ()  # metrics averaged per sequence, not per token (StepSums)

    def needs_old_logps(self, args, rollout) -> bool:
        """A forward computes pi_old for a rollout that feeds several steps: the loss has a ratio, and
        the sampler's own log-probs do not stand for pi_old (`rollout_correction_bypass`)."""
        bypass = getattr(args, "rollout_correction_bypass", False) and rollout.sampling_logps is not None
        return self.uses_old_logps and not bypass

    @classmethod
    def build(cls, args, kl_in_reward: bool) -> Objective:
        """The objective for a run's config (`kl_in_reward`: beta's KL is in the reward, not in the
        loss)."""
        return cls()

    @classmethod
    def notes(cls, args) -> list[str]:
        """Warnings about the config, logged when the trainer is built."""
        return []

    def begin_step(self, u, batch: RolloutBatch) -> None:
        """Before the step's first micro-batch."""

    def has_signal(self, u, batch: RolloutBatch) -> bool:
        """Some process's rows carry a learning signal before the backward (the gradient-flow check
        runs at the first step that has one); `weighted` may still say no after it."""
        return float(u.accelerator.reduce(batch.advantages.abs().sum(), "sum")) > 0

    def weighted(self, u, kept: bool) -> bool:
        """After the backward: the step's gradient should be nonzero (`kept`: some token kept a
        nonzero sampling-correction weight on some process)."""
        return kept

    def end_step(self, u, metrics: dict[str, float]) -> dict[str, float]:
        """The step's metrics as logged."""
        return metrics

    def micro_loss(self, u, batch: RolloutBatch, rows, num_items, num_sequences, corrections: list,
                   keep=None):
        """(loss share, metrics, detached entropy or None, trained mask) of micro-batch `rows`: its
        share of the step loss, whose normalisers `num_items` / `num_sequences` count the whole
        step."""
        raise NotImplementedError

    def eval_loss(self, u, rollout, advantages: torch.Tensor, kl_in_loss: bool) -> float:
        raise NotImplementedError


def loss_notes(args) -> list[str]:
    """Loss options combined in a way their papers did not (TRL warns about the same): each loss's
    own (rlft/core/losses.py: LossSpec.notes), then the clip options'."""
    notes = LOSSES[args.loss_type].notes(args.importance_sampling_level)
    if args.delta is not None and args.delta <= 1 + (args.epsilon_high or args.epsilon):
        notes.append(f"delta={args.delta} is not above 1 + epsilon_high: it also caps ratios the "
                     "clip range allows")
    return notes


def _gradient_of(policy_part):
    """log-probs [b, c] -> dL/dlog p [b, c] of `policy_part(logps) -> (loss, ...)`, the loss's own
    code."""
    def gradient(logps: torch.Tensor) -> torch.Tensor:
        with torch.enable_grad():
            x = logps.detach().requires_grad_()
            (grad,) = torch.autograd.grad(policy_part(x)[0], x, allow_unused=True)
        return torch.zeros_like(x) if grad is None else grad
    return gradient


class PolicyObjective(Objective):
    """The policy-gradient loss of the GRPO family (module docstring), with its options
    (`LossOptions`: each loss's parameters, rlft/core/losses.py)."""

    def __init__(self, loss_options: LossOptions, loss_type: str):
        self.loss_options = loss_options
        self.sequence_means = CLIP_MEAN_KEYS if LOSSES[loss_type].clip_per_sequence else ()

    @classmethod
    def build(cls, args, kl_in_reward: bool) -> PolicyObjective:
        options = LossOptions.from_config(args)
        if kl_in_reward:  # beta is in the reward instead: no KL term in the loss
            options = dataclasses.replace(options, beta=0.0)
        return cls(options, args.loss_type)

    @classmethod
    def notes(cls, args) -> list[str]:
        return loss_notes(args)

    def micro_loss(self, u, batch: RolloutBatch, rows, num_items, num_sequences, corrections: list,
                   keep=None):
        """One micro-batch's share of the step loss. For a token-separable policy term the scorer is
        given its gradient as a function of the log-probs, so a trainable LM head forms its
        gradients in the forward (rlft/core/fused_head.py)."""
        args = u.args
        teacher = u.scorer.teacher is not None and args.teacher_coef > 0

        def policy_part(logps, record=None):
            return self._policy_loss(u, batch, rows, logps, num_items, num_sequences, keep, record)

        logps, entropy, router, logmass, divergence = u.scorer.forward(
            u.scorer.model, batch.rollout, rows, entropy=True, entropy_grad=u.entropy_bonus_on,
            router_loss=u.router_aux_loss_coef != 0.0, teacher=teacher,
            loss_grad=self._loss_grad(u, batch, rows, num_items, num_sequences, keep, policy_part))
        loss, metrics, mask = policy_part(logps, corrections)
        # the mass the sampler kept, under the policy now (per trained token)
        if logmass is not None:
            metrics["sampling/kept_mass/mean"] = (logmass.exp() * mask).sum() / mask.sum().clamp(min=1)
        loss = self._extra_terms(u, loss, metrics, entropy, router, mask, num_items)
        if divergence is not None:  # GRPO with a teacher: + coef x token-mean reverse KL to it
            share = args.teacher_coef * (divergence * mask).sum() / num_items
            loss = loss + share
            metrics["teacher_loss"] = share.detach()
            metrics["teacher/reverse_kl"] = (divergence * mask).sum() / mask.sum().clamp(min=1)
        return loss, metrics, None if entropy is None else entropy.detach(), mask

    def _policy_loss(self, u, batch: RolloutBatch, rows, logps, num_items, num_sequences, keep, corrections):
        """The policy term of a micro-batch's loss from its log-probs [b, c], its metrics and the
        trained mask. Completions sampled by another engine (vLLM) are weighted by pi_old /
        pi_sampler (`vllm_importance_sampling_*`, rlft/core/importance.py), their statistics
        appended to `corrections` (None: a prediction of the gradient, nothing recorded, no
        metrics)."""
        args = u.args
        inputs = _PolicyInputs.of(u, batch, rows, logps.shape[1], keep, logps.detach())
        mask, old, sampler, weights = inputs.mask, inputs.old, inputs.sampler, inputs.weights
        if sampler is not None and corrections is not None:
            if args.rollout_correction_bypass:  # the mismatch of the policy now, measured all the same
                corrections.append(correction_stats(logps.detach(), sampler, mask, torch.ones_like(sampler)))
            elif weights is not None:  # (the unbounded weights: how many a bound clipped)
                unbounded = sampling_correction(old, sampler, mask, args.vllm_importance_sampling_mode, None,
                                                None)
                corrections.append(correction_stats(old, sampler, mask, weights, unbounded))
        off_policy = None
        # the sampler's log-probs when another engine sampled
        if args.off_policy_mask_threshold is not None:
            off_policy = off_policy_sequence_mask(inputs.advantages, logps,
                                                  old if sampler is None else sampler, mask,
                                                  args.off_policy_mask_threshold)
        loss, metrics = policy_loss(
            logps, old, inputs.advantages, mask, loss_type=args.loss_type, options=self.loss_options,
            ref_logps=inputs.ref, num_items=num_items, num_sequences=num_sequences,
            rollout_is_weights=weights, keep=off_policy, with_metrics=corrections is not None)
        if off_policy is not None and corrections is not None:
            metrics["off_policy/masked_fraction"] = 1.0 - off_policy.mean()
        return loss, metrics, mask

    def _closed_form(self, u, batch: RolloutBatch, rows, num_items, num_sequences,
                     keep) -> ClosedFormGrad | None:
        """The policy term's dL/dlog p in closed form (rlft/core/loss_grads.py) for a token-separable
        loss, or None where it has none: a loss without one, or sampling-correction weights that read
        the log-probs themselves (no pi_old: each token's weight is then a function of its own
        log-prob, which the loss's own code handles)."""
        args = u.args
        weighted = batch.rollout.sampling_logps is not None and args.vllm_importance_sampling_correction \
            and not args.rollout_correction_bypass
        if weighted and batch.old_logps is None:
            return None

        def build(width: int):
            inputs = _PolicyInputs.of(u, batch, rows, width, keep, None)
            return token_loss_grad(inputs.old, inputs.advantages, inputs.mask, loss_type=args.loss_type,
                                   options=self.loss_options, ref_logps=inputs.ref, num_items=num_items,
                                   num_sequences=num_sequences, rollout_is_weights=inputs.weights)

        return ClosedFormGrad(build) if has_closed_form(args.loss_type, self.loss_options) else None

    def _loss_grad(self, u, batch: RolloutBatch, rows, num_items, num_sequences, keep, policy_part):
        """What the scorer is told of the policy term's gradient (Score.loss_grad): its closed form,
        else the loss's own code under autograd, for a token-separable term; None otherwise."""
        if not self._token_separable(u, batch):
            return None
        return self._closed_form(u, batch, rows, num_items, num_sequences, keep) or _gradient_of(policy_part)

    def _token_separable(self, u, batch: RolloutBatch) -> bool:
        """The policy term's gradient at a token reads that token's log-prob alone: a token-level
        ratio, a loss without a sequence-level preparation, no off-policy sequence mask, no
        sequence-level sampling weights computed from the log-probs themselves, and no entropy bonus
        (its gradient is the entropy's). (Where this is wrong the head's backward sees it and
        recomputes: exact either way.)"""
        args = u.args
        sequence_weights = (batch.rollout.sampling_logps is not None and batch.old_logps is None
                            and args.vllm_importance_sampling_correction
                            and CORRECTIONS[args.vllm_importance_sampling_mode].per_sequence)
        return (LOSSES[args.loss_type].prepare is None and args.importance_sampling_level == "token"
                and args.off_policy_mask_threshold is None and not u.entropy_bonus_on
                and not sequence_weights)

    def _extra_terms(self, u, loss, metrics: dict, entropy, router, mask, num_items):
        """The entropy bonus and a MoE router's load-balancing loss, added to a micro-batch's
        share."""
        args, counters = u.args, u.counters
        if u.entropy_bonus_on:
            applied = counters.entropy_coef if not args.use_adaptive_entropy \
                or counters.last_entropy <= args.entropy_target else 0.0
            share = entropy_bonus(entropy, mask, applied, num_items)
            loss = loss + share
            metrics["entropy_loss"] = share.detach()
        # TRL's: coef * aux_loss per micro-batch, averaged over micro-batches and processes
        if router is not None:
            share = u.router_aux_loss_coef * router / (args.gradient_accumulation_steps
                                                         * u.accelerator.num_processes)
            loss = loss + share
            metrics["aux_loss"], metrics["router_loss"] = router.detach(), share.detach()
        return loss

    @torch.no_grad()
    def eval_loss(self, u, rollout, advantages: torch.Tensor, kl_in_loss: bool) -> float:
        """The loss on evaluation completions (TRL's `eval_loss`): the policy on-policy (ratio 1),
        plus the KL term when beta > 0. Advantage 0 everywhere (greedy: one completion per prompt)
        without KL is exactly 0, and no forward pass is spent on it."""
        args = u.args
        signal = torch.tensor(float(advantages.abs().sum()), device=u.accelerator.device)
        # every process skips the forward together (sharded engines)
        if u.accelerator.num_processes > 1:
            signal = u.accelerator.reduce(signal, "max")
        if (args.kl_coef == 0 or not kl_in_loss) and float(signal) == 0:
            return 0.0
        logps = u.scorer.logps(u.scorer.model, rollout)
        ref = u.scorer.reference_logps(rollout) if args.kl_coef > 0 and kl_in_loss else None
        loss, _ = policy_loss(logps, logps, advantages.to(logps.device), rollout.loss_mask,
                              loss_type=args.loss_type, options=self.loss_options, ref_logps=ref)
        return loss.item()


@dataclasses.dataclass
class _PolicyInputs:
    """What the policy loss of micro-batch `rows` reads besides its log-probs, cut to `width` columns:
    the trained mask, pi_old (the sampler's under `rollout_correction_bypass`; else the rollout's
    pi_old, or `current`: the log-probs now, detached, None for a closed form), the sampler's
    log-probs, the sampling-correction weights, the advantages and the reference log-probs."""

    mask: torch.Tensor
    old: torch.Tensor | None
    sampler: torch.Tensor | None
    weights: torch.Tensor | None
    advantages: torch.Tensor
    ref: torch.Tensor | None

    @classmethod
    def of(cls, u, batch: RolloutBatch, rows, width: int, keep, current) -> _PolicyInputs:
        args, rollout = u.args, batch.rollout
        mask = (rollout.loss_mask if keep is None else keep)[rows, :width]
        old = batch.old_logps[rows, :width] if batch.old_logps is not None else current
        sampler = rollout.sampling_logps[rows, :width] if rollout.sampling_logps is not None else None
        weights = None
        if sampler is not None and args.rollout_correction_bypass:  # the sampler is pi_old: no weight
            old = sampler
        elif sampler is not None and args.vllm_importance_sampling_correction:
            weights = sampling_correction(old, sampler, mask, args.vllm_importance_sampling_mode,
                                          args.vllm_importance_sampling_clip_min,
                                          args.vllm_importance_sampling_cap
                                          or args.vllm_importance_sampling_clip_max)
        advantages = batch.advantages[rows]  # [b], or [b, C] per token (REINFORCE++)
        advantages = advantages if advantages.ndim == 1 else advantages[:, :width]
        ref = None if batch.ref_logps is None else batch.ref_logps[rows, :width]
        return cls(mask, old, sampler, weights, advantages, ref)
