"""`rlft doctor`: one test per trap, each with its message and a non-zero exit."""

from __future__ import annotations

from transformers import AutoModelForCausalLM

from rlft.cli import main
from rlft.cli.doctor import run_doctor
from rlft.tiny import build_causal_lm, build_tokenizer, save_tiny
from tests.helpers import addition_rows, correct_answer, has_answer_tags, preference_rows, write_jsonl


def write_grpo_config(tmp_path, model_dir, funcs="[exact_match, 'tests.helpers:has_answer_tags']") -> str:
    data = write_jsonl(tmp_path / "train.jsonl", addition_rows(8))
    path = tmp_path / "run.yaml"
    path.write_text(f"model_name_or_path: {model_dir}\ntrain_dataset: {data}\nreward_funcs: {funcs}\n"
                    "num_generations: 4\nper_device_train_batch_size: 8\nmax_completion_length: 8\n"
                    "use_peft: true\nlora_r: 4\n")
    return str(path)


def write_reward_config(tmp_path, model_dir, extra="") -> str:
    data = write_jsonl(tmp_path / "pairs.jsonl", preference_rows(8))
    path = tmp_path / "rm.yaml"
    path.write_text(f"model_name_or_path: {model_dir}\ntrain_dataset: {data}\nmax_length: 64\n{extra}")
    return str(path)


def test_healthy_grpo_config_passes_via_cli(tmp_path, shipped_policy_dir, capsys):
    assert main(["doctor", "--config", write_grpo_config(tmp_path, shipped_policy_dir)]) == 0
    out = capsys.readouterr().out
    for check in ("pad token", "chat template", "generation", "reward spread", "gradient flow", "trap: loss shows 0"):
        assert check in out


def test_all_parameters_frozen_fails(tmp_path, shipped_policy_dir):
    frozen = AutoModelForCausalLM.from_pretrained(shipped_policy_dir).requires_grad_(False)
    code, report = run_doctor(write_grpo_config(tmp_path, shipped_policy_dir), overrides={"use_peft": False},
                              model=frozen)
    assert code == 1 and "no trainable parameters" in report.text()


def test_lora_targets_matching_nothing_fail(tmp_path, shipped_policy_dir):
    code, report = run_doctor(write_grpo_config(tmp_path, shipped_policy_dir),
                              overrides={"lora_target_modules": ["no_such_module"]})
    assert code == 1 and "FAIL" in report.text() and "no_such_module" in report.text()


def test_reward_function_with_zero_spread_fails(tmp_path, shipped_policy_dir):
    def constant(completions, **kwargs):
        return [1.0] * len(completions)

    code, report = run_doctor(write_grpo_config(tmp_path, shipped_policy_dir), reward_funcs=[constant])
    assert code == 1 and "FAIL reward spread: 100% of groups have zero spread" in report.text()
    assert "no learning signal" in report.text()


def test_tokenizer_without_pad_token_fails(tmp_path):
    tokenizer = build_tokenizer(seed=0)
    model = build_causal_lm(tokenizer, hidden_size=64)
    tokenizer.pad_token = None
    save_tiny(model, tokenizer, tmp_path / "nopad")
    code, report = run_doctor(write_grpo_config(tmp_path, tmp_path / "nopad"))
    assert code == 1 and "FAIL pad token: the tokenizer has no pad token" in report.text()


def test_reward_lora_without_task_type_fails(tmp_path, tiny_rm_dir):
    code, report = run_doctor(write_reward_config(tmp_path, tiny_rm_dir, "use_peft: true\nlora_r: 4\n"))
    assert code == 1 and "FAIL LoRA task type: lora_task_type='CAUSAL_LM'" in report.text()
    assert "PASS score head trainable" in report.text()  # rlft's own fix is in place


def test_healthy_reward_config_passes(tmp_path, tiny_rm_dir):
    code, report = run_doctor(write_reward_config(tmp_path, tiny_rm_dir,
                                                  "use_peft: true\nlora_r: 4\nlora_task_type: SEQ_CLS\n"))
    assert code == 0, report.text()
    assert "PASS gradient flow" in report.text()


def test_python_reward_functions_replace_the_config_entries(tmp_path, shipped_policy_dir):
    _, report = run_doctor(write_grpo_config(tmp_path, shipped_policy_dir), reward_funcs=[correct_answer,
                                                                                          has_answer_tags])
    assert "correct_answer std" in report.text() and "has_answer_tags std" in report.text()


