"""Config: YAML round trip, overrides, and one test per validation error path."""

from __future__ import annotations

import pytest

from rlft.config import (
    ConfigError,
    GRPOConfig,
    RewardConfig,
    from_dict,
    load_config,
    parse_overrides,
    save_config,
)


def test_defaults_are_valid_and_cpu_friendly():
    cfg = from_dict(GRPOConfig, {})
    assert cfg.dtype == "auto" and not cfg.bf16 and not cfg.fp16
    from_dict(RewardConfig, {})


def test_yaml_round_trip(tmp_path):
    cfg = from_dict(GRPOConfig, {"learning_rate": 3e-4, "reward_funcs": ["a:b", "format"], "beta": 0.04,
                                 "reward_weights": [1.0, 0.5], "top_k": 10})
    save_config(cfg, tmp_path / "run.yaml")
    assert load_config(GRPOConfig, tmp_path / "run.yaml") == cfg


def test_cli_overrides_are_typed(tmp_path):
    (tmp_path / "run.yaml").write_text("learning_rate: 1e-5\nnum_generations: 4\n")
    overrides = parse_overrides(["--beta", "0.04", "--max_steps=7", "--gradient_checkpointing",
                                 "--reward_funcs", "[correct, format]", "--top_k", "null"])
    cfg = load_config(GRPOConfig, tmp_path / "run.yaml", overrides)
    assert cfg.learning_rate == 1e-5 and cfg.num_generations == 4 and cfg.beta == 0.04
    assert cfg.max_steps == 7 and cfg.gradient_checkpointing is True
    assert cfg.reward_funcs == ["correct", "format"] and cfg.top_k is None


def test_unknown_key_suggests_nearest():
    with pytest.raises(ConfigError, match=r"'learning_rat' \(did you mean 'learning_rate': peak learning rate\?\)"):
        from_dict(GRPOConfig, {"learning_rat": 1e-5})


@pytest.mark.parametrize("field,value,message", [
    ("loss_type", "ppo", r"loss_type='ppo' is not allowed; choose one of 'grpo'"),
    ("scale_rewards", "std", r"scale_rewards='std' is not allowed"),
    ("importance_sampling_level", "seq", r"importance_sampling_level='seq' is not allowed"),
    ("kl_estimator", "k4", r"kl_estimator='k4' is not allowed"),
    ("multi_objective_aggregation", "avg", r"multi_objective_aggregation='avg'"),
    ("dtype", "fp8", r"dtype='fp8' is not allowed"),
    ("lr_scheduler_type", "step", r"lr_scheduler_type='step'"),
    ("num_generations", 1, r"num_generations=1 must be >= 2"),
    ("learning_rate", 0, r"learning_rate=0.0 must be > 0"),
    ("beta", -0.1, r"beta=-0.1 must be >= 0"),
    ("top_p", 1.5, r"top_p=1.5 must be in \(0, 1\]"),
    ("max_steps", 0, r"max_steps=0 must be > 0, or -1"),
    ("lora_dropout", 1.0, r"lora_dropout=1.0 must be in \[0, 1\)"),
    ("max_completion_length", 0, r"max_completion_length=0 must be > 0"),
    ("eval_steps", 0, r"eval_steps=0(\.0)? must be > 0"),
])
def test_each_validation_error_names_its_field(field, value, message):
    with pytest.raises(ConfigError, match=message):
        from_dict(GRPOConfig, {field: value})


def test_batch_not_divisible_by_num_generations_gives_valid_sizes():
    with pytest.raises(ConfigError, match=r"steps_per_generation = 12 completions is not divisible by num_generations=8; use a multiple such as \[8, 16"):
        from_dict(GRPOConfig, {"per_device_train_batch_size": 6, "gradient_accumulation_steps": 2})


def test_reward_weights_length_must_match_reward_funcs():
    with pytest.raises(ConfigError, match="reward_weights has 1 values but reward_funcs has 2"):
        from_dict(GRPOConfig, {"reward_funcs": ["a", "b"], "reward_weights": [1.0]})


def test_bf16_and_fp16_together_rejected():
    with pytest.raises(ConfigError, match="bf16=True and fp16=True together"):
        from_dict(GRPOConfig, {"bf16": True, "fp16": True})


def test_reward_truncation_policy_validated():
    with pytest.raises(ConfigError, match="truncation='middle' is not allowed"):
        from_dict(RewardConfig, {"truncation": "middle"})


def test_all_errors_reported_at_once():
    with pytest.raises(ConfigError) as info:
        from_dict(GRPOConfig, {"loss_type": "x", "beta": -1.0})
    assert "loss_type" in str(info.value) and "beta" in str(info.value)


def test_yaml_that_is_not_a_mapping_is_rejected(tmp_path):
    (tmp_path / "bad.yaml").write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="expected a mapping"):
        load_config(GRPOConfig, tmp_path / "bad.yaml")
