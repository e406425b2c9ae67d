"""Each GRPO algorithm option in a real short run: it trains, logs its metric, resumes exactly, and the
combinations TRL refuses are refused with the reason."""

from __future__ import annotations

import math

import pytest
import torch

from rlft import GRPOConfig, GRPOTrainer
from rlft.config import ConfigError
from rlft.telemetry.tracking import read_metrics
from tests.helpers import addition_rows, correct_answer, has_answer_tags, tiny_grpo_config
from tests.test_grpo_resume import straight_and_resumed
from tests.test_grpo_trainer import lora

OPTIONS = {  # fields -> the metrics that show the option at work
    "luspo": (dict(loss_type="luspo", importance_sampling_level="sequence"), ["clip_ratio/region_mean"]),
    "vespo": (dict(loss_type="vespo", num_iterations=2), ["vespo/phi_seq_mean"]),
    "delta": (dict(delta=1.5, num_iterations=2), ["clip_ratio/delta_mean"]),
    "top_entropy_quantile": (dict(top_entropy_quantile=0.2), ["entropy_mask/threshold", "entropy_mask/kept_fraction"]),
    "entropy_coef": (dict(entropy_coef=0.01), ["entropy_coef", "entropy_loss"]),
    "adaptive_entropy": (dict(use_adaptive_entropy=True, entropy_coef=0.01, entropy_target=10.0), ["entropy_coef"]),
    "off_policy_mask": (dict(off_policy_mask_threshold=0.0, num_iterations=2), ["off_policy/masked_fraction"]),
    "sync_ref_model": (dict(beta=0.04, sync_ref_model=True, ref_model_sync_steps=1), ["ref_model/syncs", "kl"]),
}


