"""AsyncGRPOTrainer with tools= and environment_factory=: the tool loop runs in the trainer's process, its turns
on the producer; runs repeat and resume exactly; an environment's reward is read from the instance that served
the row before another rollout resets it; weights never change inside a rollout's loop."""

from __future__ import annotations

import json
import time

import pytest
from peft import LoraConfig

from rlft import AsyncGRPOTrainer
from rlft.data.calculator import TOOLS, CalculatorEnv, answer_reward, tool_use_reward
from rlft.errors import ConfigError
from rlft.model.loading import shipped_policy_path
from tests.helpers import addition_rows, stop_after
from tests.test_async_grpo import async_config, rows_of


def calculator(tmp_path, name, callbacks=None, resume=None, reward_funcs=None, **overrides):
    settings = dict(max_steps=4, save_steps=2, max_completion_length=64, temperature=0.7, learning_rate=5e-4,
                    reward_weights=[1.0, 0.2], producer_threads=1)
    extra = {"environment_factory": overrides.pop("environment_factory")} \
        if "environment_factory" in overrides else {"tools": TOOLS}
    trainer = AsyncGRPOTrainer(str(shipped_policy_path("tiny-calculator")),
                               reward_funcs or [answer_reward, tool_use_reward],
                               async_config(tmp_path, name, **{**settings, **overrides}), addition_rows(32),
                               callbacks=callbacks, peft_config=LoraConfig(r=4, target_modules="all-linear"),
                               **extra)
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def test_async_tool_rollouts_train_and_a_resumed_run_equals_the_straight_one(tmp_path):
    """The shipped calculator calls its tool in most rollouts (several producer requests per rollout); a run
    stopped at its step-2 checkpoint (the rollout requested ahead saved scored, tool masks included) and resumed
    logs the same steps as the straight run."""
    calculator(tmp_path, "straight")
    rows = rows_of(tmp_path / "straight")
    steps = [r for r in rows if "loss" in r]
    assert len(steps) == 4 and all(r["tools/call_frequency"] > 0.5 and r["tools/producer_requests"] >= 2
                                   for r in steps)
    assert [r["sample/version"] for r in steps] == [0.0, 0.0, 1.0, 2.0]
    saved = json.loads((tmp_path / "straight" / "checkpoint-2" / "extra.json").read_text())["async"]["scored"]
    assert [(entry["rollout"], len(entry["completions"])) for entry in saved] == [(2, 8)]  # requested ahead
    calculator(tmp_path, "split", callbacks=[stop_after(2)])
    calculator(tmp_path, "split", resume=True)
    assert rows_of(tmp_path / "split") == rows


class Counter(CalculatorEnv):
    """The calculator's environment, owning its reward: the number of add calls its episode made."""

    def get_reward(self) -> float:
        return float(self.calls)


def test_an_environments_reward_is_read_before_the_next_rollout_resets_it(tmp_path):
    """Two rollouts in flight (rollout_lag 2): each row's environment reward equals the tool calls its own
    completion made, so no instance was reset by a later rollout before its reward was read; and no turn met
    weights its rollout was not scheduled for (the driver raises if one did)."""
    trainer = calculator(tmp_path, "env", max_steps=3, save_steps=1000, rollout_lag=2, reward_weights=None,
                         reward_funcs=[answer_reward], environment_factory=Counter)
    steps = [r for r in trainer.state.log_history if "loss" in r]
    assert len(steps) == 3
    for row in steps:  # a failed call (unparseable arguments) never reached the environment
        calls = row["tools/call_frequency"] - row["tools/failure_frequency"]
        assert row["rewards/Counter/mean"] == pytest.approx(calls) and calls > 0


def test_what_async_agents_cannot_run_is_refused_by_name(tmp_path):
    path, rows = str(shipped_policy_path("tiny-calculator")), addition_rows(32)
    with pytest.raises(ConfigError, match="rollout_func with AsyncGRPOTrainer.*rollout_worker="):
        AsyncGRPOTrainer(path, answer_reward, async_config(tmp_path), rows, rollout_func=lambda p, t: {})
    with pytest.raises(ConfigError, match="inflight_switch_tokens with tools or environments.*not reproducible"):
        AsyncGRPOTrainer(path, answer_reward, async_config(tmp_path, inflight_weight_updates=True,
                                                           inflight_switch_tokens=4), rows, tools=TOOLS)


