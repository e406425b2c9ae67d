"""rlft: reinforcement-learning fine-tuning of language models (GRPO, on-policy distillation and reward
models).

The names a TRL script imports from `trl` are importable from `rlft` (docs/migration.md).
"""

import logging

from rlft.config import AsyncGRPOConfig, DistillationConfig, GRPOConfig, RewardConfig, RLOOConfig, SFTConfig
from rlft.model_config import ModelConfig, get_kbit_device_map, get_peft_config, get_quantization_config
from rlft.script_args import DatasetConfig, DatasetMixtureConfig, ScriptArguments, TrlParser, get_dataset

# a library logs; the application configures handlers
logging.getLogger("rlft").addHandler(logging.NullHandler())

__all__ = ["GRPOConfig", "RewardConfig", "SFTConfig", "RLOOConfig", "GRPOTrainer", "RewardTrainer",
           "RLOOTrainer", "AsyncGRPOConfig", "AsyncGRPOTrainer", "ModelConfig", "ScriptArguments",
           "DatasetConfig", "DatasetMixtureConfig", "TrlParser", "get_dataset", "get_peft_config",
           "get_quantization_config", "get_kbit_device_map", "DistillationConfig", "DistillationTrainer"]
__version__ = "0.2.0"

_LAZY = {"GRPOTrainer": "rlft.train.grpo", "RewardTrainer": "rlft.train.reward",
         "RLOOTrainer": "rlft.train.rloo", "AsyncGRPOTrainer": "rlft.train.async_grpo",
         "DistillationTrainer": "rlft.train.distillation"}


def __getattr__(name: str):
    # Trainers import peft and the training loop; load them only when asked for.
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'rlft' has no attribute {name!r}")
