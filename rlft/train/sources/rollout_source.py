"""Where a GRPO trainer's rollouts come from: a `RolloutSource` turns a rollout index into a
`ScoredRollout` (the prompts of that index, num_generations completions each, every reward
function's rewards), and owns whatever that takes between rollouts (`state_dict()` /
`load_state_dict()` go into checkpoints).

Sources are chosen by the config's `rollout_source` from `SOURCES` (`register_source(name, cls)`
adds one: a class built from the `SourceParts`, usually a `SourceBase`, whose `check` runs before
the model is loaded):
    generate   `GeneratedSource`: the engine the config asks for (generate, vLLM, a tool loop,
               environments,
               rollout_func) samples the rollout when its step comes
    producer   `ProducerSource` (rlft/train/sources/async_source.py): a producer process samples
               rollouts ahead of the trainer on a fixed, reproducible schedule (AsyncGRPOTrainer)
    gkd        `GKDSource` (rlft/train/gkd.py): the student's, the teacher's or the dataset's
               completions
               (GKDTrainer)
    worker     `WorkerSource` (rlft/train/sources/worker_source.py): the scored samples of the user's
               rollout worker (AsyncGRPOTrainer's rollout_worker=, TRL's)
    sdft       `SDFTSource` (rlft/train/sdft.py): the student's completions, with each row's teacher
               prompt (SDFTTrainer)
    sdpo       `SDPOSource` (rlft/train/sdpo.py): GRPO's rollouts, each row's teacher prompt made
               from its group's successes (SDPOTrainer)
and `dynamic_sampling: true` wraps the chosen one in `DynamicSampling`
(rlft/train/sources/dynamic_sampling.py).

Prompts: rollout r of an epoch takes, from the epoch's seeded permutation, the r-th block of
prompts, each process its own slice of it (`PromptSchedule`); a resumed or repeated run samples the
same prompts.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from rlft.data.prompts import PromptSet, epoch_order
from rlft.rewards.calling import RewardLog, RewardScorer
from rlft.rollout.base import Rollout
from rlft.train.run.checkpoint import PartState
from rlft.train.sources.generation import Generation, ToolSetup, rollout_engine
from rlft.train.update.rollout_batch import ScoredRollout


def round_prompt_indices(num_rows: int, seed: int, rollout_index: int, round_index: int, process_index: int,
                         per_process: int) -> list[int]:
    """This process's prompts for a later generation round of a rollout (dynamic sampling): a
    permutation of all rows seeded by (seed, rollout, round); process p takes positions [p*P,
    (p+1)*P)."""
    order = epoch_order(num_rows, seed + 1_000_003 * round_index, rollout_index)
    start = process_index * per_process
    return [order[(start + k) % num_rows] for k in range(per_process)]


@dataclass
class PromptSchedule:
    """Which prompts each rollout of a run samples on this process."""

    prompts: PromptSet
    per_process: int  # prompts per rollout on each process
    rollouts_per_epoch: int
    seed: int
    # a new seeded permutation each epoch (not for a streamed dataset: its order is the data's)
    shuffle: bool
    process_index: int = 0
    num_processes: int = 1

    def indices(self, rollout_index: int) -> list[int]:
        epoch, offset = divmod(rollout_index, self.rollouts_per_epoch)
        order = epoch_order(len(self.prompts), self.seed, epoch) if self.shuffle \
            else list(range(len(self.prompts)))
        start = (offset * self.num_processes + self.process_index) * self.per_process
        return order[start:start + self.per_process]

    def round_indices(self, rollout_index: int, round_index: int) -> list[int]:
        """Round 0 is the rollout's own prompts; later rounds (dynamic sampling) draw their own."""
        if round_index == 0:
            return self.indices(rollout_index)
        return round_prompt_indices(len(self.prompts), self.seed, rollout_index, round_index,
                                    self.process_index, self.per_process)

    def batch(self, rollout_index: int, round_index: int = 0) -> dict[str, Any]:
        return self.prompts.batch(self.round_indices(rollout_index, round_index))


