"""On-policy distillation (DistillationTrainer): the loss and its gradients are the definition computed from
full logits; training moves the student toward the teacher; resume is exact; LoRA, bad input, the recipe
script and the command line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from rlft import DistillationConfig, DistillationTrainer, GRPOConfig
from rlft.errors import ConfigError
from rlft.telemetry.tracking import read_metrics
from rlft.train.run.checkpoint import latest_checkpoint
from tests.dist.grpo_step import FixedGenerator
from tests.helpers import SAME_STEP, addition_rows, assert_params_close, write_jsonl
from tests.test_grpo_resume import resumed_run_equals_straight

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    """A Llama teacher (hidden 48) for the shipped Qwen2 student (hidden 128): the same vocabulary size (its own
    tokenizer of that size: the loss compares token ids), another model."""
    from rlft.tiny import make_tiny_model_dir

    return make_tiny_model_dir(tmp_path_factory.mktemp("teacher"), kind="causal", arch="llama", hidden_size=48,
                               seed=3)


def config(tmp_path, name="run", **overrides) -> DistillationConfig:
    values = dict(output_dir=str(tmp_path / name), learning_rate=1e-3, max_steps=2, per_device_train_batch_size=8,
                  max_completion_length=8, logging_steps=1, save_steps=1000, report_to="none", disable_tqdm=True,
                  seed=0, gradient_checkpointing=False)
    values.update(overrides)
    return DistillationConfig(**values)


def reference_loss(student, teacher, rollout, beta: float, temperature: float, trained=None) -> torch.Tensor:
    """The definition from [B, T, V] logits of both models (float64 softmaxes): sum of D over every trained
    completion token (`trained`, default the rollout's loss mask) / their number."""
    ids = torch.cat([rollout.prompt_ids, rollout.completion_ids], dim=1)
    mask = torch.cat([rollout.prompt_mask, rollout.completion_mask], dim=1)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    width = rollout.completion_ids.shape[1]
    z_s = student(input_ids=ids, attention_mask=mask, position_ids=positions).logits[:, -(width + 1):-1]
    with torch.no_grad():
        z_t = teacher(input_ids=ids, attention_mask=mask, position_ids=positions).logits[:, -(width + 1):-1]
    p_s = torch.softmax(z_s.double() / temperature, dim=-1)
    p_t = torch.softmax(z_t.double() / temperature, dim=-1)
    if beta == 0.0:
        d = (p_t * (p_t.log() - p_s.log())).sum(-1)
    elif beta == 1.0:
        d = (p_s * (p_s.log() - p_t.log())).sum(-1)
    else:
        m = (1 - beta) * p_s + beta * p_t
        d = beta * (p_t * (p_t / m).log()).sum(-1) + (1 - beta) * (p_s * (p_s / m).log()).sum(-1)
    trained = (rollout.loss_mask if trained is None else trained).double()
    return (d * trained).sum() / trained.sum()


@pytest.mark.parametrize("beta", [0.0, 0.3, 1.0])
def test_one_step_is_the_definitions_loss_and_gradient(tmp_path, shipped_policy_dir, teacher_dir, beta):
    """SGD with lr 1 (no clipping): the parameter change is the gradient. Loss and change equal the untiled
    definition (reference_loss) on the same rollout; padding and the tokens after EOS count for nothing."""
    cfg = config(tmp_path, optim="sgd", learning_rate=1.0, max_grad_norm=1e9, beta=beta, temperature=0.9,
                 logprob_chunk_size=5)  # tiles of 5 positions
    trainer = DistillationTrainer(str(shipped_policy_dir), str(teacher_dir), cfg, addition_rows(16))
    trainer.generator = FixedGenerator(trainer.tokenizer)
    batch = trainer._make_rollout(0)
    assert batch.rollout.loss_mask.sum() < batch.rollout.loss_mask.numel()  # some padding after EOS
    student = trainer.model
    before = {n: p.detach().clone() for n, p in student.named_parameters()}
    want = reference_loss(student, trainer.teacher_model, batch.rollout, beta, 0.9)
    grads = torch.autograd.grad(want, list(student.parameters()))
    metrics = trainer.updater.step(batch)
    assert metrics["loss"] == pytest.approx(want.item(), rel=1e-5, abs=1e-7)
    assert metrics["distill/loss"] == metrics["loss"] and 0 < metrics["entropy"] and 0 < metrics["distill/teacher_entropy"]
    for (name, p), g in zip(student.named_parameters(), grads):
        assert torch.allclose(before[name] - p.detach(), g.float(), atol=2e-6, rtol=1e-4), name


def perturbed(model_dir, scale: float = 0.05):
    """The student's own model with seeded noise on every weight: a teacher close to it."""
    teacher = AutoModelForCausalLM.from_pretrained(model_dir)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in teacher.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g))
    return teacher


