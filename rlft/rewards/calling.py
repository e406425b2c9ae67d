"""Resolve reward functions and call them the way TRL does, with errors that say what went wrong.

A reward function is called with keyword arguments `prompts`, `completions`,
`completion_ids`, `trainer_state` and every extra dataset column, and returns one float
or None (not applicable) per completion. `async def` functions run concurrently.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import math
import numbers
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from rlft.rewards.builtins import BUILTIN_REWARDS, get_soft_overlong_punishment


class RewardFunctionError(RuntimeError):
    """A reward function raised or returned something unusable."""


def reward_name(func: Any) -> str:
    return getattr(func, "__name__", None) or type(func).__name__


def resolve_reward(spec: Any, max_completion_length: int) -> Callable:
    """A callable, a built-in name, 'module.path:function', or a reward-model folder."""
    if callable(spec):
        return spec
    if not isinstance(spec, str):
        raise RewardFunctionError(f"reward_funcs entry {spec!r} is neither callable nor a string")
    if spec in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[spec]
    if spec == "soft_overlong":
        return get_soft_overlong_punishment(max_completion_length, max(max_completion_length // 4, 1))
    if ":" in spec and not Path(spec).exists():
        module_name, _, attr = spec.partition(":")
        try:
            return getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as err:
            raise RewardFunctionError(f"reward function {spec!r} could not be imported: {err}") from err
    if Path(spec).is_dir():
        from rlft.rewards.model import RewardModelScorer

        return RewardModelScorer(spec)
    known = sorted([*BUILTIN_REWARDS, "soft_overlong"])
    raise RewardFunctionError(f"reward function {spec!r} is not a built-in ({known}), not 'module:function', "
                              "and not a reward-model folder")


async def _gather(calls):
    return await asyncio.gather(*calls, return_exceptions=True)


def _is_async(func: Callable) -> bool:
    method = type(func).__dict__.get("__call__") if not inspect.isfunction(func) else None
    return inspect.iscoroutinefunction(func) or (method is not None and inspect.iscoroutinefunction(method))


def _invoke_all(funcs: list[Callable], kwargs: dict[str, Any]) -> list[Any]:
    """Call sync functions in order, async ones concurrently; exceptions come back as values."""
    results: list[Any] = [None] * len(funcs)
    pending = []
    for index, func in enumerate(funcs):
        if _is_async(func):
            pending.append((index, func(**kwargs)))
            continue
        try:
            results[index] = func(**kwargs)
        except Exception as err:  # reported with the function's name below
            results[index] = err
    if pending:
        for (index, _), value in zip(pending, asyncio.run(_gather([call for _, call in pending]))):
            results[index] = value
    return results


def _check(name: str, values: Any, expected: int, step: int, completions: list, allow_nan: bool) -> list[float]:
    if isinstance(values, Exception):
        raise RewardFunctionError(f"reward function {name!r} raised at step {step}: "
                                  f"{type(values).__name__}: {values}") from values
    if isinstance(values, torch.Tensor):
        values = values.tolist()
    if not isinstance(values, list | tuple) or len(values) != expected:
        got = len(values) if isinstance(values, list | tuple) else type(values).__name__
        raise RewardFunctionError(f"reward function {name!r} returned {got} values at step {step}; it must return "
                                  f"a list with one float (or None) per completion: {expected}")
    out = []
    for row, value in enumerate(values):
        if value is None:
            out.append(float("nan"))
            continue
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise RewardFunctionError(f"reward function {name!r} returned {value!r} ({type(value).__name__}) for "
                                      f"completion {row} at step {step}: {completions[row]!r}; return float or None")
        if math.isnan(value) and not allow_nan:
            raise RewardFunctionError(f"reward function {name!r} returned NaN for completion {row} at step {step}: "
                                      f"{completions[row]!r}. Return None for 'not applicable', or set "
                                      "allow_nan_rewards: true to treat NaN the same way")
        out.append(float(value))
    return out


def compute_rewards(funcs: list[Callable], names: list[str], *, prompts: list, completions: list,
                    completion_ids: list[list[int]], columns: dict[str, list], step: int,
                    allow_nan: bool = False) -> torch.Tensor:
    """Call every reward function once on the whole rollout -> rewards [N, F] (NaN = not applicable)."""
    kwargs = dict(columns, prompts=prompts, completions=completions, completion_ids=completion_ids,
                  trainer_state={"global_step": step})
    results = _invoke_all(funcs, kwargs)
    rows = [_check(name, values, len(completions), step, completions, allow_nan)
            for name, values in zip(names, results)]
    return torch.tensor(rows, dtype=torch.float32).T.contiguous()
