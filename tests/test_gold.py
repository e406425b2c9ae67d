"""GOLD (GOLDTrainer, TRL's experimental names) with a same-tokenizer teacher: TRL's GOLDConfig defaults, GKD's
rollouts with the divergence at the sampling temperature (a step equals the float64 definition), cross-tokenizer
ULD refused by name, and TRL's GOLD script's shape with the imports changed."""

from __future__ import annotations

import pytest
import torch

from rlft.errors import ConfigError
from rlft.experimental.gold import GOLDConfig, GOLDTrainer
from tests.helpers import run_trl_script
from tests.test_distillation import perturbed, reference_loss
from tests.test_gkd import messages_rows


def gold_config(tmp_path, **overrides) -> GOLDConfig:
    values = dict(output_dir=str(tmp_path / "run"), max_steps=2, per_device_train_batch_size=4,
                  max_completion_length=8, logging_steps=1, save_steps=1000, report_to="none", disable_tqdm=True,
                  seed=0, gradient_checkpointing=False)
    return GOLDConfig(**{**values, **overrides})


@pytest.fixture(scope="module")
def teacher(shipped_policy_dir):
    return perturbed(shipped_policy_dir, 0.05).eval()


def test_trls_defaults_and_uld_refused(tmp_path):
    cfg = GOLDConfig(output_dir=str(tmp_path))
    assert (cfg.learning_rate, cfg.temperature, cfg.top_p, cfg.lmbda, cfg.beta, cfg.max_completion_length,
            cfg.seq_kd, cfg.num_generations, cfg.divergence_temperature) == (1e-7, 0.9, 0.95, 0.5, 0.5, 128, False,
                                                                            1, 0.9)
    with pytest.raises(ConfigError, match="use_uld_loss=True is not supported by rlft: cross-tokenizer"):
        GOLDConfig(output_dir=str(tmp_path), use_uld_loss=True)
    with pytest.raises(ConfigError, match="vllm_sync_frequency=2 is not supported"):
        GOLDConfig(output_dir=str(tmp_path), vllm_sync_frequency=2)


def test_a_dataset_step_is_the_definition_at_the_sampling_temperature(tmp_path, shipped_policy_dir, teacher):
    cfg = gold_config(tmp_path, lmbda=0.0, optim="sgd", learning_rate=1.0, max_grad_norm=1e9, beta=0.3,
                      temperature=0.7, per_device_train_batch_size=8, logprob_chunk_size=5)
    trainer = GOLDTrainer(str(shipped_policy_dir), teacher, cfg, train_dataset=messages_rows(16))
    batch = trainer._make_rollout(0)
    student = trainer.model
    before = {n: p.detach().clone() for n, p in student.named_parameters()}
    want = reference_loss(student, teacher, batch.rollout, 0.3, 0.7)  # GKD's would be at 1.0
    grads = torch.autograd.grad(want, list(student.parameters()))
    metrics = trainer.updater.step(batch)
    assert metrics["loss"] == pytest.approx(want.item(), rel=1e-5, abs=1e-7)
    assert batch.metrics["gkd/dataset_completions"] == 1.0 and "gold" in student.model_tags
    for (name, p), g in zip(student.named_parameters(), grads):
        assert torch.allclose(before[name] - p.detach(), g.float(), atol=2e-6, rtol=1e-4), name


SCRIPT = '''
"""A TRL GOLD script's shape (examples/scripts/gold.py) with the imports changed."""
from datasets import load_dataset
from transformers import AutoTokenizer, GenerationConfig
from rlft import LogCompletionsCallback, ModelConfig, ScriptArguments, TrlParser, get_peft_config, get_quantization_config
from rlft.experimental.gold.gold_config import GOLDConfig
from rlft.experimental.gold.gold_trainer import GOLDTrainer

parser = TrlParser((ScriptArguments, GOLDConfig, ModelConfig))
script_args, training_args, model_args = parser.parse_args_and_config()
training_args.model_init_kwargs = dict(revision=model_args.model_revision, attn_implementation=None,
                                       dtype=model_args.dtype, use_cache=False,
                                       quantization_config=get_quantization_config(model_args))
training_args.teacher_model_init_kwargs = dict(revision=training_args.teacher_model_revision,
                                               attn_implementation=None, dtype=model_args.dtype, use_cache=True)
tokenizer = AutoTokenizer.from_pretrained(model_args.model_name_or_path)
dataset = load_dataset(script_args.dataset_name, name=script_args.dataset_config)
trainer = GOLDTrainer(model=model_args.model_name_or_path, teacher_model=training_args.teacher_model_name_or_path,
                      args=training_args, train_dataset=dataset[script_args.dataset_train_split],
                      eval_dataset=dataset[script_args.dataset_test_split], processing_class=tokenizer,
                      peft_config=get_peft_config(model_args))
trainer.add_callback(LogCompletionsCallback(trainer, GenerationConfig(
    max_new_tokens=training_args.max_completion_length, do_sample=True, temperature=training_args.temperature),
    num_prompts=8))
trainer.train()
trainer.save_model(training_args.output_dir)
'''


def test_a_trl_style_gold_script_trains_and_saves(tmp_path, shipped_policy_dir):
    rows = [{"prompt": m["messages"][:-1], "completion": m["messages"][-1:]} for m in messages_rows(20)]
    recipe = (f"model_name_or_path: {shipped_policy_dir}\nteacher_model_name_or_path: {shipped_policy_dir}\n"
              "max_steps: 2\nper_device_train_batch_size: 4\nmax_completion_length: 8\n"
              "learning_rate: 2e-4\nuse_peft: true\nlora_r: 4\nlora_alpha: 16\nreport_to: none\n"
              "disable_tqdm: true\nlogging_steps: 1\neval_strategy: steps\neval_steps: 2\n"
              "gradient_checkpointing: false\n")
    run_trl_script(tmp_path, SCRIPT, recipe, rows[:16], rows[16:])
    assert (tmp_path / "out" / "adapter_model.safetensors").exists()
