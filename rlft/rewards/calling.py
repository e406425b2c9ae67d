"""Resolve reward functions and call them the way TRL does, with errors that say what went wrong.

A reward function is called with keyword arguments `prompts`, `completions`,
`completion_ids`, `trainer_state` (transformers' TrainerState), `log_extra(column, values)`,
`log_metric(name, value)` and every extra dataset column, and returns one float or None (not
applicable) per completion. `async def` functions run concurrently.

A reward function that runs long is named: every `REPORT_SECONDS` a warning says which one is still
running and for how long; with `reward_timeout` the calls run in a worker thread and the run stops
with an error naming the one still running once the rollout's rewards take longer (Python cannot
stop a thread: a hung function's thread is left running, as a daemon).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import inspect
import logging
import math
import numbers
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from rlft.errors import RlftError
from rlft.rewards.builtins import BUILTIN_REWARDS, get_soft_overlong_punishment

# squared deviations overflow float32 near 1.8e19; this keeps a wide margin below that
MAX_REWARD = 1e15
# how often a reward function still running is named (a module constant tests shrink)
REPORT_SECONDS = 60.0


class RewardFunctionError(RlftError, RuntimeError):
    """A reward function raised or returned something unusable."""


def reward_name(func: Any) -> str:
    return getattr(func, "__name__", None) or type(func).__name__


def resolve_reward(spec: Any, max_completion_length: int, processing_class=None) -> Callable:
    """A callable, a loaded sequence-classification model, a built-in name, 'module.path:function',
    a reward-model folder or a hub model id."""
    import torch.nn

    if isinstance(spec, torch.nn.Module):
        from rlft.rewards.reward_model import RewardModelScorer

        return RewardModelScorer(spec, tokenizer=processing_class)
    if callable(spec):
        return spec
    if not isinstance(spec, str):
        raise RewardFunctionError(f"reward_funcs entry {spec!r} is neither callable nor a string")
    if spec in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[spec]
    # the run's length; a quarter of it as the cache
    if spec in ("soft_overlong", "get_soft_overlong_punishment"):
        return get_soft_overlong_punishment(max_completion_length, max(max_completion_length // 4, 1))
    if not Path(spec).exists() and (":" in spec or _dotted(spec)):
        module_name, _, attr = spec.partition(":") if ":" in spec else spec.rpartition(".")
        try:
            # TRL's scripts import from the working directory
            if "" not in sys.path and os.getcwd() not in sys.path:
                sys.path.insert(0, os.getcwd())
            return getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as err:
            raise RewardFunctionError(f"reward function {spec!r} could not be imported: {err}") from err
    if Path(spec).is_dir() or (spec.count("/") == 1 and not Path(spec).suffix and not spec.startswith(".")):
        from rlft.rewards.reward_model import RewardModelScorer

        try:
            return RewardModelScorer(spec, tokenizer=processing_class)
        except (OSError, ValueError) as err:
            raise RewardFunctionError(f"reward model {spec!r} could not be loaded: {err}") from err
    known = sorted([*BUILTIN_REWARDS, "soft_overlong", "get_soft_overlong_punishment"])
    raise RewardFunctionError(f"reward function {spec!r} is not a built-in ({known}), not "
                              "'module:function' or 'module.function', not a reward-model folder "
                              "and not a hub model id 'org/name'")


def _dotted(spec: str) -> bool:
    """'my_lib.rewards.custom_reward' (TRL's scripts' form): identifiers joined by dots, no path
    separator."""
    parts = spec.split(".")
    return len(parts) > 1 and "/" not in spec and all(p.isidentifier() for p in parts)


def resolve_rewards(specs: Any, weights: list[float] | None, processing_classes: Any,
                    max_completion_length: int):
    """(functions, unique names, weights tensor) for the trainer's reward_funcs."""
    from rlft.errors import ConfigError

    specs = list(specs) if isinstance(specs, list | tuple) else ([] if specs is None else [specs])
    if not specs:
        raise ConfigError("No reward source provided: pass reward_funcs (a function, a built-in "
                          "name, a reward model), or an environment_factory whose environment "
                          "defines get_reward")
    if weights is not None and len(weights) != len(specs):
        raise ConfigError(f"reward_weights has {len(weights)} values but reward_funcs has "
                          f"{len(specs)}: "
                          "give one weight per reward function")
    if processing_classes is None:
        classes = [None] * len(specs)
    else:  # TRL's rule: one processing class per reward function (None for a plain function)
        classes = (list(processing_classes) if isinstance(processing_classes, list | tuple)
                   else [processing_classes])
    if len(classes) != len(specs):
        raise ConfigError("The number of reward processing classes must match the number of reward "
                          f"functions: reward_processing_classes has {len(classes)} entries, "
                          f"reward_funcs {len(specs)}")
    funcs = [resolve_reward(s, max_completion_length, c) for s, c in zip(specs, classes)]
    names = [reward_name(f) for f in funcs]
    names = [n if names.count(n) == 1 else f"{n}_{i}" for i, n in enumerate(names)]
    return funcs, names, torch.tensor(weights if weights is not None else [1.0] * len(specs),
                                      dtype=torch.float32)


