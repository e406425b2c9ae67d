"""AsyncGRPOTrainer: the k-step schedule, reproducibility, exact resume after kill -9, the loss on stale rollouts,
producer faults, no orphan process."""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from rlft import AsyncGRPOConfig, AsyncGRPOTrainer, GRPOConfig, GRPOTrainer
from rlft.errors import ConfigError
from rlft.rollout.producer import ProducerError
from rlft.telemetry.tracking import read_metrics
from rlft.train.sources.async_source import sampling_version
from tests.helpers import addition_rows, correct_answer, has_answer_tags

WALL_CLOCK = ("time/", "perf/", "rollout/", "step_time", "tokens_per_second", "sample/time_in_queue_s",
              "sample/rollout_queue_size")


def async_config(tmp_path, name="run", **overrides) -> AsyncGRPOConfig:
    values = dict(output_dir=str(tmp_path / name), learning_rate=1e-3, max_steps=4, num_generations=4,
                  per_device_train_batch_size=8, max_completion_length=8, save_steps=1000, report_to="none",
                  disable_tqdm=True, seed=0, gradient_checkpointing=False)
    values.update(overrides)
    return AsyncGRPOConfig(**values)


def trained(tmp_path, name="run", model=None, steps=None, resume=None, **overrides):
    from rlft.model.loading import shipped_policy_path

    trainer = AsyncGRPOTrainer(str(model or shipped_policy_path()), [correct_answer, has_answer_tags],
                               async_config(tmp_path, name, **overrides), addition_rows(32))
    if steps is not None:
        trainer.total_steps = steps
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def rows_of(folder):
    return [{k: v for k, v in r.items() if not k.startswith(WALL_CLOCK)} for r in read_metrics(folder)]


@pytest.mark.parametrize("lag, sync, per_rollout", [(0, 1, 1), (1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 2, 2)])
def test_the_schedule_samples_rollout_r_from_the_weights_lag_rollouts_back(lag, sync, per_rollout):
    for r in range(12):
        step = max(0, (r - lag) * per_rollout)
        version = sampling_version(r, lag, per_rollout, sync)
        assert version == step - step % sync
        assert r * per_rollout - version <= lag * per_rollout + sync - 1  # the staleness bound


def test_each_step_trains_on_rollouts_sampled_exactly_k_steps_earlier_and_two_runs_are_identical(tmp_path):
    a = trained(tmp_path, "a", rollout_lag=2, max_staleness=2)
    rows = read_metrics(tmp_path / "a")
    assert [r["sample/version"] for r in rows] == [0, 0, 0, 1]  # step t (0-based) from weights of t - 2
    assert [r["sample/staleness_max"] for r in rows] == [0, 1, 2, 2]
    assert all(r["sample/dropped_stale_total"] == 0 for r in rows)
    assert rows[-1]["sampling/sampling_logp_difference/mean"] > 0  # the policy moved since it sampled
    assert rows[-1]["sampling/kl_sampler_trainer/k3"] > 0 and abs(rows[0]["sampling/kl_sampler_trainer/k3"]) < 1e-6
    b = trained(tmp_path, "b", rollout_lag=2, max_staleness=2)
    assert rows_of(tmp_path / "a") == rows_of(tmp_path / "b")
    for (name, p), (_, q) in zip(a.model.named_parameters(), b.model.named_parameters()):
        assert torch.equal(p, q), name


@pytest.mark.parametrize("penalty", [1.0, 1.5])
def test_at_lag_0_the_sampler_is_the_trainer(tmp_path, penalty):
    """Log-probs recorded while sampling, or (a repetition penalty changes generate's logits) scored by the
    producer after sampling: either way the trainer's own at the same weights."""
    trained(tmp_path, rollout_lag=0, max_steps=2, repetition_penalty=penalty)
    for row in read_metrics(tmp_path / "run"):
        assert row["sample/staleness_max"] == 0
        assert row["sampling/sampling_logp_difference/max"] < 1e-5  # producer and trainer score alike


