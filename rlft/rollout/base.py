"""The one protocol every rollout engine meets: transformers' generate (`hf.py`), vLLM colocated (`vllm.py`)
or as a server (`vllm_server.py`), and the tool loop around any of them (`multiturn.py`).

The trainer calls the engine for completions and tells it when the policy's weights changed (after each
applied optimiser step and after a resume); an engine holding its own copy of the weights (vLLM) syncs before
its next generation, one reading the live model (generate) has nothing to do.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from rlft.rollout.hf import Rollout


@runtime_checkable
class RolloutEngine(Protocol):
    """`engine(model, prompt_ids, num_generations, greedy=False) -> Rollout` (groups of num_generations
    consecutive rows per prompt), `on_weights_changed()`, `close()`; `holds_own_weights` says whether the
    engine keeps a copy of the weights (so the trainer need not make its own whole for a rollout)."""

    holds_own_weights: bool

    def __call__(self, model, prompt_ids: list[list[int]], num_generations: int, greedy: bool = False,
                 **kwargs) -> Rollout: ...

    def on_weights_changed(self) -> None: ...

    def close(self) -> None: ...


def holds_own_weights(engine) -> bool:
    """The engine's `holds_own_weights`; a bare callable engine (a test stub, a user's own) reads the live
    model."""
    return bool(getattr(engine, "holds_own_weights", False))


def weights_changed(engine) -> None:
    """Tell the engine the policy's weights changed; a bare callable engine has nothing to sync."""
    notify = getattr(engine, "on_weights_changed", None)
    if notify is not None:
        notify()


def engine_metrics(engine) -> dict[str, float]:
    """What the engine measured since it was last asked (vLLM: weight-sync seconds and bytes); {} for engines
    that measure nothing."""
    metrics = getattr(engine, "metrics", None)
    return metrics() if metrics is not None else {}
