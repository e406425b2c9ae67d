"""TRL's `environment_factory` and `rollout_func`.

Environment (TRL's shape): `factory()` returns an object with `reset(**row) -> str | None` (called once per
rollout row with the dataset row; a string is appended to the prompt's last user message), public methods
that are the row's tools (schemas from their signatures and docstrings, like `tools=`), and optionally
`get_reward() -> float`, which makes the environment a reward source (named after its class, weight 1).
Instances are pooled and reused: one per completion row at a time. Reward functions receive them as
`environments=`.

`rollout_func(prompts, trainer) -> dict`: the escape hatch that replaces generation. It gets this
process's prompts (each once) and returns, for num_generations completions per prompt in a row,
`prompt_ids`, `completion_ids`, `logprobs` (or None) and optionally `env_mask` (1 = trained, 0 = tokens the
policy did not generate); any other key is a per-row list passed to reward functions under that name.
"""

from __future__ import annotations

import inspect

import torch

from rlft.config import ConfigError
from rlft.data.prompts import left_pad, right_pad
from rlft.rollout.hf import Rollout
from rlft.rollout.multiturn import Toolset
from rlft.rollout.tools import tool_schemas

RESERVED = ("reset", "get_reward")


class Environments:
    """A pool of environment instances from one factory."""

    def __init__(self, factory, tools: list):
        if isinstance(factory, dict):
            raise ConfigError("environment_factory as a dict of several environments is not built; pass one factory")
        if not callable(factory):
            raise ConfigError(f"environment_factory must be a callable returning an environment, got {factory!r}")
        probe = factory()
        self.kind = type(probe)
        if not callable(getattr(probe, "reset", None)):
            raise ConfigError(f"environment {self.kind.__name__} has no reset() method: define reset(self, **row), "
                              "returning None or a string appended to the prompt")
        self.factory, self.tools, self.pool = factory, list(tools), [probe]
        self.owns_reward = callable(getattr(probe, "get_reward", None))
        self.schemas = tool_schemas(self.tools + self._methods(probe))  # checked once, the same for every instance

    def _methods(self, env) -> list:
        # Listed on the class: getmembers on the instance would evaluate properties
        return [getattr(env, name) for name, _ in inspect.getmembers(type(env), predicate=inspect.isfunction)
                if name not in RESERVED and not name.startswith("_")]

    def take(self, count: int) -> list:
        while len(self.pool) < count:
            self.pool.append(self.factory())
        return self.pool[:count]

    def toolset(self, env) -> Toolset:
        functions = self.tools + self._methods(env)
        return Toolset({f.__name__: f for f in functions}, self.schemas)

    def reset(self, envs: list, rows: list[dict]) -> list:
        """Reset each environment with its dataset row; the prompts, each extended by what its reset returned."""
        prompts = []
        for index, (env, row) in enumerate(zip(envs, rows, strict=True)):
            observation = env.reset(**row)
            prompt = row["prompt"]
            if observation is not None:
                if not isinstance(observation, str):
                    raise ConfigError(f"{self.kind.__name__}.reset() returned {type(observation).__name__} for row "
                                      f"{index}: return None or a string to append to the prompt")
                prompt = prompt[:-1] + [{**prompt[-1], "content": prompt[-1]["content"] + observation}]
            prompts.append(prompt)
        return prompts

    def reward_function(self):
        """The environments' own reward as a reward function (TRL's: named after the class, weight 1)."""
        def reward(environments=None, **_):
            return [float(env.get_reward()) for env in environments]

        reward.__name__ = self.kind.__name__
        return reward


def function_rollout(func, prompts: list, trainer, num_generations: int, eos_ids: list[int],
                     pad_id: int, max_length: int, device) -> Rollout:
    """Call a user's rollout_func and check what it returned, naming the key and row that is wrong."""
    out = func(prompts, trainer)
    if not isinstance(out, dict):
        raise ConfigError(f"rollout_func returned {type(out).__name__}; return a dict with prompt_ids, completion_ids "
                          "and logprobs")
    missing = [k for k in ("prompt_ids", "completion_ids", "logprobs") if k not in out]
    if missing:
        raise ConfigError(f"rollout_func's dict lacks {missing} (logprobs may be None)")
    rows = len(prompts) * num_generations
    for key, value in out.items():
        if value is not None and (not isinstance(value, list | tuple) or len(value) != rows):
            raise ConfigError(f"rollout_func's {key!r} must be a list of {rows} rows ({len(prompts)} prompts x "
                              f"num_generations={num_generations}), got {_size(value)}")
    completions = [list(map(int, ids)) for ids in out["completion_ids"]]
    for key in ("logprobs", "env_mask"):
        for row, values in enumerate(out.get(key) or []):
            if len(values) != len(completions[row]):
                raise ConfigError(f"rollout_func's {key!r} row {row} has {len(values)} values for "
                                  f"{len(completions[row])} completion tokens")
    for row, ids in enumerate(completions):
        if not ids or len(ids) > max_length:
            raise ConfigError(f"rollout_func's completion row {row} has {len(ids)} tokens; each needs 1 to "
                              f"max_completion_length={max_length}")
    prompt_ids, prompt_mask = left_pad([list(map(int, p)) for p in out["prompt_ids"]], pad_id)
    ids, mask = right_pad(completions, pad_id)
    logps = right_pad([list(map(float, r)) for r in out["logprobs"]], 0.0, torch.float32)[0] \
        if out["logprobs"] is not None else None
    if logps is not None and not bool(torch.isfinite(logps).all()):
        raise ConfigError("rollout_func's logprobs hold a non-finite value")
    tool_mask = right_pad([list(map(int, r)) for r in out["env_mask"]], 0)[0] if out.get("env_mask") is not None \
        else None
    truncated = torch.tensor([c[-1] not in eos_ids for c in completions])
    extra = {k: list(v) for k, v in out.items() if k not in ("prompt_ids", "completion_ids", "logprobs", "env_mask")}
    return Rollout(prompt_ids.to(device), prompt_mask.to(device), ids.to(device), mask.to(device), truncated.to(device),
                   None if logps is None else logps.to(device),
                   None if tool_mask is None else tool_mask.to(device), extra=extra)


def _size(value) -> str:
    return f"{len(value)} rows" if isinstance(value, list | tuple) else type(value).__name__