def test_the_loss_on_stale_rollouts_equals_the_synchronous_loss_on_the_same_rollouts(tmp_path):
    """The async step is GRPO's step on the producer's completions and log-probs: a synchronous GRPOTrainer
    with the same weights, given the same batch, computes the same loss and gradient norm."""
    from rlft.model.loading import shipped_policy_path

    seen = []
    trainer = AsyncGRPOTrainer(str(shipped_policy_path()), [correct_answer], async_config(tmp_path, max_steps=3),
                               addition_rows(32))
    step = trainer.updater.step

    def recording(batch):
        weights = {k: v.clone() for k, v in trainer.model.state_dict().items()}
        metrics = step(batch)
        seen.append((weights, batch, metrics))
        return metrics

    trainer.updater.step = recording
    trainer.train()
    weights, batch, metrics = seen[-1]  # sampled from the weights of step 1, trained at step 2
    assert batch.rollout.sampling_logps is not None
    same = dict(output_dir=str(tmp_path / "sync"), learning_rate=1e-3, max_steps=3, num_generations=4,
                per_device_train_batch_size=8, max_completion_length=8, report_to="none", seed=0,
                gradient_checkpointing=False, lr_scheduler_type="constant",
                vllm_importance_sampling_mode="token_truncate")
    sync = GRPOTrainer(str(shipped_policy_path()), [correct_answer], GRPOConfig(**same), addition_rows(32))
    sync.model.load_state_dict(weights)
    again = sync.updater.step(batch)
    assert again["loss"] == pytest.approx(metrics["loss"], abs=1e-6)
    assert again["grad_norm"] == pytest.approx(metrics["grad_norm"], rel=1e-6)


KILLED_AFTER_SAVE = """
import os, sys
sys.path.insert(0, {root!r})
from pathlib import Path
from transformers import TrainerCallback
from tests.test_async_grpo import trained

class Kill(TrainerCallback):
    def on_save(self, args, state, control, **kwargs):
        Path({pidfile!r}).write_text(str(TRAINER.generator.proc.pid))
        os.kill(os.getpid(), 9)

import rlft.train.async_grpo as m
original = m.AsyncGRPOTrainer.__init__
def init(self, *a, **k):
    global TRAINER
    original(self, *a, **k)
    TRAINER = self
    self.flow.handler.add_callback(Kill())
m.AsyncGRPOTrainer.__init__ = init
trained(Path({tmp!r}), "split", save_steps=2, **{extra!r})
"""


@pytest.mark.parametrize("extra", [pytest.param({}, id="plain"),
                                   # the producer mid-window, its pool of carried completions in the checkpoint
                                   pytest.param({"partial_rollouts": 2, "max_completion_length": 16}, id="partial")])
def test_kill_9_then_resume_equals_the_uninterrupted_run_and_leaves_no_producer(tmp_path, extra):
    straight = trained(tmp_path, "straight", save_steps=2, **extra)
    pidfile = tmp_path / "producer.pid"
    script = KILLED_AFTER_SAVE.format(root=str(Path(__file__).resolve().parents[1]), pidfile=str(pidfile),
                                      tmp=str(tmp_path), extra=extra)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == -9, result.stderr[-3000:]
    producer = int(pidfile.read_text())
    deadline = time.monotonic() + 10
    while _alive(producer) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _alive(producer), "the producer outlived the trainer that started it"
    resumed = trained(tmp_path, "split", save_steps=2, resume=True, **extra)
    assert rows_of(tmp_path / "straight") == rows_of(tmp_path / "split")
    for (name, p), (_, q) in zip(straight.model.named_parameters(), resumed.model.named_parameters()):
        assert torch.equal(p, q), name


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


class _Hurt:
    """A callback that harms the producer once, right after checkpoint-1 is complete (before it, the
    checkpoint could not be written: it holds rollouts only the producer has)."""

    def __init__(self, sig):
        self.sig, self.trainer = sig, None

    def __call__(self, *args, **kwargs):
        from transformers import TrainerCallback

        hurt = self

        class Callback(TrainerCallback):
            def on_save(self, args, state, control, **kwargs):
                if state.global_step == 1:
                    os.kill(hurt.trainer.generator.proc.pid, hurt.sig)
        return Callback()


