"""report_to trackers, for real where they need no service: a run writes TensorBoard event files and a trackio
project, filed under the run name and project transformers' integrations use, and the scalars read back from
them equal metrics.jsonl's. wandb needs a service: a stand-in package records what wandb.init is given."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlft import GRPOTrainer
from rlft.telemetry.tracking import read_metrics, tracker_target
from tests.helpers import addition_rows, correct_answer, tiny_grpo_config

ROOT = Path(__file__).resolve().parents[1]
RUN_NAME = "Qwen3-0.6B-RLOO-tldr"
TRACKIO_READER = """
import json, sys
from trackio.sqlite_storage import SQLiteStorage
projects = SQLiteStorage.get_projects()
runs = {p: SQLiteStorage.get_runs(p) for p in projects}
logs = {p: {r: SQLiteStorage.get_logs(p, r) for r in rs} for p, rs in runs.items()}
print(json.dumps({"runs": runs, "logs": logs}, default=str))
"""


def read_trackio(env: dict) -> dict:
    read = subprocess.run([sys.executable, "-c", TRACKIO_READER], env=env, capture_output=True, text=True,
                          timeout=120, check=True)
    return json.loads(read.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def rloo_run(tmp_path_factory):
    """`rlft rloo` with run_name set and report_to tensorboard and trackio (trackio's files in a tmp folder)."""
    pytest.importorskip("tensorboard")
    pytest.importorskip("trackio")
    tmp = tmp_path_factory.mktemp("trackers")
    env = {**os.environ, "TRACKIO_DIR": str(tmp / "trackio"), "PYTHONPATH": str(ROOT)}
    env.pop("TENSORBOARD_LOGGING_DIR", None)
    result = subprocess.run([sys.executable, "-m", "rlft.cli", "rloo", "--config",
                             "examples/configs/cpu-grpo-lora.yaml", "--output_dir", str(tmp / "run"),
                             "--max_steps", "3", "--logging_steps", "1", "--eval_steps", "3", "--run_name", RUN_NAME,
                             "--report_to", "tensorboard,trackio"],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return tmp / "run", env, result


def tensorboard_events(folder: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder))
    events.Reload()
    return events


def test_tensorboard_and_trackio_hold_the_metrics_of_metrics_jsonl(rloo_run):
    run, env, _ = rloo_run
    rows = read_metrics(run)
    expected = {r["step"]: r["reward"] for r in rows if "reward" in r}
    assert sorted(expected) == [1, 2, 3]
    evaluated = [r["eval_reward"] for r in rows if "eval_reward" in r][-1]  # at step 3 (one more at the start)

    events = tensorboard_events(run / "runs" / RUN_NAME)
    assert {e.step: e.value for e in events.Scalars("reward")} == pytest.approx(expected)
    assert events.Scalars("eval_reward")[-1].value == pytest.approx(evaluated)
    assert {"loss", "grad_norm", "learning_rate"} <= set(events.Tags()["scalars"])

    logs = read_trackio(env)["logs"]["huggingface"][RUN_NAME]
    assert {row["step"]: row["reward"] for row in logs if row.get("reward") is not None} == pytest.approx(expected)
    assert any(row.get("eval_reward") == pytest.approx(evaluated) for row in logs)


def test_trackers_file_the_run_under_run_name_and_transformers_default_project(rloo_run):
    run, env, _ = rloo_run
    # TensorBoard: <output_dir>/runs/<run_name>, where transformers' TensorBoardCallback writes (runs/...)
    assert [p.name for p in (run / "runs").iterdir()] == [RUN_NAME]
    assert not (run / "rlft").exists()
    # trackio: project "huggingface" (TrainingArguments.project's default), the run under its given name
    assert read_trackio(env)["runs"] == {"huggingface": [RUN_NAME]}


def test_the_step_goes_to_trackers_as_the_step_not_as_a_metric(rloo_run):
    run, env, result = rloo_run
    assert "Reserved keys renamed" not in result.stderr + result.stdout
    assert "step" not in tensorboard_events(run / "runs" / RUN_NAME).Tags()["scalars"]
    logs = read_trackio(env)["logs"]["huggingface"][RUN_NAME]
    assert not any("__step" in row or "step_" in row for row in logs)


TRACKIO_PROJECT_RUN = """
import sys
sys.path.insert(0, {root!r})
from rlft import GRPOTrainer
from tests.helpers import addition_rows, correct_answer, tiny_grpo_config
from pathlib import Path
cfg = tiny_grpo_config(Path({folder!r}), max_steps=1, report_to=["tensorboard", "trackio"], project="my-project")
GRPOTrainer({model!r}, [correct_answer], cfg, addition_rows(16)).train()
"""


def test_trackio_takes_the_config_project_and_tensorboard_the_logging_dir_variable(tmp_path, shipped_policy_dir):
    """Without a run_name the trackers name the run themselves; the project and folder come from where
    transformers reads them: TrainingArguments.project (trackio), TENSORBOARD_LOGGING_DIR (TensorBoard)."""
    pytest.importorskip("trackio")
    env = {**os.environ, "TRACKIO_DIR": str(tmp_path / "trackio"), "TENSORBOARD_LOGGING_DIR": str(tmp_path / "tb")}
    script = TRACKIO_PROJECT_RUN.format(root=str(ROOT), folder=str(tmp_path), model=str(shipped_policy_dir))
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    runs = read_trackio(env)["runs"]
    assert list(runs) == ["my-project"] and len(runs["my-project"]) == 1 and runs["my-project"][0]  # a name
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))
    assert not (tmp_path / "run" / "runs").exists()


