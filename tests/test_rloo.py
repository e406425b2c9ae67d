"""RLOOTrainer / RLOOConfig under TRL 1.16's names and defaults: on the same rollout and rewards, rlft's RLOO
advantages and loss equal a float64 re-computation of TRL 1.16's RLOO formula written here from its
documentation and code reading (KL in the reward, leave-one-out baseline, optional whitening, a sequence-level
clip on the summed log-ratio, a mean over sequences); it trains, resumes exactly and runs from the command line."""

from __future__ import annotations

import math

import pytest
import torch

from rlft import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer
from rlft.core.losses import policy_loss
from rlft.errors import ConfigError
from tests.helpers import addition_rows, correct_answer, has_answer_tags, tiny_grpo_config


def trl_rloo_reference(rewards, weights, old, ref, mask, beta, clip_range, normalize):
    """Float64, row by row, as TRL 1.16's RLOOTrainer._generate_and_score_completions computes it."""
    n, g = len(rewards), 2
    total = []
    for row in rewards:
        values = [w * r for w, r in zip(weights, row) if not math.isnan(r)]
        total.append(sum(values) if values else math.nan)
    shaped = []
    for i, r in enumerate(total):
        if clip_range is not None and not math.isnan(r):
            r = min(max(r, clip_range[0]), clip_range[1])
        kl = sum((old[i][t] - ref[i][t]) * mask[i][t] for t in range(len(mask[i])))
        shaped.append(r - beta * kl)
    advantages = []
    for start in range(0, n, g):
        group = shaped[start:start + g]
        for r in group:
            others = [o for o in group if o is not r and not math.isnan(o)]
            advantages.append(math.nan if math.isnan(r) or not others else r - sum(others) / len(others))
    if normalize:
        valid = [a for a in advantages if not math.isnan(a)]
        mean = sum(valid) / len(valid)
        std = math.sqrt(sum((a - mean) ** 2 for a in valid) / (len(valid) - 1))
        advantages = [(a - mean) / (std + 1e-4) for a in advantages]
    return [0.0 if math.isnan(a) else a for a in advantages]


def trl_rloo_loss(logps, old, advantages, mask, eps_low, eps_high):
    losses = []
    for i, a in enumerate(advantages):
        log_ratio = sum((logps[i][t] - old[i][t]) * mask[i][t] for t in range(len(mask[i])))
        rho = math.exp(log_ratio)
        losses.append(-min(rho * a, min(max(rho, 1 - eps_low), 1 + eps_high) * a))
    return sum(losses) / len(losses)


def test_rloo_config_has_trls_defaults(tmp_path):
    cfg = RLOOConfig(output_dir=str(tmp_path))
    assert (cfg.num_generations, cfg.beta, cfg.normalize_advantages, cfg.reward_clip_range) == (2, 0.05, False, None)
    assert (cfg.learning_rate, cfg.epsilon, cfg.loss_type, cfg.advantage_estimator) == (1e-6, 0.2, "rloo", "rloo")


@pytest.mark.parametrize("normalize", [False, True])
def test_rloo_advantages_and_loss_equal_trls_formula_in_float64(tmp_path, shipped_policy_dir, normalize):
    cfg = tiny_grpo_config(tmp_path, num_generations=2, beta=0.05, epsilon_high=0.28, max_completion_length=6)
    args = RLOOConfig(**{**cfg.to_dict(), "normalize_advantages": normalize, "reward_clip_range": [-0.5, 0.8],
                         "loss_type": "rloo", "advantage_estimator": "rloo", "report_to": "none"})
    trainer = RLOOTrainer(str(shipped_policy_dir), [correct_answer, has_answer_tags], args, addition_rows(16),
                          peft_config=None)
    with torch.no_grad():  # a reference away from the policy, so the KL in the reward is not 0
        generator = torch.Generator().manual_seed(1)
        for param in trainer.ref_model.parameters():
            param.add_(0.02 * torch.randn(param.shape, generator=generator))
    rollout = trainer.source.generate(trainer.train_prompts.batch(list(range(4))), 2)
    rewards = torch.tensor([[1.0, 0.5], [0.0, 0.5], [float("nan"), float("nan")], [1.0, 0.0],
                            [0.0, 0.0], [1.0, float("nan")], [0.0, 0.5], [1.0, 0.5]])
    advantages = trainer.advantages(rewards, rollout)[0]
    mask = rollout.loss_mask.double()
    old = trainer.scorer.logps(trainer.model, rollout).double()
    ref = trainer.scorer.reference_logps(rollout).double()
    assert (old - ref).abs().max() > 1e-3
    expected = trl_rloo_reference(rewards.tolist(), [1.0, 1.0], old.tolist(), ref.tolist(), mask.tolist(), 0.05,
                                  (-0.5, 0.8), normalize)
    assert advantages.tolist() == pytest.approx(expected, rel=1e-5, abs=1e-6)
    logps = (old + 0.3 * torch.randn(old.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(0))) \
        * mask
    loss, metrics = policy_loss(logps, old * mask, advantages.double(), mask, loss_type="rloo",
                                options=trainer.loss_options)
    assert trainer.loss_options.beta == 0.0  # the KL is in the reward
    # the loss of these (float32) advantages, in float64 on both sides: equal to its rounding
    assert loss.item() == pytest.approx(trl_rloo_loss(logps.tolist(), (old * mask).tolist(), advantages.tolist(),
                                                      mask.tolist(), 0.2, 0.28), rel=1e-12)
    assert 0.0 <= metrics["clip_ratio/region_mean"].item() <= 1.0


