"""DAPO's dynamic sampling: groups without a reward spread are dropped and more prompts sampled until the batch is
full; reproducible, exactly resumable, bounded by max_num_gen_batches (then filled with zero-spread groups and
said), with its metrics."""

from __future__ import annotations

import logging
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rlft import GRPOTrainer
from rlft.rollout.hf import Rollout
from rlft.telemetry.tracking import read_metrics
from rlft.train.sources.dynamic_sampling import choose_groups, informative_groups
from rlft.train.sources.rollout_source import round_prompt_indices
from tests.helpers import addition_rows, tiny_grpo_config

NAN = float("nan")


def test_a_group_is_informative_when_its_weighted_totals_differ():
    rewards = torch.tensor([[1.0, 0.0], [1.0, 0.0],            # equal totals
                            [1.0, 0.0], [0.0, 2.0],            # 1 vs 1 after weights (1, 0.5): equal
                            [0.3, NAN], [0.3 + 2e-6, NAN],     # differ by more than 1e-6
                            [NAN, NAN], [5.0, 0.0],            # one scorable row: no spread
                            [1.0, 0.0], [1.0 + 5e-7, 0.0]])    # within the tolerance
    assert informative_groups(rewards, torch.tensor([1.0, 0.5]), 2).tolist() == [False, False, True, False, False]


def test_the_batch_is_the_first_informative_groups_in_round_then_position_order():
    flags = [[False, True, False, True], [True, False, False, False], [False, False, True, True]]
    assert choose_groups(flags, 4) == [(0, 1), (0, 3), (1, 0), (2, 2)]
    # on 2 processes of 2 groups each, process 0 trains on (0, 1) and (0, 3): (0, 3) was sampled by process 1
    assert choose_groups(flags[:2], 4) == [(0, 1), (0, 3), (1, 0), (0, 0)]  # too few: zero-spread ones fill
    assert choose_groups([[False, False]], 2) == [(0, 0), (0, 1)]


def test_later_rounds_draw_seeded_prompts_and_rollouts_concatenate_row_for_row():
    first = round_prompt_indices(50, 0, 3, 1, 0, 4)
    assert first == round_prompt_indices(50, 0, 3, 1, 0, 4) != round_prompt_indices(50, 0, 3, 2, 0, 4)
    assert round_prompt_indices(50, 0, 3, 1, 1, 4) != first  # each process its own slice
    a = Rollout(torch.tensor([[5, 6]]), torch.ones(1, 2), torch.tensor([[7, 8, 9]]), torch.ones(1, 3),
                torch.tensor([False]), completions=["a"], extra={"k": [1]})
    b = Rollout(torch.tensor([[4, 5, 6], [1, 2, 3]]), torch.ones(2, 3), torch.tensor([[7], [8]]), torch.ones(2, 1),
                torch.tensor([True, False]), completions=["b", "c"], extra={"k": [2, 3]})
    both = Rollout.cat([a, b.select([1])], pad_token_id=0)
    assert both.prompt_ids.tolist() == [[0, 5, 6], [1, 2, 3]] and both.prompt_mask.tolist() == [[0, 1, 1], [1, 1, 1]]
    assert both.completion_ids.tolist() == [[7, 8, 9], [8, 0, 0]] and both.truncated.tolist() == [False, False]
    assert both.completions == ["a", "c"] and both.extra == {"k": [1, 3]}


def even_answers_only(completions, answer, **kwargs):
    """A learning signal only for prompts whose answer is even (the completion's length, which varies): the other
    groups have zero spread."""
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [float(len(t)) if int(a) % 2 == 0 else 0.0 for t, a in zip(texts, answer)]


def run(tmp_path, shipped_policy_dir, name, steps, resume=None, **overrides):
    trainer = GRPOTrainer(str(shipped_policy_dir), [even_answers_only], run_config(tmp_path / name, steps),
                          addition_rows(64))
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def run_config(folder, steps):
    return tiny_grpo_config(folder, max_steps=steps, dynamic_sampling=True, save_steps=2, max_completion_length=16,
                            lr_scheduler_type="constant")


