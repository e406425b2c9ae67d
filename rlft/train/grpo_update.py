"""The policy-update half of GRPOTrainer: log-probs, micro-batches, one guarded optimiser step.

One optimiser step runs gradient_accumulation_steps micro-batches whose losses are shares of one
step loss: the normalisers (completion count, token count) are counted over the whole step and
all processes before the first micro-batch. A step with no trainable token, or whose loss or
gradient norm is not finite, is skipped (no optimiser step), counted and explained; the weights
never see a non-finite value.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field

import torch

from rlft.core.advantages import multi_reward_advantages
from rlft.core.batching import balanced_bins, budget_count
from rlft.core.importance import correction_stats, sampling_correction
from rlft.core.losses import LOSSES, LossOptions, off_policy_sequence_mask, policy_loss
from rlft.core.regularizers import (
    adaptive_entropy_coef,
    entropy_bonus,
    entropy_threshold,
    high_entropy_mask,
    mix_reference,
)
from rlft.errors import NonFiniteStepError
from rlft.models import GradientFlowError, check_gradient_flow
from rlft.perf import Throughput
from rlft.rollout.base import weights_changed
from rlft.rollout.hf import Rollout
from rlft.scoring import score_rows
from rlft.train.metrics import CLIP_MEAN_KEYS, StepSums, correction_metrics


@dataclass
class UpdateCounters:
    """What the policy update counts and carries from step to step; all but the run of non-finite steps go
    into checkpoints (rlft_state.json, under the keys of `state_dict`), so a resumed run continues them."""

    steps_skipped: int = 0
    nonfinite_in_a_row: int = 0
    flow_checked: bool = False  # the gradient-flow check ran (once, at the first step with a learning signal)
    entropy_coef: float = 0.0  # the entropy bonus's coefficient (Skywork-OR1's adaptive control moves it)
    last_entropy: float = math.inf  # the previous step's entropy, for that control
    ref_syncs: int = 0  # sync_ref_model updates of the reference

    def state_dict(self) -> dict:
        return {"steps_skipped": self.steps_skipped, "flow_checked": self.flow_checked,
                "entropy_coef": self.entropy_coef,
                "last_entropy": None if math.isinf(self.last_entropy) else self.last_entropy,
                "ref_syncs": self.ref_syncs}

    def load_state_dict(self, state: dict) -> None:
        self.steps_skipped, self.flow_checked = (state.get("steps_skipped", 0),
                                                 state.get("flow_checked", False))
        self.entropy_coef = state.get("entropy_coef", self.entropy_coef)
        self.last_entropy = math.inf if state.get("last_entropy") is None else state["last_entropy"]
        self.ref_syncs = state.get("ref_syncs", 0)


def _counter(name: str) -> property:
    """The trainer's attribute of the same name reads and writes the counter (older code and tests use it)."""
    return property(lambda self: getattr(self.counters, name),
                    lambda self, value: setattr(self.counters, name, value))


