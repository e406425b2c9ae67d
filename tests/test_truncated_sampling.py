"""Truncated sampling replayed in the trainer (rlft/rollout/truncation.py): transformers' generate returns, with
each sampled token, the ids top-k / top-p / min-p kept there, and the trainer's log-probs are the distribution's
the sampler drew from. At an on-policy step the importance ratio is then 1; without the replay it is the kept
mass (the bias a run shows when the replay is off)."""

from __future__ import annotations

import pytest
import torch

from rlft import GRPOTrainer
from rlft.core.logprobs import kept_log_softmax
from rlft.rollout.hf import HFGenerator
from tests.helpers import addition_rows, correct_answer, tiny_grpo_config

TRUNCATED = dict(temperature=1.0, top_p=0.8, top_k=20)


def make(tmp_path, shipped, **overrides) -> GRPOTrainer:
    cfg = tiny_grpo_config(tmp_path, **{**TRUNCATED, **overrides})
    trainer = GRPOTrainer(str(shipped), [correct_answer], cfg, addition_rows(16))
    trainer.generator.return_logps = True  # the sampler's own log-prob of each token, as vLLM returns it
    return trainer


def ratios(trainer, rollout) -> torch.Tensor:
    """pi_trainer / pi_sampler of every completion token, the policy unchanged since it sampled."""
    logps = trainer.scorer.logps(trainer.model, rollout)
    mask = rollout.completion_mask.bool()
    return (logps - rollout.sampling_logps)[mask].exp()


def test_recording_what_the_sampler_kept_changes_no_completion(tmp_path, shipped_policy_dir):
    trainer = make(tmp_path, shipped_policy_dir, min_p=0.02)
    model, prompts = trainer.accelerator.unwrap_model(trainer.model), trainer.train_prompts.batch([0, 1, 2])
    outs = []
    for replay in (False, True):
        engine = HFGenerator(trainer.tokenizer, 8, top_p=0.8, top_k=20, min_p=0.02, replay_mask=replay)
        engine.return_logps = replay
        torch.manual_seed(3)
        outs.append(engine(model, prompts["prompt_ids"], 4))
    assert torch.equal(outs[0].completion_ids, outs[1].completion_ids)
    assert outs[0].sampling_kept is None and outs[1].sampling_kept.shape[:2] == outs[1].completion_ids.shape


def test_the_kept_ids_are_what_top_k_top_p_and_min_p_keep_in_transformers_order(tmp_path, shipped_policy_dir):
    """Teacher-forced logits of the sampled completions, cut by the definitions in generate's order (temperature,
    top-k, top-p, min-p): the same sets the recorder returned."""
    trainer = make(tmp_path, shipped_policy_dir, temperature=0.7, min_p=0.05)
    rollout = trainer.source.generate(trainer.train_prompts.batch([0, 1, 2, 3]), 4)
    model = trainer.accelerator.unwrap_model(trainer.model)
    ids = torch.cat([rollout.prompt_ids, rollout.completion_ids], 1)
    mask = torch.cat([rollout.prompt_mask, rollout.completion_mask], 1)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask,
                       position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits.double()
    width = rollout.completion_ids.shape[1]
    logits = logits[:, -width - 1:-1] / 0.7  # [N, C, V]: position t predicts completion token t
    checked = 0
    for row in range(logits.shape[0]):
        for t in range(int(rollout.completion_mask[row].sum())):
            probs = torch.softmax(logits[row, t], 0)
            keep = torch.zeros_like(probs, dtype=torch.bool)
            keep[probs.argsort(descending=True)[:20]] = True  # top-k
            cut = torch.softmax(logits[row, t].masked_fill(~keep, float("-inf")), 0)
            order = cut.argsort(descending=True)  # top-p: the likeliest tokens until they hold 0.8
            needed = torch.zeros_like(keep)
            needed[order[(torch.cumsum(cut[order], 0) - cut[order]) < 0.8]] = True
            keep &= needed
            cut = torch.softmax(logits[row, t].masked_fill(~keep, float("-inf")), 0)
            keep &= cut >= 0.05 * cut.max()  # min-p
            recorded = {k for k in rollout.sampling_kept[row, t].tolist() if k >= 0}
            assert recorded == set(keep.nonzero().flatten().tolist()), (row, t)
            checked += 1
    assert checked > 50


def test_an_on_policy_step_has_importance_ratio_one_with_the_replay_and_the_kept_mass_without(
        tmp_path, shipped_policy_dir):
    """top_p 0.8 + top_k 20, float32, the policy that sampled: ratio mean within 1 +- 0.005 and max |delta
    log-prob| <= 1e-4 with the replay; without it the ratio is each token's kept mass (mean well below 1)."""
    on = make(tmp_path / "on", shipped_policy_dir)
    rollout = on.source.generate(on.train_prompts.batch(list(range(8))), 4)
    ratio = ratios(on, rollout)
    assert abs(ratio.mean().item() - 1) <= 0.005 and ratio.log().abs().max().item() <= 1e-4
    off = make(tmp_path / "off", shipped_policy_dir, replay_sampling_mask=False)
    torch.manual_seed(0)
    rollout = off.source.generate(off.train_prompts.batch(list(range(8))), 4)
    biased = ratios(off, rollout)
    assert rollout.sampling_kept is None and biased.mean().item() < 0.95 and biased.max().item() <= 1 + 1e-5
    full = kept_log_softmax(torch.zeros(1, 4), torch.tensor([0]), torch.tensor([[0, 1]]))  # log 1/2: 2 kept
    assert full.item() == pytest.approx(-0.6931471805599453)


