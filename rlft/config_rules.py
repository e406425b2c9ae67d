"""The rules a config and a trainer both apply, written once: the shape of a generation batch
(`generation_batch`) and the async schedule's worst staleness (`staleness`).

A config checks what it can without knowing how many processes will train (`validate` in
rlft/config_checks.py); a trainer calls the same functions with the process count and the optimiser steps
per rollout, and uses the numbers they return instead of deriving them again.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlft.errors import ConfigError


@dataclass(frozen=True)
class GenerationBatch:
    """One generation batch (TRL's steps_per_generation / generation_batch_size) on `processes` processes.
    Counts are completions unless named otherwise; "per process" is one process's share."""

    processes: int
    steps_per_generation: int  # micro-steps fed by one generation batch
    completions_per_process: int  # per_device_train_batch_size * steps_per_generation
    prompts_per_process: int  # completions_per_process // num_generations (whole groups)
    completions_total: int  # completions_per_process * processes
    prompts_total: int  # prompts_per_process * processes
    rows_per_step: int  # one optimiser step's, per process: per_device_train_batch_size * accumulation steps
    steps_per_rollout: int  # optimiser steps on one batch: spg // accumulation * num_iterations


def _size_problems(cfg, processes: int | None) -> list[str]:
    """Sizes the rule divides by that are not positive (validate's own checks name them for a config)."""
    sizes = {
        "per_device_train_batch_size": cfg.per_device_train_batch_size,
        "gradient_accumulation_steps": cfg.gradient_accumulation_steps,
        "steps_per_generation": cfg.steps_per_generation,
        "generation_batch_size": cfg.generation_batch_size,
        "num_iterations": cfg.num_iterations,
        "processes": processes,
    }
    problems = [f"{name}={value!r} must be > 0" for name, value in sizes.items()
                if value is not None and value < 1]
    least = getattr(cfg, "min_generations", 2)  # (also given plain namespaces)
    if cfg.num_generations is None or cfg.num_generations < least:
        problems.append(f"num_generations={cfg.num_generations!r} must be >= {least}")
    return problems


def generation_batch_problems(cfg, processes: int | None = None) -> list[str]:
    """What is wrong with the config's generation batch, one line per problem; [] when nothing is. Without
    `processes` (a config being built) only what holds for every process count is checked; sizes below 1
    are left to validate's checks of those fields."""
    if _size_problems(cfg, processes):
        return []
    per_device, accumulation, group = (cfg.per_device_train_batch_size, cfg.gradient_accumulation_steps,
                                       cfg.num_generations)
    if cfg.steps_per_generation is not None and cfg.generation_batch_size is not None:
        return ["steps_per_generation and generation_batch_size are both set: give one (TRL's rule)"]
    if cfg.generation_batch_size is None:
        problems = []
        spg = cfg.steps_per_generation or accumulation
        if spg % accumulation:
            problems.append(f"steps_per_generation={spg} is not a multiple of gradient_accumulation_steps="
                            f"{accumulation}: one generation must feed whole optimiser steps")
        rollout, valid = per_device * spg, [group * k for k in range(1, 5)]
        if rollout % group:
            problems.append(
                f"per_device_train_batch_size * steps_per_generation = {rollout} completions is not "
                f"divisible by num_generations={group}; use a multiple such as {valid} "
                "(steps_per_generation defaults to gradient_accumulation_steps)")
        return problems
    if processes is None:  # generation_batch_size is split over the processes: known to the trainer only
        return []
    per_step = per_device * processes
    if cfg.generation_batch_size % per_step:
        return [f"generation_batch_size={cfg.generation_batch_size} is not a multiple of "
                f"per_device_train_batch_size x processes = {per_step}"]
    spg = cfg.generation_batch_size // per_step
    if spg % accumulation or per_device * spg % group:
        return [f"a generation batch of {per_device * spg} completions per process ({spg} steps) must hold "
                f"whole groups of num_generations={group} and whole optimiser steps of "
                f"gradient_accumulation_steps={accumulation}"]
    return []


def generation_batch(cfg, processes: int) -> GenerationBatch:
    """The generation batch of a GRPO-family config on `processes` processes; ConfigError when it cannot hold
    whole groups of num_generations and whole optimiser steps on every process."""
    problems = _size_problems(cfg, processes) or generation_batch_problems(cfg, processes)
    if problems:
        raise ConfigError(problems[0] if len(problems) == 1 else
                          "the generation batch:\n  - " + "\n  - ".join(problems))
    per_device, accumulation = cfg.per_device_train_batch_size, cfg.gradient_accumulation_steps
    if cfg.generation_batch_size is not None:
        spg = cfg.generation_batch_size // (per_device * processes)
    else:
        spg = cfg.steps_per_generation or accumulation
    completions = per_device * spg
    prompts = completions // cfg.num_generations
    return GenerationBatch(
        processes=processes,
        steps_per_generation=spg,
        completions_per_process=completions,
        prompts_per_process=prompts,
        completions_total=completions * processes,
        prompts_total=prompts * processes,
        rows_per_step=per_device * accumulation,
        steps_per_rollout=spg // accumulation * cfg.num_iterations,
    )


def staleness(cfg, steps_per_rollout: int = 1) -> int:
    """The async schedule's worst staleness in optimiser steps, `rollout_lag * steps_per_rollout +
    weight_sync_steps - 1` (the schedule: rlft/train/async_grpo.py). ConfigError when it exceeds
    max_staleness, or when weight_sync_steps is not a multiple of steps_per_rollout (weights are pushed
    between rollouts). A config checks it with steps_per_rollout=1; the trainer with its own."""
    lag, sync, bound = cfg.rollout_lag, cfg.weight_sync_steps, cfg.max_staleness
    worst = lag * steps_per_rollout + sync - 1
    if worst > bound and steps_per_rollout == 1:
        raise ConfigError(f"rollout_lag={lag} with weight_sync_steps={sync} samples rollouts up to {worst} "
                          f"steps behind, above max_staleness={bound}: raise max_staleness or lower "
                          "rollout_lag / weight_sync_steps")
    if worst > bound:
        raise ConfigError(f"with {steps_per_rollout} optimiser steps per rollout, rollout_lag={lag} and "
                          f"weight_sync_steps={sync} train on weights up to {worst} steps old, above "
                          f"max_staleness={bound}: raise max_staleness or lower rollout_lag / "
                          "weight_sync_steps")
    if sync % steps_per_rollout:
        raise ConfigError(f"weight_sync_steps={sync} must be a multiple of the optimiser steps per rollout "
                          f"({steps_per_rollout}): weights are pushed between rollouts")
    return worst
