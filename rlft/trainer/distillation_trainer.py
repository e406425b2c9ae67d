"""`trl.trainer.distillation_trainer`'s public names, from rlft (rlft/train/distillation.py)."""

from rlft.config import DistillationConfig
from rlft.train.distillation import DistillationTrainer

__all__ = ["DistillationConfig", "DistillationTrainer"]
