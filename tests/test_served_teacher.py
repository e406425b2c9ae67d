"""Distillation from a served teacher (`teacher_model_server_url`): the step's loss and gradient are the
definition on the teacher's top-k support plus a tail bucket, computed from full logits; with the whole
vocabulary served it is the local teacher's exact step; bad servers and settings are named. The server is
tests/teacher_stub.py (vLLM's answers from a local model); tests/test_vllm.py runs a real one."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from rlft import DistillationConfig, DistillationTrainer, GRPOConfig, GRPOTrainer
from rlft.errors import ConfigError
from rlft.rollout.vllm_server import VLLMServerError
from rlft.telemetry.tracking import read_metrics
from tests.dist.grpo_step import FixedGenerator
from tests.helpers import addition_rows
from tests.teacher_stub import serve_teacher
from tests.test_distillation import perturbed, reference_loss


@pytest.fixture(scope="module")
def teacher(shipped_policy_dir):
    return perturbed(shipped_policy_dir, 0.2).eval()


@pytest.fixture(scope="module")
def tok(shipped_policy_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(shipped_policy_dir)


def config(tmp_path, url, name="run", **overrides) -> DistillationConfig:
    values = dict(output_dir=str(tmp_path / name), optim="sgd", learning_rate=1.0, max_grad_norm=1e9,
                  max_steps=1, per_device_train_batch_size=8, max_completion_length=8, logging_steps=1,
                  save_steps=1000, report_to="none", disable_tqdm=True, seed=0, gradient_checkpointing=False,
                  teacher_model_server_url=url, logprob_chunk_size=5)
    values.update(overrides)
    return DistillationConfig(**values)


def bucketed_reference(student, teacher, rollout, beta: float, k: int) -> torch.Tensor:
    """The definition from both models' [B, T, V] logits (float64): at each trained position, the teacher's
    top k tokens and the token there, each its own bucket, the rest of the vocabulary one more; D between the
    two bucketed distributions; the mean over trained tokens."""
    ids = torch.cat([rollout.prompt_ids, rollout.completion_ids], dim=1)
    mask = torch.cat([rollout.prompt_mask, rollout.completion_mask], dim=1)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    width = rollout.completion_ids.shape[1]
    p_s = torch.softmax(student(input_ids=ids, attention_mask=mask, position_ids=positions)
                        .logits[:, -(width + 1):-1].double(), dim=-1)
    with torch.no_grad():
        p_t = torch.softmax(teacher(input_ids=ids, attention_mask=mask, position_ids=positions)
                            .logits[:, -(width + 1):-1].double(), dim=-1)
    chosen = torch.zeros_like(p_t, dtype=torch.bool)
    chosen.scatter_(-1, p_t.topk(k, dim=-1).indices, True)
    chosen.scatter_(-1, rollout.completion_ids[..., None], True)
    def buckets(p):  # [B, C, V + 1]: the chosen tokens' masses (0 elsewhere) and the tail
        inside = torch.where(chosen, p, torch.zeros_like(p))
        return torch.cat([inside, (p * ~chosen).sum(-1, keepdim=True)], dim=-1)
    s, t = buckets(p_s), buckets(p_t)
    def kl(a, b):
        return torch.where(a > 0, a * (a.clamp(min=1e-300).log() - b.clamp(min=1e-300).log()), 0).sum(-1)
    if beta == 0.0:
        d = kl(t, s)
    elif beta == 1.0:
        d = kl(s, t)
    else:
        m = (1 - beta) * s + beta * t
        d = beta * kl(t, m) + (1 - beta) * kl(s, m)
    trained = rollout.loss_mask.double()
    return (d * trained).sum() / trained.sum()


@pytest.mark.parametrize("beta,k", [(0.0, 3), (0.5, 1), (1.0, 5)])
def test_one_step_is_the_bucketed_definition(tmp_path, shipped_policy_dir, teacher, tok, beta, k):
    """SGD with lr 1: the parameter change is the gradient of the definition; one request per completion,
    k log-probs asked for."""
    with serve_teacher(teacher, tok) as (url, requests):
        trainer = DistillationTrainer(str(shipped_policy_dir), None, config(tmp_path, url, beta=beta,
                                                                           loss_top_k=k), addition_rows(16))
        trainer.generator = FixedGenerator(trainer.tokenizer)
        batch = trainer._make_rollout(0)
        student = trainer.model
        before = {n: p.detach().clone() for n, p in student.named_parameters()}
        want = bucketed_reference(student, teacher, batch.rollout, beta, k)
        grads = torch.autograd.grad(want, list(student.parameters()))
        metrics = trainer.updater.step(batch)
    assert len(requests) == 8 and {r["prompt_logprobs"] for r in requests} == {k}
    assert metrics["loss"] == pytest.approx(want.item(), rel=1e-5, abs=1e-7)
    for (name, p), g in zip(student.named_parameters(), grads):
        assert torch.allclose(before[name] - p.detach(), g.float(), atol=2e-6, rtol=1e-4), name


def test_the_whole_vocabulary_served_is_the_local_teachers_exact_step(tmp_path, shipped_policy_dir, teacher, tok):
    vocab = teacher.config.vocab_size
    with serve_teacher(teacher, tok) as (url, _):
        trainer = DistillationTrainer(str(shipped_policy_dir), None, config(tmp_path, url, beta=0.5,
                                                                           loss_top_k=vocab), addition_rows(16))
        trainer.generator = FixedGenerator(trainer.tokenizer)
        batch = trainer._make_rollout(0)
        exact = reference_loss(trainer.model, teacher, batch.rollout, 0.5, 1.0)
        assert trainer.updater.step(batch)["loss"] == pytest.approx(exact.item(), rel=1e-5)


def test_trains_logs_and_a_grpo_teacher_term(tmp_path, shipped_policy_dir, teacher, tok):
    with serve_teacher(teacher, tok) as (url, requests):
        cfg = config(tmp_path, url, optim="adamw_torch", learning_rate=1e-3, max_steps=4, num_iterations=2,
                     gradient_accumulation_steps=2, per_device_train_batch_size=4)
        trainer = DistillationTrainer(str(shipped_policy_dir), None, cfg, addition_rows(24))
        trainer.train()
        # 2 rollouts of 8 rows, each used by 2 optimiser steps of 2 micro-batches: every row asked once
        assert len(requests) <= 16 and len({tuple(r["prompt"]) for r in requests}) == len(requests)
        grpo = GRPOTrainer(str(shipped_policy_dir), lambda completions, **_: [1.0] * len(completions),
                           GRPOConfig(output_dir=str(tmp_path / "grpo"), max_steps=1, num_generations=4,
                                      per_device_train_batch_size=8, max_completion_length=8,
                                      report_to="none", teacher_model_server_url=url, teacher_coef=0.5),
                           train_dataset=addition_rows(8))
        grpo.train()
    steps = [r for r in read_metrics(tmp_path / "run") if "loss" in r and "step_time" in r]
    assert len(steps) == 4 and steps[-1]["loss"] < steps[0]["loss"]
    assert 0 < steps[-1]["distill/teacher_entropy"] and 0 < steps[-1]["entropy"]
    assert "teacher_loss" in [r for r in read_metrics(tmp_path / "grpo") if "step_time" in r][-1]


def test_bad_servers_and_settings_are_named(tmp_path, shipped_policy_dir, teacher, tok):
    data = addition_rows(8)
    with serve_teacher(teacher, tok) as (url, _):
        with pytest.raises(ConfigError, match="temperature 1"):
            DistillationTrainer(str(shipped_policy_dir), None, config(tmp_path, url, temperature=0.7), data)
        with pytest.raises(ConfigError, match="keep one"):
            DistillationTrainer(str(shipped_policy_dir), str(shipped_policy_dir), config(tmp_path, url), data)
        with pytest.raises(ConfigError, match="teacher_model_init_kwargs"):
            DistillationTrainer(str(shipped_policy_dir), None,
                                config(tmp_path, url, teacher_model_init_kwargs={"dtype": "float32"}), data)
    with serve_teacher(teacher, tok, max_logprobs=4) as (url, _):
        with pytest.raises(ConfigError, match="at most 4 log-probs"):
            DistillationTrainer(str(shipped_policy_dir), None, config(tmp_path, url, loss_top_k=20), data)
    with serve_teacher(teacher, tok, shift_tokens=1) as (url, _):
        with pytest.raises(ConfigError, match="tokenizes text differently"):
            DistillationTrainer(str(shipped_policy_dir), None, config(tmp_path, url), data)
    with pytest.raises(ConfigError, match="loss_top_k=0"):
        config(tmp_path, "http://127.0.0.1:9", loss_top_k=0)
    with pytest.raises(VLLMServerError, match="127.0.0.1:9"):
        DistillationTrainer(str(shipped_policy_dir), None,
                            config(tmp_path, "http://127.0.0.1:9", vllm_server_timeout=1), data)


def test_the_stub_answers_as_a_model_would(shipped_policy_dir):
    """(The stand-in's own check: its top-1 is the model's argmax and log-probs normalise.)"""
    from tests.teacher_stub import prompt_logprobs

    model = AutoModelForCausalLM.from_pretrained(shipped_policy_dir).eval()
    answer = prompt_logprobs(model, [5, 9, 11, 13], 3)
    assert answer[0] is None and len(answer) == 4
    assert all(3 <= len(a) <= 4 and min(e["rank"] for e in a.values()) == 1 for a in answer[1:])


def test_trls_server_distillation_names_take_the_served_step_with_trls_defaults(tmp_path, shipped_policy_dir,
                                                                               teacher, tok):
    """TRL's experimental ServerDistillationConfig / ServerDistillationTrainer (no teacher_model; loss_top_k 1,
    loss_add_tail, reverse_kl_top_1_mode 'sampled', vllm_server_port 8001): the same step as DistillationTrainer
    with the same served settings; 'argmax' and a missing server are refused with TRL's reasons."""
    from rlft.experimental.server_distillation import ServerDistillationConfig, ServerDistillationTrainer

    with pytest.raises(ConfigError, match="teacher_model_server_url must be set"):
        ServerDistillationConfig(output_dir=str(tmp_path / "x"))
    with serve_teacher(teacher, tok) as (url, _):
        values = config(tmp_path, url, beta=0.5, loss_top_k=1).to_dict()
        with pytest.raises(ConfigError, match="argmax.*cannot provide teacher log-probs"):
            ServerDistillationConfig(**{**values, "reverse_kl_top_1_mode": "argmax"})
        trl_defaults = ServerDistillationConfig(output_dir=str(tmp_path / "d"), teacher_model_server_url=url)
        assert (trl_defaults.loss_top_k, trl_defaults.loss_add_tail, trl_defaults.reverse_kl_top_1_mode,
                trl_defaults.vllm_server_port) == (1, True, "sampled", 8001)
        steps = []
        for trainer_class, args in ((DistillationTrainer, DistillationConfig(**values)),
                                    (ServerDistillationTrainer, ServerDistillationConfig(**values))):
            extra = (None,) if trainer_class is DistillationTrainer else ()
            trainer = trainer_class(str(shipped_policy_dir), *extra, args, addition_rows(16))
            trainer.generator = FixedGenerator(trainer.tokenizer)
            steps.append(trainer.updater.step(trainer._make_rollout(0)))
        assert steps[1]["loss"] == steps[0]["loss"] > 0