@runtime_checkable
class RolloutSource(Protocol):
    """What a GRPO trainer asks of where its rollouts come from."""

    schedule: PromptSchedule
    engine: Any  # the rollout engine it generates with (`trainer.generator`)

    def rollout(self, index: int) -> ScoredRollout: ...

    def round(self, index: int, round_index: int) -> ScoredRollout:
        """A later generation round of rollout `index` (dynamic sampling), on its own prompts."""

    def generate(self, prompts: dict, count: int, greedy: bool = False) -> Rollout:
        """Completions for evaluation, from the current weights."""

    def open(self) -> None:
        """Before the first step of `train()`."""

    def close(self) -> None:
        """After `train()`: stop what runs only while training."""

    def session(self) -> contextlib.AbstractContextManager:
        """Around an evaluate() outside train(): start and stop what generating needs (a
        producer)."""

    def step_metrics(self, step: int) -> dict[str, float]: ...

    def state_dict(self) -> PartState: ...

    def load_state_dict(self, state: PartState | None) -> None:
        """None: a new run (nothing carried)."""


@dataclass
class SourceParts:
    """What a source is built from: the trainer's parts, not the trainer."""

    args: Any
    schedule: PromptSchedule
    rewards: RewardScorer
    throughput: Any  # rlft/telemetry/perf.py: Throughput
    accelerator: Any
    state: Any  # transformers' TrainerState: the run's step
    messages: Any  # rlft/telemetry/tracking.py: Messages
    model: Any  # the policy, unwrapped
    tokenizer: Any
    training_engine: Any
    setup: ToolSetup
    model_source: Any  # what the policy was loaded from (a vLLM engine loads it too)
    rollout_func: Callable[[list], dict] | None  # the user's, bound to the trainer
    steps_per_rollout: int
    total_steps: int
    # distillation's teacher (a module, a served client), where a source samples from it
    teacher: Any = None
    # AsyncGRPOTrainer's rollout_worker= / weight_transfer= (rlft/train/sources/worker_source.py)
    worker: Any = None
    reward_weights: Any = None  # [F] each reward function's weight in the total (SDPO's successes)
    # (event, **payload) -> None: a trainer event to the callbacks that define it (rlft/train/flow.py)
    events: Any = None


# dataset columns a rollout's rows carry for the trainer's own use (which teacher:
# rlft/train/update/teachers.py)
ROW_COLUMNS = ("teacher_id",)


def carry_row_columns(rollout: Rollout, prompts: dict, group: int) -> None:
    """The rows' ROW_COLUMNS from their prompts' dataset rows (each prompt's value `group`
    times)."""
    for name in ROW_COLUMNS:
        if name in prompts and name not in rollout.extra:
            rollout.extra[name] = [value for value in prompts[name] for _ in range(group)]


def score_rollout(rewards: RewardScorer, throughput, prompts: dict, rollout: Rollout, group: int,
                  waited: float, generating: float) -> ScoredRollout:
    """A rollout's rewards and timings: `waited` seconds for the rollout (what the step spent), of
    which the engine spent `generating` generating it (what its throughput is measured over)."""
    carry_row_columns(rollout, prompts, group)
    # before any masking
    tokens = rollout.prompt_mask.sum().item() + rollout.completion_mask.sum().item()
    timing = {"time/generation_seconds": waited, "tokens": float(tokens)}
    for key, value in throughput.generation(rollout, generating, group).items():
        # time-weighted, so that rounds add up (rlft/train/update/rollout_batch.py)
        timing[key] = value * waited
    reward_log, started = RewardLog(), time.perf_counter()
    values, completions = rewards(rollout, prompts, group, reward_log)
    timing["time/reward_seconds"] = time.perf_counter() - started
    return ScoredRollout(rollout, values, completions, [p for p in prompts["prompts"] for _ in range(group)],
                         reward_log.columns(len(completions)), reward_log.scalars, timing)


def engine_of(holder: str) -> property:
    """`engine` (what `trainer.generator` reads and sets) for a source whose engine is held by the object
    in its attribute `holder`: read and set there."""
    return property(lambda self: getattr(self, holder).engine,
                    lambda self, value: setattr(getattr(self, holder), "engine", value))


