"""TRL's LogCompletionsCallback: completions of the evaluation prompts, logged as a table at its frequency."""

from __future__ import annotations

import pytest
from transformers import GenerationConfig

from rlft import DistillationConfig, DistillationTrainer, LogCompletionsCallback
from rlft.errors import ConfigError
from rlft.telemetry.tracking import read_metrics
from tests.helpers import addition_rows


def test_completions_of_the_first_eval_prompts_are_logged_at_each_frequency_step(tmp_path, shipped_policy_dir):
    out = tmp_path / "run"
    cfg = DistillationConfig(output_dir=str(out), max_steps=4, per_device_train_batch_size=4, max_completion_length=8,
                             logging_steps=1, report_to=["tensorboard"], disable_tqdm=True, seed=0,
                             gradient_checkpointing=False, save_steps=1000)
    teacher = str(shipped_policy_dir)
    trainer = DistillationTrainer(str(shipped_policy_dir), teacher, cfg, addition_rows(16),
                                  eval_dataset=addition_rows(5, heldout=True))
    callback = LogCompletionsCallback(trainer, GenerationConfig(max_new_tokens=6, do_sample=False), num_prompts=3,
                                      freq=2)
    trainer.add_callback(callback)
    trainer.train()
    assert [row["step"] for row in callback.table] == [2, 2, 2, 4, 4, 4]
    heldout = addition_rows(3, heldout=True)
    for row, want in zip(callback.table, heldout * 2):
        assert want["prompt"][-1]["content"] in row["prompt"] and row["prompt"].endswith("assistant\n")
        assert row["completion"].startswith("<answer>")  # the warm-started policy answers in its format
        assert len(trainer.tokenizer(row["completion"], add_special_tokens=False)["input_ids"]) <= 6
    logged = [r for r in read_metrics(out / "completions.jsonl") if r.get("source") == "LogCompletionsCallback"]
    assert [(r["step"], r["prompt"], r["completion"]) for r in logged] == \
        [(r["step"], r["prompt"], r["completion"]) for r in callback.table]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(next((out / "runs").rglob("events.out.*")).parent), size_guidance={"tensors": 0})
    events.Reload()
    assert "completions/text_summary" in events.Tags()["tensors"]


def test_a_trainer_without_an_eval_set_is_refused_by_name(tmp_path, shipped_policy_dir):
    cfg = DistillationConfig(output_dir=str(tmp_path / "run"), max_steps=1, report_to=["none"], max_completion_length=8)
    trainer = DistillationTrainer(str(shipped_policy_dir), str(shipped_policy_dir), cfg, addition_rows(8))
    with pytest.raises(ConfigError, match="must have an evaluation dataset"):
        LogCompletionsCallback(trainer)
