"""The rules a config and a trainer both apply, written once: the shape of a generation batch
(`generation_batch`) and the async schedule's worst staleness (`staleness`).

A config checks what it can without knowing how many processes will train (`validate` in
rlft/config/checks.py); a trainer calls the same functions with the process count and the optimiser
steps per rollout, and uses the numbers they return instead of deriving them again.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlft.errors import ConfigError


@dataclass(frozen=True)
class GenerationBatch:
    """One generation batch (TRL's steps_per_generation / generation_batch_size) on `processes`
    processes. Counts are completions unless named otherwise; "per process" is one process's
    share."""

    processes: int
    steps_per_generation: int  # micro-steps fed by one generation batch
    completions_per_process: int  # per_device_train_batch_size * steps_per_generation
    prompts_per_process: int  # completions_per_process // num_generations (whole groups)
    completions_total: int  # completions_per_process * processes
    prompts_total: int  # prompts_per_process * processes
    # one optimiser step's, per process: per_device_train_batch_size * accumulation steps
    rows_per_step: int
    steps_per_rollout: int  # optimiser steps on one batch: spg // accumulation * num_iterations


def _size_problems(cfg, processes: int | None) -> list[str]:
    """Sizes the rule divides by that are not positive (validate's own checks name them for a
    config)."""
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
    """What is wrong with the config's generation batch, one line per problem; [] when nothing is.
    Without `processes` (a config being built) only what holds for every process count is checked;
    sizes below 1 are left to validate's checks of those fields."""
    if _size_problems(cfg, processes):
        return []
    per_device, accumulation, group = (cfg.per_device_train_batch_size, cfg.gradient_accumulation_steps,
                                       cfg.num_generations)
    if cfg.steps_per_generation is not None and cfg.generation_batch_size is not None:
        return ["steps_per_generation and generation_batch_size are both set: give one (TRL's "
                "rule)"]
    if cfg.generation_batch_size is None:
        problems = []
        spg = cfg.steps_per_generation or accumulation
        if spg % accumulation:
            problems.append(f"steps_per_generation={spg} is not a multiple of "
                            f"gradient_accumulation_steps={accumulation}: one generation must feed "
                            "whole optimiser steps")
        rollout, valid = per_device * spg, [group * k for k in range(1, 5)]
        if rollout % group:
            problems.append(
                f"per_device_train_batch_size * steps_per_generation = {rollout} completions is "
                f"not divisible by num_generations={group}; use a multiple such as {valid} "
                "(steps_per_generation defaults to gradient_accumulation_steps)")
        return problems
    # generation_batch_size is split over the processes: known to the trainer only
    if processes is None:
        return []
    per_step = per_device * processes
    if cfg.generation_batch_size % per_step:
        return [f"generation_batch_size={cfg.generation_batch_size} is not a multiple of "
                f"per_device_train_batch_size x processes = {per_step}"]
    spg = cfg.generation_batch_size // per_step
    if spg % accumulation or per_device * spg % group:
        return [f"a generation batch of {per_device * spg} completions per process ({spg} steps) "
                f"must hold whole groups of num_generations={group} and whole optimiser steps of "
                f"gradient_accumulation_steps={accumulation}"]
    return []


def generation_batch(cfg, processes: int) -> GenerationBatch:
    """The generation batch of a GRPO-family config on `processes` processes; ConfigError when it
    cannot hold whole groups of num_generations and whole optimiser steps on every process."""
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
    """The async schedule's worst staleness in optimiser steps, `(rollout_lag + partial_rollouts) *
    steps_per_rollout + weight_sync_steps - 1` (the schedule: rlft/train/async_grpo.py). ConfigError
    when it exceeds max_staleness, or when weight_sync_steps is not a multiple of
    steps_per_rollout (weights are pushed between rollouts). A config checks it with
    steps_per_rollout=1; the trainer with its own."""
    lag, sync, bound = cfg.rollout_lag, cfg.weight_sync_steps, cfg.max_staleness
    ahead = getattr(cfg, "partial_rollouts", 0)  # look-ahead: tokens up to that many rollouts older
    worst = (lag + ahead) * steps_per_rollout + sync - 1
    lagging = f"rollout_lag={lag}" + (f" and partial_rollouts={ahead}" if ahead else "")
    if worst > bound and steps_per_rollout == 1:
        raise ConfigError(f"{lagging} with weight_sync_steps={sync} samples rollouts up to "
                          f"{worst} steps behind, above max_staleness={bound}: raise max_staleness "
                          "or lower rollout_lag / weight_sync_steps"
                          + (" / partial_rollouts" if ahead else ""))
    if worst > bound:
        raise ConfigError(f"with {steps_per_rollout} optimiser steps per rollout, "
                          f"{lagging} and weight_sync_steps={sync} train on weights up to "
                          f"{worst} steps old, above max_staleness={bound}: raise max_staleness or "
                          "lower rollout_lag / weight_sync_steps" + (" / partial_rollouts" if ahead else ""))
    if sync % steps_per_rollout:
        raise ConfigError(f"weight_sync_steps={sync} must be a multiple of the optimiser steps per "
                          f"rollout ({steps_per_rollout}): weights are pushed between rollouts")
    return worst


# ---- truncated sampling and its replay (rlft/rollout/truncation.py)
# ---------------------------------- generate / vLLM settings that change the values of the logits
# before sampling (not only remove tokens)
VALUE_CHANGING = ("repetition_penalty", "encoder_repetition_penalty", "sequence_bias", "presence_penalty",
                  "frequency_penalty", "logit_bias", "exponential_decay_length_penalty", "guidance_scale",
                  "watermarking_config")
# truncations generate applies after rlft's recorder (not replayed)
OTHER_WARPERS = ("typical_p", "epsilon_cutoff", "eta_cutoff", "top_h")
NEUTRAL = {"repetition_penalty": 1.0, "encoder_repetition_penalty": 1.0, "presence_penalty": 0.0,
           "frequency_penalty": 0.0, "guidance_scale": 1.0, "typical_p": 1.0, "epsilon_cutoff": 0.0,
           "eta_cutoff": 0.0}


@dataclass(frozen=True)
class Truncation:
    """The effective truncation of a config's sampling (generation_kwargs win, as the engines apply
    them)."""

    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0

    @property
    def truncates(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0


def truncation(args) -> Truncation:
    extra = args.generation_kwargs or {}
    top_k = extra.get("top_k", args.top_k)
    top_p = extra.get("top_p", args.top_p)
    min_p = extra.get("min_p", args.min_p)
    return Truncation(max(int(top_k or 0), 0), 1.0 if top_p is None else float(top_p), float(min_p or 0.0))


def unreplayable(args) -> list[str]:
    """The settings that keep the sampler's distribution from being replayed exactly."""
    given = {"repetition_penalty": args.repetition_penalty, **(args.generation_kwargs or {})}
    found = [f"{k}={v!r}" for k, v in given.items()
             if (k in VALUE_CHANGING or k in OTHER_WARPERS) and v not in (None, NEUTRAL.get(k), {}, [])]
    if (args.generation_kwargs or {}).get("num_beams", 1) not in (None, 1):
        found.append(f"num_beams={args.generation_kwargs['num_beams']!r}")
    if args.use_vllm and truncation(args).truncates and truncation(args).top_k == 0:
        found.append("top_k=0 with vLLM (vLLM returns kept ids only with top_k set, e.g. 512)")
    return found


def replay_plan(args) -> tuple[bool, str | None]:
    """(replay the sampler's kept ids?, a line for the run when the replay is off though sampling
    truncates). `replay_sampling_mask`: null = on whenever sampling truncates and the replay can be
    exact."""
    asked, cut = args.replay_sampling_mask, truncation(args)
    if asked is False or not cut.truncates:
        return False, None
    blockers = unreplayable(args)
    if blockers and asked:
        raise ConfigError("replay_sampling_mask=True cannot replay the sampler's distribution "
                          f"exactly with {', '.join(blockers)}: the trainer renormalises the "
                          "policy over the kept tokens, but these change the logits' values too. "
                          "Remove them, or set replay_sampling_mask: false (the trainer then "
                          "scores the full vocabulary)")
    if blockers:
        return False, (f"sampling truncates (top_k={cut.top_k}, top_p={cut.top_p}, "
                       f"min_p={cut.min_p}) but {', '.join(blockers)} keeps the trainer from "
                       "replaying what the sampler drew from: log-probs are the full vocabulary's, "
                       "so importance ratios carry the kept mass (docs/vllm.md#truncated-sampling)")
    return True, None


def sampler_records(source, rollout_func, agents: bool) -> bool:
    """Whether the rollouts carry a MoE policy's routes (routing replay): transformers' generate where
    the rollout `source` runs it, or vLLM (colocated, whole or step by step, or a server started by
    `rlft vllm-serve`: rlft/rollout/vllm_routes.py); not `rollout_func`, nor tool loops where the
    source records none."""
    tools = source.records_tool_routes or not agents
    return bool(source.records_routes and not rollout_func and tools)
