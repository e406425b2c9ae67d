"""GRPOTrainer end to end on tiny real models: TRL-style usage, LoRA, reference policy, metrics."""

from __future__ import annotations

import datasets
import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM

from rlft import GRPOTrainer
from rlft.model.loading import GradientFlowError
from rlft.telemetry.tracking import read_metrics
from tests.helpers import addition_rows, correct_answer, has_answer_tags, tiny_grpo_config

EXPECTED_METRICS = [
    "loss", "policy_loss", "reward", "reward_std", "rewards/correct_answer/mean", "rewards/correct_answer/std",
    "rewards/has_answer_tags/mean", "rewards/has_answer_tags/std", "frac_reward_zero_std", "advantage_abs_mean",
    "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "entropy", "completions/mean_length",
    "completions/min_length", "completions/max_length", "completions/clipped_ratio", "grad_norm", "learning_rate",
    "tokens_per_second", "time/generation_seconds", "time/reward_seconds", "time/train_seconds", "kl",
]


def lora():
    return LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", lora_dropout=0.0)


def test_trl_style_script_trains_and_writes_all_metrics(tmp_path, shipped_policy_dir):
    dataset = datasets.Dataset.from_list(addition_rows(32))  # conversational prompts + 'answer' column
    args = tiny_grpo_config(tmp_path, max_steps=3, beta=0.04, reward_weights=[1.0, 1.0])
    trainer = GRPOTrainer(model=str(shipped_policy_dir), reward_funcs=[correct_answer, has_answer_tags], args=args,
                          train_dataset=dataset, peft_config=lora())
    trainer.train()
    rows = read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2, 3]
    missing = [k for k in EXPECTED_METRICS if k not in rows[-1]]
    assert not missing
    samples = (tmp_path / "run" / "completions.jsonl").read_text().splitlines()
    assert samples and '"correct_answer"' in samples[0]
    trainer.save_model(tmp_path / "final")
    assert (tmp_path / "final" / "adapter_config.json").exists()
    assert (tmp_path / "final" / "tokenizer.json").exists()


@pytest.mark.parametrize("checkpointing", [None, {"use_reentrant": True}, {"use_reentrant": False}])
def test_lora_with_and_without_checkpointing_trains_only_lora(tmp_path, shipped_policy_dir, checkpointing):
    model = AutoModelForCausalLM.from_pretrained(shipped_policy_dir)
    base_before = {n: p.detach().clone() for n, p in model.named_parameters()}
    args = tiny_grpo_config(tmp_path, max_steps=2, gradient_checkpointing=checkpointing is not None,
                            gradient_checkpointing_kwargs=checkpointing)
    trainer = GRPOTrainer(model, [correct_answer, has_answer_tags], args, addition_rows(16), peft_config=lora())
    lora_before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    trainer.train()
    changed_lora = [n for n, p in trainer.model.named_parameters() if p.requires_grad
                    and not torch.equal(p, lora_before[n])]
    assert changed_lora and all("lora_" in n for n in changed_lora)
    base = trainer.model.get_base_model()
    for name, param in base.named_parameters():
        if "lora_" not in name:
            clean = name.replace(".base_layer", "")
            assert torch.equal(param, base_before[clean]), f"{clean} changed"


def test_everything_frozen_stops_with_gradient_flow_message(tmp_path, shipped_policy_dir):
    model = AutoModelForCausalLM.from_pretrained(shipped_policy_dir).requires_grad_(False)
    with pytest.raises(GradientFlowError, match="no trainable parameters"):
        GRPOTrainer(model, [correct_answer], tiny_grpo_config(tmp_path), addition_rows(16))


def test_disconnected_trainable_parameter_is_named_after_first_backward(tmp_path, shipped_policy_dir):
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(shipped_policy_dir), lora())
    model.register_parameter("orphan", torch.nn.Parameter(torch.zeros(3)))  # trainable, not in the graph
    with pytest.raises(GradientFlowError, match=r"got no gradient at all \(e.g. \['orphan'\]\)"):
        GRPOTrainer(model, [correct_answer, has_answer_tags], tiny_grpo_config(tmp_path), addition_rows(16)).train()


