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