class SlowCalculator(CalculatorEnv):
    """The calculator's environment, each call taking 0.2 s (a tool that waits on something): a rollout's loop
    outlasts a training step."""

    def add(self, a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: The first number.
            b: The second number.
        """
        time.sleep(0.2)
        return super().add(a, b)


def test_in_flight_updates_reach_a_running_tool_loop_and_each_token_records_its_version(tmp_path):
    """inflight_weight_updates with tools and rollout_lag 2: the trainer pushes weights without waiting for the
    tool loops requested earlier, so later turns (or the rest of a turn) come from newer weights (here a slow
    tool keeps each loop running past a training step); every token's recorded version is at least its
    rollout's scheduled one and at most the trainer's step."""
    calculator(tmp_path, "run", rollout_lag=2, max_staleness=2, inflight_weight_updates=True, save_steps=1000,
               reward_weights=None, reward_funcs=[answer_reward], environment_factory=SlowCalculator)
    steps = [r for r in rows_of(tmp_path / "run") if "loss" in r]
    assert len(steps) == 4 and all(r["tools/producer_requests"] >= 2 for r in steps)
    for step, r in enumerate(steps):
        assert r["sample/version"] <= r["sample/token_version_min"] <= r["sample/token_version_mean"] <= step
    assert any(r["sampling/tokens_from_newer_weights"] > 0 for r in steps)


def test_partial_rollouts_with_tools_carry_rows_and_a_resumed_run_equals_the_straight_one(tmp_path):
    """partial_rollouts=1 with the calculator's tool: the driver's pool advances the next rollout's tool loops in
    each rollout's windows, so later rollouts are trained from tokens of older weights, each with its version; a
    run stopped at its step-2 checkpoint (the pool saved with it, mid-loop rows included) and resumed logs the same
    steps as the straight run."""
    settings = dict(partial_rollouts=1, max_staleness=2)
    calculator(tmp_path, "straight", **settings)
    rows = rows_of(tmp_path / "straight")
    steps = [r for r in rows if "loss" in r]
    assert len(steps) == 4 and all(r["tools/call_frequency"] > 0.5 for r in steps)
    assert any(r["sampling/tokens_from_older_weights"] > 0 and r["partial/carried_share"] > 0.5 for r in steps)
    assert all(r["sample/staleness_max"] <= 2 for r in steps)
    saved = json.loads((tmp_path / "straight" / "checkpoint-2" / "extra.json").read_text())["async"]
    assert [entry["rollout"] for entry in saved["agent_pool"]] == [3]  # rollout 3's rows, advanced in rollout 2's
    assert any(row["ids"] for row in saved["agent_pool"][0]["rows"])
    calculator(tmp_path, "split", callbacks=[stop_after(2)], **settings)
    calculator(tmp_path, "split", resume=True, **settings)
    assert rows_of(tmp_path / "split") == rows


def test_partial_rollouts_with_environments_replay_a_carried_rows_calls_after_a_resume(tmp_path):
    """Environments under partial_rollouts=1: each rollout in flight has its own instances (the Counter reward of
    every step equals the calls its rows made), and after a resume each carried row's environment is reset and its
    recorded calls replayed, so the resumed run's rewards (read from the environments) equal the straight run's."""
    settings = dict(partial_rollouts=1, max_staleness=2, reward_weights=None, reward_funcs=[answer_reward],
                    environment_factory=Counter)
    calculator(tmp_path, "straight", **settings)
    rows = rows_of(tmp_path / "straight")
    for row in [r for r in rows if "loss" in r]:
        calls = row["tools/call_frequency"] - row["tools/failure_frequency"]
        assert row["rewards/Counter/mean"] == pytest.approx(calls) and calls > 0
    saved = json.loads((tmp_path / "straight" / "checkpoint-2" / "extra.json").read_text())["async"]
    assert any(row["ran"] for row in saved["agent_pool"][0]["rows"])  # calls made before the checkpoint
    calculator(tmp_path, "split", callbacks=[stop_after(2)], **settings)
    calculator(tmp_path, "split", resume=True, **settings)
    assert rows_of(tmp_path / "split") == rows


def test_partial_rollouts_with_tools_in_the_throughput_mode_keep_cut_turns_caches(tmp_path):
    """partial_rollouts=1 with in-flight updates whenever weights arrive (where a turn a window cuts goes on from
    its KV cache: tests/test_partial.py::test_a_tool_pool_window_goes_on_from_the_cache_the_window_before_kept):
    the run trains, and every token's version lies between the weights of the rollout before its own (carried
    rows) and the step."""
    calculator(tmp_path, "run", partial_rollouts=1, max_staleness=2, inflight_weight_updates=True, save_steps=1000)
    steps = [r for r in rows_of(tmp_path / "run") if "loss" in r]
    assert len(steps) == 4 and all(r["tools/call_frequency"] > 0.5 for r in steps)
    for step, r in enumerate(steps):
        assert r["sample/version"] - 1 <= r["sample/token_version_min"] <= r["sample/token_version_mean"] <= step
    assert any(r["partial/carried_share"] > 0 for r in steps)