def check_keywords(funcs: list[Callable], names: list[str], columns: list[str]) -> list[str]:
    """Each reward function's keywords against what it will be passed: the dataset's extra columns
    and the standard arguments. A required keyword that nothing supplies is an error now (not a
    TypeError at the first step); a keyword with a default that nothing supplies but that is close
    to a column or argument name is likely a typo: one warning each."""
    import difflib

    from rlft.data.prompts import REWARD_ARGUMENTS

    supplied = [*columns, *REWARD_ARGUMENTS]
    warnings = []
    for func, name in zip(funcs, names):
        try:
            params = inspect.signature(func).parameters.values()
        except (TypeError, ValueError):  # a builtin or C callable without a signature
            continue
        for param in params:
            if param.kind not in (param.POSITIONAL_OR_KEYWORD, param.KEYWORD_ONLY) or param.name in supplied:
                continue
            near = difflib.get_close_matches(param.name, supplied, n=1)
            hint = f" Did you mean {near[0]!r}?" if near else ""
            where = f"no dataset column (columns: {columns or 'only prompt'}) and no argument rlft passes " \
                    f"({', '.join(REWARD_ARGUMENTS)})."
            if param.default is param.empty:
                raise RewardFunctionError(f"reward function {name!r} requires keyword "
                                          f"{param.name!r}, which matches {where}{hint}")
            # a defaulted keyword like no column is a parameter (format_reward's pattern), not a
            # typo
            if near:
                warnings.append(f"reward function {name!r}: keyword {param.name!r} matches {where} "
                                f"It will always get its default {param.default!r}.{hint}")
    return warnings


class RewardLog:
    """What reward functions log during one rollout: `log_metric(name, value)` scalars (averaged,
    and over processes) and `log_extra(column, values)` columns for the completions log."""

    def __init__(self):
        self.scalars: dict[str, list[float]] = {}
        self.extra: dict[str, list] = {}

    def log_metric(self, name: str, value: float) -> None:
        self.scalars.setdefault(str(name), []).append(float(value))

    def log_extra(self, column: str, values: list) -> None:
        self.extra.setdefault(str(column), []).extend(list(values))

    def metrics(self, accelerator) -> dict[str, float]:
        names = sorted(self.scalars)
        if accelerator.num_processes > 1:
            from accelerate.utils import gather_object

            names = sorted({n for part in gather_object([names]) for n in part})
        local = torch.tensor([[sum(self.scalars.get(n, [])), len(self.scalars.get(n, []))] for n in names],
                             dtype=torch.float64, device=accelerator.device).reshape(-1, 2)
        totals = accelerator.reduce(local, "sum") if accelerator.num_processes > 1 else local
        return {n: (s / c if c else float("nan")) for n, (s, c) in zip(names, totals.tolist())}

    def columns(self, rows: int) -> dict[str, list]:
        """Columns with one value per completion (others are dropped: they cannot be lined up)."""
        return {k: v for k, v in self.extra.items() if len(v) == rows}


async def _gather(calls):
    return await asyncio.gather(*calls, return_exceptions=True)


def _is_async(func: Callable) -> bool:
    method = type(func).__dict__.get("__call__") if not inspect.isfunction(func) else None
    return inspect.iscoroutinefunction(func) or (method is not None and inspect.iscoroutinefunction(method))


class Running:
    """Which reward functions are running now and since when; shared by the thread calling them and
    the one watching them."""

    def __init__(self):
        self._lock = threading.Lock()
        self._since: dict[str, float] = {}

    @contextlib.contextmanager
    def call(self, name: str):
        with self._lock:
            self._since[name] = time.monotonic()
        try:
            yield
        finally:
            with self._lock:
                self._since.pop(name, None)

    def now(self) -> list[tuple[str, float]]:
        """(name, seconds running) of each function running now, longest first."""
        moment = time.monotonic()
        with self._lock:
            return sorted(((n, moment - s) for n, s in self._since.items()), key=lambda item: -item[1])


