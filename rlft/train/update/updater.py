"""The policy update: `PolicyUpdater.step(batch) -> metrics` on one optimiser step's rows, for the
objective it is given (rlft/train/update/objectives.py: GRPO's policy loss, distillation's
divergence, ...).

One optimiser step runs micro-batches whose losses are shares of one step loss: the normalisers
(completion count, token count) are counted over the whole step and all processes before the first
micro-batch; the objective gives each micro-batch's share. The entropy mask (top_entropy_quantile)
picks the tokens trained on, whatever the objective. A step with no trainable token, or
whose loss or gradient norm is not finite, is skipped (rlft/train/update/optimization.py); the
weights never see a non-finite value. TR-DPO's reference sync (`sync_reference`) and the counters
that must survive a resume are the updater's too (`state_dict()`).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from rlft.core.regularizers import adaptive_entropy_coef, entropy_threshold, high_entropy_mask, mix_reference
from rlft.model.loading import GradientFlowError, check_gradient_flow
from rlft.train.run.checkpoint import PartState
from rlft.train.update.metrics import StepSums, correction_metrics, route_metrics
from rlft.train.update.objectives import Objective
from rlft.train.update.rollout_batch import RolloutBatch


@dataclass
class UpdateCounters:
    """What the policy update carries from step to step (rlft_state.json, under these names)."""

    # the gradient-flow check ran (once, at the first step with a learning signal)
    flow_checked: bool = False
    # the entropy bonus's coefficient (Skywork-OR1's adaptive control moves it)
    entropy_coef: float = 0.0
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


def nonfinite_reason(args, loss: float, grad_norm: float | None) -> str:
    return (f"the loss ({loss}) or gradient norm ({grad_norm}) is not finite. Likely causes: a "
            f"learning rate too high (now {args.learning_rate}), rewards so large they overflow, "
            "or float16 weights overflowing (use bfloat16 or float32)")


class PolicyUpdater:
    """The policy's optimiser step on a RolloutBatch: `scorer`
    (rlft/train/update/rollout_logprobs.py) for the forwards, `objective` for each micro-batch's
    loss, `optim` (rlft/train/update/optimization.py) for the guarded step."""

    def __init__(self, scorer, optim, args, accelerator, objective: Objective, throughput,
                 router_aux_loss_coef: float = 0.0):
        self.scorer, self.optim, self.args, self.accelerator = scorer, optim, args, accelerator
        self.objective, self.throughput = objective, throughput
        self.router_aux_loss_coef = router_aux_loss_coef
        self.counters = UpdateCounters(entropy_coef=args.entropy_coef)

    @property
    def entropy_bonus_on(self) -> bool:
        return self.args.entropy_coef != 0.0 or self.args.use_adaptive_entropy

    def step(self, batch: RolloutBatch) -> dict[str, float]:
        """One optimiser step on `batch` (one step's rows): its micro-batches, then the guarded
        step."""
        acc, started, rollout = self.accelerator, time.perf_counter(), batch.rollout
        self.scorer.model.train()
        self.objective.begin_step(self, batch)
        # top_entropy_quantile < 1: the tokens this step trains on
        keep, extra = self._entropy_keep(rollout)
        trained = rollout.loss_mask if keep is None else keep
        # Global normalisers: the whole step, every micro-batch, every process.
        num_items = acc.reduce(trained.sum().float(), "sum")
        num_sequences = rollout.completion_ids.shape[0] * acc.num_processes
        if float(num_items) == 0:  # e.g. mask_truncated_completions and every completion truncated
            self.optim.skip("no completion token is left to train on (every completion was masked, "
                            "e.g. mask_truncated_completions with every completion truncated): "
                            "raise max_completion_length", nonfinite=False)
            return self._skipped(self.optim.learning_rate, started)
        sums, corrections = StepSums(self.objective.sequence_means), []
        # Checked at the first step with a learning signal on any process: with all advantages 0
        # (and LoRA's B = 0 making policy == reference) a zero gradient is correct, not a wiring
        # fault.
        check_flow = not self.counters.flow_checked and self.objective.has_signal(self, batch)
        if check_flow:
            self.optim.engine.watch_grads(self.scorer.model)
        self._backward(batch, keep, num_items, num_sequences, sums, corrections)
        metrics = self._finish(sums, started, check_flow, self._weighted(corrections))
        # an applied step: how much of the machine its forward + backward used
        if "grad_norm" in metrics:
            metrics.update(self.throughput.training(rollout, metrics["time/train_seconds"]))
        metrics.update(extra)
        # a skipped step measured nothing: no update
        if self.entropy_bonus_on and "entropy" in metrics:
            metrics.update(self._entropy_control(metrics["entropy"]))
        metrics = {**metrics, **correction_metrics(corrections, acc)} if corrections else metrics
        metrics.update(route_metrics(self.scorer.model, acc, rollout))  # MoE routing replay
        return self.objective.end_step(self, metrics)

    def _backward(self, batch, keep, num_items, num_sequences, sums: StepSums, corrections: list) -> None:
        model, engine = self.scorer.model, self.optim.engine
        batches = self.scorer.micro_batches(batch.rollout)
        for k, rows in enumerate(batches):
            with engine.micro_batch(model, last=k == len(batches) - 1):
                loss, metrics, entropy, mask = self.objective.micro_loss(self, batch, rows, num_items,
                                                                         num_sequences, corrections, keep)
                if not loss.requires_grad:
                    raise GradientFlowError("the loss does not require grad: no trainable "
                                            "parameter is connected to it (all parameters frozen, "
                                            "or adapters disabled)")
                # DDP, FSDP and ZeRO average gradients over processes; the normalisers are global
                # sums: undo the mean.
                engine.backward(model, loss * self.accelerator.num_processes)
            sums.add(loss, metrics, entropy, mask)

    def _weighted(self, corrections: list) -> bool:
        """The step's gradient should be nonzero: some token kept a nonzero sampling-correction
        weight on some process (a *_mask correction can zero every one: then a zero gradient is
        right, not a wiring fault), and the objective agrees."""
        kept = True
        if corrections:
            kept = torch.tensor(float(sum(float(c["ratio_sum"]) for c in corrections) > 0),
                                device=self.accelerator.device)
            if self.accelerator.num_processes > 1:
                kept = self.accelerator.reduce(kept, "max")
            kept = bool(kept.item() > 0)
        return self.objective.weighted(self, kept)

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
        """top_entropy_quantile < 1: a no-grad pass over the step's micro-batches gives every
        completion token's entropy (the weights do not change within a step, so these are the
        entropies the loss pass sees); the threshold is the quantile over all of them on every
        process, so the mask does not depend on the split."""
        quantile = self.args.top_entropy_quantile
        if quantile >= 1.0:
            return None, {}
        acc, mask = self.accelerator, rollout.loss_mask
        entropies = self.scorer.entropies(rollout)  # [N, C]
        values = entropies[mask.bool()]
        # entropies are >= 0: -1 marks the padding that evens out the lengths
        if acc.num_processes > 1:
            values = acc.gather(acc.pad_across_processes(values, dim=0, pad_index=-1.0))
            values = values[values >= 0]
        threshold = entropy_threshold(values, quantile)
        keep = high_entropy_mask(entropies, mask, threshold)
        kept, total = acc.reduce(torch.stack([keep.sum(), mask.sum()]).float(), "sum").tolist()
        return keep, {"entropy_mask/threshold": threshold.item(),
                      "entropy_mask/kept_fraction": kept / max(total, 1)}

    def _entropy_control(self, step_entropy: float) -> dict[str, float]:
        """Skywork-OR1's update for the next step; logs the coefficient after it (TRL's
        `entropy_coef`)."""
        args, counters = self.args, self.counters
        if args.use_adaptive_entropy:
            counters.entropy_coef = adaptive_entropy_coef(counters.entropy_coef, step_entropy,
                                                          args.entropy_target, args.entropy_coef_delta,
                                                          args.entropy_coef_min, args.entropy_coef_max)
            counters.last_entropy = step_entropy
        return {"entropy_coef": counters.entropy_coef}

    # ---- evaluation and the reference
    # ------------------------------------------------------------------
    def eval_loss(self, rollout, advantages: torch.Tensor, kl_in_loss: bool) -> float:
        """The objective's loss on evaluation completions (TRL's `eval_loss`)."""
        return self.objective.eval_loss(self, rollout, advantages, kl_in_loss)

    def sync_reference(self, step: int) -> dict[str, float]:
        """TR-DPO: every ref_model_sync_steps optimiser steps the reference moves toward the policy
        (rlft/core/regularizers.py: mix_reference). Rollouts made before a sync keep their reference
        log-probs. A self-teacher's moving average moves here too (rlft/train/update/self_teacher.py)."""
        args, ref, teacher = self.args, self.scorer.ref_model, self.scorer.teacher
        metrics = teacher.after_step(step) if hasattr(teacher, "after_step") else {}
        if not args.sync_ref_model or ref is None or step % args.ref_model_sync_steps:
            return metrics
        policy = self.accelerator.unwrap_model(self.scorer.model)
        for mine, current in zip(ref.parameters(), policy.parameters(), strict=True):
            mix_reference(mine.data, current.data, args.ref_model_mixup_alpha)
        self.counters.ref_syncs += 1
        return {**metrics, "ref_model/syncs": float(self.counters.ref_syncs)}

    # ---- checkpoints
    # ----------------------------------------------------------------------------------
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