KILLED_MID_ROUNDS = """
import os, sys
sys.path.insert(0, {root!r})
from pathlib import Path
from transformers import TrainerCallback
import tests.test_dynamic_sampling as t
from rlft import GRPOTrainer
from tests.helpers import addition_rows

scored_after_save = []

class Saved(TrainerCallback):
    def on_save(self, args, state, control, **kwargs):
        scored_after_save.append(state.global_step)

def even_answers_only(completions, answer, **kwargs):
    if scored_after_save:
        scored_after_save.append("round")
        if len(scored_after_save) == 3:  # the second generation round after checkpoint-2: mid-rollout
            os.kill(os.getpid(), 9)
    return t.even_answers_only(completions, answer)

trainer = GRPOTrainer({model!r}, [even_answers_only], t.run_config(Path({folder!r}), 4), addition_rows(64),
                      callbacks=[Saved()])
trainer.train()
"""


def test_every_group_in_the_batch_has_a_spread_and_runs_repeat_and_resume_exactly(tmp_path, shipped_policy_dir):
    straight = run(tmp_path, shipped_policy_dir, "a", 4)
    rows = [r for r in straight.state.log_history if "loss" in r]
    assert all(r["frac_reward_zero_std"] == 0.0 for r in rows)
    assert all(r["dynamic_sampling/generation_rounds"] >= 1 for r in rows)
    assert any(r["dynamic_sampling/kept_fraction"] < 1.0 for r in rows)  # some groups were dropped
    again = run(tmp_path, shipped_policy_dir, "b", 4)
    assert [r["loss"] for r in rows] == [r["loss"] for r in again.state.log_history if "loss" in r]
    script = KILLED_MID_ROUNDS.format(root=str(Path(__file__).resolve().parents[1]), model=str(shipped_policy_dir),
                                      folder=str(tmp_path / "c"))
    killed = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert killed.returncode == -9, killed.stderr[-3000:]
    assert rows[2]["dynamic_sampling/generation_rounds"] >= 2  # so the kill came between step 3's rounds
    assert sorted(p.name for p in (tmp_path / "c" / "run").glob("checkpoint-*")) == ["checkpoint-2"]
    resumed = run(tmp_path, shipped_policy_dir, "c", 4, resume=True)
    kept = ("step", "loss", "reward", "grad_norm", "dynamic_sampling/kept_fraction",
            "dynamic_sampling/generation_rounds", "completions/mean_length")
    logged = lambda name: [{k: r[k] for k in kept} for r in read_metrics(tmp_path / name / "run")]  # noqa: E731
    assert logged("c") == logged("a") and len(logged("a")) == 4
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


def test_with_no_round_limit_a_search_says_what_it_found_and_stops_when_no_prompt_has_a_spread(
        tmp_path, shipped_policy_dir, caplog, monkeypatch):
    """max_num_gen_batches: 0 and a reward with no spread used to generate forever without a line. Now: a line
    every REPORT_ROUNDS rounds, and an error once three datasets' worth of prompts (8 prompts, 2 per round: 12
    rounds) held none with a spread."""
    import rlft.train.sources.dynamic_sampling as dynamic

    monkeypatch.setattr(dynamic, "REPORT_ROUNDS", 5)

    def constant(completions, **kwargs):
        return [1.0] * len(completions)

    cfg = tiny_grpo_config(tmp_path, max_steps=1, dynamic_sampling=True, max_num_gen_batches=0)
    trainer = GRPOTrainer(str(shipped_policy_dir), [constant], cfg, addition_rows(8))
    with caplog.at_level(logging.INFO, logger="rlft"):
        with pytest.raises(dynamic.NoRewardSpreadError,
                           match=r"no group with a reward spread in 12 rounds of rollout 0: 24 prompts sampled "
                                 r"\(3\.0 times the 8 prompts of the dataset\) with 4 completions each.*graded.*"
                                 r"num_generations or temperature.*set max_num_gen_batches"):
            trainer.train()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("dynamic sampling, rollout")]
    assert lines == [f"dynamic sampling, rollout 0: {n} rounds, 0 of 2 groups with a reward spread so far "
                     f"({2 * n} prompts sampled; max_num_gen_batches=0 (no limit))" for n in (5, 10)]