@pytest.mark.parametrize("sig, message", [(signal.SIGKILL, "exited with code -9"),
                                          (signal.SIGSTOP, "has not signalled for")])
def test_a_dead_or_stopped_producer_stops_training_with_its_name_and_the_last_checkpoint(tmp_path, sig,
                                                                                          message):
    from rlft.model.loading import shipped_policy_path

    hurt = _Hurt(sig)
    trainer = AsyncGRPOTrainer(str(shipped_policy_path()), [correct_answer],
                               async_config(tmp_path, max_steps=6, save_steps=1, heartbeat_stale_after_s=3,
                                            rollout_lag=0, max_staleness=0),
                               addition_rows(32), callbacks=[hurt()])
    hurt.trainer = trainer
    started = time.monotonic()
    with pytest.raises(ProducerError) as caught:
        trainer.train()
    assert time.monotonic() - started < 60
    text = str(caught.value)
    assert message in text and "the rollout producer (process" in text
    assert "checkpoint-1" in text and "resume_from_checkpoint=True" in text
    assert trainer.generator.proc is None  # closed: nothing left running


def test_a_skipped_step_keeps_the_schedule(tmp_path):
    """Every completion masked (truncated at 1 token): each step is skipped, the weights never change, and the
    producer still tags each rollout with its scheduled version."""
    trained(tmp_path, max_steps=3, max_completion_length=1, mask_truncated_completions=True)
    rows = read_metrics(tmp_path / "run")
    assert [r["sample/version"] for r in rows] == [0, 0, 1] and rows[-1]["steps_skipped"] == 3


def test_a_mid_rollout_resume_equals_the_uninterrupted_run_and_the_staleness_bound_counts_its_steps(tmp_path):
    from tests.helpers import stop_after

    with pytest.raises(ConfigError, match="up to 3 steps old, above max_staleness=2"):
        trained(tmp_path, "refused", num_iterations=2, weight_sync_steps=2, max_staleness=2)
    settings = dict(max_steps=6, num_iterations=2, weight_sync_steps=2, max_staleness=3, save_steps=3)
    trained(tmp_path, "straight", **settings)
    from rlft.model.loading import shipped_policy_path

    AsyncGRPOTrainer(str(shipped_policy_path()), [correct_answer, has_answer_tags],
                     async_config(tmp_path, "split", **settings), addition_rows(32),
                     callbacks=[stop_after(3)]).train()
    trained(tmp_path, "split", resume=True, **settings)
    assert rows_of(tmp_path / "straight") == rows_of(tmp_path / "split")


def test_lora_pushes_only_the_adapters(tmp_path):
    from rlft.model.loading import shipped_policy_path
    from tests.test_grpo_trainer import lora

    trainer = AsyncGRPOTrainer(str(shipped_policy_path()), [correct_answer], async_config(tmp_path, max_steps=3),
                               addition_rows(32), peft_config=lora())
    trainer.train()
    adapters = sum(p.numel() * p.element_size() for p in trainer.model.parameters() if p.requires_grad)
    pushed = [r["perf/weight_sync_bytes"] for r in read_metrics(tmp_path / "run") if "perf/weight_sync_bytes" in r]
    assert pushed and all(b == adapters for b in pushed)
    first = read_metrics(tmp_path / "run")[0]
    assert first["sampling/sampling_logp_difference/max"] < 1e-5  # the producer's LoRA model is the trainer's


def test_evaluation_runs_on_the_producer_with_the_current_weights(tmp_path):
    from rlft.model.loading import shipped_policy_path

    trainer = AsyncGRPOTrainer(str(shipped_policy_path()), [correct_answer],
                               async_config(tmp_path, max_steps=2, eval_strategy="steps", eval_steps=1),
                               addition_rows(32), eval_dataset=addition_rows(8, heldout=True))
    trainer.train()
    evals = [r for r in trainer.state.log_history if "eval_reward" in r]
    assert len(evals) == 2
    again = trainer.evaluate()  # after train: a producer starts for it, and stops after
    assert again["eval_reward"] == pytest.approx(evals[-1]["eval_reward"])
    assert trainer.generator.proc is None


