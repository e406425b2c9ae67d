"""The carriers a GRPO step passes along: `ScoredRollout` (a rollout with its rewards: what a
RolloutSource returns) and `RolloutBatch` (the rollout with its advantages and the log-probs the
update needs: what the optimiser steps of one rollout train on, and what a checkpoint inside a
rollout holds). Both are row carriers (rlft/rollout/base.py), so selecting, splitting, joining and
saving them is written once."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlft.rollout.base import Rollout, Rows, rows

# ScoredRollout.timing keys summed over generation rounds; perf/* values are weighted by generation
# time
TIMING_KEYS = ("time/generation_seconds", "time/reward_seconds", "tokens")


@dataclass
class ScoredRollout(Rows):
    """A rollout and its rewards, rows in groups of num_generations."""

    rollout: Rollout = rows("rows")
    rewards: torch.Tensor = rows("row")  # [N, F] per reward function, NaN = not applicable
    # per row, what the reward functions received (text or messages)
    completions: list = rows("list")
    prompts: list = rows("list")  # per row, its prompt (text or messages)
    # per row: reward functions' log_extra
    logged: dict[str, list] = rows("columns", default_factory=dict)
    # reward functions' log_metric values
    scalars: dict[str, list] = rows("whole", default_factory=dict)
    # seconds generating and scoring, tokens generated (prompt + completion, before masking), and
    # perf/* values times the generation seconds they were measured over (so rounds add up)
    timing: dict[str, float] = rows("whole", default_factory=dict)
    # the source's own (dynamic, async)
    metrics: dict[str, float] = rows("whole", default_factory=dict)
    # [N] advantages the source was given with the rows (a rollout worker's: TRL's RolloutSample), used
    # instead of the estimator's, and each row's total reward as the source knows it (NaN: not known)
    advantages: torch.Tensor | None = rows("row", default=None)
    totals: torch.Tensor | None = rows("row", default=None)


def add_timing(total: dict[str, float], part: dict[str, float]) -> dict[str, float]:
    """Timings of two generation rounds as one: every entry summed."""
    return {key: total.get(key, 0.0) + part.get(key, 0.0) for key in {*total, *part}}


def timing_metrics(timing: dict[str, float]) -> tuple[dict[str, float], float]:
    """(the step's timing metrics: seconds, perf/* averaged over the generation time; tokens
    generated)."""
    seconds = max(timing.get("time/generation_seconds", 0.0), 1e-12)
    metrics = {key: value / seconds if key.startswith("perf/") else value
               for key, value in timing.items() if key != "tokens"}
    metrics.setdefault("time/generation_seconds", 0.0)
    metrics.setdefault("time/reward_seconds", 0.0)
    return metrics, timing.get("tokens", 0.0)


@dataclass
class RolloutBatch(Rows):
    """What one rollout's optimiser steps train on; `select` / `split` give one step's rows."""

    rollout: Rollout = rows("rows")
    advantages: torch.Tensor = rows("right", saved=True)  # [N], or [N, C] per token (REINFORCE++)
    # [N, C] several steps a rollout
    old_logps: torch.Tensor | None = rows("right", saved=True, default=None)
    # [N, C] beta > 0, KL in loss
    ref_logps: torch.Tensor | None = rows("right", saved=True, default=None)
    samples: list = rows("list", default_factory=list)  # per row, what completions.jsonl shows
    # the rollout's (rewards, lengths, ...)
    metrics: dict[str, float] = rows("whole", default_factory=dict)

    def part(self, index: int, size: int) -> RolloutBatch:
        """Rows [index * size, (index + 1) * size): what one optimiser step trains on."""
        return self.select(slice(index * size, (index + 1) * size))


def row_view(advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """One number per completion for logs and samples: the mean advantage over its tokens ([N] stays
    [N])."""
    if advantages.ndim == 1:
        return advantages
    return (advantages * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)
