"""`trl.trainer.reward_trainer`'s public names, from rlft (rlft/train/reward.py, rlft/data/preference.py)."""

from rlft.config import RewardConfig
from rlft.data.preference import DataCollatorForPreference
from rlft.train.reward import RewardTrainer

__all__ = ["DataCollatorForPreference", "RewardConfig", "RewardTrainer"]
