"""The frame both trainers share: resume, announce, the steps with transformers' callback events,
the final summary row; each trainer supplies its own step (GRPO: rollout -> rewards -> advantages ->
policy update; reward model: pairs -> scores -> Bradley-Terry loss -> update) and what follows it
(log -> evaluate -> checkpoint).

A trainer using it provides:
  _resume(resume_from_checkpoint) -> the first step to run (and restores its own carried state)
  _announce()                     the run's opening lines (after the run log exists)
  _step(step) -> metrics          one optimiser step's work; a skipped (non-finite) step returns its
                                  counters
  _after_step(step, metrics)      log -> evaluate -> checkpoint, with `step` the number of steps
                                  done
  _final_row() -> summary         transformers' summary row (train_runtime, train_loss, ...)
  _save_checkpoint(step)          write checkpoint-<step> (a preempted run writes one where it
                                  stops)
  _end(stopping)                  after the run, however it ends: stop what runs only while training
                                  (`stopping`: the process is about to exit, preempted: free everything)
  _eval_sets                      the evaluation sets given at construction (evaluated at start if
                                  asked)
and the attributes args, accelerator, flow, messages, total_steps, steps_per_epoch. While the run
log is open, what the trainer's parts say (`messages`) goes to it.
"""

from __future__ import annotations

from transformers.trainer_utils import TrainOutput

from rlft.config import to_dict
from rlft.kinds import KINDS
from rlft.telemetry.tracking import RunLog
from rlft.train import state as run_state
from rlft.train.run import runs
from rlft.train.run.preemption import Preempted, Preemption


class TrainLoop:
    """`train()` for GRPOTrainer and RewardTrainer."""

    def train(self, resume_from_checkpoint=None):
        """The run, holding output_dir for its whole length: a second run started on the folder is
        refused (rlft/train/run/runs.py: OutputDirLock)."""
        with runs.OutputDirLock(self.accelerator, self.args.output_dir):
            return self._train(resume_from_checkpoint)

    def _train(self, resume_from_checkpoint):
        args, flow = self.args, self.flow
        start_step = self._resume(resume_from_checkpoint)
        self.run_log = RunLog(self.accelerator, args.output_dir, args.report_to, to_dict(args),
                              self.total_steps, start_step, show_progress=not args.disable_tqdm)
        self.messages.run, stopping = self.run_log, False
        try:
            self._announce()
            flow.fire("on_train_begin")
            with run_state.named_timeouts(self.accelerator, args), Preemption(self.accelerator) as preemption:
                if args.eval_on_start and start_step == 0 and self._eval_sets:
                    self.evaluate()
                for step in range(start_step, self.total_steps):
                    self._run_step(step)
                    if flow.control.should_training_stop:
                        break
                    if preemption.requested():  # every process asks, so all stop at the same step
                        stopping = True
                        self._preempted(step + 1, preemption)
                summary = self._final_row()
                flow.fire("on_train_end")
        finally:
            self.run_log.close()
            self.messages.run = None
            self._end(stopping)
        return TrainOutput(flow.state.global_step, summary["train_loss"], summary)

    def _preempted(self, step: int, preemption: Preemption) -> None:
        """A checkpoint at `step` (unless this step just wrote one), the line that says where and
        how to resume, then the exit (rlft/train/run/preemption.py)."""
        if not self.flow.control.should_save:
            self._save_checkpoint(step)
        path = f"{self.args.output_dir}/checkpoint-{step}"
        commands = [kind.name for kind in KINDS.values()
                    if kind.command and kind.trainer_name == type(self).__name__]
        command = f" (rlft {commands[0]}: --resume_from_checkpoint true)" if commands else ""
        message = (f"stopped by {preemption.name} after step {step} of {self.total_steps}: "
                   f"checkpoint written to {path}. Resume with "
                   f"resume_from_checkpoint=True{command}; the resumed run "
                   "continues exactly")
        self.messages.warn(message)  # the console (stderr) and the run's log, once
        if preemption.name == "SIGINT":
            raise KeyboardInterrupt(message)
        raise Preempted(message)

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
