"""The policy update of a GRPO step: `PolicyUpdater.step(batch) -> metrics` on one optimiser step's rows.

One optimiser step runs micro-batches whose losses are shares of one step loss: the normalisers (completion
count, token count) are counted over the whole step and all processes before the first micro-batch. The loss
is the one the config picks (rlft/core/losses.py), with the sampling correction of completions another engine
sampled, the entropy mask / bonus and a MoE router's loss where asked. A step with no trainable token, or
whose loss or gradient norm is not finite, is skipped (rlft/train/update/optimization.py); the weights never
see a non-finite value. TR-DPO's reference sync (`sync_reference`) and the counters that must survive a resume
are the updater's too (`state_dict()`).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from rlft.core.importance import correction_stats, sampling_correction
from rlft.core.losses import LOSSES, LossOptions, off_policy_sequence_mask, policy_loss
from rlft.core.regularizers import (
    adaptive_entropy_coef,
    entropy_bonus,
    entropy_threshold,
    high_entropy_mask,
    mix_reference,
)
from rlft.model.loading import GradientFlowError, check_gradient_flow
from rlft.train.run.checkpoint import PartState
from rlft.train.update.metrics import CLIP_MEAN_KEYS, StepSums, correction_metrics
from rlft.train.update.rollout_batch import RolloutBatch


@dataclass
class UpdateCounters:
    """What the policy update carries from step to step (rlft_state.json, under these names)."""

    flow_checked: bool = False  # the gradient-flow check ran (once, at the first step with a learning signal)
    entropy_coef: float = 0.0  # the entropy bonus's coefficient (Skywork-OR1's adaptive control moves it)
    last_entropy: float = math.inf  # the previous step's entropy, for that control
    ref_syncs: int = 0  # sync_ref_model updates of the reference

    def state_dict(self) -> dict:
        return {"flow_checked": self.flow_checked, "entropy_coef": self.entropy_coef,
                "last_entropy": None if math.isinf(self.last_entropy) else self.last_entropy,
                "ref_syncs": self.ref_syncs}

    def load_state_dict(self, state: dict) -> None:
        self.flow_checked = state.get("flow_checked", False)
        self.entropy_coef = state.get("entropy_coef", self.entropy_coef)
        self.last_entropy = math.inf if state.get("last_entropy") is None else state["last_entropy"]
        self.ref_syncs = state.get("ref_syncs", 0)


def option_notes(args) -> list[str]:
    """Loss options combined in a way their papers did not (TRL warns about the same)."""
    notes = []
    if args.loss_type == "luspo" and args.importance_sampling_level != "sequence":
        notes.append("loss_type luspo is GSPO's sequence-level loss weighted by length: the paper uses "
                     "importance_sampling_level: sequence (now token)")
    if args.loss_type == "vespo" and args.importance_sampling_level != "token":
        notes.append("loss_type vespo computes its own sequence weight from token ratios; "
                     "importance_sampling_level only changes the clip metrics: leave it at token")
    if (args.importance_sampling_level == "sequence"
            and args.loss_type in ("bnpo", "dr_grpo", "dapo", "cispo")):
        notes.append(f"importance_sampling_level: sequence with loss_type {args.loss_type!r}: the loss sums "
                     "per-token contributions, which effectively weights each sequence by its completion "
                     "length instead of the per-sequence objective; GSPO's setup is loss_type: grpo")
    if args.delta is not None and args.delta <= 1 + (args.epsilon_high or args.epsilon):
        notes.append(f"delta={args.delta} is not above 1 + epsilon_high: it also caps ratios the clip range "
                     "allows")
    return notes


def _gradient_of(policy_part):
    """log-probs [b, c] -> dL/dlog p [b, c] of `policy_part(logps) -> (loss, ...)`, the loss's own code."""
    def gradient(logps: torch.Tensor) -> torch.Tensor:
        with torch.enable_grad():
            x = logps.detach().requires_grad_()
            (grad,) = torch.autograd.grad(policy_part(x)[0], x, allow_unused=True)
        return torch.zeros_like(x) if grad is None else grad
    return gradient