def test_lora_reference_policy_is_the_same_model_and_kl_starts_at_zero(tmp_path, shipped_policy_dir):
    args = tiny_grpo_config(tmp_path, max_steps=3, beta=0.1, per_device_train_batch_size=32)
    trainer = GRPOTrainer(str(shipped_policy_dir), [correct_answer, has_answer_tags], args, addition_rows(32),
                          peft_config=lora())
    assert trainer.ref_model is None and isinstance(trainer.model, PeftModel)
    total = sum(p.numel() for p in trainer.model.parameters())
    assert total == trainer.param_summary["total"]  # no second copy of the base weights anywhere
    trainer.train()
    rows = read_metrics(tmp_path / "run")
    assert rows[0]["kl"] == 0.0  # adapters start at B = 0, so policy == reference at step 1
    assert rows[-1]["kl"] > 0.0


def test_full_finetuning_with_beta_keeps_a_frozen_copy(tmp_path, shipped_policy_dir):
    trainer = GRPOTrainer(str(shipped_policy_dir), [correct_answer, has_answer_tags],
                          tiny_grpo_config(tmp_path, max_steps=1, beta=0.1), addition_rows(16))
    assert trainer.ref_model is not None and trainer.ref_model is not trainer.model
    assert not any(p.requires_grad for p in trainer.ref_model.parameters())
    before = [p.clone() for p in trainer.ref_model.parameters()]
    trainer.train()
    assert all(torch.equal(a, b) for a, b in zip(before, trainer.ref_model.parameters()))


def test_no_reference_model_at_beta_zero(tmp_path, shipped_policy_dir):
    trainer = GRPOTrainer(str(shipped_policy_dir), [correct_answer], tiny_grpo_config(tmp_path), addition_rows(16))
    assert trainer.ref_model is None


def test_zero_loss_is_explained_in_the_run(tmp_path, shipped_policy_dir, capsys):
    args = tiny_grpo_config(tmp_path, max_steps=2, loss_type="grpo", per_device_train_batch_size=32)
    GRPOTrainer(str(shipped_policy_dir), [correct_answer, has_answer_tags], args, addition_rows(32)).train()
    err = capsys.readouterr().err
    assert "loss is ~0 while grad_norm > 0: expected" in err
    rows = read_metrics(tmp_path / "run")
    assert all(abs(r["loss"]) < 1e-6 for r in rows) and any(r["grad_norm"] > 0.01 for r in rows)


def test_zero_reward_spread_warns_there_is_no_signal(tmp_path, shipped_policy_dir, capsys):
    def constant(completions, **kwargs):
        return [1.0] * len(completions)

    args = tiny_grpo_config(tmp_path, max_steps=3, zero_signal_warning_steps=3)
    GRPOTrainer(str(shipped_policy_dir), [constant], args, addition_rows(16)).train()
    assert "zero reward spread for 3 logged steps" in capsys.readouterr().err
    assert read_metrics(tmp_path / "run")[-1]["frac_reward_zero_std"] == 1.0


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "cispo", "sapo"])
def test_every_loss_type_runs_with_accumulation_and_iterations(tmp_path, shipped_policy_dir, loss_type):
    args = tiny_grpo_config(tmp_path, max_steps=2, loss_type=loss_type, per_device_train_batch_size=4,
                            gradient_accumulation_steps=2, num_iterations=2, importance_sampling_level="sequence")
    GRPOTrainer(str(shipped_policy_dir), [correct_answer, has_answer_tags], args, addition_rows(16)).train()
    rows = read_metrics(tmp_path / "run")
    assert len(rows) == 2 and all(torch.isfinite(torch.tensor(r["loss"])) for r in rows)


def test_reward_model_folder_as_reward_function(tmp_path, shipped_policy_dir, tiny_rm_dir):
    args = tiny_grpo_config(tmp_path, max_steps=1)
    GRPOTrainer(str(shipped_policy_dir), [str(tiny_rm_dir), correct_answer], args, addition_rows(16)).train()
    row = read_metrics(tmp_path / "run")[0]
    name = tiny_rm_dir.name
    assert f"rewards/{name}/mean" in row and abs(row[f"rewards/{name}/mean"]) < 1e3


def test_eval_dataset_logs_greedy_rewards(tmp_path, shipped_policy_dir):
    args = tiny_grpo_config(tmp_path, max_steps=2, eval_strategy="steps", eval_steps=2)
    GRPOTrainer(str(shipped_policy_dir), [correct_answer], args, addition_rows(16),
                eval_dataset=addition_rows(20, heldout=True)).train()
    evals = [r for r in read_metrics(tmp_path / "run") if "eval_reward" in r]
    assert len(evals) == 1 and 0.0 <= evals[0]["eval_rewards/correct_answer/mean"] <= 1.0
