"""GKD (GKDTrainer, TRL's experimental names): a seeded draw per rollout chooses the student's, the teacher's
or the dataset's completions; the step is distillation's divergence on them at temperature 1; TRL's
`messages` datasets and script shape; resume is exact."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from rlft.errors import ConfigError
from rlft.experimental.gkd import GKDConfig, GKDTrainer
from rlft.train.gkd import GKDSource
from rlft.train.run.checkpoint import latest_checkpoint
from tests.helpers import addition_rows, run_trl_script
from tests.test_distillation import perturbed, reference_loss
from tests.test_grpo_resume import resumed_run_equals_straight


def messages_rows(count: int = 32, heldout: bool = False) -> list[dict]:
    """TRL's GKD format: a conversation whose last message, the assistant's, is the completion."""
    return [{"messages": r["prompt"] + [{"role": "assistant", "content": f"<answer>{r['answer']}</answer>"}]}
            for r in addition_rows(count, heldout)]


def config(tmp_path, name="run", **overrides) -> GKDConfig:
    values = dict(output_dir=str(tmp_path / name), max_steps=2, per_device_train_batch_size=4, max_new_tokens=8,
                  logging_steps=1, save_steps=1000, report_to="none", disable_tqdm=True, seed=0,
                  gradient_checkpointing=False)
    values.update(overrides)
    return GKDConfig(**values)


@pytest.fixture(scope="module")
def teacher(shipped_policy_dir):
    return perturbed(shipped_policy_dir, 0.05).eval()


def test_trls_defaults_and_the_draw_takes_lmbda_of_the_rollouts_the_same_way_every_time(tmp_path):
    cfg = config(tmp_path)
    assert (cfg.lmbda, cfg.beta, cfg.temperature, cfg.seq_kd, cfg.max_completion_length, cfg.disable_dropout) == \
        (0.5, 0.5, 0.9, False, 8, True)
    assert GKDConfig(output_dir=str(tmp_path)).learning_rate == 2e-5 and cfg.divergence_temperature == 1.0
    with pytest.raises(ConfigError, match=r"lmbda=1.5 must be in \[0, 1\]"):
        config(tmp_path, lmbda=1.5)
    draws = {}
    for lmbda, seq_kd in ((0.0, False), (0.3, False), (0.3, True), (1.0, False)):
        source = SimpleNamespace(args=SimpleNamespace(seed=3, lmbda=lmbda, seq_kd=seq_kd))
        draws[lmbda, seq_kd] = [GKDSource.kind(source, i) for i in range(2000)]
    assert set(draws[0.0, False]) == {"dataset"} and set(draws[1.0, False]) == {"student"}
    share = draws[0.3, False].count("student") / 2000
    assert abs(share - 0.3) < 3 * (0.3 * 0.7 / 2000) ** 0.5  # within 3 sigma
    fixed = [k for k in draws[0.3, True] if k != "student"]
    assert set(fixed) == {"teacher"}  # seq_kd: the teacher's completions take the dataset's place
    assert [k == "student" for k in draws[0.3, True]] == [k == "student" for k in draws[0.3, False]]


def test_a_dataset_step_is_the_float64_definition_on_the_chat_templates_completion_tokens(tmp_path,
                                                                                          shipped_policy_dir,
                                                                                          teacher):
    """lmbda 0: the dataset's completions, the chat template's last turn after the generation prompt (through
    its end-of-turn token); one SGD step at lr 1 is the divergence at beta from full logits at temperature 1
    (not the sampling 0.9), and its gradient."""
    cfg = config(tmp_path, lmbda=0.0, optim="sgd", learning_rate=1.0, max_grad_norm=1e9, beta=0.3,
                 per_device_train_batch_size=8, logprob_chunk_size=5)
    trainer = GKDTrainer(str(shipped_policy_dir), teacher, cfg, train_dataset=messages_rows(16))
    batch = trainer._make_rollout(0)
    rollout, tok = batch.rollout, trainer.tokenizer
    for row, sample in enumerate(batch.samples):
        kept = rollout.completion_ids[row][rollout.completion_mask[row].bool()].tolist()
        assert tok.decode(kept) == sample["completion"][-1]["content"] + "<|im_end|>"
    assert not rollout.truncated.any() and batch.metrics["gkd/dataset_completions"] == 1.0
    student = trainer.model
    before = {n: p.detach().clone() for n, p in student.named_parameters()}
    want = reference_loss(student, teacher, rollout, 0.3, 1.0)
    grads = torch.autograd.grad(want, list(student.parameters()))
    metrics = trainer.updater.step(batch)
    assert metrics["loss"] == pytest.approx(want.item(), rel=1e-5, abs=1e-7)
    for (name, p), g in zip(student.named_parameters(), grads):
        assert torch.allclose(before[name] - p.detach(), g.float(), atol=2e-6, rtol=1e-4), name


def test_seq_kd_trains_on_the_teachers_own_completions(tmp_path, shipped_policy_dir, teacher):
    """seq_kd with lmbda 0: the teacher completes the prompts (top_k 1 here, so its completion is its greedy
    one, checked against its own generate)."""
    cfg = config(tmp_path, lmbda=0.0, seq_kd=True, top_k=1)
    trainer = GKDTrainer(str(shipped_policy_dir), teacher, cfg, train_dataset=messages_rows(16))
    batch = trainer._make_rollout(0)
    assert batch.metrics["gkd/teacher_completions"] == 1.0
    rollout = batch.rollout
    greedy = teacher.generate(input_ids=rollout.prompt_ids, attention_mask=rollout.prompt_mask, do_sample=False,
                              max_new_tokens=8, pad_token_id=trainer.tokenizer.pad_token_id)
    width = rollout.completion_ids.shape[1]
    for row in range(len(rollout.completion_ids)):
        n = int(rollout.completion_mask[row].sum())
        assert rollout.completion_ids[row, :n].tolist() == greedy[row, -width:][:n].tolist()


def test_two_plus_two_steps_equal_four_with_a_mixed_draw(tmp_path, shipped_policy_dir, teacher):
    def trainer(name):
        return GKDTrainer(str(shipped_policy_dir), teacher, config(tmp_path, name, max_steps=4, save_steps=2,
                                                                  learning_rate=1e-3), train_dataset=messages_rows(32))

    straight, _ = resumed_run_equals_straight(trainer, 4, 2)
    assert [straight.source.kind(i) for i in range(4)] == ["dataset", "dataset", "student", "dataset"]  # mixed
    assert latest_checkpoint(tmp_path / "split").name == "checkpoint-4"


def test_bad_datasets_and_arguments_are_named(tmp_path, shipped_policy_dir):
    rows = messages_rows(8)
    rows[2] = {"messages": rows[2]["messages"][:1]}
    with pytest.raises(ValueError, match="row 2: 'messages' must be a conversation"):
        GKDTrainer(str(shipped_policy_dir), None, config(tmp_path), train_dataset=rows)
    with pytest.raises(ConfigError, match="data_collator, formatting_func are SFTTrainer's hooks"):
        GKDTrainer(str(shipped_policy_dir), None, config(tmp_path), data_collator=object(), formatting_func=str,
                   train_dataset=messages_rows(8))
    with pytest.raises(ValueError, match="needs a 'messages' column"):
        GKDTrainer(str(shipped_policy_dir), None, config(tmp_path), train_dataset=addition_rows(8))


SCRIPT = '''
"""A TRL GKD script's shape (examples/scripts/gkd.py) with the import changed."""
from datasets import load_dataset
from transformers import AutoTokenizer, GenerationConfig
from rlft import LogCompletionsCallback, ModelConfig, ScriptArguments, TrlParser, get_peft_config
from rlft.experimental.gkd import GKDConfig, GKDTrainer

