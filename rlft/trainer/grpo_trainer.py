"""`trl.trainer.grpo_trainer`'s public names, from rlft (rlft/train/grpo.py)."""

from rlft.config import GRPOConfig
from rlft.train.grpo import GRPOTrainer

__all__ = ["GRPOConfig", "GRPOTrainer"]
