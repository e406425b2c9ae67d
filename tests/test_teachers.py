"""Several teachers (rlft/train/update/teachers.py): each row is distilled from the teacher its `teacher_id` names,
local or served; the step is the definition summed over the teachers' rows; per-teacher metrics; bad ids
named; resume exact (a checkpoint inside a rollout keeps each row's teacher)."""

from __future__ import annotations

import pytest
import torch

from rlft import DistillationConfig, DistillationTrainer
from rlft.errors import ConfigError
from rlft.telemetry.tracking import read_metrics
from tests.dist.grpo_step import FixedGenerator
from tests.helpers import addition_rows
from tests.teacher_stub import serve_teacher
from tests.test_distillation import perturbed, reference_loss
from tests.test_grpo_resume import assert_same_rows


def routed_rows(count: int, ids=("math", "code")) -> list[dict]:
    return [{**row, "teacher_id": ids[i % len(ids)]} for i, row in enumerate(addition_rows(count))]


def config(tmp_path, name="run", **overrides) -> DistillationConfig:
    values = dict(output_dir=str(tmp_path / name), optim="sgd", learning_rate=1.0, max_grad_norm=1e9, max_steps=1,
                  per_device_train_batch_size=8, max_completion_length=8, logging_steps=1, save_steps=1000,
                  report_to="none", disable_tqdm=True, seed=0, gradient_checkpointing=False, temperature=0.8)
    values.update(overrides)
    return DistillationConfig(**values)


@pytest.fixture(scope="module")
def teachers(shipped_policy_dir):
    return {"math": perturbed(shipped_policy_dir, 0.05).eval(), "code": perturbed(shipped_policy_dir, 0.2).eval()}


def test_each_row_takes_its_teachers_divergence_in_the_one_step_definition(tmp_path, shipped_policy_dir, teachers):
    """Loss and SGD change (lr 1: the gradient) are sum over rows of D(student, that row's teacher) / all trained
    tokens, from full logits in float64; the per-teacher metrics are each teacher's token mean and share."""
    trainer = DistillationTrainer(str(shipped_policy_dir), teachers, config(tmp_path, beta=0.5), routed_rows(16))
    trainer.generator = FixedGenerator(trainer.tokenizer)
    batch = trainer._make_rollout(0)
    rollout, student = batch.rollout, trainer.model
    named = rollout.extra["teacher_id"]  # each row's, from its dataset row (the prompts come shuffled)
    assert [["math", "code"][k] for k in rollout.teacher_index.tolist()] == named and len(set(named)) == 2
    total = rollout.loss_mask.sum()
    parts = {}
    for k, (name, teacher) in enumerate(teachers.items()):
        trained = rollout.loss_mask * (rollout.teacher_index == k)[:, None]
        parts[name] = (reference_loss(student, teacher, rollout, 0.5, 0.8, trained), trained.sum())
    want = sum(mean * tokens for mean, tokens in parts.values()) / total
    before = {n: p.detach().clone() for n, p in student.named_parameters()}
    grads = torch.autograd.grad(want, list(student.parameters()))
    metrics = trainer.updater.step(batch)
    assert metrics["loss"] == pytest.approx(want.item(), rel=1e-5, abs=1e-7)
    for (name, p), g in zip(student.named_parameters(), grads):
        assert torch.allclose(before[name] - p.detach(), g.float(), atol=2e-6, rtol=1e-4), name
    for name, (mean, tokens) in parts.items():
        assert metrics[f"teacher_jsd/{name}"] == pytest.approx(mean.item(), rel=1e-5)
        assert metrics[f"teacher_token_frac/{name}"] == pytest.approx((tokens / total).item())
        assert metrics[f"teacher_entropy/{name}"] > 0
    assert parts["code"][0] > parts["math"][0]  # the farther teacher, the larger divergence


def test_a_served_and_a_local_teacher_together_and_the_errors(tmp_path, shipped_policy_dir, teachers):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(shipped_policy_dir)
    with serve_teacher(teachers["code"], tok) as (url, requests):
        cfg = config(tmp_path, teacher_server_urls={"code": url}, teacher_models={"math": str(shipped_policy_dir)},
                     temperature=1.0, loss_top_k=tok.vocab_size if hasattr(tok, "vocab_size") else 400)
        trainer = DistillationTrainer(str(shipped_policy_dir), None, cfg, routed_rows(16))
        trainer.generator = FixedGenerator(trainer.tokenizer)
        metrics = trainer.updater.step(trainer._make_rollout(0))
        assert len(requests) == 4  # only the code rows went to the server
        assert metrics["teacher_jsd/math"] == 0.0 and metrics["teacher_jsd/code"] > 0  # math: the student itself
    with pytest.raises(ConfigError, match=r"Example has `teacher_id='physics'`.*Expected one of: \['math', 'code'\]"):
        trainer = DistillationTrainer(str(shipped_policy_dir), teachers, config(tmp_path, "bad"),
                                      routed_rows(16, ("math", "physics")))
        trainer._make_rollout(0)
    with pytest.raises(ConfigError, match="no 'teacher_id' column"):
        DistillationTrainer(str(shipped_policy_dir), teachers, config(tmp_path, "none"), addition_rows(16)).train()
    one = DistillationTrainer(str(shipped_policy_dir), {"only": teachers["math"]}, config(tmp_path, "one"),
                              addition_rows(16))  # one teacher: no column needed
    one.train()
    with pytest.raises(ConfigError, match="keep one form"):
        DistillationTrainer(str(shipped_policy_dir), None, config(tmp_path, "two", teacher_model_name_or_path="x",
                                                                  teacher_models={"a": "y"}), addition_rows(8))


def test_two_plus_two_steps_equal_four_with_a_checkpoint_inside_a_rollout(tmp_path, shipped_policy_dir, teachers):
    """Two optimiser steps per rollout, a checkpoint after the first: the rest of the rollout, each row's
    teacher with it, comes back from the checkpoint."""
    def trainer(name):
        cfg = config(tmp_path, name, max_steps=4, save_steps=1, optim="adamw_torch", learning_rate=1e-3,
                     steps_per_generation=2, per_device_train_batch_size=4, logging_steps=1)
        return DistillationTrainer(str(shipped_policy_dir), teachers, cfg, routed_rows(32))

    straight = trainer("straight")
    straight.train()
    split = trainer("split")
    split.total_steps = 3
    split.train()
    resumed = trainer("split")
    resumed.train(resume_from_checkpoint=str(tmp_path / "split" / "checkpoint-3"))
    assert_same_rows(tmp_path / "straight", tmp_path / "split", 4)
    for (name, p), (_, q) in zip(straight.model.named_parameters(), resumed.model.named_parameters()):
        assert torch.equal(p, q), name
    rows = [r for r in read_metrics(tmp_path / "straight") if "loss" in r and "step_time" in r]
    assert all("teacher_jsd/math" in r and "teacher_token_frac/code" in r for r in rows)