parser = TrlParser((ScriptArguments, GKDConfig, ModelConfig))
script_args, training_args, model_args = parser.parse_args_and_config()
tokenizer = AutoTokenizer.from_pretrained(model_args.model_name_or_path, padding_side="left")
dataset = load_dataset(script_args.dataset_name)
trainer = GKDTrainer(model=model_args.model_name_or_path, teacher_model=training_args.teacher_model_name_or_path,
                     args=training_args, train_dataset=dataset[script_args.dataset_train_split],
                     eval_dataset=dataset[script_args.dataset_test_split], processing_class=tokenizer,
                     peft_config=get_peft_config(model_args))
if training_args.eval_strategy != "no" and "prompt" in dataset[script_args.dataset_test_split].column_names:
    generation_config = GenerationConfig(max_new_tokens=training_args.max_new_tokens, do_sample=True,
                                         temperature=training_args.temperature)
    trainer.add_callback(LogCompletionsCallback(trainer, generation_config, num_prompts=8))
trainer.train()
trainer.save_model(training_args.output_dir)
'''


def test_a_trl_style_gkd_script_trains_and_saves(tmp_path, shipped_policy_dir):
    recipe = (f"model_name_or_path: {shipped_policy_dir}\nteacher_model_name_or_path: {shipped_policy_dir}\n"
              "max_steps: 2\nper_device_train_batch_size: 4\nmax_new_tokens: 8\n"
              "lmbda: 0.5\nuse_peft: true\nlora_r: 4\nreport_to: none\ndisable_tqdm: true\n"
              "logging_steps: 1\neval_strategy: steps\neval_steps: 2\n")
    run_trl_script(tmp_path, SCRIPT, recipe, messages_rows(16), messages_rows(4, heldout=True))
    assert (tmp_path / "out" / "adapter_model.safetensors").exists()


def test_trls_static_helpers_and_generation_config(tmp_path, shipped_policy_dir):
    """GKDTrainer.generalized_jsd_loss (TRL's static method, for logits a caller holds) is the generalized JSD
    per kept position, reduced as TRL reduces; generate_on_policy_outputs masks the prompt and what follows the
    first EOS; generation_config states the student's sampling settings."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from rlft.core.distill import divergence_from_logprobs

    g = torch.Generator().manual_seed(0)
    s, t = torch.randn(2, 5, 11, generator=g, dtype=torch.float64), torch.randn(2, 5, 11, generator=g, dtype=torch.float64)
    labels = torch.tensor([[-100, 3, 4, -100, -100], [-100, -100, 1, 2, 3]])
    for beta in (0.0, 0.5, 1.0):
        per = divergence_from_logprobs(torch.log_softmax(s / 0.7, -1), torch.log_softmax(t / 0.7, -1), beta)
        kept = per[labels != -100]
        loss = GKDTrainer.generalized_jsd_loss(s, t, labels, beta=beta, temperature=0.7)
        assert torch.allclose(loss, kept.sum() / 5, atol=1e-12)
        assert torch.allclose(GKDTrainer.generalized_jsd_loss(s, t, labels, beta, 0.7, "sum"), kept.sum(), atol=1e-12)
        terms = GKDTrainer.generalized_jsd_loss(s, t, None, beta, 0.7, "none")
        assert terms.shape == (2, 5, 11) and torch.allclose(terms.sum(-1), per, atol=1e-12)
        assert torch.allclose(GKDTrainer.generalized_jsd_loss(s, t, None, beta, 0.7), per.sum() / 2, atol=1e-12)
    tok = AutoTokenizer.from_pretrained(shipped_policy_dir, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(shipped_policy_dir)
    batch = tok(["What is 1+2?", "What is 30+4?"], return_tensors="pt", padding=True)
    greedy = GenerationConfig(max_new_tokens=6, do_sample=False, eos_token_id=tok.eos_token_id,
                              pad_token_id=tok.pad_token_id)
    ids, mask, labels = GKDTrainer.generate_on_policy_outputs(
        model, {"prompts": batch["input_ids"], "prompt_attention_mask": batch["attention_mask"]}, greedy)
    width = batch["input_ids"].shape[1]
    assert torch.equal(ids[:, :width], batch["input_ids"]) and torch.equal(mask[:, :width], batch["attention_mask"])
    assert (labels[:, :width] == -100).all()
    for row in range(2):
        tail = ids[row, width:].tolist()
        stop = tail.index(tok.eos_token_id) + 1 if tok.eos_token_id in tail else len(tail)
        assert mask[row, width:].tolist() == [1] * stop + [0] * (len(tail) - stop)
        assert labels[row, width:width + stop].tolist() == tail[:stop]
    trainer = GKDTrainer(str(shipped_policy_dir), None, config(tmp_path), train_dataset=messages_rows(8))
    generation = trainer.generation_config
    assert (generation.max_new_tokens, generation.temperature, generation.top_k, generation.top_p) == (8, 0.9, 0, 1.0)
    assert trainer.train_dataset[0].keys() == {"messages"}  # the caller's dataset, as TRL keeps it
