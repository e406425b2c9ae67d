"""Config: reading a recipe (YAML + options), and one test per validation error path."""

from __future__ import annotations

import pytest

from rlft.cli.recipes import parse_run
from rlft.config import ConfigError, DistillationConfig, GRPOConfig, RewardConfig, RLOOConfig
from rlft.config.model_config import ModelConfig


def test_defaults_are_valid_and_cpu_friendly():
    cfg = GRPOConfig()
    assert not cfg.bf16 and not cfg.fp16  # bf16=None resolves to the device's: False on a CPU
    assert cfg.max_prompt_length is None  # TRL 1.16: no prompt truncation unless asked
    RewardConfig()


def test_a_recipe_yaml_fills_every_dataclass_and_options_win(tmp_path):
    (tmp_path / "run.yaml").write_text(
        "learning_rate: 1e-5\nnum_generations: 4\nmodel_name_or_path: some/model\nuse_peft: true\n"
        "reward_funcs: [exact_match, format]\ntrain_dataset: data.jsonl\n")
    script, cfg, model, _, _ = parse_run("grpo", ["--beta", "0.04", "--max_steps=7", "--lora_r", "8",
                                                  "--top_k", "3"], str(tmp_path / "run.yaml"))
    assert cfg.learning_rate == 1e-5 and cfg.num_generations == 4 and cfg.beta == 0.04
    assert cfg.max_steps == 7 and cfg.top_k == 3
    assert model.model_name_or_path == "some/model" and model.use_peft and model.lora_r == 8
    assert script.reward_funcs == ["exact_match", "format"] and script.train_dataset == "data.jsonl"


def test_unknown_key_suggests_nearest(tmp_path):
    (tmp_path / "run.yaml").write_text("learning_rat: 1e-5\n")
    with pytest.raises(ConfigError, match=r"'learning_rat' \(did you mean 'learning_rate'\?\)"):
        parse_run("grpo", [], str(tmp_path / "run.yaml"))
    with pytest.raises(ConfigError, match=r"'num_generation' \(did you mean 'num_generations'\?\)"):
        parse_run("grpo", ["--num_generation", "4"])


@pytest.mark.parametrize("field,value,message", [
    ("loss_type", "ppo", r"loss_type='ppo' is not allowed; choose one of 'grpo'"),
    ("scale_rewards", "std", r"scale_rewards='std' is not allowed"),
    ("importance_sampling_level", "seq", r"importance_sampling_level='seq' is not allowed"),
    ("kl_estimator", "k4", r"kl_estimator='k4' is not allowed"),
    ("multi_objective_aggregation", "avg", r"multi_objective_aggregation='avg'"),
    ("lr_scheduler_type", "step", r"lr_scheduler_type='step'"),
    ("optim", "adamw_magic", r"optim='adamw_magic' is not allowed; choose one of 'adamw_torch'"),
    ("num_generations", 1, r"num_generations=1 must be >= 2"),
    ("learning_rate", 0.0, r"learning_rate=0.0 must be a finite number > 0"),
    ("beta", -0.1, r"beta=-0.1 must be >= 0"),
    ("top_p", 1.5, r"top_p=1.5 must be in \(0, 1\]"),
    ("max_steps", 0, r"max_steps=0 must be > 0, or -1"),
    ("max_completion_length", 0, r"max_completion_length=0 must be > 0"),
    ("eval_steps", 0.0, r"eval_steps=0(\.0)? must be > 0"),
])
def test_each_validation_error_names_its_field(field, value, message):
    with pytest.raises(ConfigError, match=message):
        GRPOConfig(**{field: value})


