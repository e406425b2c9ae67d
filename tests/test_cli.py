"""The `rlft` command line: subcommands listed, help works, config errors exit non-zero."""

from __future__ import annotations

import subprocess
import sys

import pytest

from rlft.cli import main


def test_help_lists_every_subcommand():
    out = subprocess.run([sys.executable, "-m", "rlft.cli", "--help"], capture_output=True, text=True, check=True)
    for name in ("grpo", "reward", "demo", "doctor", "plot"):
        assert name in out.stdout


@pytest.mark.parametrize("sub", ["grpo", "reward", "demo", "doctor", "plot"])
def test_subcommand_help(sub, capsys):
    with pytest.raises(SystemExit) as info:
        main([sub, "--help"])
    assert info.value.code == 0
    assert "usage: rlft" in capsys.readouterr().out


def test_demo_help_shows_its_knobs(capsys):
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    out = capsys.readouterr().out
    for knob in ("--steps", "--full", "--seed", "--output-dir"):
        assert knob in out


def test_bad_config_value_exits_2_with_field_name(capsys):
    assert main(["grpo", "--loss_type", "ppo"]) == 2
    assert "loss_type='ppo'" in capsys.readouterr().err


def test_output_to_a_file_shows_one_plain_line_per_logged_step(tmp_path, shipped_policy_dir):
    """Under a log file / CI / nohup the rich bar draws nothing: plain progress lines replace it."""
    import subprocess
    import sys

    from tests.helpers import addition_rows, write_jsonl

    data = write_jsonl(tmp_path / "train.jsonl", addition_rows(16))
    config = tmp_path / "run.yaml"
    config.write_text(f"model_name_or_path: {shipped_policy_dir}\ntrain_dataset: {data}\noutput_dir: {tmp_path / 'o'}\n"
                      "reward_funcs: [exact_match]\nnum_generations: 4\nper_device_train_batch_size: 8\n"
                      "max_completion_length: 8\nmax_steps: 3\nlogging_steps: 1\ngradient_checkpointing: false\n")
    with open(tmp_path / "log.txt", "w") as log:
        result = subprocess.run([sys.executable, "-m", "rlft.cli", "grpo", "--config", str(config)], stdout=log,
                                stderr=subprocess.STDOUT, timeout=300)
    assert result.returncode == 0
    lines = [x for x in (tmp_path / "log.txt").read_text().splitlines() if x.startswith("rlft step ")]
    assert [x.split()[2] for x in lines] == ["1/3", "2/3", "3/3"]
    assert all("reward" in x and "loss" in x and "grad_norm" in x for x in lines)