def nonfinite_reason(args, loss: float, grad_norm: float | None) -> str:
    return (f"the loss ({loss}) or gradient norm ({grad_norm}) is not finite. Likely causes: a learning "
            f"rate too high (now {args.learning_rate}), rewards so large they overflow, or float16 "
            "weights overflowing (use bfloat16 or float32)")


class PolicyUpdater:
    """The policy's optimiser step on a RolloutBatch: `scorer` (rlft/train/update/rollout_logprobs.py) for the
    forwards, `optim` (rlft/train/update/optimization.py) for the guarded step."""

    uses_old_logps = True  # the importance ratio's denominator when a rollout feeds several steps

    def __init__(self, scorer, optim, args, accelerator, loss_options: LossOptions, throughput,
                 router_aux_loss_coef: float = 0.0):
        self.scorer, self.optim, self.args, self.accelerator = scorer, optim, args, accelerator
        self.loss_options, self.throughput = loss_options, throughput
        self.router_aux_loss_coef = router_aux_loss_coef
        self.counters = UpdateCounters(entropy_coef=args.entropy_coef)

    @property
    def entropy_bonus_on(self) -> bool:
        return self.args.entropy_coef != 0.0 or self.args.use_adaptive_entropy

    def step(self, batch: RolloutBatch) -> dict[str, float]:
        """One optimiser step on `batch` (one step's rows): its micro-batches, then the guarded step."""
        acc, started, rollout = self.accelerator, time.perf_counter(), batch.rollout
        self.scorer.model.train()
        keep, extra = self._entropy_keep(rollout)  # top_entropy_quantile < 1: the tokens this step trains on
        trained = rollout.loss_mask if keep is None else keep
        # Global normalisers: the whole step, every micro-batch, every process.
        num_items = acc.reduce(trained.sum().float(), "sum")
        num_sequences = rollout.completion_ids.shape[0] * acc.num_processes
        if float(num_items) == 0:  # e.g. mask_truncated_completions and every completion truncated
            self.optim.skip("no completion token is left to train on (every completion was masked, e.g. "
                            "mask_truncated_completions with every completion truncated): raise "
                            "max_completion_length", nonfinite=False)
            return self._skipped(self.optim.learning_rate, started)
        per_sequence = CLIP_MEAN_KEYS if LOSSES[self.args.loss_type].clip_per_sequence else ()
        sums, corrections = StepSums(per_sequence), []
        # Checked at the first step with a learning signal on any process: with all advantages 0 (and LoRA's
        # B = 0 making policy == reference) a zero gradient is correct, not a wiring fault.
        check_flow = not self.counters.flow_checked and self._has_signal(batch)
        if check_flow:
            self.optim.engine.watch_grads(self.scorer.model)
        self._backward(batch, keep, num_items, num_sequences, sums, corrections)
        metrics = self._finish(sums, started, check_flow, self._weighted(corrections))
        if "grad_norm" in metrics:  # an applied step: how much of the machine its forward + backward used
            metrics.update(self.throughput.training(rollout, metrics["time/train_seconds"]))
        metrics.update(extra)
        if self.entropy_bonus_on and "entropy" in metrics:  # a skipped step measured nothing: no update
            metrics.update(self._entropy_control(metrics["entropy"]))
        return {**metrics, **correction_metrics(corrections, acc)} if corrections else metrics

    def _has_signal(self, batch: RolloutBatch) -> bool:
        """Some process's rows carry a learning signal (a nonzero advantage)."""
        return float(self.accelerator.reduce(batch.advantages.abs().sum(), "sum")) > 0

    def _backward(self, batch, keep, num_items, num_sequences, sums: StepSums, corrections: list) -> None:
        model, engine = self.scorer.model, self.optim.engine
        batches = self.scorer.micro_batches(batch.rollout)
        for k, rows in enumerate(batches):
            with engine.micro_batch(model, last=k == len(batches) - 1):
                loss, metrics, entropy, mask = self._micro_loss(batch, rows, num_items, num_sequences,
                                                                corrections, keep)
                if not loss.requires_grad:
                    raise GradientFlowError("the loss does not require grad: no trainable parameter is "
                                            "connected to it (all parameters frozen, or adapters disabled)")
                # DDP, FSDP and ZeRO average gradients over processes; the normalisers are global sums: undo
                # the mean.
                engine.backward(model, loss * self.accelerator.num_processes)
            sums.add(loss, metrics, entropy, mask)

    def _weighted(self, corrections: list) -> bool:
        """Some token kept a nonzero sampling-correction weight on some process (a *_mask correction can zero
        every one: then a zero gradient is right, not a wiring fault)."""
        if not corrections:
            return True
        kept = torch.tensor(float(sum(float(c["ratio_sum"]) for c in corrections) > 0),
                            device=self.accelerator.device)
        if self.accelerator.num_processes > 1:
            kept = self.accelerator.reduce(kept, "max")
        return bool(kept.item() > 0)

    def _finish(self, sums: StepSums, started: float, check_flow: bool, weighted: bool) -> dict[str, float]:
        metrics = sums.reduce(self.accelerator)
        loss = metrics["loss"]

        def check() -> None:
            grads = self.optim.engine.grads(self.scorer.model)  # (releases what watch_grads set up)
            if weighted:  # else checked at the next step with a learning signal
                check_gradient_flow(grads)
                self.counters.flow_checked = True

        outcome = self.optim.apply(math.isfinite(loss), lambda norm: nonfinite_reason(self.args, loss, norm),
                                   before_step=check if check_flow else None)
        if not outcome.applied:
            return self._skipped(outcome.learning_rate, started)
        metrics.update({"grad_norm": outcome.grad_norm, "learning_rate": outcome.learning_rate,
                        "steps_skipped": self.optim.skipped,
                        "time/train_seconds": time.perf_counter() - started})
        return metrics

    def _skipped(self, learning_rate: float, started: float) -> dict[str, float]:
        return {"learning_rate": learning_rate, "steps_skipped": self.optim.skipped,
                "time/train_seconds": time.perf_counter() - started}

    @torch.no_grad()
    def _entropy_keep(self, rollout) -> tuple[torch.Tensor | None, dict[str, float]]:
        """top_entropy_quantile < 1: a no-grad pass over the step's micro-batches gives every completion
        token's entropy (the weights do not change within a step, so these are the entropies the loss pass
        sees); the threshold is the quantile over all of them on every process, so the mask does not depend on
        the split."""
        quantile = self.args.top_entropy_quantile
        if quantile >= 1.0:
            return None, {}
        acc, mask = self.accelerator, rollout.loss_mask
        entropies = self.scorer.entropies(rollout)  # [N, C]
        values = entropies[mask.bool()]
        if acc.num_processes > 1:  # entropies are >= 0: -1 marks the padding that evens out the lengths
            values = acc.gather(acc.pad_across_processes(values, dim=0, pad_index=-1.0))
            values = values[values >= 0]
        threshold = entropy_threshold(values, quantile)
        keep = high_entropy_mask(entropies, mask, threshold)
        kept, total = acc.reduce(torch.stack([keep.sum(), mask.sum()]).float(), "sum").tolist()
        return keep, {"entropy_mask/threshold": threshold.item(),
                      "entropy_mask/kept_fraction": kept / max(total, 1)}

    def _entropy_control(self, step_entropy: float) -> dict[str, float]:
        """Skywork-OR1's update for the next step; logs the coefficient after it (TRL's `entropy_coef`)."""
        args, counters = self.args, self.counters
        if args.use_adaptive_entropy:
            counters.entropy_coef = adaptive_entropy_coef(counters.entropy_coef, step_entropy,
                                                          args.entropy_target, args.entropy_coef_delta,
                                                          args.entropy_coef_min, args.entropy_coef_max)
            counters.last_entropy = step_entropy
        return {"entropy_coef": counters.entropy_coef}

    def _micro_loss(self, batch: RolloutBatch, rows, num_items, num_sequences, corrections: list, keep=None):
        """One micro-batch's share of the step loss. For a token-separable policy term the scorer is given its
        gradient as a function of the log-probs, so a trainable LM head forms its gradients in the forward
        (rlft/core/fused_head.py)."""
        args = self.args
        teacher = self.scorer.teacher is not None and args.teacher_coef > 0

        def policy_part(logps, record=None):
            return self._policy_loss(batch, rows, logps, num_items, num_sequences, keep, record)

        logps, entropy, router, logmass, divergence = self.scorer.forward(
            self.scorer.model, batch.rollout, rows, entropy=True, entropy_grad=self.entropy_bonus_on,
            router_loss=self.router_aux_loss_coef != 0.0, teacher=teacher,
            loss_grad=_gradient_of(policy_part) if self._token_separable(batch) else None)
        loss, metrics, mask = policy_part(logps, corrections)
        if logmass is not None:  # the mass the sampler kept, under the policy now (per trained token)
            metrics["sampling/kept_mass/mean"] = (logmass.exp() * mask).sum() / mask.sum().clamp(min=1)
        loss = self._extra_terms(loss, metrics, entropy, router, mask, num_items)
        if divergence is not None:  # GRPO with a teacher: + coef x token-mean reverse KL to it
            share = args.teacher_coef * (divergence * mask).sum() / num_items
            loss = loss + share
            metrics["teacher_loss"] = share.detach()
            metrics["teacher/reverse_kl"] = (divergence * mask).sum() / mask.sum().clamp(min=1)
        return loss, metrics, None if entropy is None else entropy.detach(), mask

    def _policy_loss(self, batch: RolloutBatch, rows, logps, num_items, num_sequences, keep, corrections):
        """The policy term of a micro-batch's loss from its log-probs [b, c], its metrics and the trained
        mask. Completions sampled by another engine (vLLM) are weighted by pi_old / pi_sampler
        (`vllm_importance_sampling_*`, rlft/core/importance.py), their statistics appended to `corrections`
        (None: a prediction of the gradient, nothing recorded, no metrics)."""
        args, rollout = self.args, batch.rollout
        width = logps.shape[1]
        mask = (rollout.loss_mask if keep is None else keep)[rows, :width]
        old = batch.old_logps[rows, :width] if batch.old_logps is not None else logps.detach()
        sampler = rollout.sampling_logps[rows, :width] if rollout.sampling_logps is not None else None
        weights = None
        if sampler is not None and args.vllm_importance_sampling_correction:
            weights = sampling_correction(old, sampler, mask, args.vllm_importance_sampling_mode,
                                          args.vllm_importance_sampling_clip_min,
                                          args.vllm_importance_sampling_cap
                                          or args.vllm_importance_sampling_clip_max)
            if corrections is not None:
                corrections.append(correction_stats(old, sampler, mask, weights))
        advantages = batch.advantages[rows]  # [b], or [b, C] per token (REINFORCE++)
        advantages = advantages if advantages.ndim == 1 else advantages[:, :width]
        off_policy = None
        if args.off_policy_mask_threshold is not None:  # the sampler's log-probs when another engine sampled
            off_policy = off_policy_sequence_mask(advantages, logps, old if sampler is None else sampler,
                                                  mask, args.off_policy_mask_threshold)
        loss, metrics = policy_loss(
            logps, old, advantages, mask, loss_type=args.loss_type, options=self.loss_options,
            ref_logps=None if batch.ref_logps is None else batch.ref_logps[rows, :width], num_items=num_items,
            num_sequences=num_sequences, rollout_is_weights=weights, keep=off_policy,
            with_metrics=corrections is not None)
        if off_policy is not None and corrections is not None:
            metrics["off_policy/masked_fraction"] = 1.0 - off_policy.mean()
        return loss, metrics, mask

    def _token_separable(self, batch: RolloutBatch) -> bool:
        """The policy term's gradient at a token reads that token's log-prob alone: a token-level ratio, a
        loss without a sequence-level preparation, no off-policy sequence mask, no sequence-level sampling
        weights computed from the log-probs themselves, and no entropy bonus (its gradient is the entropy's).
        (Where this is wrong the head's backward sees it and recomputes: exact either way.)"""
        args = self.args
        sequence_weights = (batch.rollout.sampling_logps is not None and batch.old_logps is None
                            and args.vllm_importance_sampling_correction
                            and args.vllm_importance_sampling_mode.startswith("sequence"))
        return (LOSSES[args.loss_type].prepare is None and args.importance_sampling_level == "token"
                and args.off_policy_mask_threshold is None and not self.entropy_bonus_on
                and not sequence_weights)

    def _extra_terms(self, loss, metrics: dict, entropy, router, mask, num_items):
        """The entropy bonus and a MoE router's load-balancing loss, added to a micro-batch's share."""
        args, counters = self.args, self.counters
        if self.entropy_bonus_on:
            applied = counters.entropy_coef if not args.use_adaptive_entropy \
                or counters.last_entropy <= args.entropy_target else 0.0
            share = entropy_bonus(entropy, mask, applied, num_items)
            loss = loss + share
            metrics["entropy_loss"] = share.detach()
        # TRL's: coef * aux_loss per micro-batch, averaged over micro-batches and processes
        if router is not None:
            share = self.router_aux_loss_coef * router / (args.gradient_accumulation_steps
                                                         * self.accelerator.num_processes)
            loss = loss + share
            metrics["aux_loss"], metrics["router_loss"] = router.detach(), share.detach()
        return loss

    # ---- evaluation and the reference ------------------------------------------------------------------
    @torch.no_grad()
    def eval_loss(self, rollout, advantages: torch.Tensor, kl_in_loss: bool) -> float:
        """The loss on evaluation completions (TRL's `eval_loss`): the policy on-policy (ratio 1), plus the KL
        term when beta > 0. Advantage 0 everywhere (greedy: one completion per prompt) without KL is exactly
        0, and no forward pass is spent on it."""
        args = self.args
        signal = torch.tensor(float(advantages.abs().sum()), device=self.accelerator.device)
        if self.accelerator.num_processes > 1:  # every process skips the forward together (sharded engines)
            signal = self.accelerator.reduce(signal, "max")
        if (args.kl_coef == 0 or not kl_in_loss) and float(signal) == 0:
            return 0.0
        logps = self.scorer.logps(self.scorer.model, rollout)
        ref = self.scorer.reference_logps(rollout) if args.kl_coef > 0 and kl_in_loss else None
        loss, _ = policy_loss(logps, logps, advantages.to(logps.device), rollout.loss_mask,
                              loss_type=args.loss_type, options=self.loss_options, ref_logps=ref)
        return loss.item()

    def sync_reference(self, step: int) -> dict[str, float]:
        """TR-DPO: every ref_model_sync_steps optimiser steps the reference moves toward the policy
        (rlft/core/regularizers.py: mix_reference). Rollouts made before a sync keep their reference
        log-probs."""
        args, ref = self.args, self.scorer.ref_model
        if not args.sync_ref_model or ref is None or step % args.ref_model_sync_steps:
            return {}
        policy = self.accelerator.unwrap_model(self.scorer.model)
        for mine, current in zip(ref.parameters(), policy.parameters(), strict=True):
            mix_reference(mine.data, current.data, args.ref_model_mixup_alpha)
        self.counters.ref_syncs += 1
        return {"ref_model/syncs": float(self.counters.ref_syncs)}

    # ---- checkpoints ----------------------------------------------------------------------------------
    def state_dict(self) -> PartState:
        """The counters (rlft_state.json) and a moved reference (tensors, `ref_model.<name>`)."""
        tensors, ref = {}, self.scorer.ref_model
        if self.args.sync_ref_model and ref is not None:
            tensors = {f"ref_model.{name}": value.detach().clone()
                       for name, value in ref.state_dict().items()}
        return PartState(state={**self.optim.state_dict(), **self.counters.state_dict()}, tensors=tensors)

    def load_state_dict(self, part: PartState) -> None:
        self.optim.load_state_dict(part.state)
        self.counters.load_state_dict(part.state)
        ref = {k[len("ref_model."):]: v for k, v in part.tensors.items() if k.startswith("ref_model.")}
        if ref and self.scorer.ref_model is not None:
            self.scorer.ref_model.load_state_dict(ref, strict=True)