def _invoke_all(funcs: list[Callable], names: list[str], kwargs: dict[str, Any],
                running: Running | None = None) -> list[Any]:
    """Call sync functions in order, async ones concurrently; exceptions come back as values.
    `running` learns which function runs when."""
    running = running or Running()
    results: list[Any] = [None] * len(funcs)
    pending = []
    for index, (func, name) in enumerate(zip(funcs, names)):
        if _is_async(func):
            pending.append((index, name, func(**kwargs)))
            continue
        with running.call(name):
            try:
                results[index] = func(**kwargs)
            except Exception as err:  # reported with the function's name below
                results[index] = err
    if pending:
        async def tracked(name, coroutine):
            with running.call(name):
                return await coroutine

        calls = [tracked(name, coroutine) for _, name, coroutine in pending]
        for (index, _, _), value in zip(pending, asyncio.run(_gather(calls))):
            results[index] = value
    return results


def _log_waiting(name: str, seconds: float, step: Any, message: str) -> None:
    logging.getLogger("rlft").warning(message)


def _still_running(running: Running, step: Any, timeout: float | None,
                   report: Callable = _log_waiting) -> None:
    """Name each reward function still running: report(name, seconds, step, message) (the trainer's:
    the console, the run's log and its trackers; Python's `rlft` logger otherwise)."""
    limit = (f"reward_timeout={timeout:g} s stops the run" if timeout is not None else
             "no reward_timeout: set one to stop the run when a reward function hangs; Ctrl-C "
             "twice stops it now")
    for name, seconds in running.now():
        report(name, seconds, step,
               f"reward function {name!r} is still running after {seconds:.0f} s at step {step} "
               f"({limit})")


def _timed_out(running: Running, step: Any, timeout: float) -> RewardFunctionError:
    late = running.now()
    names = ", ".join(repr(name) for name, _ in late) or "the reward functions"
    took = f"; it has run {late[0][1]:.1f} s" if late else ""
    return RewardFunctionError(
        f"reward function {names} did not return within reward_timeout={timeout:g} s at step "
        f"{step}{took}. "
        "The run stops here (its thread is left running in the background). Make the function "
        "faster or give it its own time limit (a request timeout, a sandbox limit), or raise "
        "reward_timeout (null: no limit)")


def _watched(work: Callable[[], Any], running: Running, step: Any, timeout: float | None,
             report: Callable = _log_waiting) -> Any:
    """work(), naming what still runs every REPORT_SECONDS. Without a timeout it runs in this thread
    and a watcher thread names it; with one it runs in a daemon thread, in this thread's grad mode,
    and this thread stops waiting after `timeout` seconds with an error naming what still runs."""
    if timeout is None:
        done = threading.Event()

        def watch():
            while not done.wait(REPORT_SECONDS):
                _still_running(running, step, None, report)

        threading.Thread(target=watch, daemon=True, name="rlft-reward-watch").start()
        try:
            return work()
        finally:
            done.set()
    outcome: dict[str, Any] = {}
    grad = torch.is_grad_enabled()

    def run():
        try:
            with torch.set_grad_enabled(grad):
                outcome["value"] = work()
        except BaseException as err:  # raised in the caller's thread below
            outcome["error"] = err

    worker = threading.Thread(target=run, daemon=True, name="rlft-reward-functions")
    started = time.monotonic()
    next_report, deadline = started + REPORT_SECONDS, started + timeout
    worker.start()
    while True:
        worker.join(max(0.0, min(deadline, next_report) - time.monotonic()))
        if not worker.is_alive():
            break
        if time.monotonic() >= deadline:
            raise _timed_out(running, step, timeout)
        _still_running(running, step, timeout, report)
        next_report += REPORT_SECONDS
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def _check(name: str, values: Any, expected: int, step: int, completions: list,
           allow_nan: bool) -> list[float]:
    if isinstance(values, Exception):
        raise RewardFunctionError(f"reward function {name!r} raised at step {step}: "
                                  f"{type(values).__name__}: {values}") from values
    if isinstance(values, torch.Tensor):
        values = values.tolist()
    if not isinstance(values, list | tuple) or len(values) != expected:
        got = len(values) if isinstance(values, list | tuple) else type(values).__name__
        raise RewardFunctionError(f"reward function {name!r} returned {got} values at step {step}; "
                                  "it must return a list with one float (or None) per completion: "
                                  f"{expected}")
    out = []
    for row, value in enumerate(values):
        if value is None:
            out.append(float("nan"))
            continue
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise RewardFunctionError(f"reward function {name!r} returned {value!r} "
                                      f"({type(value).__name__}) for completion {row} at step "
                                      f"{step}: {completions[row]!r}; "
                                      "return float or None")
        if math.isnan(value) and not allow_nan:
            raise RewardFunctionError(f"reward function {name!r} returned NaN for completion {row} "
                                      f"at step {step}: {completions[row]!r}. "
                                      "Return None for 'not applicable', or set "
                                      "allow_nan_rewards: true to treat NaN the same way")
        if math.isinf(value) or abs(value) > MAX_REWARD:
            raise RewardFunctionError(f"reward function {name!r} returned {value!r} for completion "
                                      f"{row} at step {step}: {completions[row]!r}. Rewards must "
                                      f"be finite and below {MAX_REWARD:g} in magnitude (group "
                                      "statistics would overflow); rescale the reward")
        out.append(float(value))
    return out


