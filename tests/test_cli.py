"""The `rlft` command line: subcommands listed, help works, config errors exit non-zero."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlft.cli import main

ROOT = Path(__file__).resolve().parents[1]


def test_help_lists_every_subcommand():
    out = subprocess.run([sys.executable, "-m", "rlft.cli", "--help"], capture_output=True, text=True, check=True)
    for name in ("grpo", "reward", "demo", "doctor", "plot"):
        assert name in out.stdout


@pytest.mark.parametrize("sub", ["grpo", "reward", "distillation", "demo", "doctor", "plot"])
def test_subcommand_help(sub, capsys):
    try:
        code = main([sub, "--help"])
    except SystemExit as info:
        code = info.code
    assert code == 0
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


def test_a_dataset_problem_exits_2_with_the_file_and_no_traceback(tmp_path, capsys, shipped_policy_dir):
    code = main(["grpo", "--model_name_or_path", str(shipped_policy_dir), "--train_dataset",
                 str(tmp_path / "missing.jsonl"), "--reward_funcs", "exact_match", "--output_dir", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert code == 2 and "missing.jsonl' is neither an existing file" in err and "Traceback" not in err


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


def test_third_party_noise_is_silent_unless_verbose(tmp_path, shipped_policy_dir):
    """Weight-loading/writing bars and peft's is_gradient_checkpointing FutureWarning (LoRA + checkpointing)
    are not in a log file; every line is rlft's own. --verbose or RLFT_VERBOSE=1 brings them back."""
    import os
    import subprocess
    import sys

    from tests.helpers import addition_rows, write_jsonl

    data = write_jsonl(tmp_path / "train.jsonl", addition_rows(16))
    common = ["grpo", "--model_name_or_path", str(shipped_policy_dir), "--train_dataset", str(data),
              "--reward_funcs", "exact_match", "--num_generations", "4", "--per_device_train_batch_size", "8",
              "--max_completion_length", "8", "--max_steps", "1", "--logging_steps", "1", "--use_peft",
              "--gradient_checkpointing", "true"]

    def log_of(name: str, *extra: str, env: dict | None = None) -> str:
        with open(tmp_path / f"{name}.txt", "w") as log:
            result = subprocess.run([sys.executable, "-m", "rlft.cli", *common, "--output_dir", str(tmp_path / name),
                                     *extra], stdout=log, stderr=subprocess.STDOUT, timeout=300,
                                    env={**os.environ, **(env or {})})
        assert result.returncode == 0
        return (tmp_path / f"{name}.txt").read_text()

    quiet = log_of("quiet")
    assert [line.split()[0] for line in quiet.splitlines()] == ["rlft"] * len(quiet.splitlines()), quiet
    assert "rlft step 1/1 reward" in quiet
    for loud in (log_of("flag", "--verbose"), log_of("env", env={"RLFT_VERBOSE": "1"})):
        assert "Loading weights" in loud and "is_gradient_checkpointing` is deprecated" in loud


