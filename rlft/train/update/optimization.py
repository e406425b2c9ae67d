"""The model under training with its optimiser, schedule and training engine, and the one guarded
optimiser step every trainer takes (GRPO's policy update and the reward model's alike):

    gradients clipped -> every process agrees whether the step is finite -> applied, or skipped
    (weights unchanged; the schedule advances either way, so the learning rate stays a function of
    the step)

Skips are counted (in checkpoints under the trainer's counter name) and said; `max_nonfinite_steps`
non-finite steps in a row stop the run with the trainer's explanation. A non-finite value never
reaches the weights. It saves and loads itself: the engine's files (model, optimizer state) and the
schedule.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from rlft.errors import NonFiniteError
from rlft.train.run.safe_files import load_json, writing


@dataclass
class StepOutcome:
    applied: bool
    # before clipping (None: the engine did not say, e.g. a step skipped before it)
    grad_norm: float | None
    learning_rate: float  # the rate this step used (or would have)


class GuardedOptimizer:
    """`apply(finite)` after the backward passes; `skip(reason)` for a step with nothing to train
    on."""

    def __init__(self, model, optimizer, scheduler, engine, accelerator, flow, messages, *, max_grad_norm,
                 max_nonfinite_steps: int, counter: str, stop_message: Callable[[int, str], str],
                 on_applied: Callable[[], None] | None = None):
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.engine, self.accelerator, self.flow, self.messages = engine, accelerator, flow, messages
        self.max_grad_norm, self.max_nonfinite_steps = max_grad_norm, max_nonfinite_steps
        self.counter, self.stop_message, self.on_applied = counter, stop_message, on_applied
        self.skipped, self.nonfinite_in_a_row = 0, 0

    @property
    def learning_rate(self) -> float:
        return self.scheduler.get_last_lr()[0]

    def agree(self, flag: bool) -> bool:
        """True only when it is true on every process (the step is taken by all or by none)."""
        if self.accelerator.num_processes == 1:
            return flag
        value = torch.tensor([float(flag)], device=self.accelerator.device)
        # a min: reduce knows sum/mean/max
        return bool(-self.accelerator.reduce(-value, "max").item() >= 1)

    def apply(self, finite: bool, explain: Callable[[float | None], str],
              before_step: Callable[[], None] | None = None) -> StepOutcome:
        """Clip, then apply the step unless the loss (`finite` on this process) or the gradient norm
        is not finite on some process: then skip it (`explain(grad_norm)` says why). `before_step`
        runs before an applied step (the gradient-flow check)."""
        # None: DeepSpeed clips in its step
        grad_norm = self.engine.clip(self.model, self.max_grad_norm)
        finite = self.agree(finite and (grad_norm is None or math.isfinite(grad_norm)))
        if finite and before_step is not None:
            before_step()
        learning_rate, applied = self.learning_rate, False
        if finite:
            self.flow.fire("on_pre_optimizer_step")
            applied, engine_norm = self.engine.step(self.model, self.optimizer)
            grad_norm = engine_norm if grad_norm is None else grad_norm
        if not applied:  # not finite (DeepSpeed checks the gradient norm in its own step)
            self.skip(explain(grad_norm), nonfinite=True)
            return StepOutcome(False, grad_norm, learning_rate)
        if self.on_applied is not None:
            self.on_applied()
        self.flow.fire("on_optimizer_step")
        self.scheduler.step()
        self.engine.zero_grad(self.model, self.optimizer)
        self.nonfinite_in_a_row = 0
        return StepOutcome(True, grad_norm, learning_rate)

    def skip(self, reason: str, nonfinite: bool) -> None:
        """No optimiser step; the schedule still advances. Counted and said; the run stops after
        max_nonfinite_steps non-finite ones in a row."""
        self.engine.zero_grad(self.model, self.optimizer)
        self.scheduler.step()
        self.skipped += 1
        self.nonfinite_in_a_row = self.nonfinite_in_a_row + 1 if nonfinite else 0
        step = self.flow.state.global_step + 1
        self.messages.warn(f"step {step} skipped, weights unchanged ({self.skipped} skipped so "
                           f"far): {reason}")
        if self.nonfinite_in_a_row >= self.max_nonfinite_steps:
            raise NonFiniteError(self.stop_message(self.nonfinite_in_a_row, reason))

    # ---- checkpoints
    # ---------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {self.counter: self.skipped}

    def load_state_dict(self, state: dict) -> None:
        self.skipped, self.nonfinite_in_a_row = state.get(self.counter, 0), 0

    def save(self, folder: Path, tokenizer) -> None:
        """The engine's files (model, optimizer state) and the schedule (every process calls
        this)."""
        self.engine.save_checkpoint(self.model, self.optimizer, folder, tokenizer)
        if self.accelerator.is_main_process:
            with writing(folder / "scheduler.json"):
                (folder / "scheduler.json").write_text(json.dumps(self.scheduler.state_dict()))

    def load(self, folder: Path) -> None:
        self.engine.load_checkpoint(self.model, self.optimizer, folder)
        self.scheduler.load_state_dict(load_json(folder / "scheduler.json"))