@pytest.mark.parametrize("name", list(OPTIONS))
def test_each_option_trains_and_logs_its_metric(tmp_path, shipped_policy_dir, name):
    fields, keys = OPTIONS[name]
    peft = None if fields.get("sync_ref_model") else lora()
    trainer = GRPOTrainer(str(shipped_policy_dir), [correct_answer, has_answer_tags],
                          tiny_grpo_config(tmp_path, max_steps=4, **fields), addition_rows(32), peft_config=peft)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    trainer.train()
    rows = [r for r in read_metrics(tmp_path / "run") if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for key in keys:
        assert all(key in r and math.isfinite(r[key]) for r in rows), key
    moved = [n for n, p in trainer.model.named_parameters() if p.requires_grad and not torch.equal(p, before[n])]
    assert moved, "no trainable parameter changed"
    if name == "adaptive_entropy":  # entropy (< 10 nats) stays under the target: +0.005 per step
        assert [round(r["entropy_coef"], 6) for r in rows] == [0.015, 0.02, 0.025, 0.03]
    if name == "top_entropy_quantile":
        assert all(0.1 < r["entropy_mask/kept_fraction"] < 0.4 for r in rows)
    if name == "sync_ref_model":
        assert [r["ref_model/syncs"] for r in rows] == [1, 2, 3, 4]
        policy = dict(trainer.model.named_parameters())
        ref = dict(trainer.ref_model.named_parameters())
        assert any(not torch.equal(ref[n], policy[n]) for n in ref)  # mixed, not copied


def test_the_entropy_bonus_raises_entropy(tmp_path, shipped_policy_dir):
    """Same run with and without a large bonus: the bonus run ends with higher entropy."""
    entropies = {}
    for coef in (0.0, 0.5):
        out = tmp_path / f"c{coef}"
        GRPOTrainer(str(shipped_policy_dir), [correct_answer],
                    tiny_grpo_config(tmp_path, output_dir=str(out), max_steps=6, entropy_coef=coef,
                                     learning_rate=3e-3), addition_rows(32), peft_config=lora()).train()
        entropies[coef] = [r["entropy"] for r in read_metrics(out) if "entropy" in r][-1]
    assert entropies[0.5] > entropies[0.0] + 0.1, entropies


def test_resume_restores_the_moved_reference_and_the_adaptive_coefficient(tmp_path, shipped_policy_dir):
    options = dict(full=True, beta=0.04, sync_ref_model=True, ref_model_sync_steps=2, use_adaptive_entropy=True,
                   entropy_coef=0.01, entropy_target=10.0, delta=1.5, top_entropy_quantile=0.5, num_iterations=2,
                   off_policy_mask_threshold=0.01)
    straight, resumed = straight_and_resumed(tmp_path, shipped_policy_dir, **options)
    assert resumed.entropy_coef == straight.entropy_coef == pytest.approx(0.04)
    assert resumed.ref_syncs == straight.ref_syncs == 3
    for (name, p), (_, q) in zip(straight.ref_model.named_parameters(), resumed.ref_model.named_parameters()):
        assert torch.equal(p, q), name


def test_refused_combinations_name_the_reason(tmp_path, shipped_policy_dir):
    with pytest.raises(ConfigError, match="sync_ref_model=True with beta=0"):
        GRPOConfig(sync_ref_model=True)
    with pytest.raises(ConfigError, match="sync_ref_model=True with a LoRA model"):
        GRPOTrainer(str(shipped_policy_dir), [correct_answer],
                    tiny_grpo_config(tmp_path, sync_ref_model=True, beta=0.1), addition_rows(16), peft_config=lora())
    with pytest.raises(ConfigError, match=r"delta=0.9 must be > 1"):
        GRPOConfig(delta=0.9)
    with pytest.raises(ConfigError, match=r"top_entropy_quantile=1.2 must be in \[0, 1\]"):
        GRPOConfig(top_entropy_quantile=1.2)
    with pytest.raises(ConfigError, match="entropy_coef_min=0.5 exceeds entropy_coef_max=0.1"):
        GRPOConfig(entropy_coef_min=0.5, entropy_coef_max=0.1)
    with pytest.raises(ConfigError, match="vespo folds the sampling correction .* token_truncate or token_mask"):
        GRPOConfig(loss_type="vespo", use_vllm=True, vllm_importance_sampling_mode="sequence_mask")


def test_combinations_the_papers_did_not_use_are_noted(tmp_path, shipped_policy_dir):
    from rlft.train.update.objectives import loss_notes as option_notes

    assert "importance_sampling_level: sequence" in option_notes(GRPOConfig(loss_type="luspo"))[0]
    assert "leave it at token" in option_notes(GRPOConfig(loss_type="vespo", importance_sampling_level="sequence"))[0]
    assert "not above 1 + epsilon_high" in option_notes(GRPOConfig(delta=1.1))[0]
    assert option_notes(GRPOConfig(loss_type="luspo", importance_sampling_level="sequence", delta=2.0)) == []


def test_bypass_takes_the_samplers_log_probs_as_pi_old_and_applies_no_weight(tmp_path, shipped_policy_dir):
    """verl's bypass mode: a step with rollout_correction_bypass equals the step whose pi_old is the sampler's
    log-probs, uncorrected (the clipped ratio is pi_theta / pi_sampler); it differs from the decoupled step
    (pi_old the policy now, weighted by pi_old / pi_sampler); a rollout with sampler log-probs needs no forward
    for pi_old, one without still does; the mismatch is still measured."""
    import dataclasses

    def token_sum_reward(completion_ids, **kwargs):  # (spread within every group: advantages not 0)
        return [float(sum(ids) % 7) for ids in completion_ids]

    steps = {}
    for name, overrides in (("bypass", {}), ("old_is_sampler", dict(vllm_importance_sampling_correction=False)),
                            ("decoupled", {})):
        cfg = tiny_grpo_config(tmp_path, output_dir=str(tmp_path / name), optim="sgd", learning_rate=1.0,
                               max_grad_norm=1e9, loss_type="dapo", epsilon=0.1, **overrides)
        trainer = GRPOTrainer(str(shipped_policy_dir), token_sum_reward, cfg, addition_rows(16))
        batch = trainer._make_rollout(0)
        rollout = batch.rollout
        with torch.no_grad():
            logps = trainer.scorer.policy_logps(rollout)
        noise = torch.randn(logps.shape, generator=torch.Generator().manual_seed(0)) * 0.3
        rollout.sampling_logps = (logps + noise) * rollout.completion_mask
        if name == "old_is_sampler":
            batch = dataclasses.replace(batch, old_logps=rollout.sampling_logps.clone())
        trainer.args.rollout_correction_bypass = name == "bypass"  # (the check wants vLLM or async)
        if name == "bypass":
            assert not trainer.updater.objective.needs_old_logps(trainer.args, rollout)
            assert trainer.updater.objective.needs_old_logps(trainer.args, dataclasses.replace(rollout, sampling_logps=None))
        metrics = trainer.updater.step(batch)
        steps[name] = (metrics, [p.detach().clone() for p in trainer.model.parameters()])
    (bypass, b_params), (same, s_params), (decoupled, d_params) = (steps[k] for k in ("bypass", "old_is_sampler",
                                                                                      "decoupled"))
    assert bypass["loss"] == pytest.approx(same["loss"], rel=1e-6) and bypass["clip_ratio/region_mean"] > 0.05
    for p, q in zip(b_params, s_params):
        assert torch.allclose(p, q, atol=1e-7)
    assert not all(torch.allclose(p, q, atol=1e-6) for p, q in zip(b_params, d_params))
    assert bypass["sampling/sampling_logp_difference/mean"] == pytest.approx(
        decoupled["sampling/sampling_logp_difference/mean"], rel=1e-6) and bypass[
        "sampling/sampling_logp_difference/mean"] > 0.1
    with pytest.raises(ConfigError, match="rollout_correction_bypass=True takes the sampler's log-probs"):
        tiny_grpo_config(tmp_path, rollout_correction_bypass=True)