def test_training_lowers_the_divergence_and_logs_trls_metrics(tmp_path, shipped_policy_dir):
    trainer = DistillationTrainer(str(shipped_policy_dir), perturbed(shipped_policy_dir),
                                  config(tmp_path, max_steps=6, beta=0.5, save_steps=6),
                                  addition_rows(32), eval_dataset=addition_rows(8, heldout=True))
    trainer.train()
    rows = read_metrics(tmp_path / "run")
    steps = [r for r in rows if "loss" in r and "step_time" in r]
    assert len(steps) == 6 and steps[-1]["loss"] < 0.5 * steps[0]["loss"]
    for key in ("distill/loss", "entropy", "distill/teacher_entropy", "completions/mean_length", "num_tokens",
                "step_time", "grad_norm", "tokens/computed"):
        assert key in steps[-1], key
    assert not any(k.startswith(("reward", "frac_reward", "advantage")) for k in steps[-1])
    metrics = trainer.evaluate()
    assert set(metrics) == {"eval_loss"} and 0 <= metrics["eval_loss"] < steps[0]["loss"]
    assert latest_checkpoint(tmp_path / "run").name == "checkpoint-6"


def test_two_plus_two_steps_equal_four_with_lora(tmp_path, shipped_policy_dir, teacher_dir):
    from peft import LoraConfig

    lora = dict(peft_config=None)
    lora["peft_config"] = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    resumed_run_equals_straight(lambda name: DistillationTrainer(
        str(shipped_policy_dir), str(teacher_dir), config(tmp_path, name, max_steps=4, save_steps=2),
        addition_rows(32), **lora), 4, 2)
    assert (tmp_path / "straight" / "checkpoint-4" / "adapter_model.safetensors").exists()


def test_self_distillation_trains_at_loss_zero_and_a_wiring_fault_is_still_named(tmp_path, shipped_policy_dir):
    """The teacher is the student's own checkpoint: every divergence is 0, so is every gradient, and that is the
    loss at its minimum, not a fault (TRL trains it at loss 0). A trainable parameter outside the graph is
    still named once the two differ."""
    from rlft.model.loading import GradientFlowError

    trainer = DistillationTrainer(str(shipped_policy_dir), str(shipped_policy_dir),
                                  config(tmp_path, "self", max_steps=2, weight_decay=0.0), addition_rows(16))
    trainer.train()
    steps = [r for r in read_metrics(tmp_path / "self") if "loss" in r and "step_time" in r]
    assert [r["loss"] for r in steps] == [0.0, 0.0] and [r["grad_norm"] for r in steps] == [0.0, 0.0]
    assert not trainer.updater.counters.flow_checked  # no step with a signal yet: nothing to check

    model = AutoModelForCausalLM.from_pretrained(shipped_policy_dir)
    model.register_parameter("orphan", torch.nn.Parameter(torch.zeros(3)))  # trainable, not in the graph
    with pytest.raises(GradientFlowError, match=r"got no gradient at all \(e.g. \['orphan'\]\)"):
        DistillationTrainer(model, str(teacher_of(tmp_path, shipped_policy_dir)), config(tmp_path, "orphan"),
                            addition_rows(16)).train()