@pytest.mark.parametrize("values,message", [
    ({"dtype": "fp8"}, r"dtype='fp8' is not allowed"),
    ({"lora_dropout": 1.0}, r"lora_dropout=1.0 must be in \[0, 1\)"),
    ({"load_in_4bit": True, "load_in_8bit": True}, "pick one"),
])
def test_model_config_errors_name_their_field(values, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig(**values)


def test_batch_not_divisible_by_num_generations_gives_valid_sizes():
    with pytest.raises(ConfigError, match=r"steps_per_generation = 12 completions is not divisible by "
                                          r"num_generations=8; use a multiple such as \[8, 16"):
        GRPOConfig(per_device_train_batch_size=6, gradient_accumulation_steps=2)


def test_bf16_and_fp16_together_rejected():
    with pytest.raises(ConfigError, match="bf16=True and fp16=True together"):
        GRPOConfig(bf16=True, fp16=True)


def test_reward_truncation_policy_validated():
    with pytest.raises(ConfigError, match="truncation='middle' is not allowed"):
        RewardConfig(truncation="middle")


def test_all_errors_reported_at_once():
    with pytest.raises(ConfigError) as info:
        GRPOConfig(loss_type="x", beta=-1.0)
    assert "loss_type" in str(info.value) and "beta" in str(info.value)


def test_a_value_of_the_wrong_type_is_named():
    with pytest.raises(ConfigError, match=r"num_generations='8' is a str; the field takes int"):
        GRPOConfig(num_generations="8")


def test_use_peft_given_as_a_list_in_a_recipe_is_refused_not_read_as_true(tmp_path):
    """`use_peft: [false]` is a non-empty list, which is truthy: unchecked, it trained LoRA without a word."""
    (tmp_path / "run.yaml").write_text("model_name_or_path: m\ntrain_dataset: d.jsonl\nuse_peft: [false]\n")
    with pytest.raises(ConfigError, match=r"invalid ModelConfig:\n  - use_peft=\[False\] is a list; "
                                          r"the field takes bool"):
        parse_run("grpo", [], str(tmp_path / "run.yaml"))


@pytest.mark.parametrize("values, message", [
    ({"lora_r": "8"}, r"lora_r='8' is a str; the field takes int"),
    ({"lora_alpha": 16.5}, r"lora_alpha=16.5 is a float; the field takes int"),
    ({"load_in_4bit": "yes"}, r"load_in_4bit='yes' is a str; the field takes bool"),
    ({"lora_modules_to_save": "score"}, r"lora_modules_to_save='score' is a str; the field takes "
                                        r"list\[str\] \| None; write a list as \[a, b\]"),
])
def test_a_model_config_value_of_the_wrong_type_is_named(values, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig(**values)


def test_lora_target_modules_takes_peft_s_string_form_or_a_list():
    assert ModelConfig(lora_target_modules="all-linear").lora_target_modules == "all-linear"
    assert ModelConfig(lora_target_modules=["q_proj", "v_proj"]).lora_target_modules == ["q_proj", "v_proj"]
    with pytest.raises(ConfigError, match=r"lora_target_modules=7 is a int"):
        ModelConfig(lora_target_modules=7)


@pytest.mark.parametrize("yaml_text, message", [
    ("reward_funcs: format\n", r"invalid GRPOScriptArguments:\n  - reward_funcs='format' is a str; the field "
                                r"takes list\[str\] \| None; write a list as \[a, b\]"),
    ("dataset_streaming: [true]\n", r"dataset_streaming=\[True\] is a list; the field takes bool"),
    ("datasets:\n  - path: a\n    fraction: half\n", r"datasets\[0\]: invalid DatasetConfig:\n  - "
                                                      r"fraction='half' is a str; the field takes float \| None"),
])
def test_a_script_argument_of_the_wrong_type_is_named(tmp_path, yaml_text, message):
    (tmp_path / "run.yaml").write_text("model_name_or_path: m\n" + yaml_text)
    with pytest.raises(ConfigError, match=message):
        parse_run("grpo", [], str(tmp_path / "run.yaml"))


def test_yaml_that_is_not_a_mapping_is_rejected(tmp_path):
    (tmp_path / "bad.yaml").write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="expected a mapping"):
        parse_run("grpo", [], str(tmp_path / "bad.yaml"))


@pytest.mark.parametrize("rate", [1e39, float("inf"), float("nan"), -1e-5])
def test_absurd_learning_rates_are_refused_by_name(rate):
    with pytest.raises(ConfigError, match=r"learning_rate="):
        GRPOConfig(learning_rate=rate)
    with pytest.raises(ConfigError, match=r"learning_rate="):
        RewardConfig(learning_rate=rate)


def test_a_subclass_field_that_only_changes_the_default_keeps_the_parents_help_with_percent_escaped():
    from dataclasses import field, fields

    from rlft.config.common import config_class

    @config_class
    class Parent:
        share: float = field(default=0.5, metadata={"help": "50% of the batch"})

    @config_class
    class Child(Parent):
        share: float = 0.25

    assert [f.metadata["help"] for f in fields(Child)] == ["50%% of the batch"]  # argparse reads %% as %
    assert Child().share == 0.25 and fields(Parent)[0].metadata["help"] == "50%% of the batch"


def test_generation_batch_defaults_to_gradient_accumulation_steps_micro_steps_per_process():
    from rlft.config.rules import generation_batch

    cfg = GRPOConfig(per_device_train_batch_size=8, gradient_accumulation_steps=2, num_generations=4,
                     num_iterations=2)
    batch = generation_batch(cfg, processes=3)
    assert (batch.steps_per_generation, batch.completions_per_process, batch.prompts_per_process) == (2, 16, 4)
    assert (batch.completions_total, batch.prompts_total, batch.rows_per_step) == (48, 12, 16)
    assert batch.steps_per_rollout == 2  # one optimiser step per generation, num_iterations=2 passes over it


def test_generation_batch_size_is_shared_out_over_the_processes():
    from rlft.config.rules import generation_batch

    cfg = GRPOConfig(per_device_train_batch_size=4, gradient_accumulation_steps=2, num_generations=4,
                     generation_batch_size=32)
    batch = generation_batch(cfg, processes=2)
    assert (batch.steps_per_generation, batch.completions_per_process, batch.prompts_per_process) == (4, 16, 4)
    assert (batch.completions_total, batch.steps_per_rollout) == (32, 2)


def test_generation_batch_size_that_is_not_a_multiple_of_every_process_batch_is_refused():
    from rlft.config.rules import generation_batch

    cfg = GRPOConfig(per_device_train_batch_size=4, num_generations=4, generation_batch_size=24)  # builds
    with pytest.raises(ConfigError, match=r"generation_batch_size=24 is not a multiple of "
                                          r"per_device_train_batch_size x processes = 16"):
        generation_batch(cfg, processes=4)


def test_generation_batch_that_splits_a_group_across_processes_is_refused():
    from rlft.config.rules import generation_batch

    cfg = GRPOConfig(per_device_train_batch_size=2, num_generations=8, generation_batch_size=8)  # builds
    with pytest.raises(ConfigError, match=r"a generation batch of 4 completions per process \(2 steps\) must "
                                          r"hold whole groups of num_generations=8 and whole optimiser steps"):
        generation_batch(cfg, processes=2)


def test_generation_batch_refuses_steps_per_generation_that_is_not_whole_optimiser_steps():
    from rlft.config.rules import generation_batch

    cfg = GRPOConfig(per_device_train_batch_size=4, gradient_accumulation_steps=2, num_generations=4)
    cfg.steps_per_generation = 3  # changed after construction: the trainer's call still catches it
    with pytest.raises(ConfigError, match="steps_per_generation=3 is not a multiple of "
                                          "gradient_accumulation_steps=2"):
        generation_batch(cfg, processes=1)


def test_the_generation_batch_rule_already_applies_when_the_config_is_built():
    with pytest.raises(ConfigError, match="invalid GRPOConfig:\n  - steps_per_generation=3 is not a multiple"):
        GRPOConfig(per_device_train_batch_size=4, gradient_accumulation_steps=2, steps_per_generation=3,
                   num_generations=4)


def test_staleness_is_rollout_lag_times_steps_per_rollout_plus_weight_sync_steps_minus_one():
    from rlft.config import AsyncGRPOConfig
    from rlft.config.rules import staleness

    cfg = AsyncGRPOConfig(rollout_lag=2, weight_sync_steps=2, max_staleness=10)
    assert (staleness(cfg), staleness(cfg, 2)) == (3, 5)


def test_staleness_above_max_staleness_is_refused_naming_the_steps_per_rollout():
    from rlft.config import AsyncGRPOConfig
    from rlft.config.rules import staleness

    cfg = AsyncGRPOConfig(rollout_lag=2, weight_sync_steps=2, max_staleness=4)  # 3 steps at one per rollout
    with pytest.raises(ConfigError, match=r"with 2 optimiser steps per rollout, rollout_lag=2 and "
                                          r"weight_sync_steps=2 train on weights up to 5 steps old, above "
                                          r"max_staleness=4"):
        staleness(cfg, 2)


def test_staleness_above_max_staleness_is_refused_when_the_config_is_built():
    from rlft.config import AsyncGRPOConfig

    with pytest.raises(ConfigError, match=r"rollout_lag=3 with weight_sync_steps=3 samples rollouts up to 5 "
                                          r"steps behind, above max_staleness=4"):
        AsyncGRPOConfig(rollout_lag=3, weight_sync_steps=3)


def test_staleness_refuses_weight_sync_steps_that_are_not_whole_rollouts():
    from rlft.config import AsyncGRPOConfig
    from rlft.config.rules import staleness

    cfg = AsyncGRPOConfig(rollout_lag=1, weight_sync_steps=3, max_staleness=10)
    with pytest.raises(ConfigError, match=r"weight_sync_steps=3 must be a multiple of the optimiser steps per "
                                          r"rollout \(2\)"):
        staleness(cfg, 2)


def test_to_dict_keeps_the_tokenizers_tokens_and_hides_credentials():
    """transformers hides every "*_token" field; pad_token and eos_token name tokens, and a config rebuilt
    from the dict (the async producer's, RLOOConfig(**grpo.to_dict())) needs them."""
    from rlft import RLOOConfig

    cfg = GRPOConfig(output_dir="x", pad_token="<|endoftext|>", eos_token="<|im_end|>", hub_token="secret")
    as_dict = cfg.to_dict()
    assert (as_dict["pad_token"], as_dict["eos_token"]) == ("<|endoftext|>", "<|im_end|>")
    assert as_dict["hub_token"] != "secret"
    assert RLOOConfig(**{**as_dict, "hub_token": None}).pad_token == "<|endoftext|>"


def test_a_token_budget_at_or_below_zero_disables_budgeting_as_in_trl(tmp_path):
    from rlft import AsyncGRPOConfig, GRPOConfig

    for budget in (0, -1):
        assert AsyncGRPOConfig(output_dir=str(tmp_path), token_budget=budget).token_budget is None
        assert GRPOConfig(output_dir=str(tmp_path), token_budget=budget).token_budget is None
    assert GRPOConfig(output_dir=str(tmp_path), token_budget=64).token_budget == 64


# ---- one declaration per field (rlft/config/options.py) ------------------------------------------------
def test_a_fields_facts_are_read_from_its_one_declaration():
    """The tables the code uses (rlft's own fields, what may change on resume, what takes a mapping, what has
    no effect or is refused) are queries of the `option(...)` declarations and of transformers' fields'
    facts (compat.TRAINING_ARGUMENTS)."""
    from rlft.config import MAY_CHANGE, RLFT_FIELDS, AsyncGRPOConfig
    from rlft.config.options import dict_fields, no_effect, options, refused

    assert {"kl_estimator", "token_budget", "teacher_models", "rollout_lag"} <= RLFT_FIELDS
    assert not {"beta", "loss_type", "lmbda", "reverse_kl_top_1_mode"} & RLFT_FIELDS  # TRL's own
    assert {"learning_rate", "logging_steps", "token_budget", "torch_compile"} <= MAY_CHANGE  # the last: no effect
    assert not {"seed", "beta", "loss_type", "deepspeed"} & MAY_CHANGE
    assert "generation_kwargs" in dict_fields(GRPOConfig) and "teacher_models" in dict_fields(DistillationConfig)
    assert "generation_kwargs" not in dict_fields(RewardConfig) and "deepspeed" not in dict_fields(GRPOConfig)
    assert "queue_maxsize" in no_effect(AsyncGRPOConfig) and "queue_maxsize" not in no_effect(GRPOConfig)
    # one field, two kinds: GRPO refuses what a reward model only ignores
    assert "auto_find_batch_size" in refused(GRPOConfig) and "auto_find_batch_size" not in no_effect(GRPOConfig)
    assert "auto_find_batch_size" in no_effect(RewardConfig) and "auto_find_batch_size" not in refused(RewardConfig)
    # a subclass that only changes a default keeps its base's facts; one that states a check replaces it
    assert options(RLOOConfig)["beta"] == options(GRPOConfig)["beta"]
    assert options(DistillationConfig)["beta"].check is not options(GRPOConfig)["beta"].check


def test_a_declared_check_refuses_by_name_and_a_redeclared_one_wins():
    with pytest.raises(ConfigError, match=r"beta=-0.5 must be >= 0"):
        GRPOConfig(beta=-0.5)
    with pytest.raises(ConfigError, match=r"beta=1.5 must be in \[0, 1\]: 0 is the forward KL") as err:
        DistillationConfig(beta=1.5)
    assert ">= 0" not in str(err.value)
    with pytest.raises(ConfigError, match=r"lr_scheduler_type='cosine_forever' is not allowed; choose one of"):
        GRPOConfig(lr_scheduler_type="cosine_forever")
    with pytest.raises(ConfigError, match=r"truncation='middle' is not allowed"):
        RewardConfig(truncation="middle")


def test_a_mapping_field_takes_its_json_string_by_its_annotation_alone():
    cfg = DistillationConfig(teacher_models='{"math": "a/b", "code": "c/d"}', lr_scheduler_kwargs="{min_lr: 0}")
    assert cfg.teacher_models == {"math": "a/b", "code": "c/d"} and cfg.lr_scheduler_kwargs == {"min_lr": 0}
