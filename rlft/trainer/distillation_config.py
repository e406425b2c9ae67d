"""`trl.trainer.distillation_config`'s public name, from rlft (rlft/config.py)."""

from rlft.config import DistillationConfig

__all__ = ["DistillationConfig"]