def test_rloo_trains_logs_kl_and_resumes_exactly(tmp_path, shipped_policy_dir):
    """Stopped after step 2 of 4 (the same schedule: a run of max_steps 2 would decay the learning rate to 0 by
    then) and resumed: the steps after it and the weights equal the straight run's bitwise. (The loss of an
    on-policy RLOO step is ~0 by construction, 1e-8 either way: the KL and the weights tell the runs apart.)"""
    from tests.helpers import stop_after

    def run(name, resume=None, callbacks=None):
        cfg = tiny_grpo_config(tmp_path / name, num_generations=2, max_steps=4, save_steps=2,
                               learning_rate=1e-2)
        args = RLOOConfig(**{**cfg.to_dict(), "beta": 0.05, "loss_type": "rloo", "advantage_estimator": "rloo",
                             "report_to": "none", "full_determinism": False})
        trainer = RLOOTrainer(str(shipped_policy_dir), [correct_answer], args, addition_rows(16),
                              callbacks=callbacks)
        trainer.train(resume_from_checkpoint=resume)
        return trainer

    straight = run("a")
    rows = [r for r in straight.state.log_history if "loss" in r]
    assert len(rows) == 4 and all(math.isfinite(r["loss"]) and "kl" in r for r in rows)
    assert rows[0]["kl"] == pytest.approx(0.0, abs=1e-7) and rows[-1]["kl"] != 0.0  # the policy moved
    run("b", callbacks=[stop_after(2)])
    resumed = run("b", resume=True)
    keep = ("step", "loss", "kl", "reward", "grad_norm", "learning_rate")
    after = lambda t: [{k: r.get(k) for k in keep} for r in t.state.log_history if "loss" in r][2:]  # noqa: E731
    assert after(resumed) == after(straight) and len(after(straight)) == 2
    for (name, p), (_, q) in zip(straight.model.named_parameters(), resumed.model.named_parameters()):
        assert torch.equal(p, q), name


def test_rlft_rloo_runs_from_the_command_line(tmp_path, shipped_policy_dir, monkeypatch):
    from rlft.cli import main

    monkeypatch.chdir(tmp_path)
    rows = tmp_path / "rows.jsonl"
    import json

    rows.write_text("\n".join(json.dumps(r) for r in addition_rows(8)))
    code = main(["rloo", "--model_name_or_path", str(shipped_policy_dir), "--train_dataset", str(rows),
                 "--reward_funcs", "tests.helpers:correct_answer", "--output_dir", str(tmp_path / "out"),
                 "--max_steps", "1", "--per_device_train_batch_size", "4", "--max_completion_length", "6",
                 "--report_to", "none", "--reward_clip_range", "-1", "1", "--disable_tqdm", "true"])
    # the model is in output_dir itself, where `trl rloo` saves it
    assert code == 0 and (tmp_path / "out" / "model.safetensors").is_file()
    assert not (tmp_path / "out" / "final").exists()


