"""TRL's real surface around the loop: parsing (TrlParser, HfArgumentParser), configs that are
transformers' TrainingArguments, the Trainer methods scripts call around train(), optimiser names,
precision and quantization knobs, and TRL's helpers under their names.

Each test is one behaviour a TRL recipe relies on, written from TRL's and transformers' documentation.
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForSequenceClassification, HfArgumentParser, TrainingArguments
from transformers.trainer_utils import TrainOutput

import rlft
from rlft import (
    DatasetMixtureConfig,
    GRPOConfig,
    GRPOTrainer,
    ModelConfig,
    RewardConfig,
    RewardTrainer,
    ScriptArguments,
    TrlParser,
    get_peft_config,
    get_quantization_config,
)
from rlft.config import ConfigError
from tests.helpers import addition_rows, correct_answer, preference_rows, tiny_grpo_config, write_jsonl

TRL_NAMES = [
    "GRPOConfig",
    "GRPOTrainer",
    "RewardConfig",
    "RewardTrainer",
    "ModelConfig",
    "ScriptArguments",
    "DatasetMixtureConfig",
    "TrlParser",
    "get_peft_config",
    "get_quantization_config",
    "get_kbit_device_map",
    "get_dataset",
    "DistillationConfig",
    "DistillationTrainer",
]


def test_the_names_a_trl_script_imports_are_importable_from_rlft():
    for name in TRL_NAMES:
        assert getattr(rlft, name) is not None, name
    from rlft.rewards import (  # noqa: F401
        accuracy_reward,
        get_soft_overlong_punishment,
        reasoning_accuracy_reward,
        think_format_reward,
    )
    from rlft.trainer.distillation_config import DistillationConfig  # noqa: F401 (TRL's module paths)
    from rlft.trainer.distillation_trainer import DistillationTrainer  # noqa: F401


# ---- the configs are TrainingArguments ------------------------------------------------------------------
@pytest.mark.parametrize("cls", [GRPOConfig, RewardConfig])
def test_configs_are_training_arguments_with_their_methods(cls, tmp_path):
    args = cls(output_dir=str(tmp_path))
    assert isinstance(args, TrainingArguments)
    assert args.world_size == 1 and args.process_index == 0 and args.device.type == "cpu"
    assert isinstance(args.get_process_log_level(), int)
    values = args.to_dict()
    assert values["output_dir"] == str(tmp_path) and json.dumps(values)  # JSON-ready, enums as their values
    assert values["learning_rate"] == (1e-6 if cls is GRPOConfig else 1e-4)


def test_hf_argument_parser_parse_dict_takes_a_gpu_recipe():
    """A GPU recipe's fields on a CPU machine: bf16 and tf32 are accepted (transformers alone refuses both
    without a GPU); tf32 is noted as having no effect here."""
    from rlft.config.compat import no_effect_notes

    recipe = {
        "output_dir": "out",
        "bf16": True,
        "tf32": True,
        "learning_rate": 1e-6,
        "per_device_train_batch_size": 4,
        "gradient_accumulation_steps": 4,
        "num_generations": 8,
        "max_completion_length": 1024,
        "use_vllm": True,
        "vllm_mode": "server",
        "vllm_gpu_memory_utilization": 0.7,
        "report_to": "wandb",
        "gradient_checkpointing": True,
        "gradient_checkpointing_kwargs": {"use_reentrant": False},
        "lr_scheduler_type": "cosine",
        "warmup_ratio": 0.1,
        "logging_steps": 1,
        "save_strategy": "steps",
        "save_steps": 100,
        "push_to_hub": False,
        "hub_model_id": "me/model",
        "hub_strategy": "every_save",
        "beta": 0.04,
        "loss_type": "dr_grpo",
        "scale_rewards": False,
        "max_grad_norm": 0.2,
        "seed": 42,
        "log_completions": True,
        "torch_compile": False,
        "ddp_find_unused_parameters": False,
    }
    (args,) = HfArgumentParser((GRPOConfig,)).parse_dict(recipe)
    assert args.bf16 is True and args.loss_type == "dr_grpo" and args.scale_rewards == "none"
    assert args.report_to == ["wandb"] and args.lr_scheduler_type.value == "cosine"
    assert any(note.startswith("tf32=True has no effect") for note in no_effect_notes(args))


def test_trl_parser_reads_one_recipe_yaml_that_mixes_every_dataclass(tmp_path):
    (tmp_path / "recipe.yaml").write_text(
        "model_name_or_path: my/model\ndtype: bfloat16\nuse_peft: true\nlora_r: 8\n"
        "lora_target_modules: [q_proj]\n"
        "dataset_name: my/data\ndataset_train_split: train\nlearning_rate: 3.0e-6\nnum_generations: 4\n"
        "per_device_train_batch_size: 4\nreport_to: none\noutput_dir: out\ndatasets:\n  - path: a/b\n"
        "env:\n  RLFT_TEST_RECIPE_ENV: set\n"
    )
    parser = TrlParser((ScriptArguments, GRPOConfig, ModelConfig, DatasetMixtureConfig))
    script, training, model, mixture = parser.parse_args_and_config(
        ["--config", str(tmp_path / "recipe.yaml"), "--lora_r", "16"]
    )
    assert (
        script.dataset_name == "my/data" and training.learning_rate == 3e-6 and training.num_generations == 4
    )
    assert (
        model.model_name_or_path == "my/model" and model.lora_r == 16
    )  # the command line wins over the YAML
    assert model.lora_target_modules == "q_proj" and mixture.datasets[0].path == "a/b"
    import os

    assert os.environ.pop("RLFT_TEST_RECIPE_ENV") == "set"
    peft = get_peft_config(model)
    assert peft.r == 16 and peft.target_modules == "q_proj" and get_quantization_config(model) is None


def test_trl_parser_refuses_an_unknown_yaml_key_with_the_nearest_name(tmp_path):
    (tmp_path / "recipe.yaml").write_text("learning_rat: 1.0e-5\n")
    parser = TrlParser((ScriptArguments, GRPOConfig, ModelConfig))
    with pytest.raises(ConfigError, match=r"'learning_rat' \(did you mean 'learning_rate'\?\)"):
        parser.parse_args_and_config(["--config", str(tmp_path / "recipe.yaml")])
    *_, rest = parser.parse_args_and_config(
        ["--config", str(tmp_path / "recipe.yaml")], return_remaining_strings=True
    )
    assert rest == ["--learning_rat", "1e-05"]


# ---- a recipe script, end to end -------------------------------------------------------------------------
def test_a_trl_recipe_script_trains_evaluates_and_writes_the_files_trl_writes(tmp_path, shipped_policy_dir):
    train = write_jsonl(tmp_path / "train.jsonl", addition_rows(32))
    test = write_jsonl(tmp_path / "test.jsonl", addition_rows(4, heldout=True))
    out = tmp_path / "run"
    (tmp_path / "recipe.yaml").write_text(
        f"model_name_or_path: {shipped_policy_dir}\ndataset_name: json\nuse_peft: true\nlora_r: 4\n"
        f"lora_target_modules: all-linear\noutput_dir: {out}\nmax_steps: 2\nnum_generations: 4\n"
        "per_device_train_batch_size: 8\nmax_completion_length: 8\nlogging_steps: 1\neval_strategy: steps\n"
        "eval_steps: 2\nreport_to: none\ngradient_checkpointing: false\nlearning_rate: 1.0e-4\n"
    )
    parser = TrlParser((ScriptArguments, GRPOConfig, ModelConfig))
    script, training_args, model_args = parser.parse_args_and_config(
        ["--config", str(tmp_path / "recipe.yaml")]
    )
    from datasets import load_dataset

    dataset = load_dataset(script.dataset_name, data_files={"train": str(train), "test": str(test)})
    trainer = GRPOTrainer(
        model_args.model_name_or_path,
        [correct_answer],
        training_args,
        train_dataset=dataset[script.dataset_train_split],
        eval_dataset=dataset[script.dataset_test_split],
        peft_config=get_peft_config(model_args),
    )
    result = trainer.train()
    assert isinstance(result, TrainOutput) and result.global_step == 2
    for key in ("train_runtime", "train_samples_per_second", "train_steps_per_second", "train_loss", "epoch"):
        assert key in result.metrics, key
    trainer.log_metrics("train", result.metrics)
    trainer.save_metrics("train", result.metrics)
    metrics = trainer.evaluate()
    trainer.save_metrics("eval", metrics)
    trainer.save_state()
    trainer.save_model(training_args.output_dir)
    trainer.create_model_card(model_name="tiny-adder-grpo", dataset_name="addition")
    assert json.loads((out / "train_results.json").read_text())["train_loss"] == pytest.approx(
        result.training_loss
    )
    assert "eval_reward" in json.loads((out / "eval_results.json").read_text())
    assert {"train_loss", "eval_reward"} <= set(json.loads((out / "all_results.json").read_text()))
    assert json.loads((out / "trainer_state.json").read_text())["global_step"] == 2
    assert (out / "adapter_model.safetensors").exists() and not list(out.glob("*.bin"))  # no pickle
    card = (out / "README.md").read_text()
    assert "tiny-adder-grpo" in card and "- grpo" in card and "datasets: addition" in card
    assert trainer.is_world_process_zero() and trainer.is_local_process_zero()
    assert {"trl", "grpo", "rlft"} <= set(trainer.accelerator.unwrap_model(trainer.model).model_tags)
    trainer.end()


def test_a_reward_model_script_with_hf_argument_parser_and_a_loaded_classifier(tmp_path, tiny_rm_dir):
    (args,) = HfArgumentParser((RewardConfig,)).parse_args_into_dataclasses(
        [
            "--output_dir",
            str(tmp_path / "rm"),
            "--max_steps",
            "3",
            "--per_device_train_batch_size",
            "8",
            "--logging_steps",
            "1",
            "--max_length",
            "64",
            "--report_to",
            "none",
            "--gradient_checkpointing",
            "false",
            "--eval_strategy",
            "steps",
            "--eval_steps",
            "3",
        ]
    )
    model = AutoModelForSequenceClassification.from_pretrained(tiny_rm_dir, num_labels=1)
    from rlft.model.loading import load_tokenizer

    trainer = RewardTrainer(
        model,
        args,
        train_dataset=preference_rows(48),
        eval_dataset=preference_rows(16, seed=1, heldout=True),
        processing_class=load_tokenizer(tiny_rm_dir, "right"),
    )
    result = trainer.train()
    assert result.global_step == 3 and result.training_loss > 0
    trainer.save_metrics("train", result.metrics)
    trainer.save_metrics("eval", trainer.evaluate())
    trainer.save_state()
    trainer.save_model(args.output_dir)
    trainer.create_model_card()
    out = tmp_path / "rm"
    for name in (
        "train_results.json",
        "eval_results.json",
        "all_results.json",
        "trainer_state.json",
        "README.md",
        "model.safetensors",
        "config.json",
    ):
        assert (out / name).exists(), name
    assert "eval_accuracy" in json.loads((out / "eval_results.json").read_text())
    assert {"trl", "reward-trainer"} <= set(model.model_tags)


def test_push_to_hub_offline_is_a_clear_error_and_the_model_is_still_saved(
    tmp_path, shipped_policy_dir, monkeypatch
):
    from rlft.train.surface import HubError

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    trainer = GRPOTrainer(
        str(shipped_policy_dir),
        [correct_answer],
        tiny_grpo_config(tmp_path, hub_model_id="me/tiny", push_to_hub=False),
        addition_rows(16),
    )
    with pytest.raises(HubError, match=r"push_to_hub could not reach the Hugging Face Hub .* saved in"):
        trainer.push_to_hub()
    assert (tmp_path / "run" / "model.safetensors").exists()


# ---- optimisers and precision ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "optim,expected",
    [
        ("adamw_torch_fused", "AdamW"),
        ("adamw_torch", "AdamW"),
        ("adafactor", "Adafactor"),
        ("sgd", "SGD"),
        ("rmsprop", "RMSprop"),
    ],
)
def test_every_transformers_optimizer_name_goes_through_transformers_mapping(
    tmp_path, shipped_policy_dir, optim, expected
):
    trainer = GRPOTrainer(
        str(shipped_policy_dir),
        [correct_answer],
        tiny_grpo_config(tmp_path, optim=optim, weight_decay=0.1),
        addition_rows(16),
    )
    optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    assert type(optimizer).__name__ == expected
    decays = sorted(group["weight_decay"] for group in optimizer.param_groups)
    assert decays == [0.0, 0.1]  # transformers' groups: no decay on norms and biases


def test_an_optimizer_that_cannot_run_here_names_itself_its_package_and_the_device(
    tmp_path, shipped_policy_dir
):
    pytest.importorskip("torch")
    import importlib.util

    if importlib.util.find_spec("bitsandbytes") is not None:
        pytest.skip("bitsandbytes is installed here")
    with pytest.raises(
        ConfigError,
        match=r"optim='adamw_8bit' cannot run on this machine's CPU \(no CUDA GPU\); "
        r"it needs the bitsandbytes package",
    ):
        GRPOTrainer(
            str(shipped_policy_dir),
            [correct_answer],
            tiny_grpo_config(tmp_path, optim="adamw_8bit"),
            addition_rows(16),
        )


def test_quantization_config_without_bitsandbytes_or_a_gpu_is_a_clear_error(tmp_path, shipped_policy_dir):
    quantization = get_quantization_config(ModelConfig(load_in_4bit=True, use_peft=True))
    assert quantization.load_in_4bit
    with pytest.raises(
        ConfigError, match=r"bitsandbytes k-bit weights \(QLoRA.*need bitsandbytes and a CUDA GPU"
    ):
        GRPOTrainer(
            str(shipped_policy_dir),
            [correct_answer],
            tiny_grpo_config(tmp_path),
            addition_rows(16),
            quantization_config=quantization,
        )
    with pytest.raises(ConfigError, match="need bitsandbytes and a CUDA GPU"):
        GRPOTrainer(
            str(shipped_policy_dir),
            [correct_answer],
            tiny_grpo_config(tmp_path, model_init_kwargs={"quantization_config": quantization}),
            addition_rows(16),
        )


def test_bf16_on_a_cpu_loads_bfloat16_weights(tmp_path, shipped_policy_dir):
    trainer = GRPOTrainer(
        str(shipped_policy_dir), [correct_answer], tiny_grpo_config(tmp_path, bf16=True), addition_rows(16)
    )
    assert next(trainer.model.parameters()).dtype == torch.bfloat16


# ---- no refusals TRL does not have -------------------------------------------------------------------------
def test_fields_trl_accepts_at_values_that_change_nothing_here_are_accepted(tmp_path):
    GRPOConfig(
        output_dir=str(tmp_path),
        hub_model_id="me/x",
        hub_strategy="end",
        hub_token="t",
        push_to_hub=False,
        save_total_limit=2,
        save_only_model=True,
        log_on_each_node=False,
        torch_empty_cache_steps=10,
        dataloader_num_workers=2,
        remove_unused_columns=True,
        include_num_input_tokens_seen=True,
    )
    RewardConfig(
        output_dir=str(tmp_path), save_only_model=True, dataset_num_proc=4, activation_offloading=True
    )


def test_save_total_limit_keeps_only_the_newest_checkpoints(tmp_path, shipped_policy_dir):
    trainer = GRPOTrainer(
        str(shipped_policy_dir),
        [correct_answer],
        tiny_grpo_config(tmp_path, max_steps=4, save_steps=1, save_total_limit=2),
        addition_rows(32),
    )
    trainer.train()
    assert sorted(p.name for p in (tmp_path / "run").glob("checkpoint-*")) == ["checkpoint-3", "checkpoint-4"]


def test_prompts_are_not_truncated_unless_asked(tmp_path, shipped_policy_dir):
    long = [
        {**row, "prompt": [{"role": "user", "content": row["prompt"][-1]["content"] + " " + "9" * 600}]}
        for row in addition_rows(16)
    ]
    with pytest.raises(
        ValueError,
        match=r"row \d+: prompt of \d+ tokens \+ max_completion_length=8 exceeds the "
        r"model's context of 512 tokens",
    ):
        GRPOTrainer(str(shipped_policy_dir), [correct_answer], tiny_grpo_config(tmp_path), long * 2)


# ---- MoE router loss ---------------------------------------------------------------------------------------
def test_a_moe_policys_router_loss_is_added_as_trl_adds_it(tmp_path):
    from rlft.tiny import build_causal_lm, build_tokenizer

    tokenizer = build_tokenizer(0, vocab_size=384)
    model = build_causal_lm(tokenizer, arch="qwen2_moe", hidden_size=64)
    trainer = GRPOTrainer(
        model,
        [correct_answer],
        tiny_grpo_config(tmp_path, max_steps=1, router_aux_loss_coef=0.5),
        addition_rows(16),
        processing_class=tokenizer,
    )
    assert trainer.router_aux_loss_coef == 0.5
    batch = trainer._make_rollout(0)
    rows = torch.arange(batch.rollout.completion_ids.shape[0])
    without = trainer.scorer.forward(trainer.model, batch.rollout, rows)
    with_router = trainer.scorer.forward(trainer.model, batch.rollout, rows, router_loss=True)
    assert (
        torch.equal(without[0], with_router[0]) and with_router[2] > 0
    )  # same log-probs, plus the router loss
    trainer.train()
    row = trainer.state.log_history[0]
    assert row["aux_loss"] > 0
    # loss = policy_loss + coef * aux_loss (one micro-batch, one process)
    assert row["loss"] == pytest.approx(row["policy_loss"] + 0.5 * row["aux_loss"], rel=1e-5)


def test_router_loss_coefficient_on_a_dense_model_is_an_error(tmp_path, shipped_policy_dir):
    with pytest.raises(
        ConfigError,
        match="router_aux_loss_coef=0.1 is set but Qwen2ForCausalLM is not a Mixture-of-Experts model",
    ):
        GRPOTrainer(
            str(shipped_policy_dir),
            [correct_answer],
            tiny_grpo_config(tmp_path, router_aux_loss_coef=0.1),
            addition_rows(16),
        )


def test_a_checkpoint_folder_loads_with_from_pretrained_like_transformers(tmp_path, shipped_policy_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    trainer = GRPOTrainer(
        str(shipped_policy_dir), [correct_answer], tiny_grpo_config(tmp_path, save_steps=2), addition_rows(16)
    )
    trainer.train()
    checkpoint = tmp_path / "run" / "checkpoint-2"
    loaded = AutoModelForCausalLM.from_pretrained(checkpoint)
    AutoTokenizer.from_pretrained(checkpoint)
    for (name, saved), (_, trained) in zip(loaded.named_parameters(), trainer.model.named_parameters()):
        assert torch.equal(saved, trained), name


# ---- TRL's built-in rewards --------------------------------------------------------------------------------
def test_trl_rewards_under_their_names_and_signatures():
    import pickle

    from rlft.rewards import (
        accuracy_reward,
        get_cosine_scaled_reward,
        get_repetition_penalty_reward,
        get_soft_overlong_punishment,
        reasoning_accuracy_reward,
        think_format_reward,
    )

    third = r"\frac{1}{3}"
    boxed = [
        [{"role": "assistant", "content": r"The answer is \boxed{\frac{1}{3}}"}],
        [{"role": "assistant", "content": r"The answer is \boxed{\frac{1}{2}}"}],
    ]
    assert accuracy_reward(boxed, [third, third]) == [1.0, 0.0]
    assert accuracy_reward(boxed[:1], ["not latex at all }{"]) == [
        None
    ]  # an unparseable gold: not applicable
    thinking = [
        [{"content": r"<think> r </think> \boxed{\frac{1}{3}}"}],
        [{"content": r"<think> \boxed{\frac{1}{3}}"}],
    ]
    assert reasoning_accuracy_reward(thinking, [third, third]) == [1.0, 0.0]  # unfinished reasoning scores 0
    assert think_format_reward([[{"content": "<think>\nx\n</think>\ny"}], [{"content": "<think>\nx"}]]) == [
        1.0,
        0.0,
    ]
    repetition = get_repetition_penalty_reward(ngram_size=2, max_penalty=-1.0)
    assert repetition([[1, 2, 3, 4], [5, 5, 5, 5, 5]]) == [0.0, -0.75]
    cosine = get_cosine_scaled_reward(max_len=100)
    assert cosine(
        [[{"content": r"\boxed{\frac{1}{3}}"}], [{"content": r"\boxed{\frac{1}{2}}"}]],
        [third, third],
        [[1] * 50, [1] * 50],
    ) == pytest.approx([0.75, -0.75])
    overlong = get_soft_overlong_punishment(max_completion_len=10, soft_punish_cache=4)
    assert overlong(completion_ids=[[1] * 5, [1] * 8, [1] * 12]) == [0.0, -0.5, -1.0]
    for reward in (repetition, cosine, overlong):  # reward functions travel to other processes
        assert pickle.loads(pickle.dumps(reward)).__name__ == reward.__name__
    with pytest.raises(ValueError, match="must be <= 0"):
        get_repetition_penalty_reward(2, 1.0)


# ---- TRL's trainer helpers ---------------------------------------------------------------------------------
def test_trl_helper_methods_are_thin_wrappers_over_core(tmp_path, shipped_policy_dir):
    trainer = GRPOTrainer(
        str(shipped_policy_dir), [correct_answer], tiny_grpo_config(tmp_path), addition_rows(16)
    )
    entropies = torch.tensor([[0.1, 0.2, 0.3, 0.4, 0.5, 0.6], [0.7, 0.8, 0.9, 1.0, 1.1, 1.2]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]])
    # 10 unpadded tokens; the 0.8 quantile keeps the top 20%: 0.9 and 1.0 (1.1 and 1.2 are padding)
    expected = torch.tensor([[0, 0, 0, 0, 0, 0], [0, 0, 1, 1, 0, 0]], dtype=torch.bool)
    assert torch.equal(trainer.get_high_entropy_mask(entropies, mask, 0.8), expected)
    assert not trainer.get_high_entropy_mask(entropies, torch.zeros_like(mask), 0.8).any()
    advantages = torch.tensor([[1.0], [-1.0], [-1.0]])
    logps = torch.zeros(3, 2)
    sampler = torch.tensor([[0.5, 0.5], [0.5, 0.5], [0.01, 0.01]])
    keep = GRPOTrainer.get_off_policy_mask(advantages, logps, sampler, torch.ones(3, 2), 0.1)
    assert keep.tolist() == [[1.0], [0.0], [1.0]]
    assert trainer.aux_loss_enabled is False and trainer.reward_processing_classes == [None]


# ---- reward-model data: TRL's collator, processed columns, compute_metrics, named eval sets ----------------
def test_data_collator_for_preference_pads_chosen_then_rejected():
    from rlft.trainer.reward_trainer import DataCollatorForPreference

    batch = DataCollatorForPreference(pad_token_id=0)(
        [
            {"chosen_ids": [1, 2, 3], "rejected_ids": [4, 5], "margin": 0.5},
            {"chosen_ids": [6, 7], "rejected_ids": [8], "margin": 0.0},
        ]
    )
    assert batch["input_ids"].tolist() == [[1, 2, 3], [6, 7, 0], [4, 5, 0], [8, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 1, 0], [1, 1, 0], [1, 0, 0]]
    assert batch["margin"].tolist() == [0.5, 0.0]


def test_reward_trainer_takes_a_collator_compute_metrics_and_pretokenized_pairs(tmp_path, tiny_rm_dir):
    from rlft.trainer.reward_trainer import DataCollatorForPreference

    seen = []

    class Counting(DataCollatorForPreference):
        def __call__(self, examples):
            seen.append(len(examples))
            return super().__call__(examples)

    def my_metrics(prediction):
        return {"my_metric": float((prediction.predictions[:, 0] > prediction.predictions[:, 1]).mean())}

    tokens = [{"chosen_ids": [5, 6, 7, 8], "rejected_ids": [5, 6, 9]}] * 32
    cfg = RewardConfig(
        output_dir=str(tmp_path / "rm"),
        max_steps=2,
        per_device_train_batch_size=8,
        report_to="none",
        eval_strategy="steps",
        eval_steps=2,
        gradient_checkpointing=False,
        logging_steps=1,
    )
    trainer = RewardTrainer(
        str(tiny_rm_dir),
        cfg,
        data_collator=Counting(pad_token_id=0),
        train_dataset=tokens,
        eval_dataset=tokens[:8],
        compute_metrics=my_metrics,
    )
    assert "chosen_ids" in trainer.train_dataset[0] and "chosen_ids" in trainer.eval_dataset[0]
    trainer.train()
    assert seen and seen[0] == 8
    evals = [row for row in trainer.state.log_history if "eval_my_metric" in row]
    assert evals and 0.0 <= evals[0]["eval_my_metric"] <= 1.0


@pytest.mark.parametrize("form", ["dataset_dict", "iterable", "dict_of_iterables"])
def test_named_and_streaming_eval_sets_for_both_trainers(tmp_path, shipped_policy_dir, tiny_rm_dir, form):
    import datasets

    def shaped(rows_a, rows_b):
        a, b = datasets.Dataset.from_list(rows_a), datasets.Dataset.from_list(rows_b)
        if form == "dataset_dict":
            return datasets.DatasetDict({"data1": a, "data2": b}), ["eval_data1_", "eval_data2_"]
        if form == "iterable":
            return a.to_iterable_dataset(), ["eval_"]
        return {"data1": a.to_iterable_dataset(), "data2": b.to_iterable_dataset()}, [
            "eval_data1_",
            "eval_data2_",
        ]

    evaluation, prefixes = shaped(addition_rows(2, heldout=True), addition_rows(3, heldout=True))
    grpo = GRPOTrainer(
        str(shipped_policy_dir),
        [correct_answer],
        tiny_grpo_config(tmp_path / "g"),
        addition_rows(16),
        eval_dataset=evaluation,
    )
    metrics = grpo.evaluate()
    assert all(any(k.startswith(p) and k.endswith("reward") for k in metrics) for p in prefixes), metrics
    assert all(metrics[f"{p}loss"] == 0.0 for p in prefixes), metrics  # greedy: no advantage, no KL
    evaluation, prefixes = shaped(preference_rows(4, heldout=True), preference_rows(6, heldout=True))
    reward = RewardTrainer(
        str(tiny_rm_dir),
        RewardConfig(
            output_dir=str(tmp_path / "r"), report_to="none", max_length=64, per_device_train_batch_size=8
        ),
        train_dataset=preference_rows(16),
        eval_dataset=evaluation,
    )
    metrics = reward.evaluate()
    assert all(f"{p}loss" in metrics and f"{p}margin" in metrics for p in prefixes), metrics


def test_generation_kwargs_reach_generate_and_a_key_it_rejects_is_named(tmp_path, shipped_policy_dir):
    trainer = GRPOTrainer(
        str(shipped_policy_dir),
        [correct_answer],
        tiny_grpo_config(
            tmp_path, max_steps=1, generation_kwargs={"num_beams": 2, "top_k": 50, "length_penalty": -0.1}
        ),
        addition_rows(16),
    )
    trainer.train()  # beam sampling: generate expands rows into beams itself
    assert trainer.state.global_step == 1
    with pytest.raises(
        ConfigError, match=r"generation_kwargs \['temprature'\] are neither GenerationConfig fields"
    ):
        GRPOTrainer(
            str(shipped_policy_dir),
            [correct_answer],
            tiny_grpo_config(tmp_path, generation_kwargs={"temprature": 0.5}),
            addition_rows(16),
        )
    with pytest.raises(ConfigError, match="num_return_sequences=4 is not supported: num_generations sets"):
        GRPOTrainer(
            str(shipped_policy_dir),
            [correct_answer],
            tiny_grpo_config(tmp_path, generation_kwargs={"num_return_sequences": 4}),
            addition_rows(16),
        )


def test_trl_grpo_command_line_arguments_are_accepted(tmp_path, shipped_policy_dir, monkeypatch):
    import rlft.cli.recipes
    from rlft.cli import main

    seen = {}

    def capture(kind, script, cfg, model, mixture):
        seen.update(script=script, model=model)
        raise SystemExit(0)

    monkeypatch.setattr(rlft.cli.recipes, "build_trainer", capture)
    with pytest.raises(SystemExit):
        main(
            [
                "grpo",
                "--model_name_or_path",
                str(shipped_policy_dir),
                "--dataset_name",
                "trl-lib/DeepMath-103K",
                "--reward_funcs",
                "accuracy_reward",
                "think_format_reward",
                "--reward_model_name_or_path",
                "my/rm",
                "--use_peft",
                "--lora_target_modules",
                "q_proj",
                "v_proj",
                "--output_dir",
                str(tmp_path / "o"),
            ]
        )
    assert seen["script"].reward_funcs == ["accuracy_reward", "think_format_reward"]
    assert seen["script"].reward_model_name_or_path == "my/rm" and seen["model"].lora_target_modules == [
        "q_proj",
        "v_proj",
    ]


# ---- what TRL's own tests read around the loop --------------------------------------------------------------
def test_evaluate_reports_the_loss_on_the_eval_completions(tmp_path, shipped_policy_dir):
    """Greedy evaluation (one completion per prompt) has no advantage, so its loss is exactly 0; with sampled
    groups the on-policy dapo loss is -sum_i A_i |o_i| / sum_i |o_i| (ratio 1, nothing clipped)."""
    cfg = tiny_grpo_config(tmp_path, max_completion_length=8)
    trainer = GRPOTrainer(str(shipped_policy_dir), [correct_answer], cfg, addition_rows(16),
                          eval_dataset=addition_rows(3, heldout=True))
    metrics = trainer.evaluate()
    assert metrics["eval_loss"] == 0.0 and "eval_reward" in metrics
    rollout = trainer.source.generate(trainer.train_prompts.batch([0]), 4)
    rewards = torch.tensor([[1.0], [0.0], [1.0], [0.0]])
    lengths = rollout.loss_mask.sum(dim=1).double()
    advantages = torch.tensor([1.0, -1.0, 1.0, -1.0], dtype=torch.float64) * 0.5 / (3 ** -0.5 + 1e-4)
    expected = -(advantages * lengths).sum() / lengths.sum()
    assert trainer._eval_loss(rollout, rewards, 4) == pytest.approx(expected.item(), rel=1e-5)


def test_a_streamed_train_set_is_read_per_process_as_trl_configures_it(tmp_path, shipped_policy_dir):
    import datasets

    stream = datasets.Dataset.from_list(addition_rows(16)).to_iterable_dataset()
    with pytest.raises(ConfigError, match=r"Iterable datasets require `dispatch_batches=False`"):
        GRPOTrainer(str(shipped_policy_dir), [correct_answer],
                    tiny_grpo_config(tmp_path, accelerator_config={"dispatch_batches": True}), stream)
    trainer = GRPOTrainer(str(shipped_policy_dir), [correct_answer],
                          tiny_grpo_config(tmp_path, dataloader_num_workers=4), stream)
    assert trainer.args.accelerator_config.dispatch_batches is False
    assert trainer.args.dataloader_num_workers == 0  # workers would split the stream's groups


def test_log_extra_columns_reach_the_latest_generation_batch_view(tmp_path, shipped_policy_dir):
    def tagged(completions, log_extra=None, **kwargs):
        log_extra("first_char", [str(c)[:1] for c in completions])
        return [0.0] * len(completions)

    trainer = GRPOTrainer(str(shipped_policy_dir), [tagged], tiny_grpo_config(tmp_path, max_steps=1),
                          addition_rows(16))
    trainer.train()
    logs = trainer._logs
    assert len(logs["extra"]["first_char"]) == len(logs["completion"]) == 8
    assert logs["rewards"]["tagged"] == [0.0] * 8 and len(logs["advantages"]) == 8


def test_trls_older_pretokenized_column_names_warn_in_trls_words(tiny_rm_dir, tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_rm_dir)
    rows = [{"chosen_input_ids": tokenizer(r["chosen"]).input_ids,
             "rejected_input_ids": tokenizer(r["rejected"]).input_ids} for r in preference_rows(8)]
    with pytest.warns(FutureWarning, match="will not be supported in v1"):
        RewardTrainer(str(tiny_rm_dir), RewardConfig(output_dir=str(tmp_path), report_to="none"),
                      train_dataset=rows)