def teacher_of(tmp_path, model_dir):
    """The student's own model with seeded noise (perturbed), saved as a folder."""
    folder = tmp_path / "perturbed"
    perturbed(model_dir).save_pretrained(folder)
    return folder


def test_bad_teachers_and_configs_are_named(tmp_path, shipped_policy_dir, teacher_dir):
    from peft import LoraConfig

    data = addition_rows(16)
    with pytest.raises(ConfigError, match="needs a teacher"):
        DistillationTrainer(str(shipped_policy_dir), None, config(tmp_path), data)
    with pytest.raises(ConfigError, match="takes a DistillationConfig, got GRPOConfig"):
        DistillationTrainer(str(shipped_policy_dir), str(teacher_dir), GRPOConfig(output_dir=str(tmp_path / "g")),
                            data)
    with pytest.raises(ConfigError, match=r"beta=1.5 must be in \[0, 1\]"):
        config(tmp_path, beta=1.5)
    other = AutoModelForCausalLM.from_pretrained(teacher_dir)
    other.resize_token_embeddings(400)
    # TRL's wording ("vocab_size"), which its own tests match on
    with pytest.raises(ConfigError, match=r"student model has vocab_size 386 but the teacher model .*vocab_size 400"):
        DistillationTrainer(str(shipped_policy_dir), other, config(tmp_path), data)
    with pytest.raises(ConfigError, match="teacher_model_init_kwargs only applies"):
        DistillationTrainer(str(shipped_policy_dir), other, config(tmp_path, teacher_model_init_kwargs={"dtype": "float32"}),
                            data)
    head = LoraConfig(r=4, target_modules=["q_proj", "lm_head"], task_type="CAUSAL_LM")
    with pytest.raises(ConfigError, match="leave lm_head out of the LoRA target_modules"):
        DistillationTrainer(str(shipped_policy_dir), str(teacher_dir), config(tmp_path), data, peft_config=head)


SCRIPT = '''
"""A TRL distillation script (scripts/distillation.py's shape) with the import changed."""
from datasets import load_dataset
from rlft import DistillationConfig, DistillationTrainer, ModelConfig, ScriptArguments, TrlParser, get_peft_config

parser = TrlParser((ScriptArguments, DistillationConfig, ModelConfig))
script_args, training_args, model_args = parser.parse_args_and_config()
dataset = load_dataset(script_args.dataset_name, name=script_args.dataset_config, split="train")
trainer = DistillationTrainer(model=model_args.model_name_or_path,
                              teacher_model=training_args.teacher_model_name_or_path, args=training_args,
                              train_dataset=dataset, peft_config=get_peft_config(model_args))
trainer.train()
trainer.save_model(training_args.output_dir)
'''


def test_a_trl_style_script_and_the_command_line_train_and_save(tmp_path, shipped_policy_dir, teacher_dir):
    (tmp_path / "prompts").mkdir()
    data = write_jsonl(tmp_path / "prompts" / "train.jsonl", addition_rows(16)).parent  # a dataset folder
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"model_name_or_path: {shipped_policy_dir}\nteacher_model_name_or_path: {teacher_dir}\n"
                      f"dataset_name: {data}\nmax_steps: 2\nper_device_train_batch_size: 4\n"
                      "max_completion_length: 8\nbeta: 0.5\nlearning_rate: 1.0e-4\nuse_peft: true\nlora_r: 4\n"
                      "report_to: none\ndisable_tqdm: true\nlogging_steps: 1\n"
                      "teacher_model_init_kwargs: {\"dtype\": \"float32\"}\n")
    script = tmp_path / "distill.py"
    script.write_text(SCRIPT)
    env = {"PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"}
    result = subprocess.run([sys.executable, str(script), "--config", str(recipe), "--output_dir",
                             str(tmp_path / "script")], capture_output=True, text=True, env=env, cwd=tmp_path,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "script" / "adapter_model.safetensors").exists()
    result = subprocess.run([sys.executable, "-m", "rlft.cli", "distillation", "--config", str(recipe),
                             "--output_dir", str(tmp_path / "cli")],
                            capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "cli" / "adapter_model.safetensors").exists()
    assert f"rlft distillation: model saved to {tmp_path / 'cli'}" in result.stdout
    assert [r["step"] for r in read_metrics(tmp_path / "cli") if "distill/loss" in r] == [1, 2]


