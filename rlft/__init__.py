"""rlft: reinforcement-learning fine-tuning of language models (GRPO and reward models)."""

import logging

from rlft.config import GRPOConfig, RewardConfig

logging.getLogger("rlft").addHandler(logging.NullHandler())  # a library logs; the application configures handlers

__all__ = ["GRPOConfig", "RewardConfig", "GRPOTrainer", "RewardTrainer"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # Trainers import transformers/peft/accelerate; load them only when asked for.
    if name == "GRPOTrainer":
        from rlft.train.grpo import GRPOTrainer

        return GRPOTrainer
    if name == "RewardTrainer":
        from rlft.train.reward import RewardTrainer

        return RewardTrainer
    raise AttributeError(f"module 'rlft' has no attribute {name!r}")
