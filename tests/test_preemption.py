"""Preemption (rlft/train/run/preemption.py): a signal to a running trainer -- SIGTERM as a cluster scheduler sends
before its SIGKILL, a double Ctrl-C -- ends with a checkpoint, a line saying where and how to resume, a distinct
exit status, and a resume equal to the uninterrupted run; a second signal during a save leaves the previous
checkpoint as it was. Runs in subprocesses (tests/dist/preempt_run.py), the signal sent by the run to itself at a
fixed step, so the test does not race it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from rlft.telemetry.tracking import read_metrics
from rlft.train.run.checkpoint import latest_checkpoint, verify
from rlft.train.run.preemption import PREEMPTED_EXIT, Preempted

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = "tests/dist/preempt_run.py"


def command(model, out, kind="grpo", sig="SIGTERM", rank=0, step=0, steps=5, save_steps=100, slow=0.0,
            resume=False, processes=1) -> list[str]:
    args = [SCRIPT, str(model), str(out), kind, sig, str(rank), str(step), str(steps), str(save_steps), str(slow),
            *(["--resume"] if resume else [])]
    if processes > 1:
        return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(processes), "--standalone",
                *args]
    return [sys.executable, *args]


def run(*args, **kwargs) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run(command(*args, **kwargs), cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def params(out: Path) -> dict[str, torch.Tensor]:
    return torch.load(out / "params.pt")


def assert_same_run(straight: Path, resumed: Path, from_step: int) -> None:
    for name, value in params(straight).items():
        assert torch.equal(value, params(resumed)[name]), name
    keep = ("loss", "reward", "grad_norm", "completions/mean_length")
    rows = lambda out: [{k: r.get(k) for k in keep} for r in read_metrics(out / "run") if r["step"] > from_step]  # noqa: E731
    assert rows(resumed) == rows(straight) and len(rows(straight)) > 0


@pytest.mark.parametrize("kind", ["grpo", "async", pytest.param("async-tools-partial", marks=pytest.mark.slow)])
def test_sigterm_mid_run_writes_a_checkpoint_exits_75_and_the_resume_equals_the_uninterrupted_run(
        tmp_path, shipped_policy_dir, kind):
    straight = run(shipped_policy_dir, tmp_path / "straight", kind)
    assert straight.returncode == 0, straight.stderr[-3000:]
    stopped = run(shipped_policy_dir, tmp_path / "stopped", kind, step=2)
    assert stopped.returncode == PREEMPTED_EXIT, stopped.stderr[-3000:]
    assert "stopped by SIGTERM after step 2 of 5: checkpoint written to" in stopped.stderr
    assert "resume_from_checkpoint=True" in stopped.stderr
    # heard at once, said once; the stop line once too
    assert stopped.stderr.count("SIGTERM received: the run stops after the current step and writes a checkpoint") == 1
    assert stopped.stderr.count("stopped by SIGTERM") == 1, stopped.stderr[-3000:]
    assert latest_checkpoint(tmp_path / "stopped" / "run").name == "checkpoint-2"  # no regular checkpoint before
    assert not (tmp_path / "stopped" / "params.pt").exists()
    if kind.startswith("async"):  # the producer process was stopped with the run
        assert "rlft.rollout.producer_worker" not in subprocess.run(["ps", "-eo", "args"], capture_output=True,
                                                                      text=True).stdout
    resumed = run(shipped_policy_dir, tmp_path / "stopped", kind, resume=True)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_same_run(tmp_path / "straight", tmp_path / "stopped", 2)


def test_on_two_processes_a_signal_to_one_stops_both_at_the_same_step(tmp_path, shipped_policy_dir):
    """Process 1 alone is signalled: both write checkpoint-3 together and stop; the resume equals a straight
    2-process run."""
    straight = run(shipped_policy_dir, tmp_path / "straight", processes=2)
    assert straight.returncode == 0, straight.stderr[-3000:]
    stopped = run(shipped_policy_dir, tmp_path / "stopped", rank=1, step=3, processes=2)
    assert stopped.returncode != 0 and "stopped by SIGTERM after step 3 of 5" in stopped.stderr, stopped.stderr[-3000:]
    assert f"exitcode  : {PREEMPTED_EXIT}" in stopped.stderr  # torchrun reports each process's status
    assert [r["step"] for r in read_metrics(tmp_path / "stopped" / "run")] == [1, 2, 3]
    verify(tmp_path / "stopped" / "run" / "checkpoint-3")
    resumed = run(shipped_policy_dir, tmp_path / "stopped", resume=True, processes=2)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_same_run(tmp_path / "straight", tmp_path / "stopped", 3)


def test_a_signal_during_a_save_and_a_second_ctrl_c_leave_the_previous_checkpoint_intact(tmp_path,
                                                                                          shipped_policy_dir):
    """SIGTERM while checkpoint-4 is written: the save completes, the run stops there (75). Ctrl-C twice while
    checkpoint-4 is written: the save is abandoned (no checkpoint-4, no temporary folder), checkpoint-2 stays
    whole."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    for sig, count in ((signal.SIGTERM, 1), (signal.SIGINT, 2)):
        out = tmp_path / sig.name
        proc = subprocess.Popen(command(shipped_policy_dir, out, steps=6, save_steps=2, slow=4.0), cwd=ROOT, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 300
        while not (out / "saving-4").exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
            time.sleep(0.05)
        for _ in range(count):
            proc.send_signal(sig)
            time.sleep(0.5)
        _, stderr = proc.communicate(timeout=300)
        run_dir = out / "run"
        if sig == signal.SIGTERM:
            assert proc.returncode == PREEMPTED_EXIT, stderr[-3000:]
            assert latest_checkpoint(run_dir).name == "checkpoint-4" and "after step 4 of 6" in stderr
            verify(run_dir / "checkpoint-4")
        else:
            assert proc.returncode != 0 and "KeyboardInterrupt" in stderr, stderr[-3000:]
            assert latest_checkpoint(run_dir).name == "checkpoint-2" and not list(run_dir.glob(".tmp-*"))
            verify(run_dir / "checkpoint-2")


def test_the_stop_line_names_the_command_the_run_came_from(tmp_path, shipped_policy_dir):
    from rlft import DistillationConfig, DistillationTrainer, GRPOConfig
    from rlft.train.async_grpo import AsyncGRPOTrainer
    from tests.helpers import addition_rows

    class Signal:
        name = "SIGTERM"

    common = dict(max_steps=1, report_to=["none"], max_completion_length=8)
    distill = DistillationTrainer(str(shipped_policy_dir), str(shipped_policy_dir),
                                  DistillationConfig(output_dir=str(tmp_path / "d"), **common), addition_rows(8))
    grpo_like = AsyncGRPOTrainer.__new__(AsyncGRPOTrainer)  # no command of its own: no command named
    for trainer, want in ((distill, "(rlft distillation: --resume_from_checkpoint true)"), (grpo_like, "=True;")):
        trainer.args, trainer.total_steps = GRPOConfig(output_dir=str(tmp_path / "x"), **common), 3
        trainer.flow = type("Flow", (), {"control": type("Control", (), {"should_save": True})()})()
        trainer.messages = distill.messages
        with pytest.raises(Preempted) as stop:
            trainer._preempted(1, Signal())
        assert want in str(stop.value) and "rlft grpo/rloo/reward" not in str(stop.value)