def test_two_processes_take_the_step_one_process_takes(tmp_path, shipped_policy_dir, teacher_dir):
    """The loss is normalised by the trained tokens of the whole step on every process: one step on 2 processes
    (and in 4 micro-batches) equals one process in one batch, for each beta, with LoRA, with the teacher
    served (each process asking for its own rows), with two teachers (each row routed by its teacher_id),
    GKD's on the dataset's and the student's completions, GOLD's ULD (the teacher in its own tokens), and SDFT's and SDPO's (each process's rows read by
    their own teacher prompts; SDPO's successes found within each process's groups)."""
    from transformers import AutoTokenizer

    from tests.teacher_stub import serve_teacher
    from tests.test_distributed import launch

    served = AutoModelForCausalLM.from_pretrained(teacher_dir).eval()
    # (the fixture's teacher shares the student's vocabulary size, not its tokenizer: the stand-in server
    # tokenizes with the student's so that the served teacher's tokenizer check passes)
    with serve_teacher(served, AutoTokenizer.from_pretrained(shipped_policy_dir)) as (url, _):
        for processes in (1, 2):
            result = launch(["tests/dist/distill_step.py", str(shipped_policy_dir), str(teacher_dir),
                             str(tmp_path / f"{processes}.pt"), url], processes)
            assert result.returncode == 0, result.stderr[-3000:]
    one, two = torch.load(tmp_path / "1.pt"), torch.load(tmp_path / "2.pt")
    for name in one:  # float64 runs, equal to its rounding (tests/helpers.py: SAME_STEP)
        assert one[name]["metrics"]["loss"] != 0, name
        for key, value in one[name]["metrics"].items():
            assert value == pytest.approx(two[name]["metrics"][key], abs=SAME_STEP), (name, key)
        assert_params_close(two[name]["params"], one[name]["params"], SAME_STEP, name)
    # micro-batches: the same step in four parts (in float32 the order alone moved the embedding by 1.2e-6)
    assert_params_close(one["micro_batches"]["params"], one["reverse_kl"]["params"], SAME_STEP)


def test_grpo_with_a_teacher_term_adds_coef_times_the_token_mean_reverse_kl(tmp_path, shipped_policy_dir, teacher_dir):
    """GRPO's step with teacher_coef 0.5 changes the weights by GRPO's own change plus 0.5 x the gradient of the
    token-mean reverse KL to the teacher (from full logits), and logs the term apart from policy_loss."""
    from tests.helpers import tiny_grpo_config

    def token_sum_reward(completion_ids, **kwargs):
        return [float(sum(ids) % 7) for ids in completion_ids]

    changes, metrics = {}, {}
    for coef in (0.0, 0.5):
        cfg = tiny_grpo_config(tmp_path, output_dir=str(tmp_path / f"c{coef}"), optim="sgd", learning_rate=1.0,
                               max_grad_norm=1e9, loss_type="dapo", teacher_coef=coef, log_completions=False)
        from rlft import GRPOTrainer

        trainer = GRPOTrainer(str(shipped_policy_dir), [token_sum_reward], cfg, addition_rows(16),
                              teacher_model=str(teacher_dir) if coef else None)
        trainer.generator = FixedGenerator(trainer.tokenizer)
        batch = trainer._make_rollout(0)
        before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        if coef:
            want = reference_loss(trainer.model, trainer.teacher_model, batch.rollout, 1.0, 1.0)
            rkl = dict(zip(before, torch.autograd.grad(want, list(trainer.model.parameters()))))
        metrics[coef] = trainer.updater.step(batch.part(0, trainer.rows_per_step))
        changes[coef] = {n: before[n] - p.detach() for n, p in trainer.model.named_parameters()}
    got = metrics[0.5]
    assert got["teacher/reverse_kl"] == pytest.approx(want.item(), rel=1e-5)
    assert got["teacher_loss"] == pytest.approx(0.5 * want.item(), rel=1e-5)
    assert got["policy_loss"] == pytest.approx(metrics[0.0]["policy_loss"], abs=1e-6)
    assert got["loss"] == pytest.approx(got["policy_loss"] + got["teacher_loss"], abs=1e-6)
    for name, change in changes[0.5].items():
        assert torch.allclose(change, changes[0.0][name] + 0.5 * rkl[name].float(), atol=3e-6, rtol=1e-4), name


