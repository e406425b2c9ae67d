"""`trl.trainer.rloo_trainer`'s public names, from rlft (rlft/train/rloo.py)."""

from rlft.config import RLOOConfig
from rlft.train.rloo import RLOOTrainer

__all__ = ["RLOOConfig", "RLOOTrainer"]
