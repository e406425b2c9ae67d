"""Async distillation (AsyncDistillationTrainer, TRL's experimental names): TRL's defaults mapped onto rlft's
served-teacher fields; the producer samples while two served teachers score each row by its teacher_id (MOPD);
a run resumed from its checkpoint equals the straight one; what is not taken is named."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from rlft.errors import ConfigError
from rlft.experimental.async_distillation import AsyncDistillationConfig, AsyncDistillationTrainer
from rlft.telemetry.tracking import read_metrics
from tests.helpers import addition_rows
from tests.teacher_stub import serve_teacher
from tests.test_distillation import perturbed
from tests.test_grpo_resume import resumed_run_equals_straight


def config(tmp_path, name="run", **overrides) -> AsyncDistillationConfig:
    values = dict(output_dir=str(tmp_path / name), max_steps=3, per_device_train_batch_size=8,
                  max_completion_length=8, report_to="none", disable_tqdm=True, gradient_checkpointing=False,
                  save_steps=1000, producer_threads=1, seed=0, learning_rate=1e-3)
    values.update(overrides)
    return AsyncDistillationConfig(**values)


def test_trls_defaults_on_rlfts_fields(tmp_path, shipped_policy_dir):
    cfg = AsyncDistillationConfig(output_dir=str(tmp_path))
    assert (cfg.beta, cfg.teacher_top_k, cfg.loss_top_k, cfg.add_tail_bucket, cfg.loss_add_tail,
            cfg.max_completion_length, cfg.logging_steps, cfg.rollout_lag, cfg.num_generations) == \
        (0.0, 8, 8, True, True, 2048, 1, 1, 1)
    assert cfg.model_init_kwargs == {"dtype": "float32"}  # TRL's `dtype`, unless model_init_kwargs names one
    assert AsyncDistillationConfig(output_dir=str(tmp_path), model_init_kwargs={"dtype": "bfloat16"},
                                   teacher_top_k=3).model_init_kwargs == {"dtype": "bfloat16"}
    with pytest.raises(ConfigError, match="a served teacher answers its log-probs at temperature 1"):
        AsyncDistillationTrainer(str(shipped_policy_dir), config(tmp_path, teacher_temperature=0.5,
                                                               teacher_server_urls={"a": "http://127.0.0.1:9"}),
                                 train_dataset=addition_rows(8))
    with pytest.raises(ConfigError, match="rollout_worker= / weight_transfer= are not taken"):
        AsyncDistillationTrainer(str(shipped_policy_dir), config(tmp_path), train_dataset=addition_rows(8),
                                 rollout_worker=object())


def test_two_served_teachers_score_the_producers_rollouts_and_a_resumed_run_equals_the_straight_one(
        tmp_path, shipped_policy_dir):
    tok = AutoTokenizer.from_pretrained(shipped_policy_dir)
    near, far = perturbed(shipped_policy_dir, 0.05).eval(), perturbed(shipped_policy_dir, 0.2).eval()
    rows = [dict(r, teacher_id=("near", "far")[i % 2]) for i, r in enumerate(addition_rows(32))]
    with serve_teacher(near, tok) as (near_url, near_asked), serve_teacher(far, tok) as (far_url, far_asked):
        def trainer(name):
            cfg = config(tmp_path, name, save_steps=2, logging_steps=1,
                         teacher_server_urls={"near": near_url, "far": far_url})
            return AsyncDistillationTrainer(str(shipped_policy_dir), cfg, train_dataset=rows)

        # (rows compared below, the producer's wall-clock ones aside)
        straight, _ = resumed_run_equals_straight(trainer, 3, 2, rows=False)
    logged = [r for r in straight.state.log_history if "distill/loss" in r]
    assert len(logged) == 3 and all(r["teacher_jsd/far"] > r["teacher_jsd/near"] > 0 for r in logged)
    assert len(near_asked) > 0 and len(far_asked) > 0
    # the logged numbers the run computes (the producer's wall-clock ones aside)
    a, b = ([{k: v for k, v in r.items() if k.startswith(("loss", "distill/", "teacher_", "grad_norm"))}
             for r in read_metrics(tmp_path / name)] for name in ("straight", "split"))
    assert [r["step"] for r in read_metrics(tmp_path / "split")] == [1, 2, 3] and a == b
