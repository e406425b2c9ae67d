"""A GRPO (or async GRPO) run that one process tells itself to stop: at the end of step SIGNAL_STEP, process
SIGNAL_RANK sends SIGNAL to itself, as a cluster scheduler would (0: no signal). On the main process the trained
parameters are written to OUT/params.pt when the run ends normally; SLOW_SAVE > 0 makes every checkpoint write
take that many seconds (touching OUT/saving-<step> first), so a signal can arrive during one.

    python tests/dist/preempt_run.py MODEL OUT KIND SIGNAL SIGNAL_RANK SIGNAL_STEP MAX_STEPS SAVE_STEPS SLOW_SAVE
        [--resume]      (KIND: grpo, async, or async-tools-partial: the shipped calculator's tool, partial rollouts)
    torchrun --nproc_per_node 2 --standalone tests/dist/preempt_run.py ...
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import torch
from transformers import TrainerCallback

from rlft import AsyncGRPOConfig, AsyncGRPOTrainer, GRPOConfig, GRPOTrainer
from rlft.train.update import optimization
from rlft.train.state import release_processes
from tests.helpers import addition_rows, correct_answer


class SignalSelf(TrainerCallback):
    def __init__(self, sig: int, rank: int, step: int, process: int):
        self.sig, self.rank, self.step, self.process = sig, rank, step, process

    def on_step_end(self, args, state, control, **kwargs):
        if self.sig and state.global_step == self.step and self.process == self.rank:
            os.kill(os.getpid(), self.sig)


def slow_saves(out: Path, seconds: float) -> None:
    original = optimization.GuardedOptimizer.save

    def save(self, folder, tokenizer):
        (out / f"saving-{folder.name.rsplit('-', 1)[-1]}").touch()
        time.sleep(seconds)
        original(self, folder, tokenizer)

    optimization.GuardedOptimizer.save = save


def main() -> None:
    model, out, kind, sig, rank, step, steps, save_steps, slow = sys.argv[1:10]
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if float(slow) > 0:
        slow_saves(out, float(slow))
    fields = dict(output_dir=str(out / "run"), learning_rate=1e-3, max_steps=int(steps), num_generations=4,
                  per_device_train_batch_size=8, max_completion_length=8, logging_steps=1,
                  save_steps=int(save_steps), report_to="none", disable_tqdm=True, seed=0,
                  gradient_checkpointing=False)
    config, trainer_class = (AsyncGRPOConfig, AsyncGRPOTrainer) if kind.startswith("async") \
        else (GRPOConfig, GRPOTrainer)
    rewards, given = [correct_answer], {}
    if kind == "async-tools-partial":  # the calculator's tool loops, partial rollouts: the driver's pool
        from rlft.data.calculator import TOOLS, answer_reward
        from rlft.model.loading import shipped_policy_path

        model, rewards, given = str(shipped_policy_path("tiny-calculator")), [answer_reward], {"tools": TOOLS}
        fields.update(max_completion_length=48, temperature=0.7, partial_rollouts=1, max_staleness=2)
    trainer = trainer_class(model, rewards, config(**fields), addition_rows(32), **given)
    process = trainer.accelerator.process_index
    trainer.add_callback(SignalSelf(getattr(signal, sig), int(rank), int(step), process))
    accelerator, code = trainer.accelerator, 0
    try:
        trainer.train(resume_from_checkpoint=True if "--resume" in sys.argv else None)
        if trainer.accelerator.is_main_process:
            params = trainer.accelerator.get_state_dict(trainer.model)
            torch.save({k: v.detach().clone() for k, v in params.items()}, out / "params.pt")
    except SystemExit as stop:  # preempted: the processes end together, then the exit status
        code = stop.code
    trainer = None
    release_processes(accelerator)
    sys.exit(code)


if __name__ == "__main__":
    main()