def test_a_teacher_without_its_coefficient_and_the_reverse_are_named(tmp_path, shipped_policy_dir, teacher_dir):
    from rlft import GRPOTrainer
    from tests.helpers import correct_answer, tiny_grpo_config

    with pytest.raises(ConfigError, match="teacher_coef is 0, so it would be loaded and never used"):
        GRPOTrainer(str(shipped_policy_dir), [correct_answer], tiny_grpo_config(tmp_path), addition_rows(16),
                    teacher_model=str(teacher_dir))
    with pytest.raises(ConfigError, match="teacher_coef=0.1 needs a teacher"):
        GRPOTrainer(str(shipped_policy_dir), [correct_answer], tiny_grpo_config(tmp_path, teacher_coef=0.1),
                    addition_rows(16))
    for name, value in (("teacher_coef", 0.5), ("dynamic_sampling", True), ("entropy_coef", 0.01),
                        ("multi_objective_aggregation", "normalize_then_sum")):
        with pytest.raises(ConfigError, match=f"{name}={value!r} is a GRPO setting with no meaning in distillation"):
            config(tmp_path, **{name: value})
    with pytest.raises(ConfigError, match="GRPOTrainer takes a GRPO-family config, not a DistillationConfig"):
        GRPOTrainer(str(shipped_policy_dir), [correct_answer], config(tmp_path), addition_rows(16))


def test_tool_results_are_not_distilled(tmp_path, tiny_tool_dir):
    """With tools=, the tool's output inside a completion is neither scored nor trained: one SGD step moves the
    weights by the definition's gradient over the policy's own tokens (loss_mask), which differs from the one
    over every completion token."""
    from tests.test_tools_trainer import calculator_script, scripted
    from tests.tools_helpers import add

    cfg = config(tmp_path, optim="sgd", learning_rate=1.0, max_grad_norm=1e9, max_completion_length=96,
                 per_device_train_batch_size=4)
    trainer = scripted(DistillationTrainer(str(tiny_tool_dir), perturbed(tiny_tool_dir), cfg, addition_rows(8),
                                           tools=[add]), calculator_script)
    batch = trainer._make_rollout(0)
    rollout = batch.rollout
    assert (rollout.loss_mask < rollout.completion_mask).any()  # tool output exists and is masked
    student = trainer.model
    before = {n: p.detach().clone() for n, p in student.named_parameters()}
    grads, losses = {}, {}
    for name, mask in (("own", rollout.loss_mask), ("all", rollout.completion_mask)):
        want = reference_loss(student, trainer.teacher_model, rollout, 1.0, 1.0, mask)
        grads[name], losses[name] = torch.autograd.grad(want, list(student.parameters())), want.item()
    metrics = trainer.updater.step(batch)
    assert metrics["loss"] == pytest.approx(losses["own"], rel=1e-5)
    for (name, p), g in zip(student.named_parameters(), grads["own"]):
        assert torch.allclose(before[name] - p.detach(), g.float(), atol=2e-6, rtol=1e-4), name
    assert max((a - b).abs().max().item() for a, b in zip(grads["own"], grads["all"])) > 1e-5


