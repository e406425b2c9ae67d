"""transformers' `TrainerState`, `TrainerControl` and callbacks, driving rlft's own loops.

Both trainers keep a real `TrainerState` (global_step, epoch, max_steps, log_history,
num_input_tokens_seen) and fire the standard `TrainerCallback` events through transformers'
`CallbackHandler`. `DefaultFlowCallback` decides when to log, evaluate and save from the
*_strategy / *_steps fields exactly as in `transformers.Trainer`, and the loops honour
`TrainerControl` (should_log, should_evaluate, should_save, should_training_stop), so callbacks
written for transformers or TRL work unchanged.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

from transformers import TrainerControl, TrainerState
from transformers.trainer_callback import CallbackHandler, DefaultFlowCallback

FLOW_FILE = "trainer_state.json"  # transformers' file name and format


def _interval(value: float | None, total: int) -> int | None:
    """transformers' rule: an interval below 1 is a fraction of the total steps."""
    if value is None:
        return None
    return max(int(math.ceil(total * value)), 1) if value < 1 else int(value)


class Flow:
    """One run's TrainerState, TrainerControl and callback handler."""

    def __init__(self, args, callbacks, model, processing_class, optimizer, scheduler, max_steps: int,
                 steps_per_epoch: float, accelerator, train_batch_size: int):
        self.args = args
        self.steps_per_epoch = steps_per_epoch
        self.state = TrainerState(
            is_local_process_zero=accelerator.is_local_main_process,
            is_world_process_zero=accelerator.is_main_process, max_steps=max_steps,
            num_train_epochs=int(math.ceil(max_steps / steps_per_epoch)), train_batch_size=train_batch_size,
            logging_steps=_interval(args.logging_steps, max_steps),
            eval_steps=_interval(args.eval_steps, max_steps),
            save_steps=_interval(args.save_steps, max_steps))
        self.control = TrainerControl()
        self.handler = CallbackHandler([DefaultFlowCallback, *(callbacks or [])], model, processing_class,
                                       optimizer, scheduler)
        # sum of every step's loss since step 0 (train_loss), kept across resume
        self.loss_sum = 0.0
        self.started = time.perf_counter()
        self.start_step = 0

    def fire(self, event: str, **kwargs) -> TrainerControl:
        self.control = getattr(self.handler, event)(self.args, self.state, self.control, **kwargs)
        return self.control

    def dispatch(self, event: str, **payload) -> None:
        """A trainer's own event (TRL's self-distillation ones: `on_generation_batch_built`, ...):
        each callback that defines the method gets args, state, control, model, processing_class and
        the payload, as TRL calls them."""
        handler = self.handler
        for callback in handler.callbacks:
            method = getattr(callback, event, None)
            if method is not None:
                method(args=self.args, state=self.state, control=self.control, model=handler.model,
                       processing_class=handler.processing_class, **payload)

    def set_step(self, step: int) -> None:
        self.state.global_step = step
        self.state.epoch = step / self.steps_per_epoch

    def record(self, logs: dict) -> dict:
        """What transformers' Trainer.log does: add epoch, append to log_history with the step, fire
        on_log."""
        logs = {**logs, "epoch": self.state.epoch}
        self.state.log_history.append({**logs, "step": self.state.global_step})
        self.fire("on_log", logs=logs)
        return logs

    def summary(self, samples_per_step: int) -> dict:
        """The final row transformers/TRL log when training ends."""
        runtime = time.perf_counter() - self.started
        steps = self.state.global_step - self.start_step
        return {"train_runtime": runtime,
                "train_samples_per_second": steps * samples_per_step / max(runtime, 1e-9),
                "train_steps_per_second": steps / max(runtime, 1e-9),
                "total_flos": float(self.state.total_flos),
                "train_loss": self.loss_sum / max(self.state.global_step, 1)}

    # ---- checkpoint ----------------------------------------------------------------------------
    def save(self, folder: Path) -> None:
        self.state.stateful_callbacks["TrainerControl"] = self.control.state()
        self.state.save_to_json(str(folder / FLOW_FILE))

    def load(self, folder: Path, loss_sum: float) -> None:
        loaded = TrainerState.load_from_json(str(folder / FLOW_FILE))
        for name in ("global_step", "epoch", "log_history", "num_input_tokens_seen", "total_flos",
                     "best_metric", "best_model_checkpoint"):
            setattr(self.state, name, getattr(loaded, name))
        self.loss_sum = loss_sum
        self.start_step = loaded.global_step
