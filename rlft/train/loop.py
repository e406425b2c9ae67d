"""The frame both trainers share: resume, announce, the steps with transformers' callback events, the final
summary row; each trainer supplies its own step (GRPO: rollout -> rewards -> advantages -> policy update;
reward model: pairs -> scores -> Bradley-Terry loss -> update) and what follows it (log -> evaluate ->
checkpoint).

A trainer using it provides:
  _resume(resume_from_checkpoint) -> the first step to run (and restores its own carried state)
  _announce()                     the run's opening lines (after the run log exists)
  _step(step) -> metrics          one optimiser step's work; a skipped (non-finite) step returns its counters
  _after_step(step, metrics)      log -> evaluate -> checkpoint, with `step` the number of steps done
  _final_row() -> summary         transformers' summary row (train_runtime, train_loss, ...)
  _end()                          after the run, however it ends: stop what runs only while training
  _eval_sets                      the evaluation sets given at construction (evaluated at start if asked)
and the attributes args, accelerator, flow, messages, total_steps, steps_per_epoch, log_project. While the
run log is open, what the trainer's parts say (`messages`) goes to it.
"""

from __future__ import annotations

from transformers.trainer_utils import TrainOutput

from rlft.config import to_dict
from rlft.tracking import RunLog
from rlft.train import state as run_state


class TrainLoop:
    """`train()` for GRPOTrainer and RewardTrainer."""

    log_project = "rlft"

    def train(self, resume_from_checkpoint=None):
        args, flow = self.args, self.flow
        start_step = self._resume(resume_from_checkpoint)
        self.log = RunLog(self.accelerator, args.output_dir, args.report_to, to_dict(args), self.total_steps,
                          start_step, show_progress=not args.disable_tqdm, project=self.log_project)
        self.messages.run = self.log
        try:
            self._announce()
            flow.fire("on_train_begin")
            with run_state.named_timeouts(self.accelerator, args):
                if args.eval_on_start and start_step == 0 and self._eval_sets:
                    self.evaluate()
                for step in range(start_step, self.total_steps):
                    self._run_step(step)
                    if flow.control.should_training_stop:
                        break
                summary = self._final_row()
                flow.fire("on_train_end")
        finally:
            self.log.close()
            self.messages.run = None
            self._end()
        return TrainOutput(flow.state.global_step, summary["train_loss"], summary)

    def _run_step(self, step: int) -> None:
        """One step between transformers' events, as Trainer fires them."""
        flow = self.flow
        if step % self.steps_per_epoch == 0:
            flow.fire("on_epoch_begin")
        flow.fire("on_step_begin")
        metrics = self._step(step)
        flow.loss_sum += metrics.get("loss", 0.0)
        flow.set_step(step + 1)
        flow.fire("on_step_end")
        if (step + 1) % self.steps_per_epoch == 0:
            flow.fire("on_epoch_end")
        self._after_step(step + 1, metrics)
