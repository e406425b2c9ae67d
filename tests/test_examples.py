"""The example configs never rot: each CPU config runs a few steps from the repository root, every config loads."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlft.cli import main
from rlft.cli.doctor import detect_kind
from rlft.cli.recipes import parse_run
from rlft.telemetry.tracking import read_metrics

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "examples" / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_every_example_config_is_a_valid_config(path, monkeypatch):
    monkeypatch.chdir(ROOT)
    parse_run(detect_kind(str(path)), [], str(path))


def run(*args: str) -> None:
    assert main(list(args)) == 0


def test_cpu_grpo_lora_example_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)  # its paths are relative to the repository root, as its comment says
    run("grpo", "--config", "examples/configs/cpu-grpo-lora.yaml", "--output_dir", str(tmp_path / "grpo"),
        "--max_steps", "3", "--logging_steps", "1", "--eval_steps", "3")
    rows = read_metrics(tmp_path / "grpo")
    assert [r["step"] for r in rows if "reward" in r] == [1, 2, 3]
    assert any("eval_reward" in r for r in rows)
    assert (tmp_path / "grpo" / "adapter_config.json").exists()  # the model in output_dir, as trl saves it


def test_cpu_reward_example_then_grpo_with_that_reward_model(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    run("reward", "--config", "examples/configs/cpu-reward.yaml", "--output_dir", str(tmp_path / "rm"),
        "--max_steps", "4", "--logging_steps", "2")
    assert [r["step"] for r in read_metrics(tmp_path / "rm")] == [2, 4]
    reward_model = tmp_path / "rm"
    run("grpo", "--config", "examples/configs/cpu-grpo-with-reward-model.yaml", "--output_dir",
        str(tmp_path / "grpo"), "--reward_funcs", str(reward_model), "format", "--max_steps", "2",
        "--logging_steps", "1", "--eval_steps", "2")
    rows = [r for r in read_metrics(tmp_path / "grpo") if "reward" in r]
    assert [r["step"] for r in rows] == [1, 2]
    assert all("rewards/rm/mean" in r and "rewards/format_reward/mean" in r for r in rows)


def test_an_example_config_runs_from_any_folder(tmp_path, monkeypatch):
    """Relative paths in a config that do not exist from the working directory are read from the config's folder,
    and the run says which path it used."""
    monkeypatch.chdir(tmp_path)
    script, _, model, _, notes = parse_run("grpo", [], str(ROOT / "examples" / "configs" / "cpu-grpo-lora.yaml"))
    assert Path(model.model_name_or_path).resolve() == (ROOT / "rlft" / "assets" / "tiny-adder").resolve()
    assert Path(script.train_dataset).is_file()
    assert any(n.startswith("model_name_or_path: '../../rlft/assets/tiny-adder' does not exist from") for n in notes)
    run("grpo", "--config", str(ROOT / "examples" / "configs" / "cpu-grpo-lora.yaml"), "--output_dir",
        str(tmp_path / "out"), "--max_steps", "1", "--eval_strategy", "no", "--save_steps", "1")
    assert (tmp_path / "out" / "adapter_config.json").exists()


def test_the_distillation_demo_runs_and_writes_its_figure(tmp_path, tiny_causal_dir):
    """examples/distillation_demo.py (docs/distillation.md's figure), cut to 2 steps with a ready teacher."""
    import json
    import subprocess
    import sys

    figure = tmp_path / "distillation.png"
    result = subprocess.run([sys.executable, "examples/distillation_demo.py", "--teacher", str(tiny_causal_dir),
                             "--steps", "2", "--eval_every", "1", "--output_dir", str(tmp_path / "run"),
                             "--out", str(figure)], cwd=ROOT, capture_output=True, text=True, timeout=300,
                            env={"PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"})
    assert result.returncode == 0, result.stderr[-3000:]
    numbers = json.loads(figure.with_suffix(".json").read_text())
    assert figure.stat().st_size > 0 and [step for step, _ in numbers["curve"]] == [0, 1, 2]
    assert 0 <= numbers["teacher_accuracy"] <= 1 and "student held-out accuracy" in result.stdout


def test_the_self_distillation_demo_runs_and_writes_its_figure(tmp_path):
    """examples/self_distillation_demo.py (docs/distillation.md's SDFT figure), cut to 2 steps."""
    import json
    import subprocess
    import sys

    figure = tmp_path / "sdft.png"
    result = subprocess.run([sys.executable, "examples/self_distillation_demo.py", "--steps", "2", "--eval_every",
                             "1", "--output_dir", str(tmp_path / "run"), "--out", str(figure)], cwd=ROOT,
                            capture_output=True, text=True, timeout=300,
                            env={"PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"})
    assert result.returncode == 0, result.stderr[-3000:]
    numbers = json.loads(figure.with_suffix(".json").read_text())
    assert [step for step, _ in numbers["curve"]] == [0, 1, 2] and [s for s, _ in numbers["losses"]] == [1, 2]
    assert numbers["teacher_accuracy"] == 0.0 and numbers["curve"][0][1] == 0.29


def test_the_sdpo_demo_runs_and_writes_its_figure(tmp_path):
    """examples/sdpo_demo.py (docs/distillation.md's SDPO figure), cut to 2 steps at two weights."""
    import json
    import subprocess
    import sys

    figure = tmp_path / "sdpo.png"
    result = subprocess.run([sys.executable, "examples/sdpo_demo.py", "--weights", "0", "1", "--steps", "2",
                             "--eval_every", "1", "--output_dir", str(tmp_path / "run"), "--out", str(figure)],
                            cwd=ROOT, capture_output=True, text=True, timeout=300,
                            env={"PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"})
    assert result.returncode == 0, result.stderr[-3000:]
    curves = json.loads(figure.with_suffix(".json").read_text())["curves"]
    assert sorted(curves) == ["0.0", "1.0"] and all([s for s, _ in c] == [0, 1, 2] for c in curves.values())
