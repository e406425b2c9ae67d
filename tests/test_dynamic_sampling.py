"""DAPO's dynamic sampling: groups without a reward spread are dropped and more prompts sampled until the batch is
full; reproducible, exactly resumable, bounded by max_num_gen_batches (then filled with zero-spread groups and
said), with its metrics."""

from __future__ import annotations

import logging
import math

import pytest
import torch

from rlft import GRPOTrainer
from rlft.rollout.hf import Rollout
from rlft.train.dynamic import cat_rollouts, informative_groups, round_prompt_indices, select_rows
from tests.helpers import addition_rows, tiny_grpo_config

NAN = float("nan")


def test_a_group_is_informative_when_its_weighted_totals_differ():
    rewards = torch.tensor([[1.0, 0.0], [1.0, 0.0],            # equal totals
                            [1.0, 0.0], [0.0, 2.0],            # 1 vs 1 after weights (1, 0.5): equal
                            [0.3, NAN], [0.3 + 2e-6, NAN],     # differ by more than 1e-6
                            [NAN, NAN], [5.0, 0.0],            # one scorable row: no spread
                            [1.0, 0.0], [1.0 + 5e-7, 0.0]])    # within the tolerance
    assert informative_groups(rewards, torch.tensor([1.0, 0.5]), 2).tolist() == [False, False, True, False, False]


def test_later_rounds_draw_seeded_prompts_and_rollouts_concatenate_row_for_row():
    first = round_prompt_indices(50, 0, 3, 1, 0, 4)
    assert first == round_prompt_indices(50, 0, 3, 1, 0, 4) != round_prompt_indices(50, 0, 3, 2, 0, 4)
    assert round_prompt_indices(50, 0, 3, 1, 1, 4) != first  # each process its own slice
    a = Rollout(torch.tensor([[5, 6]]), torch.ones(1, 2), torch.tensor([[7, 8, 9]]), torch.ones(1, 3),
                torch.tensor([False]), completions=["a"], extra={"k": [1]})
    b = Rollout(torch.tensor([[4, 5, 6], [1, 2, 3]]), torch.ones(2, 3), torch.tensor([[7], [8]]), torch.ones(2, 1),
                torch.tensor([True, False]), completions=["b", "c"], extra={"k": [2, 3]})
    both = cat_rollouts([a, select_rows(b, [1])], pad_token_id=0)
    assert both.prompt_ids.tolist() == [[0, 5, 6], [1, 2, 3]] and both.prompt_mask.tolist() == [[0, 1, 1], [1, 1, 1]]
    assert both.completion_ids.tolist() == [[7, 8, 9], [8, 0, 0]] and both.truncated.tolist() == [False, False]
    assert both.completions == ["a", "c"] and both.extra == {"k": [1, 3]}


def even_answers_only(completions, answer, **kwargs):
    """A learning signal only for prompts whose answer is even (the completion's length, which varies): the other
    groups have zero spread."""
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [float(len(t)) if int(a) % 2 == 0 else 0.0 for t, a in zip(texts, answer)]


def run(tmp_path, shipped_policy_dir, name, steps, resume=None, **overrides):
    cfg = tiny_grpo_config(tmp_path / name, max_steps=steps, dynamic_sampling=True, save_steps=2,
                           max_completion_length=16, lr_scheduler_type="constant", **overrides)
    trainer = GRPOTrainer(str(shipped_policy_dir), [even_answers_only], cfg, addition_rows(64))
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def test_every_group_in_the_batch_has_a_spread_and_runs_repeat_and_resume_exactly(tmp_path, shipped_policy_dir):
    straight = run(tmp_path, shipped_policy_dir, "a", 4)
    rows = [r for r in straight.state.log_history if "loss" in r]
    assert all(r["frac_reward_zero_std"] == 0.0 for r in rows)
    assert all(r["dynamic_sampling/generation_rounds"] >= 1 for r in rows)
    assert any(r["dynamic_sampling/kept_fraction"] < 1.0 for r in rows)  # some groups were dropped
    again = run(tmp_path, shipped_policy_dir, "b", 4)
    assert [r["loss"] for r in rows] == [r["loss"] for r in again.state.log_history if "loss" in r]
    run(tmp_path, shipped_policy_dir, "c", 2)
    resumed = run(tmp_path, shipped_policy_dir, "c", 4, resume=True)
    last = [r for r in resumed.state.log_history if "loss" in r][-1]
    assert last["loss"] == rows[-1]["loss"] and last["reward"] == rows[-1]["reward"]
    for p, q in zip(straight.model.parameters(), resumed.model.parameters()):
        assert torch.equal(p, q)


def test_the_round_limit_fills_the_batch_and_says_so(tmp_path, shipped_policy_dir, caplog):
    def constant(completions, **kwargs):
        return [1.0] * len(completions)

    cfg = tiny_grpo_config(tmp_path, max_steps=1, dynamic_sampling=True, max_num_gen_batches=3)
    trainer = GRPOTrainer(str(shipped_policy_dir), [constant], cfg, addition_rows(64))
    with caplog.at_level(logging.WARNING, logger="rlft"):
        trainer.train()
    row = next(r for r in trainer.state.log_history if "dynamic_sampling/generation_rounds" in r)
    assert row["dynamic_sampling/generation_rounds"] == 3 and row["dynamic_sampling/kept_fraction"] == 0.0
    assert row["frac_reward_zero_std"] == 1.0 and row["completions/count"] == 8  # full batch, no signal
    assert "0 of 2 groups had a reward spread after 3 rounds" in caplog.text
    assert math.isfinite(row["loss"])


@pytest.mark.parametrize("value", [-1])
def test_a_negative_round_limit_is_refused(tmp_path, value):
    from rlft.config import ConfigError, GRPOConfig

    with pytest.raises(ConfigError, match="max_num_gen_batches=-1 must be >= 0"):
        GRPOConfig(output_dir=str(tmp_path), max_num_gen_batches=value)


def test_log_extra_columns_follow_the_rows_kept_from_every_round(tmp_path, shipped_policy_dir):
    def tagged(completions, answer, log_extra=None, log_metric=None, **kwargs):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        log_extra("text", texts)  # each row's own completion: must stay lined up with it
        log_metric("rows_scored", float(len(texts)))
        return even_answers_only(completions, answer)

    cfg = tiny_grpo_config(tmp_path, max_steps=1, dynamic_sampling=True, max_completion_length=16)
    trainer = GRPOTrainer(str(shipped_policy_dir), [tagged], cfg, addition_rows(64))
    batch = trainer._make_rollout(0)
    assert batch.metrics["dynamic_sampling/generation_rounds"] >= 2  # odd-answer groups forced another round
    assert all(sample["text"] == (sample["completion"][-1]["content"] if isinstance(sample["completion"], list)
                                  else sample["completion"]) for sample in batch.samples)
    assert batch.metrics["rows_scored"] == 8.0
