"""Reward functions: TRL's calling convention, errors that name the culprit, built-ins."""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time

import pytest
import torch
from transformers import TrainerState

from rlft.rewards import (
    RewardFunctionError,
    RewardLog,
    accuracy_reward,
    compute_rewards,
    exact_match_reward,
    format_reward,
    get_soft_overlong_punishment,
    math_verify_reward,
    resolve_reward,
)


def call(funcs, completions=("<answer>4</answer>", "<answer>5</answer>"), allow_nan=False, timeout=None,
         **columns):
    completions = list(completions)
    columns = columns or {"answer": ["4"] * len(completions)}
    return compute_rewards(funcs, [getattr(f, "__name__", "f") for f in funcs], prompts=["q"] * len(completions),
                           completions=completions, completion_ids=[[1, 2]] * len(completions),
                           columns=columns, trainer_state=TrainerState(global_step=7), reward_log=RewardLog(),
                           allow_nan=allow_nan, timeout=timeout)


def test_extra_columns_arrive_as_keyword_arguments_and_none_is_nan():
    seen = {}

    def reward(prompts, completions, completion_ids, answer, trainer_state, **kwargs):
        seen.update(prompts=prompts, answer=answer, step=trainer_state.global_step)
        return [1.0, None]

    rewards = call([reward])
    assert rewards[0, 0] == 1.0 and math.isnan(rewards[1, 0])
    assert seen == {"prompts": ["q", "q"], "answer": ["4", "4"], "step": 7}


def test_async_reward_functions_run_concurrently():
    """Each waits for the other's signal: run one after the other, they would time out."""
    first, second = asyncio.Event(), asyncio.Event()

    async def ping(completions, **kwargs):
        first.set()
        await asyncio.wait_for(second.wait(), timeout=5)
        return [1.0] * len(completions)

    async def pong(completions, **kwargs):
        second.set()
        await asyncio.wait_for(first.wait(), timeout=5)
        return [2.0] * len(completions)

    rewards = call([ping, pong])
    assert rewards[:, 0].tolist() == [1.0, 1.0] and rewards[:, 1].tolist() == [2.0, 2.0]


def test_raising_function_is_named_with_step():
    def broken(completions, **kwargs):
        raise KeyError("solution")

    with pytest.raises(RewardFunctionError, match=r"'broken' raised at step 7: KeyError: 'solution'"):
        call([broken])


def test_wrong_length_is_named():
    def short(completions, **kwargs):
        return [1.0]

    with pytest.raises(RewardFunctionError, match=r"'short' returned 1 values at step 7; .* one float \(or None\) per "
                                                  r"completion: 2"):
        call([short])


def test_non_number_names_the_example():
    def stringy(completions, **kwargs):
        return [1.0, "yes"]

    with pytest.raises(RewardFunctionError, match=r"'stringy' returned 'yes' \(str\) for completion 1 at step 7: "
                                                  r"'<answer>5</answer>'"):
        call([stringy])


def test_nan_is_an_error_unless_allowed():
    def nan(completions, **kwargs):
        return [float("nan"), 1.0]

    with pytest.raises(RewardFunctionError, match="returned NaN for completion 0 at step 7.*allow_nan_rewards"):
        call([nan])
    assert math.isnan(call([nan], allow_nan=True)[0, 0])


def test_exact_match_reward_normalises_answers():
    completions = ["<answer> 1,000 </answer>", "so 42.0", "<answer>x</answer>", "nothing", "<answer>7</answer>"]
    assert exact_match_reward(completions, ["1000", "42", "X", "3", None]) == [1.0, 1.0, 1.0, 0.0, None]


def test_exact_match_reward_reads_chat_completions():
    assert exact_match_reward([[{"role": "assistant", "content": "<answer>9</answer>"}]], ["9"]) == [1.0]


def test_math_verify_reward_is_thread_safe_and_extracts_answer_tags():
    results = {}

    def work():
        results["value"] = math_verify_reward(["<answer>\\frac{1}{2}</answer>", "<answer>0.3</answer>", "1/2"],
                                              solution=["$0.5$", "$\\frac{1}{2}$", "not math at all ###"])

    thread = threading.Thread(target=work)
    thread.start()
    thread.join(timeout=60)
    assert results["value"][:2] == [1.0, 0.0]
    assert results["value"][2] is None  # unparseable gold: not applicable, not a silent 0


def test_format_reward_default_and_custom_pattern():
    assert format_reward(["<answer>3</answer>", "<think>hm</think> <answer>3</answer>", "3"]) == [1.0, 1.0, 0.0]
    assert format_reward(["abc", "abd"], pattern=r"^abc$") == [1.0, 0.0]


def test_format_reward_rejects_repeated_closing_tags():
    """Seen in a demo run: a policy padded correct answers with extra closing tags."""
    hacked = ["<answer>106</answer></answer></answer>", "<answer>1</answer><answer>2</answer>", "<answer>1</answer> x"]
    assert format_reward(hacked) == [0.0, 0.0, 0.0]


