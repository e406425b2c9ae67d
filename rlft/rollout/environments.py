"""TRL's `environment_factory` and `rollout_func`.

Environment (TRL's shape): `factory()` returns an object with `reset(**row) -> str | None` (called
once per rollout row with the dataset row; a string is appended to the prompt's last user message),
public methods that are the row's tools (schemas from their signatures and docstrings, like
`tools=`), and optionally `get_reward() -> float`, which makes the environment a reward source
(named after its class, weight 1). Instances are pooled and reused: one per completion row at a
time. Reward functions receive them as `environments=`.

`rollout_func(prompts, trainer) -> dict`: the escape hatch that replaces generation. It gets this
process's prompts (each once) and returns, for num_generations completions per prompt in a row,
`prompt_ids`, `completion_ids`, `logprobs` (or None) and optionally `env_mask` (1 = trained, 0 =
tokens the policy did not generate); any other key is a per-row list passed to reward functions
under that name.
"""

from __future__ import annotations

import inspect

import torch

from rlft.data.prompts import left_pad, right_pad
from rlft.errors import ConfigError
from rlft.rollout.base import Rollout
from rlft.rollout.multiturn import Toolset
from rlft.rollout.tools import tool_schemas

RESERVED = ("reset", "get_reward")


class Environments:
    """Pools of environment instances: one factory (every row uses it), or TRL's dict of named
    factories, where each row's `environment` column picks its environment and only that
    environment's tools are in its prompt."""

    def __init__(self, factories, tools: list):
        self.multi = isinstance(factories, dict)
        factories = factories if self.multi else {None: factories}
        if not factories:
            raise ConfigError("environment_factory is an empty dict: give at least one name: "
                              "factory")
        self.factories, self.tools = dict(factories), list(tools)
        self.pools, self.kinds, self.schemas, self.tools_of = {}, {}, {}, {}
        self.lanes: dict[tuple, list] = {}  # (lane > 0, name) -> instances
        for name, factory in self.factories.items():
            if not callable(factory):
                raise ConfigError(f"environment_factory{'' if name is None else f'[{name!r}]'} "
                                  f"must be a callable returning an environment, got {factory!r}")
            probe = factory()
            kind = type(probe)
            if not callable(getattr(probe, "reset", None)):
                raise ConfigError(f"environment {kind.__name__} has no reset() method: define "
                                  "reset(self, **row), returning None or a string appended to the "
                                  "prompt")
            self.pools[name], self.kinds[name] = [probe], kind
            # the probe's bound methods (TRL's `_env_tools`)
            self.tools_of[name] = self.tools + _methods(probe)
            # checked once, the same per instance
            self.schemas[name] = tool_schemas(self.tools_of[name])
        self.owners = list(dict.fromkeys(k for k in self.kinds.values()
                                         if callable(getattr(k, "get_reward", None))))

    @property
    def all_schemas(self) -> list[dict]:
        """Every environment's tools once (the up-front rendering of prompts; each row's own is
        rendered later)."""
        seen = {}
        for schemas in self.schemas.values():
            for schema in schemas:
                seen.setdefault(schema["function"]["name"], schema)
        return list(seen.values())

    def names(self, rows: list[dict]) -> list:
        """Each row's environment: the `environment` column with a dict of factories, else the one
        factory."""
        if not self.multi:
            return [None] * len(rows)
        for index, row in enumerate(rows):
            if row.get("environment") not in self.factories:
                raise ConfigError(f"row {index} has environment={row.get('environment')!r}, "
                                  "which is not among the environments passed to "
                                  f"environment_factory: {list(self.factories)}")
        return [row["environment"] for row in rows]

    def take(self, names: list, lane: int = 0) -> list:
        """One instance per row, reused across batches; a pool grows only when a batch needs more at
        once. `lane`: batches in flight at once (partial rollouts' look-ahead) take from separate
        lanes, so no instance serves two of them."""
        handed, out = {}, []
        for name in names:
            pool, index = self.pools[name] if lane == 0 else self.lanes.setdefault((lane, name), []), \
                handed.get(name, 0)
            if index == len(pool):
                pool.append(self.factories[name]())
            handed[name] = index + 1
            out.append(pool[index])
        self.latest = out
        return out

    def __getitem__(self, row: int):
        """The instance that served row `row` of the latest rollout (TRL's
        `trainer.environments[row]`)."""
        return getattr(self, "latest", [])[row]

    def __len__(self) -> int:
        return len(getattr(self, "latest", []))

    def __bool__(self) -> bool:  # configured environments are there before any rollout used one
        return True

    def toolset(self, env, name=None) -> Toolset:
        functions = self.tools + _methods(env)
        return Toolset({f.__name__: f for f in functions}, self.schemas[name])

    def reset(self, envs: list, rows: list[dict]) -> list:
        """Reset each environment with its dataset row; the prompts, each extended by what its reset
        returned."""
        prompts = []
        for index, (env, row) in enumerate(zip(envs, rows, strict=True)):
            # `environment` only routes the row (TRL's control field): reset gets the dataset's
            # columns
            columns = {k: v for k, v in row.items() if not (self.multi and k == "environment")}
            observation = env.reset(**columns)
            prompt = row["prompt"]
            if observation is not None:
                if not isinstance(observation, str):
                    raise ConfigError(f"{type(env).__name__}.reset() returned "
                                      f"{type(observation).__name__} for row {index}: return None "
                                      "or a string to append to the prompt")
                prompt = prompt[:-1] + [{**prompt[-1], "content": prompt[-1]["content"] + observation}]
            prompts.append(prompt)
        return prompts

    def reward_functions(self) -> list:
        """Each environment class that owns its reward, as a reward function (TRL's: named after the
        class, weight 1); a row whose environment is another class gets None from it."""
        return [_owned_reward(kind) for kind in self.owners]