@pytest.mark.parametrize("sub", ["grpo", "reward", "distillation"])
def test_training_help_lists_every_field_of_every_dataclass_with_default_and_help(sub, capsys):
    import dataclasses

    from rlft.cli.field_help import FIELD_HELP
    from rlft.config.model_config import ModelConfig
    from rlft.kinds import KINDS, load

    assert main([sub, "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    script, config = load(KINDS[sub].script_args), load(KINDS[sub].config)
    for cls in (script, config, ModelConfig):
        for f in dataclasses.fields(cls):
            if f.init:
                assert f"--{f.name} " in out or f"--{f.name}," in out, f.name
    own = {"grpo": "num_generations", "reward": "max_length", "distillation": "teacher_model_revision"}[sub]
    for name in ("learning_rate", own, "lora_r", "train_dataset"):
        text = config.__dataclass_fields__[name].metadata["help"] if name == own else FIELD_HELP[name]
        assert " ".join(text.split()) in out, name
    assert "peak learning rate (default: 1e-06)" in out if sub != "reward" else "(default: 0.0001)" in out


def test_every_field_rlft_declares_has_one_help_line_and_no_line_names_a_missing_field():
    import dataclasses

    from transformers import TrainingArguments

    from rlft.cli.field_help import FIELD_HELP
    from rlft.cli.recipes import GRPOScriptArguments, RewardScriptArguments
    from rlft.config.model_config import ModelConfig
    from rlft.kinds import KINDS, load

    transformers_own = {f.name for f in dataclasses.fields(TrainingArguments)}
    configs = tuple(load(kind.config) for kind in KINDS.values())  # every kind's
    declared = {f.name for cls in configs for f in dataclasses.fields(cls)} - transformers_own
    declared |= {f.name for cls in (ModelConfig, GRPOScriptArguments, RewardScriptArguments)
                 for f in dataclasses.fields(cls)} - {"dataset_name", "dataset_config", "dataset_train_split",
                                                      "dataset_test_split", "dataset_streaming", "ignore_bias_buffers"}
    every = {f.name for cls in (*configs, ModelConfig, GRPOScriptArguments) for f in dataclasses.fields(cls)}
    assert declared - set(FIELD_HELP) == set()
    assert set(FIELD_HELP) - every == set()


def test_any_field_on_the_command_line_without_a_yaml(tmp_path, shipped_policy_dir, monkeypatch):
    """Options are parsed into the fields' types: lists from several words, booleans from a bare flag."""
    from tests.helpers import addition_rows, write_jsonl

    data = write_jsonl(tmp_path / "train.jsonl", addition_rows(16))
    seen = {}

    class Stop(Exception):
        pass

    def capture(kind, script, cfg, model, mixture):
        seen.update(script=script, cfg=cfg, model=model)
        raise Stop

    import rlft.cli.recipes

    monkeypatch.setattr(rlft.cli.recipes, "build_trainer", capture)
    with pytest.raises(Stop):
        main(["grpo", "--model_name_or_path", str(shipped_policy_dir), "--train_dataset", str(data),
              "--output_dir", str(tmp_path / "o"), "--reward_funcs", "exact_match", "format",
              "--reward_weights", "1.0", "0.5", "--use_peft", "--learning-rate", "2e-5", "--max_steps", "3"])
    script, cfg, model = seen["script"], seen["cfg"], seen["model"]
    assert script.reward_funcs == ["exact_match", "format"] and cfg.reward_weights == [1.0, 0.5]
    assert model.use_peft is True and cfg.learning_rate == 2e-5 and cfg.max_steps == 3
    assert main(["grpo", "--learning_rat", "1"]) == 2


def test_import_rlft_and_the_commands_help_load_no_torch_and_a_kinds_help_loads_no_trainer(tmp_path):
    """`import rlft` and `rlft --help` answer at once (no torch, no transformers: TRL's lazy module is the
    anchor); `rlft grpo --help` reads the configs but loads no trainer, model or rollout engine the first
    time, and nothing heavy once its text is cached (rlft/cli/help_cache.py): the same text, at once."""
    script = ("import sys\nimport rlft\nassert rlft.__all__ and 'GRPOTrainer' in rlft.__all__\n"
              "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers'))\n"
              "assert not heavy, heavy[:5]\nfrom rlft.cli import main\n"
              "try:\n    main([{args}])\nexcept SystemExit:\n    pass\n"
              "loaded = sorted(m for m in sys.modules if m.split('.')[0] in {forbidden})\n"
              "assert not loaded, loaded[:5]\n")
    cases = [("'--help'", ("torch", "transformers")),
             ("'grpo', '--help'", ("rlft.train", "rlft.rollout", "rlft.model.", "vllm")),
             ("'distillation', '--help'", ("rlft.train", "rlft.rollout", "rlft.model.", "vllm")),
             ("'grpo', '--help'", ("torch", "transformers", "datasets"))]  # now from the cache
    printed = []
    for args, forbidden in cases:
        forbidden_modules = {name for name in forbidden if "." not in name}
        code = script.format(args=args, forbidden=repr(forbidden_modules))
        code += "".join(f"assert not any(m.startswith({prefix!r}) for m in sys.modules), {prefix!r}\n"
                        for prefix in forbidden if "." in prefix)
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                                env={**os.environ, "PYTHONPATH": str(ROOT), "XDG_CACHE_HOME": str(tmp_path),
                                     "COLUMNS": "100"}, timeout=120)
        assert result.returncode == 0, (args, result.stderr[-2000:])
        printed.append(result.stdout)
    assert printed[1] == printed[3] and "--num_generations" in printed[3]
    assert sorted(p.name.partition("-")[0] for p in (tmp_path / "rlft" / "help").iterdir()) == [
        "distillation", "grpo"]


def test_a_cached_help_text_is_used_only_under_its_own_key_and_replaced_when_anything_changes(
        tmp_path, monkeypatch, capsys):
    from rlft.cli import help_cache

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("COLUMNS", "100")
    help_cache._installation.cache_clear()
    folder = tmp_path / "rlft" / "help"
    first = help_cache.help_text("rloo")
    assert first == help_cache.render("rloo") and "--num_generations" in first
    (kept,) = folder.iterdir()
    kept.write_text("a text kept for this key")  # read back as it is while the key holds
    assert main(["rloo", "--help"]) == 0 and capsys.readouterr().out == "a text kept for this key"
    monkeypatch.setenv("COLUMNS", "120")  # another width: another key, rendered again
    assert help_cache.help_text("rloo") == help_cache.render("rloo") != first
    assert [p.name for p in folder.iterdir()] == [f"rloo-{help_cache.cache_key('rloo')}.txt"]  # the old gone
    before = help_cache.cache_key("rloo")
    with monkeypatch.context() as patch:
        patch.setattr(help_cache, "_versions", lambda: "transformers=another")
        help_cache._installation.cache_clear()
        assert help_cache.cache_key("rloo") != before  # a package upgraded
    help_cache._installation.cache_clear()
    help_cache.warm(["gkd"])  # what a training command leaves for later
    assert (folder / f"gkd-{help_cache.cache_key('gkd')}.txt").read_text() == help_cache.render("gkd")
    help_cache._installation.cache_clear()


def test_trls_module_paths_come_from_the_kind_rows_and_the_deprecated_one_warns_as_trls():
    import importlib
    import warnings

    from rlft.kinds import KINDS, load

    for kind in KINDS.values():
        for path in kind.trl_paths:
            module = importlib.import_module(f"rlft.{path}")
            for name, target in kind.names().items():
                assert getattr(module, name) is load(target), (path, name)
    with pytest.warns(FutureWarning, match=r"Update your imports to `from rlft import DistillationTrainer`"):
        from rlft.experimental.distillation import DistillationTrainer
    from rlft import DistillationConfig
    from rlft import DistillationTrainer as Stable

    assert DistillationTrainer is Stable
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        from rlft.trainer.distillation_config import (
            DistillationConfig as Same,  # no warning on TRL's own path
        )
    assert Same is DistillationConfig
    with pytest.raises(ImportError):
        from rlft.trainer.grpo_trainer import NotThere  # noqa: F401