def test_soft_overlong_punishment_follows_dapo():
    reward = get_soft_overlong_punishment(max_completion_len=10, soft_punish_cache=4)
    ids = [[0] * n for n in (6, 8, 10, 11)]
    assert reward(completion_ids=ids) == [0.0, -0.5, -1.0, -1.0]


def test_resolve_builtin_module_path_and_unknown():
    assert resolve_reward("accuracy", 8) is accuracy_reward
    assert resolve_reward("tests.helpers:correct_answer", 8).__name__ == "correct_answer"
    with pytest.raises(RewardFunctionError, match="could not be imported"):
        resolve_reward("tests.helpers:nope", 8)


def test_a_reward_that_outlasts_reward_timeout_stops_the_run_naming_it_the_step_and_the_seconds():
    release = threading.Event()

    def quick(completions, **kwargs):
        return [1.0] * len(completions)

    def hangs(completions, **kwargs):
        release.wait(60)  # a function that never returns (released after the test)
        return [0.0] * len(completions)

    started = time.monotonic()
    try:
        with pytest.raises(RewardFunctionError, match=r"reward function 'hangs' did not return within "
                                                      r"reward_timeout=0.5 s at step 7; it has run \d+\.\d s\. The run "
                                                      r"stops here.*Make the function faster.*raise reward_timeout"):
            call([quick, hangs], timeout=0.5)
        assert time.monotonic() - started < 5  # promptly, not when the function returns
    finally:
        release.set()


@pytest.mark.parametrize("timeout, limit", [(None, "no reward_timeout: set one"),
                                            (30.0, "reward_timeout=30 s stops the run")])
def test_a_reward_still_running_is_named_every_report_interval(monkeypatch, caplog, timeout, limit):
    import rlft.rewards.calling as calling

    monkeypatch.setattr(calling, "REPORT_SECONDS", 0.2)

    def slow(completions, **kwargs):
        time.sleep(0.75)
        return [1.0] * len(completions)

    with caplog.at_level(logging.WARNING, logger="rlft"):
        rewards = call([slow], timeout=timeout)
    lines = [r.getMessage() for r in caplog.records if "still running" in r.getMessage()]
    assert rewards[:, 0].tolist() == [1.0, 1.0] and 2 <= len(lines) <= 4
    assert lines[0].startswith("reward function 'slow' is still running after 0 s at step 7 (" + limit)


def test_with_reward_timeout_the_calls_keep_their_order_results_and_errors():
    order = []

    def first(completions, **kwargs):
        order.append("first")
        return [1.0, 2.0]

    async def concurrent(completions, **kwargs):
        return [3.0, 4.0]

    def last(completions, **kwargs):
        order.append("last")
        return [5.0, None]

    watched = call([first, concurrent, last], timeout=30.0)
    assert order == ["first", "last"]
    assert torch.equal(watched.nan_to_num(-1), call([first, concurrent, last]).nan_to_num(-1))

    def broken(completions, **kwargs):
        raise KeyError("answer")

    with pytest.raises(RewardFunctionError, match=r"reward function 'broken' raised at step 7: KeyError"):
        call([first, broken], timeout=30.0)


def test_with_reward_timeout_functions_run_in_the_callers_grad_mode():
    seen = []

    def records_grad_mode(completions, **kwargs):
        seen.append(torch.is_grad_enabled())
        return [0.0] * len(completions)

    with torch.no_grad():
        call([records_grad_mode], timeout=30.0)
    call([records_grad_mode], timeout=30.0)
    assert seen == [False, True]


def test_during_training_a_slow_reward_is_named_on_the_console_and_to_the_trackers(tmp_path, shipped_policy_dir,
                                                                                    monkeypatch, capsys):
    """Nothing configures Python's logging here: the line still reaches the console (stderr), and the seconds
    so far reach the run's trackers (`rewards/<name>/running_seconds`)."""
    import rlft.rewards.calling as calling
    from rlft import GRPOTrainer
    from tests.helpers import addition_rows, tiny_grpo_config

    monkeypatch.setattr(calling, "REPORT_SECONDS", 0.2)

    def sleepy(completions, **kwargs):
        time.sleep(0.5)
        return [1.0] * len(completions)

    cfg = tiny_grpo_config(tmp_path, max_steps=1, report_to=["tensorboard"], log_completions=False)
    GRPOTrainer(str(shipped_policy_dir), [sleepy], cfg, addition_rows(8)).train()
    err = " ".join(capsys.readouterr().err.split())
    assert "reward function 'sleepy' is still running after 0 s at step 0 (no reward_timeout" in err
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(next((tmp_path / "run" / "runs").rglob("events.out.*")).parent))
    events.Reload()
    assert "rewards/sleepy/running_seconds" in events.Tags()["scalars"]