def _methods(env) -> list:
    # Listed on the class: getmembers on the instance would evaluate properties
    return [getattr(env, name) for name, _ in inspect.getmembers(type(env), predicate=inspect.isfunction)
            if name not in RESERVED and not name.startswith("_")]


def _owned_reward(kind):
    if inspect.iscoroutinefunction(kind.get_reward):
        async def reward(environments=None, **_):
            return [float(await env.get_reward()) if type(env) is kind else None for env in environments]
    else:
        def reward(environments=None, **_):
            return [float(env.get_reward()) if type(env) is kind else None for env in environments]
    reward.__name__ = kind.__name__
    return reward


def function_rollout(func, prompts: list, num_generations: int, eos_ids: list[int], pad_id: int,
                     max_length: int, device) -> Rollout:
    """Call a user's rollout_func (bound to its trainer: `func(prompts)`) and check what it
    returned, naming the key and row that is wrong."""
    out = func(prompts)
    if not isinstance(out, dict):
        raise ConfigError(f"rollout_func returned {type(out).__name__}; return a dict with "
                          "prompt_ids, completion_ids and logprobs")
    missing = [k for k in ("prompt_ids", "completion_ids", "logprobs") if k not in out]
    if missing:
        raise ConfigError(f"rollout_func's dict lacks {missing} (logprobs may be None)")
    rows = len(prompts) * num_generations
    for key, value in out.items():
        if value is not None and (not isinstance(value, list | tuple) or len(value) != rows):
            raise ConfigError(f"rollout_func's {key!r} must be a list of {rows} rows "
                              f"({len(prompts)} prompts x num_generations={num_generations}), got "
                              f"{_size(value)}")
    completions = [list(map(int, ids)) for ids in out["completion_ids"]]
    for key in ("logprobs", "env_mask"):
        for row, values in enumerate(out.get(key) or []):
            if len(values) != len(completions[row]):
                raise ConfigError(f"rollout_func's {key!r} row {row} has {len(values)} values for "
                                  f"{len(completions[row])} completion tokens")
    for row, ids in enumerate(completions):
        if not ids or len(ids) > max_length:
            raise ConfigError(f"rollout_func's completion row {row} has {len(ids)} tokens; each "
                              f"needs 1 to max_completion_length={max_length}")
    prompt_ids, prompt_mask = left_pad([list(map(int, p)) for p in out["prompt_ids"]], pad_id)
    ids, mask = right_pad(completions, pad_id)
    logps = right_pad([list(map(float, r)) for r in out["logprobs"]], 0.0, torch.float32)[0] \
        if out["logprobs"] is not None else None
    if logps is not None and not bool(torch.isfinite(logps).all()):
        raise ConfigError("rollout_func's logprobs hold a non-finite value")
    tool_mask = (right_pad([list(map(int, r)) for r in out["env_mask"]], 0)[0]
                 if out.get("env_mask") is not None else None)
    truncated = torch.tensor([c[-1] not in eos_ids for c in completions])
    extra = {k: list(v) for k, v in out.items()
             if k not in ("prompt_ids", "completion_ids", "logprobs", "env_mask")}
    return Rollout(prompt_ids.to(device), prompt_mask.to(device), ids.to(device), mask.to(device),
                   truncated.to(device), None if logps is None else logps.to(device),
                   None if tool_mask is None else tool_mask.to(device), extra=extra)


def _size(value) -> str:
    return f"{len(value)} rows" if isinstance(value, list | tuple) else type(value).__name__