def test_with_the_replay_a_sequence_mask_zeroes_no_sequence_at_step_one_and_without_it_does(
        tmp_path, shipped_policy_dir):
    """sequence_mask with a lower bound of 0.8: the sequences' ratios are products of kept masses without the
    replay (here 0.62-0.68: zeroed), 1 with it; the kept mass is logged."""
    zeroed = {}
    for replay in (True, False):
        trainer = make(tmp_path / str(replay), shipped_policy_dir, replay_sampling_mask=replay, max_steps=1,
                       vllm_importance_sampling_mode="sequence_mask", vllm_importance_sampling_clip_min=0.8)
        trainer.train()
        row = trainer.state.log_history[0]
        zeroed[replay] = row["sampling/importance_sampling_zeroed_fraction"]
        if replay:
            assert row["sampling/importance_sampling_ratio/mean"] == pytest.approx(1.0, abs=0.005)
            assert row["sampling/importance_sampling_ratio/outside_fraction"] == 0.0
            assert 0.0 < row["sampling/kept_mass/mean"] < 1.0
    assert zeroed[True] == 0.0 and zeroed[False] > 0.0


def test_a_value_changing_setting_turns_the_automatic_replay_off_and_says_so(tmp_path, shipped_policy_dir, caplog):
    trainer = make(tmp_path, shipped_policy_dir, repetition_penalty=1.1, max_steps=1)
    assert not trainer.generator.replay_mask
    assert any("repetition_penalty=1.1 keeps the trainer from replaying" in note for note in trainer._setup_notes)


def test_the_async_producer_at_rollout_lag_zero_is_on_policy_with_the_replay(tmp_path, shipped_policy_dir):
    """The producer process samples with generate, records what it kept and each token's log-prob under the
    distribution it sampled from; at rollout_lag 0 the trainer's weights are the sampler's: ratio 1 with the
    replay, the kept mass without."""
    from rlft import AsyncGRPOConfig, AsyncGRPOTrainer

    rows = {}
    for replay in (True, False):
        args = AsyncGRPOConfig(output_dir=str(tmp_path / str(replay)), learning_rate=1e-3, max_steps=1,
                               num_generations=4, per_device_train_batch_size=8, max_completion_length=8,
                               report_to="none", disable_tqdm=True, seed=0, gradient_checkpointing=False,
                               rollout_lag=0, replay_sampling_mask=replay, **TRUNCATED)
        trainer = AsyncGRPOTrainer(str(shipped_policy_dir), [correct_answer], args, addition_rows(16))
        trainer.train()
        rows[replay] = trainer.state.log_history[0]
    assert rows[True]["sampling/importance_sampling_ratio/mean"] == pytest.approx(1.0, abs=0.005)
    assert rows[True]["sampling/sampling_logp_difference/max"] <= 1e-4
    assert rows[False]["sampling/importance_sampling_ratio/mean"] < 0.95


def test_a_resume_inside_a_rollout_carries_the_kept_ids_and_equals_the_straight_run(tmp_path, shipped_policy_dir):
    from rlft.train.run.safe_files import load_safetensors

    def run(name, steps, resume=None):
        cfg = tiny_grpo_config(tmp_path / name, max_steps=steps, steps_per_generation=2, save_steps=1, **TRUNCATED)
        trainer = GRPOTrainer(str(shipped_policy_dir), [correct_answer], cfg, addition_rows(16))
        trainer.train(resume_from_checkpoint=resume)
        return trainer

    straight = run("a", 4)
    carried = load_safetensors(tmp_path / "a" / "run" / "checkpoint-1" / "extra.safetensors")
    assert carried["sampling_kept"].dtype == torch.int32 and (carried["sampling_kept"] >= 0).any()
    resumed = run("b", 4, resume=str(tmp_path / "a" / "run" / "checkpoint-1"))
    losses = lambda t: [r["loss"] for r in t.state.log_history if "loss" in r and "train_loss" not in r]  # noqa: E731
    assert losses(resumed)[-3:] == losses(straight)[-3:]
    for p, q in zip(straight.model.parameters(), resumed.model.parameters()):
        assert torch.equal(p, q)


def test_tool_calling_rollouts_carry_the_kept_ids_of_the_policys_tokens_only(tmp_path):
    """Multi-turn, on the shipped calculator policy: each turn's kept ids line up with the policy's tokens; tool
    output has none (the full vocabulary; it is not trained anyway); the on-policy ratio is still 1."""
    from rlft.data import calculator
    from rlft.model.loading import shipped_policy_path

    cfg = tiny_grpo_config(tmp_path, max_completion_length=64, max_tool_calling_iterations=2, num_generations=2,
                           per_device_train_batch_size=8, **{**TRUNCATED, "top_p": 0.95})
    trainer = GRPOTrainer(str(shipped_policy_path("tiny-calculator")), [calculator.answer_reward], cfg,
                          addition_rows(16), tools=calculator.TOOLS)
    trainer.generator.engine.return_logps = True
    rollout = trainer.source.generate(trainer.train_prompts.batch([0, 1, 2, 3]), 2)
    has_kept = (rollout.sampling_kept >= 0).any(-1)
    policy = rollout.loss_mask.bool()
    assert (rollout.completion_mask.bool() & ~policy).any()  # a tool answered
    assert torch.equal(has_kept, policy)
    logps = trainer.scorer.logps(trainer.model, rollout)
    ratio = (logps - rollout.sampling_logps)[policy].exp()
    assert abs(ratio.mean().item() - 1) <= 0.005 and ratio.log().abs().max().item() <= 1e-4