class SourceBase:
    """What every source shares: nothing to check, start, stop, log or save beyond its rollouts. A
    source defines `rollout`, `round` (dynamic sampling's later rounds) and `generate`
    (evaluation)."""

    schedule: PromptSchedule
    engine: Any = None
    records_routes = False  # whether its rollouts carry a MoE policy's routes (routing_replay)
    records_tool_routes = False  # ... tool and environment rollouts too (rlft/rollout/multiturn.py)
    scores_itself = False  # its rollouts come with their advantages (the trainer's reward functions unused)

    @classmethod
    def check(cls, args, processes: int, tools: list, environment_factory, rollout_func) -> None:
        """Before anything is loaded: what this source cannot run (with these tools= / environments
        / rollout_func, on this many processes), as a ConfigError."""

    def open(self) -> None:
        pass

    def close(self) -> None:
        pass

    def session(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def step_metrics(self, step: int) -> dict[str, float]:
        return {}

    def state_dict(self) -> PartState:
        return PartState()

    def load_state_dict(self, state: PartState | None) -> None:
        pass


class GeneratedSource(SourceBase):
    """Each rollout generated when its step comes, by the engine the config asks for."""

    records_routes = True  # its engine (generate, vLLM) records a MoE policy's routes
    records_tool_routes = True  # each turn's (the tool loop's, rlft/rollout/multiturn.py)

    def __init__(self, parts: SourceParts):
        self.args, self.schedule, self.rewards = parts.args, parts.schedule, parts.rewards
        self.throughput, self.group = parts.throughput, parts.args.num_generations
        engine = rollout_engine(parts.args, parts.tokenizer, parts.model, parts.model_source,
                                parts.training_engine, parts.setup)
        self.generation = Generation(engine, parts.model, parts.tokenizer, parts.args,
                                     parts.accelerator.device, parts.training_engine, parts.setup,
                                     parts.rollout_func)

    engine = engine_of("generation")

    def rollout(self, index: int) -> ScoredRollout:
        return self.round(index, 0)

    def round(self, index: int, round_index: int) -> ScoredRollout:
        prompts = self.schedule.batch(index, round_index)
        started = time.perf_counter()
        rollout = self.generate(prompts, self.group)
        seconds = time.perf_counter() - started
        return score_rollout(self.rewards, self.throughput, prompts, rollout, self.group, seconds, seconds)

    def generate(self, prompts: dict, count: int, greedy: bool = False) -> Rollout:
        return self.generation(prompts, count, greedy)


class EngineSource(SourceBase):
    """A source built on `GeneratedSource` (`self.generated`: the config's engine samples the student's
    completions) that works on its rollouts (GKD, self-distillation); its engine is that one's, and
    tools, environments and rollout_func are not taken."""

    trainer = "This trainer"  # its trainer's name, for the refusal
    agents_hint = ""  # where tools are taken instead

    @classmethod
    def check(cls, args, processes: int, tools: list, environment_factory, rollout_func) -> None:
        if tools or environment_factory is not None or rollout_func is not None:
            from rlft.errors import ConfigError

            raise ConfigError(f"{cls.trainer} samples the student's completions with the rollout engine "
                              "alone: tools=, environment_factory= and rollout_func= are not taken"
                              + cls.agents_hint)

    engine = engine_of("generated")


# name -> the source class, or "module:Class" for one imported when a run asks for it
SOURCES: dict[str, type[SourceBase] | str] = {}


def register_source(name: str, source: type[SourceBase] | str) -> type[SourceBase] | str:
    """Add a rollout source (a class built from SourceParts, usually a SourceBase); `rollout_source:
    <name>` in a config then selects it."""
    if name in SOURCES:
        raise ValueError(f"rollout source {name!r} is already registered")
    SOURCES[name] = source
    return source


def source_class(name: str) -> type[SourceBase]:
    """The registered source `name` (a config's `rollout_source`), or a ConfigError naming the
    others."""
    if name not in SOURCES:
        from rlft.errors import ConfigError

        raise ConfigError(f"rollout_source={name!r}: choose one of {sorted(SOURCES)} "
                          "(rlft/train/sources/rollout_source.py: register_source adds one)")
    found = SOURCES[name]
    if isinstance(found, str):
        import importlib

        module, _, name = found.partition(":")
        found = getattr(importlib.import_module(module), name)
    return found


register_source("generate", GeneratedSource)
register_source("producer", "rlft.train.sources.async_source:ProducerSource")
register_source("gkd", "rlft.train.gkd:GKDSource")
register_source("worker", "rlft.train.sources.worker_source:WorkerSource")
register_source("sdft", "rlft.train.sdft:SDFTSource")
register_source("sdpo", "rlft.train.sdpo:SDPOSource")