def test_wandb_gets_run_name_and_the_wandb_project_variable(tmp_path, shipped_policy_dir, monkeypatch):
    """A stand-in `wandb` package (no service here) records what accelerate's tracker passes wandb.init."""
    package = tmp_path / "site" / "wandb"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(
        "CALLS = []\n"
        "class _Config(dict):\n"
        "    def update(self, values, allow_val_change=False):\n"
        "        dict.update(self, values)\n"
        "config = _Config()\n"
        "class _Run:\n"
        "    def log(self, values, step=None, **kwargs):\n"
        "        CALLS.append(('log', step, dict(values)))\n"
        "    def finish(self):\n"
        "        CALLS.append(('finish',))\n"
        "def init(**kwargs):\n"
        "    CALLS.append(('init', kwargs))\n"
        "    return _Run()\n")
    info = tmp_path / "site" / "wandb-0.0.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: wandb\nVersion: 0.0.0\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    import accelerate.tracking
    from accelerate.utils import LoggerType

    # accelerate lists the installed trackers once, at import
    monkeypatch.setattr(accelerate.tracking, "_available_trackers",
                        [*accelerate.tracking._available_trackers, LoggerType.WANDB])
    monkeypatch.setenv("WANDB_PROJECT", "summarize")
    monkeypatch.delitem(sys.modules, "wandb", raising=False)
    cfg = tiny_grpo_config(tmp_path, max_steps=2, report_to=["wandb"], run_name=RUN_NAME)
    GRPOTrainer(str(shipped_policy_dir), [correct_answer], cfg, addition_rows(16)).train()
    import wandb

    inits = [c[1] for c in wandb.CALLS if c[0] == "init"]
    assert inits == [{"project": "summarize", "name": RUN_NAME}]
    logged = [c for c in wandb.CALLS if c[0] == "log"]
    assert [c[1] for c in logged if "reward" in c[2]] == [1, 2] and not any("step" in c[2] for c in logged)


@pytest.mark.parametrize("tracker, variables, config, expected", [
    ("wandb", {}, {"run_name": None}, ("huggingface", {})),
    ("wandb", {"WANDB_PROJECT": "p"}, {"run_name": "r"}, ("p", {"name": "r"})),
    ("trackio", {"WANDB_PROJECT": "p"}, {"run_name": "r", "project": "huggingface"},
     ("huggingface", {"resume": "allow", "name": "r"})),
    ("tensorboard", {}, {"run_name": "r"}, (os.path.join("runs", "r"), {})),
])
def test_each_tracker_takes_the_project_and_run_name_transformers_gives_it(monkeypatch, tracker, variables, config,
                                                                           expected):
    for name in ("WANDB_PROJECT", "TENSORBOARD_LOGGING_DIR"):
        monkeypatch.delenv(name, raising=False)
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    assert tracker_target(tracker, config) == expected


def test_trackio_finishes_its_run_once(rloo_run, tmp_path, shipped_policy_dir):
    """accelerate finished trackio's run object and trackio's exit hook finished it again: two "Run finished"
    lines per run. Once from the command line; once when a script also calls trainer.end()."""
    _, env, result = rloo_run
    assert (result.stdout + result.stderr).count("Run finished") == 1
    script = ("from rlft import GRPOTrainer\nfrom tests.helpers import addition_rows, correct_answer, "
              f"tiny_grpo_config\nfrom pathlib import Path\ncfg = tiny_grpo_config(Path({str(tmp_path)!r}), "
              "max_steps=1, report_to=['trackio'])\n"
              f"trainer = GRPOTrainer({str(shipped_policy_dir)!r}, [correct_answer], cfg, addition_rows(8))\n"
              "trainer.train()\ntrainer.end()\n")
    ran = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert (ran.stdout + ran.stderr).count("Run finished") == 1