def test_a_teacher_replaced_in_place_is_refused_on_resume(tmp_path, shipped_policy_dir):
    """The same folder, shapes and class with other weights: the run record's fingerprint of the teacher's
    weights tells them apart (its name and size alone did not)."""
    teacher = teacher_of(tmp_path, shipped_policy_dir)
    cfg = lambda: config(tmp_path, "run", max_steps=2, save_steps=1)  # noqa: E731
    first = DistillationTrainer(str(shipped_policy_dir), str(teacher), cfg(), addition_rows(16))
    first.total_steps = 1
    first.train()
    DistillationTrainer(str(shipped_policy_dir), str(teacher), cfg(), addition_rows(16)).train(
        resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-1"))  # the same teacher resumes
    perturbed(teacher, 0.01).save_pretrained(teacher)  # replaced in place
    again = DistillationTrainer(str(shipped_policy_dir), str(teacher), cfg(), addition_rows(16))
    with pytest.raises(ConfigError, match=r"different config[\s\S]*_teacher:.*'weights'"):
        again.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-1"))


def test_a_teacher_padded_past_the_students_vocabulary_with_its_tokenizer_is_read_over_the_students_rows(
        tmp_path, shipped_policy_dir):
    """Qwen2.5-7B's embedding matrix has 152,064 rows for the 151,936 of 0.5B's, the same tokenizer: a teacher
    whose extra rows are padding no token reaches is taken, its distribution over the student's rows (TRL's GKD
    resizes it the same way); the step is the definition with the teacher cut to those rows. A larger teacher
    with another tokenizer stays refused (test_bad_teachers_and_configs_are_named), and seq_kd with it too."""
    import copy

    from transformers import AutoTokenizer

    student_vocab = AutoModelForCausalLM.from_pretrained(shipped_policy_dir).get_output_embeddings().weight.shape[0]
    teacher = perturbed(shipped_policy_dir, 0.05)
    teacher.resize_token_embeddings(student_vocab + 64)
    with torch.no_grad():  # padding rows that would matter if they were read
        teacher.get_output_embeddings().weight[student_vocab:] = 3.0
    folder = tmp_path / "padded"
    teacher.save_pretrained(folder)
    AutoTokenizer.from_pretrained(shipped_policy_dir).save_pretrained(folder)
    cut = copy.deepcopy(teacher)
    cut.resize_token_embeddings(student_vocab)
    cfg = config(tmp_path, optim="sgd", learning_rate=1.0, max_grad_norm=1e9, beta=0.5, logprob_chunk_size=5)
    trainer = DistillationTrainer(str(shipped_policy_dir), str(folder), cfg, addition_rows(16))
    trainer.generator = FixedGenerator(trainer.tokenizer)
    batch = trainer._make_rollout(0)
    student = trainer.model
    before = {n: p.detach().clone() for n, p in student.named_parameters()}
    want = reference_loss(student, cut.eval(), batch.rollout, 0.5, 1.0)
    grads = torch.autograd.grad(want, list(student.parameters()))
    metrics = trainer.updater.step(batch)
    assert metrics["loss"] == pytest.approx(want.item(), rel=1e-5, abs=1e-7)
    for (name, p), g in zip(student.named_parameters(), grads):
        assert torch.allclose(before[name] - p.detach(), g.float(), atol=2e-6, rtol=1e-4), name
    from rlft.experimental.gkd import GKDConfig, GKDTrainer

    with pytest.raises(ConfigError, match="seq_kd=True samples from the teacher, whose vocab_size is padded"):
        GKDTrainer(str(shipped_policy_dir), str(folder), GKDConfig(output_dir=str(tmp_path / "gkd"), seq_kd=True,
                                                                 report_to="none"),
                   train_dataset=[{"prompt": r["prompt"], "completion": [{"role": "assistant", "content": "4"}]}
                                  for r in addition_rows(8)])
