"""An output folder belongs to one run; a checkpoint records the config that wrote it and a resume
compares it with the new one."""

from __future__ import annotations

import json

import pytest
from peft import LoraConfig

from rlft import GRPOTrainer, RewardTrainer
from rlft.config import ConfigError
from rlft.train.checkpoint import STATE_FILE
from rlft.train.runs import compare, config_hash
from tests.helpers import (
    addition_rows,
    correct_answer,
    preference_rows,
    stop_after,
    tiny_grpo_config,
    tiny_reward_config,
)


def grpo(tmp_path, shipped, peft_config=None, **overrides):
    lora = LoraConfig(r=4, target_modules="all-linear") if peft_config == "lora" else None
    return GRPOTrainer(str(shipped), [correct_answer], tiny_grpo_config(tmp_path, **overrides), addition_rows(16),
                       peft_config=lora)


def test_a_new_run_into_a_folder_holding_a_run_is_refused_then_replaced_on_request(tmp_path, shipped_policy_dir):
    grpo(tmp_path, shipped_policy_dir, save_steps=1).train()
    run = tmp_path / "run"
    (run / "notes.txt").write_text("mine")  # the user's own file
    before = (run / "metrics.jsonl").read_text()
    with pytest.raises(ConfigError, match=r"already holds a run \(checkpoint-1, checkpoint-2, metrics.jsonl.*"
                                          r"resume_from_checkpoint=True.*overwrite_output_dir=True"):
        grpo(tmp_path, shipped_policy_dir, save_steps=1).train()
    assert (run / "metrics.jsonl").read_text() == before and (run / "checkpoint-2").is_dir()

    again = grpo(tmp_path, shipped_policy_dir, max_steps=1, save_steps=1, overwrite_output_dir=True, seed=3)
    again.train()
    assert sorted(p.name for p in run.glob("checkpoint-*")) == ["checkpoint-1"]  # no checkpoint of the other run
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [1]
    assert (run / "notes.txt").read_text() == "mine"


def test_a_checkpoint_records_the_config_and_its_hash(tmp_path, shipped_policy_dir):
    grpo(tmp_path, shipped_policy_dir, save_steps=2).train()
    state = json.loads((tmp_path / "run" / "checkpoint-2" / STATE_FILE).read_text())
    assert state["config"]["num_generations"] == 4 and state["config"]["_reward_funcs"] == ["correct_answer"]
    assert state["config"]["_model"]["class"] == "Qwen2ForCausalLM"
    assert state["config_hash"] == config_hash(state["config"])


@pytest.mark.parametrize("change, field", [
    ({"num_generations": 2, "per_device_train_batch_size": 4}, "num_generations: 4 -> 2"),
    ({"loss_type": "grpo"}, "loss_type: 'dapo' -> 'grpo'"),
    ({"seed": 1}, "seed: 0 -> 1"),
    ({"peft_config": "lora"}, "_model: "),
])
def test_resume_with_a_config_change_that_breaks_exactness_is_refused(tmp_path, shipped_policy_dir, change, field):
    grpo(tmp_path, shipped_policy_dir, save_steps=2).train()
    resumed = grpo(tmp_path, shipped_policy_dir, max_steps=3, **change)
    with pytest.raises(ConfigError, match="different config") as err:
        resumed.train(resume_from_checkpoint=True)
    assert field in str(err.value)


def test_resume_applies_and_reports_a_new_learning_rate_and_logging(tmp_path, shipped_policy_dir, caplog):
    first = grpo(tmp_path, shipped_policy_dir, save_steps=2, max_steps=4, lr_scheduler_type="linear")
    first.add_callback(stop_after(2))
    first.train()
    resumed = grpo(tmp_path, shipped_policy_dir, save_steps=2, max_steps=4, lr_scheduler_type="linear",
                   learning_rate=2e-3, logging_steps=2)
    with caplog.at_level("WARNING", logger="rlft"):
        resumed.train(resume_from_checkpoint=True)
    assert "learning_rate: 0.001 -> 0.002" in caplog.text and "logging_steps: 1 -> 2" in caplog.text
    rows = [r for r in resumed.state.log_history if "learning_rate" in r]
    # the linear schedule rebuilt from the new peak: step 3 ran at 2e-3 * (4 - 2) / 4, step 4 at 2e-3 * 1/4
    assert rows[-1]["learning_rate"] == pytest.approx(2e-3 * 1 / 4)
    assert resumed.scheduler.base_lrs == [2e-3] * len(resumed.optimizer.param_groups)


def test_the_reward_trainer_refuses_a_changed_config_on_resume(tmp_path, tiny_rm_dir):
    RewardTrainer(str(tiny_rm_dir), tiny_reward_config(tmp_path, max_steps=2, save_steps=2),
                  train_dataset=preference_rows(32)).train()
    changed = RewardTrainer(str(tiny_rm_dir), tiny_reward_config(tmp_path, max_steps=3, per_device_train_batch_size=8),
                            train_dataset=preference_rows(32))
    with pytest.raises(ConfigError, match="per_device_train_batch_size: 16 -> 8"):
        changed.train(resume_from_checkpoint=True)
    with pytest.raises(ConfigError, match="already holds a run"):
        RewardTrainer(str(tiny_rm_dir), tiny_reward_config(tmp_path, max_steps=1),
                      train_dataset=preference_rows(32)).train()


def test_compare_splits_refused_from_applied_fields():
    refused, applied = compare({"seed": 1, "save_steps": 5, "lora_r": 8}, {"seed": 1, "save_steps": 9, "lora_r": 16})
    assert refused == ["lora_r: 8 -> 16"] and applied == ["save_steps: 5 -> 9"]


def test_a_checkpoint_from_before_a_field_existed_resumes_when_the_field_keeps_its_default():
    from rlft import GRPOConfig
    from rlft.train import runs

    defaults = runs.field_defaults(GRPOConfig(output_dir="unused"))
    saved = {"seed": 1, "learning_rate": 1e-3}  # written by an rlft without the newer fields
    new = {**saved, "advantage_estimator": "grpo", "dynamic_sampling": False, "max_num_gen_batches": 10}
    assert runs.compare(saved, new, defaults) == ([], [])
    refused, _ = runs.compare(saved, {**new, "dynamic_sampling": True}, defaults)
    assert refused == ["dynamic_sampling: False -> True"]
