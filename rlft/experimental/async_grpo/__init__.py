"""`trl.experimental.async_grpo`'s public names, from rlft (rlft/train/async_grpo.py, docs/async.md)."""

from rlft.config import AsyncGRPOConfig

__all__ = ["AsyncGRPOConfig", "AsyncGRPOTrainer"]


def __getattr__(name: str):
    if name == "AsyncGRPOTrainer":  # the trainer imports peft and the loop: only when asked for
        from rlft.train.async_grpo import AsyncGRPOTrainer

        return AsyncGRPOTrainer
    raise AttributeError(f"module 'rlft.experimental.async_grpo' has no attribute {name!r}")