@dataclass
class RolloutBatch:
    rollout: Rollout
    advantages: torch.Tensor  # [N]
    old_logps: torch.Tensor | None = None  # [N, C], only when one rollout feeds several optimiser steps
    ref_logps: torch.Tensor | None = None  # [N, C], only when beta > 0
    metrics: dict[str, float] = field(default_factory=dict)
    samples: list[dict] = field(default_factory=list)

    def part(self, index: int, size: int) -> RolloutBatch:
        """Rows [index * size, (index + 1) * size): what one optimiser step trains on."""
        rows = slice(index * size, (index + 1) * size)
        r = self.rollout
        return RolloutBatch(Rollout(r.prompt_ids[rows], r.prompt_mask[rows], r.completion_ids[rows],
                                    r.completion_mask[rows], r.truncated[rows],
                                    None if r.sampling_logps is None else r.sampling_logps[rows],
                                    None if r.tool_mask is None else r.tool_mask[rows]),
                            self.advantages[rows],
                            None if self.old_logps is None else self.old_logps[rows],
                            None if self.ref_logps is None else self.ref_logps[rows], self.metrics,
                            self.samples)

    TENSORS = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "truncated")

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {name: getattr(self.rollout, name) for name in self.TENSORS}
        out["truncated"] = out["truncated"].to(torch.uint8)
        out["advantages"] = self.advantages
        for name in ("sampling_logps", "tool_mask"):
            if getattr(self.rollout, name) is not None:
                out[name] = getattr(self.rollout, name)
        for name in ("old_logps", "ref_logps"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        return out

    @classmethod
    def from_saved(cls, tensors: dict[str, torch.Tensor], extra: dict, device) -> RolloutBatch:
        t = {k: v.to(device) for k, v in tensors.items()}
        rollout = Rollout(t["prompt_ids"], t["prompt_mask"], t["completion_ids"], t["completion_mask"],
                          t["truncated"].bool(), t.get("sampling_logps"), t.get("tool_mask"))
        return cls(rollout, t["advantages"], t.get("old_logps"), t.get("ref_logps"), extra["metrics"],
                   extra["samples"])


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


class PolicyUpdate:
    """Mixed into GRPOTrainer; uses its args, accelerator, model, optimizer, scheduler, log, generator; owns
    `counters` (UpdateCounters)."""

    steps_skipped, entropy_coef = _counter("steps_skipped"), _counter("entropy_coef")
    last_entropy, ref_syncs = _counter("last_entropy"), _counter("ref_syncs")

    @property
    def throughput(self) -> Throughput:
        """MFU and tokens/s per phase against this device's measured matmul peak (rlft/perf.py)."""
        if getattr(self, "_throughput", None) is None:
            model = self.accelerator.unwrap_model(self.model)
            self._throughput = Throughput(model.config, self.accelerator.device,
                                          next(model.parameters()).dtype)
        return self._throughput

    @property
    def loss_options(self) -> LossOptions:
        """The loss's settings, read from the config once per run (a frozen LossOptions)."""
        if getattr(self, "_loss_options", None) is None:
            # beta in the reward instead (REINFORCE++): no KL term in the loss
            options = LossOptions.from_config(self.args)
            self._loss_options = options if self.kl_in_loss else dataclasses.replace(options, beta=0.0)
        return self._loss_options

    def _forward(self, model, rollout: Rollout, rows, entropy: bool = False, entropy_grad: bool = False,
                 router_loss: bool = False):
        """Per-token log-probs [b, c] of the completion tokens (and their entropy [b, c]; and a MoE policy's
        router load-balancing loss, the model's own `aux_loss`) for `rows` (a slice or an index tensor), cut
        to the rows' longest completion and prompt (rlft/scoring.py: score_rows)."""
        # the backbone, then the LM head tile by tile on the completion positions only (rlft/scoring.py)
        scored = score_rows(model, rollout, rows, self.args.temperature, entropy, router_loss,
                            self.args.logprob_chunk_size, self.args.pad_to_multiple_of)
        ent = None if scored.entropy is None else scored.entropy if entropy_grad else scored.entropy.detach()
        return scored.logps, ent, scored.aux_loss

    def _sync_reference(self, step: int) -> dict[str, float]:
        """TR-DPO: every ref_model_sync_steps optimiser steps the reference moves toward the policy
        (rlft/core/regularizers.py: mix_reference). Rollouts made before a sync keep their reference
        log-probs."""
        args = self.args
        if not args.sync_ref_model or self.ref_model is None or step % args.ref_model_sync_steps:
            return {}
        policy = self.accelerator.unwrap_model(self.model)
        for ref, current in zip(self.ref_model.parameters(), policy.parameters(), strict=True):
            mix_reference(ref.data, current.data, args.ref_model_mixup_alpha)
        self.counters.ref_syncs += 1
        return {"ref_model/syncs": float(self.counters.ref_syncs)}

    def _reference_tensors(self) -> dict[str, torch.Tensor]:
        """A moved reference is part of the run's state: saved in checkpoints (as tensors, like the
        rollout)."""
        if not self.args.sync_ref_model or self.ref_model is None:
            return {}
        return {f"ref_model.{name}": value.detach().clone()
                for name, value in self.ref_model.state_dict().items()}

    def _load_reference_tensors(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Restore a saved reference; returns the other (rollout) tensors."""
        ref = {k[len("ref_model."):]: v for k, v in tensors.items() if k.startswith("ref_model.")}
        if ref and self.ref_model is not None:
            self.ref_model.load_state_dict(ref, strict=True)
        return {k: v for k, v in tensors.items() if not k.startswith("ref_model.")}

    def _micro_batches(self, rollout: Rollout) -> list[torch.Tensor]:
        """Row indices of each micro-batch, longest completions first, so a micro-batch pads only to its own
        longest row (the step's loss is a sum over rows with global normalisers: row order changes nothing).
        With `token_budget`, micro-batches are filled by tokens instead of rows (rlft/core/batching.py)."""
        lengths = rollout.completion_mask.sum(dim=1)
        if self.args.token_budget is None:
            order = torch.argsort(lengths, descending=True, stable=True)
            return list(order.split(self.args.per_device_train_batch_size))
        tokens = (rollout.prompt_mask.sum(dim=1) + lengths).cpu()
        count = torch.tensor(budget_count(tokens, self.args.token_budget), device=self.accelerator.device)
        # every process runs as many forwards (sharded engines need it)
        if self.accelerator.num_processes > 1:
            count = self.accelerator.reduce(count, "max")
        return [rows.to(lengths.device) for rows in balanced_bins(tokens, int(count), self.args.token_budget)]

    @torch.no_grad()
    def _logps_no_grad(self, model, rollout: Rollout) -> torch.Tensor:
        out = torch.zeros(rollout.completion_ids.shape, device=rollout.completion_ids.device)  # [N, C]
        for rows in self._micro_batches(rollout):
            logps = self._forward(model, rollout, rows)[0]
            out[rows, :logps.shape[1]] = logps.float()
        return out

    def _sampling_policy_logps(self, rollout: Rollout) -> torch.Tensor:
        """The policy's log-probs of a rollout's tokens as it sampled them, computed once per rollout: the KL
        in RLOO's and REINFORCE++'s reward and the old log-probs of several steps per rollout share them."""
        cached = getattr(self, "_policy_logps_of", None)
        if cached is not None and cached[0] is rollout:
            return cached[1]
        logps = self._logps_no_grad(self.model, rollout)
        self._policy_logps_of = (rollout, logps)
        return logps

    @torch.no_grad()
    def _eval_loss(self, rollout: Rollout, rewards: torch.Tensor, group: int) -> float:
        """The loss on evaluation completions (TRL's `eval_loss`): advantages within each prompt's `group`
        completions, the policy on-policy (ratio 1), plus the KL term when beta > 0. Greedy evaluation (one
        completion per prompt) has advantage 0 everywhere: without KL its loss is exactly 0, and no forward
        pass is spent on it."""
        args = self.args
        lengths = rollout.loss_mask.sum(dim=1).float().cpu()
        token = {"mask": rollout.loss_mask.float().cpu()} if self.token_level_advantages else {}
        advantages, _, _ = multi_reward_advantages(rewards.cpu(), self.reward_weights, group,
                                                   args.scale_rewards, args.multi_objective_aggregation,
                                                   estimator=args.advantage_estimator, lengths=lengths,
                                                   **token)
        signal = torch.tensor(float(advantages.abs().sum()), device=self.accelerator.device)
        if self.accelerator.num_processes > 1:  # every process skips the forward together (sharded engines)
            signal = self.accelerator.reduce(signal, "max")
        if (args.beta == 0 or not self.kl_in_loss) and float(signal) == 0:
            return 0.0
        logps = self._logps_no_grad(self.model, rollout)
        ref = self._reference_logps(rollout) if args.beta > 0 and self.kl_in_loss else None
        loss, _ = policy_loss(logps, logps, advantages.to(logps.device), rollout.loss_mask,
                              loss_type=args.loss_type, options=self.loss_options, ref_logps=ref)
        return loss.item()

    def _reference_logps(self, rollout: Rollout) -> torch.Tensor:
        if self.ref_model is not None:
            return self._logps_no_grad(self.ref_model, rollout)
        # LoRA: the base model is the reference
        with self.accelerator.unwrap_model(self.model).disable_adapter():
            return self._logps_no_grad(self.model, rollout)

    def _optimizer_step(self, batch: RolloutBatch) -> dict[str, float]:
        acc = self.accelerator
        started = time.perf_counter()
        rollout = batch.rollout
        self.model.train()
        keep, extra = self._entropy_keep(rollout)  # top_entropy_quantile < 1: the tokens this step trains on
        trained = rollout.loss_mask if keep is None else keep
        # Global normalisers: the whole step, every micro-batch, every process.
        num_items = acc.reduce(trained.sum().float(), "sum")
        num_sequences = rollout.completion_ids.shape[0] * acc.num_processes
        if float(num_items) == 0:  # e.g. mask_truncated_completions and every completion truncated
            return self._skip_step("no completion token is left to train on (every completion was masked, "
                                   "e.g. mask_truncated_completions with every completion truncated): raise "
                                   "max_completion_length", started, nonfinite=False)
        per_sequence = CLIP_MEAN_KEYS if LOSSES[self.args.loss_type].clip_per_sequence else ()
        sums, corrections = StepSums(per_sequence), []
        # Checked at the first step with a learning signal on any process: with all advantages 0 (and LoRA's
        # B = 0 making policy == reference) a zero gradient is correct, not a wiring fault.
        check_flow = (not self.counters.flow_checked
                      and float(acc.reduce(batch.advantages.abs().sum(), "sum")) > 0)
        if check_flow:
            self.engine.watch_grads(self.model)
        batches = self._micro_batches(rollout)
        for k, rows in enumerate(batches):
            with self.engine.micro_batch(self.model, last=k == len(batches) - 1):
                loss, metrics, entropy, mask = self._micro_loss(batch, rows, num_items, num_sequences,
                                                                corrections, keep)
                if not loss.requires_grad:
                    raise GradientFlowError("the loss does not require grad: no trainable parameter is "
                                            "connected to it (all parameters frozen, or adapters disabled)")
                # DDP, FSDP and ZeRO average gradients over processes; the normalisers are global sums: undo
                # the mean.
                self.engine.backward(self.model, loss * acc.num_processes)
            sums.add(loss, metrics, entropy, mask)
        metrics = self._finish_step(sums, started, check_flow)
        if "grad_norm" in metrics:  # an applied step: how much of the machine its forward + backward used
            metrics.update(self.throughput.training(rollout, metrics["time/train_seconds"]))
        metrics.update(extra)
        if self._entropy_bonus_on() and "entropy" in metrics:  # a skipped step measured nothing: no update
            metrics.update(self._entropy_control(metrics["entropy"]))
        return {**metrics, **correction_metrics(corrections, acc)} if corrections else metrics

    @torch.no_grad()
    def _entropy_keep(self, rollout: Rollout) -> tuple[torch.Tensor | None, dict[str, float]]:
        """top_entropy_quantile < 1: a no-grad pass over the step's micro-batches gives every completion
        token's entropy (the weights do not change within a step, so these are the entropies the loss pass
        sees); the threshold is the quantile over all of them on every process, so the mask does not depend on
        the split."""
        quantile = self.args.top_entropy_quantile
        if quantile >= 1.0:
            return None, {}
        acc, mask = self.accelerator, rollout.loss_mask
        entropies = torch.zeros(mask.shape, device=mask.device)  # [N, C]
        for rows in self._micro_batches(rollout):
            ent = self._forward(self.model, rollout, rows, entropy=True)[1]
            entropies[rows, :ent.shape[1]] = ent.float()
        values = entropies[mask.bool()]
        if acc.num_processes > 1:  # entropies are >= 0: -1 marks the padding that evens out the lengths
            values = acc.gather(acc.pad_across_processes(values, dim=0, pad_index=-1.0))
            values = values[values >= 0]
        threshold = entropy_threshold(values, quantile)
        keep = high_entropy_mask(entropies, mask, threshold)
        kept, total = acc.reduce(torch.stack([keep.sum(), mask.sum()]).float(), "sum").tolist()
        return keep, {"entropy_mask/threshold": threshold.item(),
                      "entropy_mask/kept_fraction": kept / max(total, 1)}

    def _entropy_bonus_on(self) -> bool:
        return self.args.entropy_coef != 0.0 or self.args.use_adaptive_entropy

    def _entropy_control(self, step_entropy: float) -> dict[str, float]:
        """Skywork-OR1's update for the next step; logs the coefficient after it (TRL's `entropy_coef`)."""
        args = self.args
        if args.use_adaptive_entropy:
            self.entropy_coef = adaptive_entropy_coef(self.entropy_coef, step_entropy, args.entropy_target,
                                                      args.entropy_coef_delta, args.entropy_coef_min,
                                                      args.entropy_coef_max)
            self.last_entropy = step_entropy
        return {"entropy_coef": self.entropy_coef}

    def _micro_loss(self, batch: RolloutBatch, rows, num_items, num_sequences, corrections: list, keep=None):
        """One micro-batch's share of the step loss. Completions sampled by another engine (vLLM) are
        weighted by pi_old / pi_sampler (`vllm_importance_sampling_*`, rlft/core/importance.py)."""
        args, rollout = self.args, batch.rollout
        bonus = self._entropy_bonus_on()
        logps, entropy, router = self._forward(self.model, rollout, rows, entropy=True, entropy_grad=bonus,
                                               router_loss=self.router_aux_loss_coef != 0.0)
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
            num_sequences=num_sequences, rollout_is_weights=weights, keep=off_policy)
        if off_policy is not None:
            metrics["off_policy/masked_fraction"] = 1.0 - off_policy.mean()
        if bonus:
            applied = self.entropy_coef if not args.use_adaptive_entropy \
                or self.last_entropy <= args.entropy_target else 0.0
            share = entropy_bonus(entropy, mask, applied, num_items)
            loss = loss + share
            metrics["entropy_loss"] = share.detach()
        # TRL's: coef * aux_loss per micro-batch, averaged over micro-batches and processes
        if router is not None:
            share = self.router_aux_loss_coef * router / (self.args.gradient_accumulation_steps
                                                         * self.accelerator.num_processes)
            loss = loss + share
            metrics["aux_loss"], metrics["router_loss"] = router.detach(), share.detach()
        return loss, metrics, None if entropy is None else entropy.detach(), mask

    def _finish_step(self, sums: StepSums, started: float, check_flow: bool) -> dict[str, float]:
        grad_norm = self.engine.clip(self.model, self.args.max_grad_norm)  # None: DeepSpeed clips in its step
        metrics = sums.reduce(self.accelerator)
        if not (math.isfinite(grad_norm if grad_norm is not None else 0.0)
                and math.isfinite(metrics["loss"])):
            return self._skip_step(self._nonfinite_reason(metrics["loss"], grad_norm), started,
                                   nonfinite=True)
        if check_flow:
            check_gradient_flow(self.engine.grads(self.model))
            self.counters.flow_checked = True
        learning_rate = self.scheduler.get_last_lr()[0]
        self.flow.fire("on_pre_optimizer_step")
        applied, engine_norm = self.engine.step(self.model, self.optimizer)
        grad_norm = engine_norm if grad_norm is None else grad_norm
        if not applied:  # DeepSpeed found the gradient norm not finite and left the weights as they were
            return self._skip_step(self._nonfinite_reason(metrics["loss"], grad_norm), started,
                                   nonfinite=True)
        weights_changed(self.generator)  # an engine with its own copy of the weights syncs before it samples
        self.flow.fire("on_optimizer_step")
        self.scheduler.step()
        self.engine.zero_grad(self.model, self.optimizer)
        self.counters.nonfinite_in_a_row = 0
        metrics.update({"grad_norm": grad_norm, "learning_rate": learning_rate,
                        "steps_skipped": self.steps_skipped,
                        "time/train_seconds": time.perf_counter() - started})
        return metrics

    def _nonfinite_reason(self, loss: float, grad_norm: float | None) -> str:
        return (f"the loss ({loss}) or gradient norm ({grad_norm}) is not finite. Likely causes: a learning "
                f"rate too high (now {self.args.learning_rate}), rewards so large they overflow, or float16 "
                "weights overflowing (use bfloat16 or float32)")

    def _skip_step(self, reason: str, started: float, nonfinite: bool) -> dict[str, float]:
        """No optimiser step; the schedule still advances, so the learning rate stays a function of the
        step."""
        self.engine.zero_grad(self.model, self.optimizer)
        learning_rate = self.scheduler.get_last_lr()[0]
        self.scheduler.step()
        self.counters.steps_skipped += 1
        self.counters.nonfinite_in_a_row = self.counters.nonfinite_in_a_row + 1 if nonfinite else 0
        step = self.flow.state.global_step + 1
        self.log.warn(f"step {step} skipped, weights unchanged ({self.steps_skipped} skipped so far): "
                      f"{reason}")
        if self.counters.nonfinite_in_a_row >= self.args.max_nonfinite_steps:
            raise NonFiniteStepError(f"{self.counters.nonfinite_in_a_row} consecutive steps were non-finite "
                                     f"(max_nonfinite_steps={self.args.max_nonfinite_steps}); stopping. "
                                     f"{reason}")
        return {"learning_rate": learning_rate, "steps_skipped": self.steps_skipped,
                "time/train_seconds": time.perf_counter() - started}
