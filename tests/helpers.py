"""Small builders shared by trainer tests."""

from __future__ import annotations

from rlft import GRPOConfig
from rlft.data.addition import rows, split_problems


def run_trl_script(tmp_path, script: str, recipe: str, train: list[dict], test: list[dict]):
    """A TRL-shaped script (its text) run in a fresh process on a dataset folder of train/test JSONL, with a
    recipe YAML (`recipe`, `dataset_name` added) and --output_dir tmp_path/out; asserts it succeeded and
    returns the CompletedProcess."""
    import subprocess
    import sys
    from pathlib import Path

    data = tmp_path / "data"
    data.mkdir()
    write_jsonl(data / "train.jsonl", train)
    write_jsonl(data / "test.jsonl", test)
    config = tmp_path / "recipe.yaml"
    config.write_text(f"dataset_name: {data}\n{recipe}")
    path = tmp_path / "script.py"
    path.write_text(script)
    env = {"PYTHONPATH": str(Path(__file__).resolve().parents[1]), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"}
    result = subprocess.run([sys.executable, str(path), "--config", str(config), "--output_dir", str(tmp_path / "out")],
                            capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def write_jsonl(path, rows: list[dict]):
    """rows -> a jsonl dataset file; returns the path."""
    import json

    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def addition_rows(count: int = 64, heldout: bool = False) -> list[dict]:
    train, held = split_problems()
    return rows((held if heldout else train)[:count])


def tiny_grpo_config(tmp_path, **overrides) -> GRPOConfig:
    values = dict(output_dir=str(tmp_path / "run"), learning_rate=1e-3, max_steps=2, num_generations=4,
                  per_device_train_batch_size=8, max_completion_length=8, logging_steps=1, save_steps=1000,
                  report_to="none", disable_tqdm=True, seed=0, gradient_checkpointing=False, log_completions=True)
    values.update(overrides)
    return GRPOConfig(**values)


def correct_answer(completions, answer, **kwargs):
    """A TRL-style reward: keyword arguments, one float per completion."""
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [1.0 if f"<answer>{a}</answer>" in t else 0.0 for t, a in zip(texts, answer)]


def slow_correct_answer(completions, answer, **kwargs):
    """correct_answer, taking half a second per call: a run that lasts long enough for another to start."""
    import time

    time.sleep(0.5)
    return correct_answer(completions, answer)


def has_answer_tags(completions, **kwargs):
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [0.5 if "<answer>" in t and "</answer>" in t else 0.0 for t in texts]


SUBJECTS = ["the answer", "your reply", "this response", "the summary", "my review", "that note", "the letter",
            "his message", "her essay", "our report", "the guide", "the comment"]
HELDOUT_SUBJECTS = ["the draft", "a story", "their email", "the poem"]
GOOD = ["kind", "helpful", "polite", "correct", "clear"]
BAD = ["rude", "wrong", "unclear", "bad", "worse"]


def preference_rows(count: int = 64, seed: int = 0, heldout: bool = False, style: str = "implicit") -> list[dict]:
    """An easy synthetic preference task: chosen responses use good words, rejected ones bad words."""
    import random

    rng = random.Random(seed)
    subjects = HELDOUT_SUBJECTS if heldout else SUBJECTS
    out = []
    for _ in range(count):
        subject = rng.choice(subjects)
        good = f"{subject.capitalize()} is {rng.choice(GOOD)} and {rng.choice(GOOD)}."
        bad = f"{subject.capitalize()} is {rng.choice(BAD)} and {rng.choice(BAD)}."
        question = f"Please rate {subject}."
        if style == "implicit":
            out.append({"chosen": f"{question} {good}", "rejected": f"{question} {bad}"})
        elif style == "explicit":
            out.append({"prompt": f"{question} ", "chosen": good, "rejected": bad})
        else:  # conversational
            out.append({"prompt": [{"role": "user", "content": question}],
                        "chosen": [{"role": "assistant", "content": good}],
                        "rejected": [{"role": "assistant", "content": bad}]})
    return out


def tiny_reward_config(tmp_path, **overrides):
    from rlft import RewardConfig

    values = dict(output_dir=str(tmp_path / "rm"), learning_rate=3e-3, max_steps=40, per_device_train_batch_size=16,
                  logging_steps=5, save_steps=1000, report_to="none", disable_tqdm=True, seed=0, max_length=64,
                  gradient_checkpointing=False)
    values.update(overrides)
    return RewardConfig(**values)


def stop_after(step: int, save: bool = False):
    """A TrainerCallback that stops training after `step` (as a kill right after it would), optionally saving."""
    from transformers import TrainerCallback

    class StopAfter(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == step:
                control.should_training_stop = True
                control.should_save = control.should_save or save
            return control

    return StopAfter()


def one_step_each(tmp_path, model_dir, field: str, values: tuple, **overrides) -> list:
    """One GRPO step on the addition task (gradient checkpointing on) for each value of config `field`, each its
    own trainer and output folder: the trainers, in the order of `values`."""
    from rlft import GRPOTrainer

    trainers = []
    for value in values:
        cfg = tiny_grpo_config(tmp_path / f"{field}-{value}", max_steps=1, gradient_checkpointing=True,
                               **{field: value}, **overrides)
        trainers.append(GRPOTrainer(str(model_dir), [correct_answer], cfg, addition_rows(8)))
        trainers[-1].train()
    return trainers


def assert_same_step(first, second, atol: float = 1e-6) -> None:
    """Two trainers took the same step: their first logged loss and every weight agree within `atol`."""
    import pytest
    import torch

    assert second.state.log_history[0]["loss"] == pytest.approx(first.state.log_history[0]["loss"], abs=atol)
    reference = dict(first.model.named_parameters())
    for name, weight in second.model.named_parameters():
        assert torch.allclose(weight, reference[name], atol=atol), name


# ---- two computations of one training step ---------------------------------------------------------------
# Tests that compare two ways of computing one step that differ only in the order they sum in (process counts,
# micro-batch splits, packing, training engines) run the models in float64 (`model_init_kwargs=FLOAT64`), so
# that a green run on one CPU is green on the next: in float32 the order alone moved an embedding's change by
# 1.2e-6 with AVX2 kernels and 2.4e-7 with AVX-512 ones (tests/test_distillation.py, 2026-11-28).
FLOAT64 = {"dtype": "float64"}
# In float64 two orders agree to rounding: a parameter's change (SGD at lr 1: its gradient) is a sum of at most
# ~10^4 terms of at most ~10^2 (the largest change seen is 16), which reordering moves by at most about
# 2 x 10^4 x 2^-53 x 10^2 = 2e-10 (seen: 4e-16). A wrong normaliser, a term counted once per micro-batch or a
# missing reduction moves it by 1e-4 of itself or more.
SAME_STEP = 1e-9
# transformers' RMSNorm computes in float32 even in a float64 model. Where one order sums a gradient before
# that rounding and the other after it (a prompt held once for its group of G completions, or scored with
# each), the two differ by up to G x 2^-24 of the gradient: 4 x 6e-8 x 16 = 4e-6 here (seen: 4.6e-9).
SHARED_PROMPT = 1e-5


def float32_step_bound(change: float, value: float, terms: int = 256) -> float:
    """How far a float32 run of a step may be from its float64 run (for an engine that trains float32 only):
    each summed gradient element is off by at most `terms` x 2^-24 of its largest change `change` (Higham's
    n u bound, n the accumulations that round: tiles, micro-batches, processes, layers), plus the rounding of
    the float32 parameter after the step, at most half its unit in the last place: 2^-24 x |value|, doubled
    (a layer norm's weight near 1 with a change of 7e-4 was off by 5.9e-8, that half unit)."""
    return 2.0 ** -24 * (terms * change + 2 * value)


def assert_params_close(got: dict, want: dict, bound, label="") -> None:
    """Every tensor of `got` is within `bound` of `want`'s (a number, or name -> number)."""

    assert sorted(got) == sorted(want), label
    for name, value in got.items():
        allowed = bound(name) if callable(bound) else bound
        gap = (value.double() - want[name].double()).abs().max().item() if value.numel() else 0.0
        assert gap <= allowed, (label, name, gap, allowed)