def even_answers_only(completions, answer, **kwargs):
    """A reward spread only for prompts with an even answer: other groups need replacing."""
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [float(len(t)) if int(a) % 2 == 0 else 0.0 for t, a in zip(texts, answer)]


def dynamic(tmp_path, name, resume=None):
    from rlft.model.loading import shipped_policy_path

    trainer = AsyncGRPOTrainer(str(shipped_policy_path()), [even_answers_only],
                               async_config(tmp_path, name, dynamic_sampling=True, save_steps=2,
                                            max_completion_length=16), addition_rows(64))
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def test_dynamic_sampling_requests_later_rounds_from_the_producer_and_repeats_and_resumes_exactly(tmp_path):
    straight = dynamic(tmp_path, "a")
    rows = rows_of(tmp_path / "a")
    assert all(r["frac_reward_zero_std"] == 0.0 for r in rows)  # every group trained on has a spread
    assert any(r["dynamic_sampling/generation_rounds"] >= 2 for r in rows)  # rounds were requested
    assert [r["sample/version"] for r in rows] == [0.0, 0.0, 1.0, 2.0]  # the schedule kept
    dynamic(tmp_path, "b")
    assert rows_of(tmp_path / "b") == rows
    resumed = dynamic(tmp_path, "a", resume=str(tmp_path / "a" / "checkpoint-2"))
    assert rows_of(tmp_path / "a") == rows
    for p, q in zip(straight.model.parameters(), resumed.model.parameters()):
        assert torch.equal(p, q)


def test_bad_async_settings_are_refused_with_the_fix(tmp_path):
    with pytest.raises(ConfigError, match="above max_staleness=1"):
        async_config(tmp_path, rollout_lag=1, weight_sync_steps=2, max_staleness=1)
    with pytest.raises(ConfigError, match="producer_cpus"):
        async_config(tmp_path, producer_cpus=[])
    from rlft.model.loading import shipped_policy_path

    with pytest.raises(ConfigError, match="takes an AsyncGRPOConfig"):
        AsyncGRPOTrainer(str(shipped_policy_path()), [correct_answer], GRPOConfig(output_dir=str(tmp_path / "g")),
                         addition_rows(32))
    with pytest.raises(ConfigError, match="rollout_func with AsyncGRPOTrainer: it generates by itself"):
        AsyncGRPOTrainer(str(shipped_policy_path()), [correct_answer], async_config(tmp_path),
                         addition_rows(32), rollout_func=lambda prompts, trainer: {})


def test_trl_module_path():
    from rlft.experimental.async_grpo import AsyncGRPOConfig as Config
    from rlft.experimental.async_grpo import AsyncGRPOTrainer as Trainer

    assert Config is AsyncGRPOConfig and Trainer is AsyncGRPOTrainer
    assert textwrap.dedent(Config.__doc__ or "")
    defaults = Config(output_dir="/tmp/unused")
    assert (defaults.max_staleness, defaults.weight_sync_steps, defaults.heartbeat_stale_after_s,
            defaults.logging_steps, defaults.lr_scheduler_type) == (4, 1, 300.0, 1, "constant")


@pytest.mark.vllm
@pytest.mark.parametrize("use_peft", [pytest.param(True, id="lora"),  # (CI time: full weights under -m slow)
                                      pytest.param(False, id="full", marks=pytest.mark.slow)])
def test_vllm_in_the_producer_process_samples_on_schedule_and_matches_the_trainer(tmp_path, use_peft):
    """vLLM in the producer's own process: at rollout_lag 0 its float32 log-probs equal the trainer's after every
    push (LoRA merged into the producer's copy, full weights pushed); at lag 1 the schedule holds."""
    pytest.importorskip("vllm")
    from rlft.model.loading import shipped_policy_path
    from tests.test_grpo_trainer import lora

    for lag in (0, 1):
        name = f"lag{lag}"
        AsyncGRPOTrainer(str(shipped_policy_path()), [correct_answer],
                         async_config(tmp_path, name, max_steps=3, use_vllm=True, rollout_lag=lag,
                                      vllm_dtype="float32", learning_rate=1e-2 if use_peft else 1e-3),
                         addition_rows(32), peft_config=lora() if use_peft else None).train()
        rows = read_metrics(tmp_path / name)
        assert [r["sample/version"] for r in rows] == ([0, 1, 2] if lag == 0 else [0, 0, 1])
        if lag == 0:
            assert all(r["sampling/sampling_logp_difference/max"] < 1e-4 for r in rows), rows