def test_truncated_sampling_without_the_replay_is_a_warning(tmp_path, shipped_policy_dir):
    config = write_grpo_config(tmp_path, shipped_policy_dir)
    code, report = run_doctor(config, overrides={"top_p": 0.8, "replay_sampling_mask": False})
    assert code == 0 and "WARN truncated sampling" in report.text() and "carry the kept mass" in report.text()
    code, report = run_doctor(config, overrides={"top_p": 0.8})
    assert "PASS truncated sampling" in report.text()


def test_a_distillation_recipe_is_checked_as_one(tmp_path, shipped_policy_dir, tiny_causal_dir, capsys):
    """A YAML naming a teacher (no teacher_coef, no reward functions) is a distillation recipe: student and
    teacher load with one vocabulary, a rollout is sampled, the divergence's gradient reaches the adapters; a
    teacher with a smaller vocabulary fails naming both sizes (a larger one with the student's tokenizer is a
    padded one, taken: tests/test_distillation.py)."""
    data = write_jsonl(tmp_path / "train.jsonl", addition_rows(8))
    path = tmp_path / "distill.yaml"
    path.write_text(f"model_name_or_path: {shipped_policy_dir}\nteacher_model_name_or_path: {tiny_causal_dir}\n"
                    f"train_dataset: {data}\nmax_completion_length: 8\nuse_peft: true\nlora_r: 4\nbeta: 0.5\n")
    assert main(["doctor", "--config", str(path)]) == 0
    out = capsys.readouterr().out
    for check in ("distillation config is valid", "models", "generation", "gradient flow", "beta=0.5"):
        assert check in out, check
    other = AutoModelForCausalLM.from_pretrained(tiny_causal_dir)
    other.resize_token_embeddings(300)
    code, report = run_doctor(str(path), teacher_model=other)
    assert code == 1 and "the teacher's" in report.text() and "300" in report.text()


def test_a_sampler_in_another_precision_without_a_correction_and_an_moe_policy_are_warnings():
    """Issue 55: configurations known to drift are named before a run (rlft/cli/doctor.py: _drift_check)."""
    from types import SimpleNamespace

    import torch

    from rlft.cli.doctor import Report, _drift_check

    def warnings(dtype="bfloat16", correction=False, experts=None, use_vllm=True, replay="auto", quantization=None,
                 mode="colocate", **extra):
        report = Report()
        cfg = SimpleNamespace(use_vllm=use_vllm, vllm_dtype=dtype, vllm_importance_sampling_correction=correction,
                              routing_replay=replay, vllm_quantization=quantization, vllm_mode=mode, **extra)
        _drift_check(report, cfg, torch.float32, SimpleNamespace(num_experts=experts))
        return [row for row in report.rows if row[0] == "WARN"]

    assert [w[1] for w in warnings()] == ["sampler precision"]
    assert warnings(correction=True) == [] and warnings(dtype="auto") == []
    # a quantized engine in the trainer's dtype is another policy too
    quantized = warnings(dtype="auto", quantization="fp8_per_tensor")
    assert [w[1] for w in quantized] == ["sampler precision"] and "vllm_quantization=fp8_per_tensor" in quantized[0][2]
    assert warnings(dtype="auto", quantization="fp8_per_tensor", correction=True) == []
    # every vLLM engine records its routes (rlft/rollout/vllm_routes.py): colocated, whole or step by step, and
    # a server
    assert warnings(dtype="auto", experts=8) == []
    assert warnings(dtype="auto", experts=8, mode="server") == []
    assert warnings(dtype="auto", experts=8, inflight_weight_updates=True, partial_rollouts=1) == []
    assert [w[1] for w in warnings(dtype="auto", experts=8, replay="none")] == ["mixture of experts"]
    assert [w[1] for w in warnings(dtype="auto", experts=8, mode="server", replay="none")] == ["mixture of experts"]
    # transformers' generate: the routes are replayed unless routing_replay is none
    assert warnings(dtype="auto", experts=8, use_vllm=False) == []
    assert [w[1] for w in warnings(dtype="auto", experts=8, use_vllm=False, replay="none")] == ["mixture of experts"]