def test_the_policy_scores_a_rollout_once_for_the_kl_and_the_old_log_probs(tmp_path, shipped_policy_dir):
    """RLOO with beta > 0 and two optimiser steps per rollout: the no-grad policy pass behind the reward's KL is
    the one the old log-probs reuse (one pass of the policy, one of the reference)."""
    cfg = tiny_grpo_config(tmp_path, num_generations=2, max_completion_length=6, num_iterations=2)
    args = RLOOConfig(**{**cfg.to_dict(), "beta": 0.05, "loss_type": "rloo", "advantage_estimator": "rloo",
                         "report_to": "none"})
    trainer = RLOOTrainer(str(shipped_policy_dir), [correct_answer], args, addition_rows(16))
    passes = []
    forward = trainer.scorer.logps
    trainer.scorer.logps = lambda model, rollout: passes.append(model is trainer.model) or forward(model, rollout)
    batch = trainer._make_rollout(0)
    assert passes == [True, False]  # the policy once, the reference once
    assert batch.old_logps is not None and torch.equal(batch.old_logps, forward(trainer.model, batch.rollout))


def test_rloo_clip_fractions_combine_micro_batches_by_their_sequences():
    """RLOO's clip ratios are fractions of sequences: a step of two micro-batches (2 sequences of 10 tokens all
    clipped, 2 of 1 token none clipped) reports 0.5, not the token-weighted 10/11; token-level losses keep the
    token weighting."""
    from rlft.core.losses import LOSSES
    from rlft.train.update.metrics import CLIP_MEAN_KEYS, StepSums

    assert LOSSES["rloo"].clip_per_sequence and not LOSSES["grpo"].clip_per_sequence
    one = type("Acc", (), {"num_processes": 1, "device": torch.device("cpu")})()
    parts = [(1.0, torch.ones(2, 10)), (0.0, torch.ones(2, 1))]
    for keys, expected in ((CLIP_MEAN_KEYS, 0.5), ((), 20 / 22)):
        sums = StepSums(keys)
        for value, mask in parts:
            sums.add(torch.tensor(0.0), {k: torch.tensor(value) for k in CLIP_MEAN_KEYS}, None, mask)
        out = sums.reduce(one)
        assert all(out[k] == pytest.approx(expected) for k in CLIP_MEAN_KEYS)


def test_where_the_kl_goes_is_the_trainers_way_unless_the_config_says(tmp_path, shipped_policy_dir):
    """RLOOTrainer puts beta's KL in the reward and GRPOTrainer in the loss when kl_in_reward is left at null;
    either config can ask for the other (the loss's own beta is then 0 / beta)."""
    cfg = tiny_grpo_config(tmp_path, num_generations=2, beta=0.05)
    as_dict = {**cfg.to_dict(), "report_to": "none"}
    for trainer_class, args, in_loss in [
            (RLOOTrainer, RLOOConfig(**as_dict), False),
            (RLOOTrainer, RLOOConfig(**{**as_dict, "kl_in_reward": False}), True),
            (GRPOTrainer, GRPOConfig(**as_dict), True),
            (GRPOTrainer, GRPOConfig(**{**as_dict, "kl_in_reward": True, "advantage_estimator": "rloo"}), False)]:
        trainer = trainer_class(str(shipped_policy_dir), [correct_answer], args, addition_rows(16))
        assert trainer.kl_in_loss is in_loss and trainer.loss_options.beta == (0.05 if in_loss else 0.0)
        assert trainer.estimator.kl_in_reward is not in_loss


def test_the_kl_in_the_reward_is_refused_where_it_cannot_go(tmp_path):
    with pytest.raises(ConfigError, match="kl_in_reward=True with advantage_estimator reinforce_pp"):
        GRPOConfig(output_dir=str(tmp_path), kl_in_reward=True, advantage_estimator="reinforce_pp")
    with pytest.raises(ConfigError, match="use multi_objective_aggregation: sum_then_normalize"):
        GRPOConfig(output_dir=str(tmp_path), kl_in_reward=True, multi_objective_aggregation="normalize_then_sum")


def test_an_unknown_rollout_source_names_the_registered_ones(tmp_path, shipped_policy_dir):
    cfg = tiny_grpo_config(tmp_path, rollout_source="replay_jsonl")
    with pytest.raises(ConfigError, match=r"rollout_source='replay_jsonl': choose one of \['generate', 'gkd', 'producer', 'sdft', 'sdpo', 'worker'\]"):
        GRPOTrainer(str(shipped_policy_dir), [correct_answer], cfg, addition_rows(16))