@pytest.mark.vllm
def test_a_vllm_server_as_the_producers_engine_trains_on_schedule(tmp_path):
    """`rlft vllm-serve` on loopback; the producer process talks to it (weights pushed by the producer)."""
    pytest.importorskip("vllm")
    from rlft.model.loading import shipped_policy_path
    from tests.test_grpo_trainer import lora
    from tests.test_vllm import free_port, serving

    port = free_port()
    with serving(tmp_path, shipped_policy_path(), port):
        AsyncGRPOTrainer(str(shipped_policy_path()), [correct_answer],
                         async_config(tmp_path, max_steps=3, use_vllm=True, vllm_mode="server", vllm_server_port=port,
                                      rollout_lag=0, learning_rate=1e-2), addition_rows(32), peft_config=lora()).train()
    rows = read_metrics(tmp_path / "run")
    assert [r["sample/version"] for r in rows] == [0, 1, 2]
    assert all(r["sampling/sampling_logp_difference/max"] < 1e-4 for r in rows), rows


def test_a_failed_producer_is_restarted_from_the_current_weights_when_asked(tmp_path, caplog):
    """producer_restarts: the run goes on; the rollouts the dead producer owed are sampled again from the weights
    of the step the restart came at (their version and staleness say so), and a resume after it is exact."""
    from rlft.model.loading import shipped_policy_path

    hurt = _Hurt(signal.SIGKILL)
    config = async_config(tmp_path, max_steps=5, save_steps=1, producer_restarts=1)
    trainer = AsyncGRPOTrainer(str(shipped_policy_path()), [correct_answer], config, addition_rows(32),
                               callbacks=[hurt()])
    hurt.trainer = trainer
    with caplog.at_level(logging.WARNING, logger="rlft"):
        trainer.train()
    assert "exited with code -9" in caplog.text
    # the death shows at the next push (step 1) or, when that write still reached the pipe, the next take (step 2)
    restarted_at = int(re.search(r"Restarted the producer from the weights of step (\d+)", caplog.text).group(1))
    assert trainer.generator.proc is None  # the new producer was stopped at the end too
    rows = rows_of(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    restarts = [r["rollout/producer_restarts"] for r in read_metrics(tmp_path / "run")]
    assert restarts == [0.0] * restarted_at + [1.0] * (5 - restarted_at)
    # rollout 2 (step 3's) was owed from the weights of step 1: sampled again from those of the restart
    assert [r["sample/version"] for r in rows] == [0.0, 0.0, float(restarted_at), 2.0, 3.0]
    assert all(r["sample/staleness_max"] <= 1.0 for r in rows)
    resumed = AsyncGRPOTrainer(str(shipped_policy_path()), [correct_answer],
                               async_config(tmp_path, "resumed", max_steps=5, save_steps=1, producer_restarts=1),
                               addition_rows(32))
    resumed.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-3"))
    assert rows_of(tmp_path / "resumed") == rows[3:]
    for p, q in zip(trainer.model.parameters(), resumed.model.parameters()):
        assert torch.equal(p, q)


def test_a_producer_timeout_on_several_processes_is_not_taken_for_a_collective_timeout():
    """named_timeouts turns timeouts into 'another process did not answer a collective'; a producer's own
    request_timeout error keeps its words (and the trainer's last-checkpoint advice)."""
    from types import SimpleNamespace

    from rlft.train.state import named_timeouts

    accelerator = SimpleNamespace(num_processes=2, process_index=0)
    with pytest.raises(ProducerError, match="spent over request_timeout=600 s"):
        with named_timeouts(accelerator, None):
            raise ProducerError("the rollout producer (process 1) spent over request_timeout=600 s on one request")
