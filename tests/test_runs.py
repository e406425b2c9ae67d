"""An output folder belongs to one run; a checkpoint records the config that wrote it and a resume
compares it with the new one."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from peft import LoraConfig

from rlft import GRPOTrainer, RewardTrainer
from rlft.config import ConfigError
from rlft.telemetry.tracking import read_metrics
from rlft.train.run.checkpoint import STATE_FILE
from rlft.train.run.runs import compare, config_hash
from tests.helpers import (
    addition_rows,
    correct_answer,
    preference_rows,
    stop_after,
    tiny_grpo_config,
    tiny_reward_config,
    write_jsonl,
)

ROOT = Path(__file__).resolve().parents[1]


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


def test_overwriting_a_folder_removes_the_earlier_runs_saved_model_but_not_the_users_files(tmp_path,
                                                                                          shipped_policy_dir):
    """The final model lives in output_dir (as TRL's scripts save it): a LoRA run replacing a full run must not
    leave the full run's weights beside its adapter, where loading the folder would find both."""
    full = grpo(tmp_path, shipped_policy_dir, max_steps=1)
    full.train()
    full.save_model()
    run = tmp_path / "run"
    (run / "notes.txt").write_text("mine")
    assert (run / "model.safetensors").is_file() and (run / "config.json").is_file()
    lora = grpo(tmp_path, shipped_policy_dir, "lora", max_steps=1, overwrite_output_dir=True)
    lora.train()
    assert not (run / "model.safetensors").exists() and not (run / "config.json").exists()
    lora.save_model()
    assert (run / "adapter_model.safetensors").is_file() and not (run / "model.safetensors").exists()
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


def lora_grpo(tmp_path, shipped, **lora_settings):
    settings = {"r": 4, "lora_alpha": 32, "lora_dropout": 0.05, "target_modules": ["q_proj", "v_proj"],
                **lora_settings}
    return GRPOTrainer(str(shipped), [correct_answer], tiny_grpo_config(tmp_path, save_steps=2, max_steps=3),
                       addition_rows(16), peft_config=LoraConfig(**settings))


def test_a_lora_checkpoint_records_the_adapters_settings(tmp_path, shipped_policy_dir):
    first = lora_grpo(tmp_path, shipped_policy_dir)
    first.add_callback(stop_after(2))
    first.train()
    peft = json.loads((tmp_path / "run" / "checkpoint-2" / STATE_FILE).read_text())["config"]["_peft"]
    assert {k: peft["default"][k] for k in ("r", "lora_alpha", "lora_dropout", "target_modules", "use_rslora",
                                            "use_dora", "modules_to_save")} == {
        "r": 4, "lora_alpha": 32, "lora_dropout": 0.05, "target_modules": ["q_proj", "v_proj"],
        "use_rslora": False, "use_dora": False, "modules_to_save": None}


@pytest.mark.parametrize("change, line", [
    ({"lora_alpha": 64}, "LoRA lora_alpha: 32 -> 64"),
    ({"r": 8}, "LoRA r (lora_r): 4 -> 8"),
    ({"use_rslora": True}, "LoRA use_rslora: False -> True"),
    ({"target_modules": ["q_proj", "k_proj", "v_proj"]},
     "LoRA target_modules (lora_target_modules): ['q_proj', 'v_proj'] -> ['k_proj', 'q_proj', 'v_proj']"),
])
def test_resuming_lora_with_a_setting_that_changes_the_saved_weights_meaning_is_refused_naming_it(
        tmp_path, shipped_policy_dir, change, line):
    first = lora_grpo(tmp_path, shipped_policy_dir)
    first.add_callback(stop_after(2))
    first.train()
    with pytest.raises(ConfigError, match="different config") as err:
        lora_grpo(tmp_path, shipped_policy_dir, **change).train(resume_from_checkpoint=True)
    assert line in str(err.value)


def test_resuming_lora_with_another_dropout_is_applied_with_a_notice(tmp_path, shipped_policy_dir, caplog):
    first = lora_grpo(tmp_path, shipped_policy_dir)
    first.add_callback(stop_after(2))
    first.train()
    resumed = lora_grpo(tmp_path, shipped_policy_dir, lora_dropout=0.2)
    with caplog.at_level("WARNING", logger="rlft"):
        resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == 3
    assert "LoRA lora_dropout: 0.05 -> 0.2 (applied from the resumed step" in caplog.text


def test_a_lora_checkpoint_of_an_older_rlft_without_the_record_resumes_with_a_note(tmp_path, shipped_policy_dir,
                                                                                   caplog):
    first = lora_grpo(tmp_path, shipped_policy_dir)
    first.add_callback(stop_after(2))
    first.train()
    state_file = tmp_path / "run" / "checkpoint-2" / STATE_FILE
    state = json.loads(state_file.read_text())
    del state["config"]["_peft"]  # as an rlft before the LoRA record wrote it
    state_file.write_text(json.dumps(state))
    resumed = lora_grpo(tmp_path, shipped_policy_dir, lora_alpha=64)
    with caplog.at_level("WARNING", logger="rlft"):
        resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == 3 and "records no LoRA settings (written by an older rlft)" in caplog.text


def test_compare_splits_refused_from_applied_fields():
    refused, applied = compare({"seed": 1, "save_steps": 5, "lora_r": 8}, {"seed": 1, "save_steps": 9, "lora_r": 16})
    assert refused == ["lora_r: 8 -> 16"] and applied == ["save_steps: 5 -> 9"]


def test_a_checkpoint_from_before_a_field_existed_resumes_when_the_field_keeps_its_default():
    from rlft import GRPOConfig
    from rlft.train.run import runs

    defaults = runs.field_defaults(GRPOConfig(output_dir="unused"))
    saved = {"seed": 1, "learning_rate": 1e-3}  # written by an rlft without the newer fields
    new = {**saved, "advantage_estimator": "grpo", "dynamic_sampling": False, "max_num_gen_batches": 10}
    assert runs.compare(saved, new, defaults) == ([], [])
    refused, _ = runs.compare(saved, {**new, "dynamic_sampling": True}, defaults)
    assert refused == ["dynamic_sampling: False -> True"]


def test_two_runs_started_together_on_one_folder_one_trains_and_the_other_is_refused_naming_it(tmp_path,
                                                                                               shipped_policy_dir):
    """Both would pass the 'folder already holds a run' check (nothing is there yet); the folder's lock lets one
    through. Their max_steps differ, so metrics.jsonl tells whose it is."""
    data = write_jsonl(tmp_path / "train.jsonl", addition_rows(16))
    out = tmp_path / "out"
    command = [sys.executable, "-m", "rlft.cli", "grpo", "--model_name_or_path", str(shipped_policy_dir),
               "--train_dataset", str(data), "--reward_funcs", "tests.helpers:slow_correct_answer",
               "--output_dir", str(out), "--per_device_train_batch_size", "8", "--num_generations", "4",
               "--max_completion_length", "8", "--logging_steps", "1", "--save_steps", "2", "--report_to", "none",
               "--disable_tqdm", "true", "--max_steps"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    runs = [subprocess.Popen([*command, str(steps)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True) for steps in (8, 9)]
    outputs = [run.communicate(timeout=600) for run in runs]
    codes = [run.returncode for run in runs]
    assert sorted(codes) == [0, 1], [err[-2000:] for _, err in outputs]
    winner = codes.index(0)
    refusal = outputs[1 - winner][1]
    assert f"rlft grpo: output_dir={str(out)!r} is in use by another training run (pid {runs[winner].pid} on " \
        in refusal and "Wait for that run to end" in refusal and "another output_dir" in refusal
    steps = (8, 9)[winner]
    assert [r["step"] for r in read_metrics(out)] == list(range(1, steps + 1))
    saved = sorted({*range(2, steps + 1, 2), steps})  # every save_steps, and the last step
    assert sorted(int(p.name.split("-")[1]) for p in out.glob("checkpoint-*")) == saved


HOLD_THE_LOCK = """
import sys, time, types
sys.path.insert(0, {root!r})
from rlft.train.run.runs import OutputDirLock
OutputDirLock(types.SimpleNamespace(is_main_process=True, num_processes=1), {folder!r}).__enter__()
print("locked", flush=True)
time.sleep(600)
"""


def test_a_killed_runs_lock_file_does_not_block_the_next_run(tmp_path, shipped_policy_dir):
    """The lock is the OS's, held by a live process: while it lives a run is refused naming its pid; once it is
    killed (no chance to clean up) the lock file left behind blocks nothing."""
    from rlft.errors import OutputDirBusyError

    holder = subprocess.Popen([sys.executable, "-c", HOLD_THE_LOCK.format(root=str(ROOT),
                                                                           folder=str(tmp_path / "run"))],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(OutputDirBusyError, match=rf"pid {holder.pid} on "):
            grpo(tmp_path, shipped_policy_dir).train()
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert (tmp_path / "run" / ".rlft.lock").is_file()
    grpo(tmp_path, shipped_policy_dir).train()
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [1, 2]


def test_the_weights_fingerprint_sees_one_bit_and_not_the_summation_split(monkeypatch):
    import copy

    import torch

    from rlft.train.run import runs

    model = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Linear(5, 3, bias=False))
    twin = copy.deepcopy(model)
    want = runs.weights_fingerprint(model)
    assert len(want) == 16 and runs.weights_fingerprint(twin) == want
    monkeypatch.setattr(runs, "_CHUNK", 4)  # other chunks: integer sums in another order, the same digits
    assert runs.weights_fingerprint(model) == want
    with torch.no_grad():
        flat = twin[0].weight.view(-1)
        flat[3] = torch.nextafter(flat[3], torch.tensor(2.0))  # one unit in the last place
    assert runs.weights_fingerprint(twin) != want
    with torch.no_grad():  # two weights swapped: the same sum, not the same fingerprint
        moved = copy.deepcopy(model)
        moved[1].weight[0, 0], moved[1].weight[0, 1] = model[1].weight[0, 1].item(), model[1].weight[0, 0].item()
    assert runs.weights_fingerprint(moved) != want


def test_a_checkpoint_without_weight_fingerprints_resumes_and_says_they_were_not_compared(tmp_path):
    from rlft.train.run.runs import check_resume

    teacher = {"class": "LlamaForCausalLM", "name_or_path": "t", "parameters": 10}
    saved = {"learning_rate": 1e-3, "_teacher": teacher}
    new = {"learning_rate": 1e-3, "_teacher": {**teacher, "weights": "0123456789abcdef"},
           "_reward_models": {"judge": {**teacher, "weights": "fedcba9876543210"}}}
    notes = check_resume(tmp_path, {"config": saved}, new)
    assert any("no fingerprint of the teacher's weights" in n for n in notes)
    assert any("no fingerprint of the reward models' weights" in n for n in notes)
    with pytest.raises(Exception, match="_teacher"):  # a recorded fingerprint is compared
        check_resume(tmp_path, {"config": {**saved, "_teacher": {**teacher, "weights": "x"}}}, new)
