"""`trl.trainer.rloo_config`'s public name, from rlft (rlft/config.py)."""

from rlft.config import RLOOConfig

__all__ = ["RLOOConfig"]