def compute_rewards(funcs: list[Callable], names: list[str], *, prompts: list, completions: list,
                    completion_ids: list[list[int]], columns: dict[str, list], trainer_state: Any,
                    reward_log: RewardLog, allow_nan: bool = False,
                    timeout: float | None = None, report: Callable = _log_waiting) -> torch.Tensor:
    """Call every reward function once on the whole rollout -> rewards [N, F] (NaN = not
    applicable). `timeout` (reward_timeout): seconds they may take together before the run stops
    naming the one still running; `report(name, seconds, step, message)` hears every REPORT_SECONDS
    which one still runs."""
    kwargs = dict(columns, prompts=prompts, completions=completions, completion_ids=completion_ids,
                  trainer_state=trainer_state, log_extra=reward_log.log_extra,
                  log_metric=reward_log.log_metric)
    step = getattr(trainer_state, "global_step", trainer_state)
    if not funcs:  # (distillation: no reward function) -> [N, 0]
        return torch.zeros(len(completions), 0)
    running = Running()
    results = _watched(lambda: _invoke_all(funcs, names, kwargs, running), running, step, timeout, report)
    rows = [_check(name, values, len(completions), step, completions, allow_nan)
            for name, values in zip(names, results)]
    rewards = torch.tensor(rows, dtype=torch.float32).T.contiguous()  # [N, F]
    unscored = torch.isnan(rewards).all(dim=1).nonzero()
    if len(unscored):  # TRL's warning, with the first such row's arguments
        row = int(unscored[0])
        shown = {k: v[row] for k, v in columns.items() if isinstance(v, list) and len(v) == len(completions)}
        logging.getLogger("rlft").warning(
            "All reward functions returned None for the following kwargs:\n%s\nPlease ensure that "
            "at least one reward function returns a valid reward (%d of %d completions have none; "
            "they get no advantage)",
            {**shown, "prompt": prompts[row], "completion": completions[row]}, len(unscored),
            len(completions))
    return rewards


def _repeat(values: list, times: int) -> list:
    return [v for v in values for _ in range(times)]


class RewardScorer:
    """A rollout's rewards from every reward function, called as TRL calls them: the completions
    decoded (or, for multi-turn rollouts, as the chat messages the rollout recorded), each prompt's
    dataset columns repeated
    for its `group` completions, the rollout's own per-row values (environments, rollout_func
    keys)."""

    def __init__(self, funcs: list[Callable], names: list[str], tokenizer, trainer_state: Any,
                 allow_nan: bool = False, timeout: float | None = None, report: Callable = _log_waiting):
        self.funcs, self.names, self.tokenizer = funcs, names, tokenizer
        self.trainer_state, self.allow_nan, self.timeout = trainer_state, allow_nan, timeout
        self.report = report  # (name, seconds, step, message): a reward function still running

    def __call__(self, rollout, prompts: dict, group: int,
                 reward_log: RewardLog | None = None) -> tuple[torch.Tensor, list]:
        """(rewards [N, F], the completions the functions received) for the rows of `rollout`, whose
        prompts are the PromptSet batch `prompts`."""
        mask = rollout.completion_mask.bool()
        ids = [row[m].tolist() for row, m in zip(rollout.completion_ids.cpu(), mask.cpu())]
        texts = self.tokenizer.batch_decode(ids, skip_special_tokens=True)
        repeated_prompts = _repeat(prompts["prompts"], group)
        completions = [[{"role": "assistant", "content": t}] if isinstance(p, list) else t
                       for p, t in zip(repeated_prompts, texts)]
        if rollout.completions is not None:  # multi-turn: the assistant and tool messages
            completions = rollout.completions
        columns = {k: _repeat(v, group) for k, v in prompts.items() if k not in ("prompts", "prompt_ids")}
        # TRL passes environments=None without them
        columns.update({"environments": None, **rollout.extra})
        rewards = compute_rewards(self.funcs, self.names, prompts=repeated_prompts, completions=completions,
                                  completion_ids=ids, columns=columns, trainer_state=self.trainer_state,
                                  reward_log=reward_log or RewardLog(), allow_nan=self.allow_nan,
                                  timeout=self.timeout, report=self.report)
        return rewards, completions
