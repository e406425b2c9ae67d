"""report_to trackers that need no service, for real: a run writes TensorBoard event files and a trackio
project, and the scalars read back from them equal metrics.jsonl's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlft.tracking import read_metrics

ROOT = Path(__file__).resolve().parents[1]
TRACKIO_READER = """
import json, sys
from trackio.sqlite_storage import SQLiteStorage
runs = SQLiteStorage.get_runs("rlft")
print(json.dumps({"runs": runs, "logs": SQLiteStorage.get_logs("rlft", runs[0])}, default=str))
"""


def test_tensorboard_and_trackio_hold_the_metrics_of_metrics_jsonl(tmp_path):
    pytest.importorskip("tensorboard")
    pytest.importorskip("trackio")
    env = {**os.environ, "TRACKIO_DIR": str(tmp_path / "trackio"), "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, "-m", "rlft.cli", "grpo", "--config", "examples/configs/cpu-grpo-lora.yaml",
                             "--output_dir", str(tmp_path / "run"), "--max_steps", "3", "--logging_steps", "1",
                             "--eval_steps", "3", "--report_to", "tensorboard,trackio"],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = read_metrics(tmp_path / "run")
    expected = {r["step"]: r["reward"] for r in rows if "reward" in r}
    assert sorted(expected) == [1, 2, 3]
    evaluated = [r["eval_reward"] for r in rows if "eval_reward" in r][-1]  # at step 3 (one more at the start)

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "run" / "rlft"))  # accelerate: project_dir / project name
    events.Reload()
    assert {e.step: e.value for e in events.Scalars("reward")} == pytest.approx(expected)
    assert events.Scalars("eval_reward")[-1].value == pytest.approx(evaluated)
    assert {"loss", "grad_norm", "learning_rate"} <= set(events.Tags()["scalars"])

    read = subprocess.run([sys.executable, "-c", TRACKIO_READER], env=env, capture_output=True, text=True,
                          timeout=120, check=True)
    logged = json.loads(read.stdout.strip().splitlines()[-1])
    assert len(logged["runs"]) == 1
    assert {row["step"]: row["reward"] for row in logged["logs"] if row.get("reward") is not None} == \
        pytest.approx(expected)
    assert any(row.get("eval_reward") == pytest.approx(evaluated) for row in logged["logs"])
