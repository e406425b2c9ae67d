"""rlft: reinforcement-learning fine-tuning of language models (GRPO, on-policy distillation and
reward models).

The names a TRL script imports from `trl` are importable from `rlft` (docs/migration.md). Every name
loads on first use (as TRL's lazy module does), so `import rlft` and `rlft --help` load neither
torch nor transformers.
"""

import logging

from rlft import paths as _paths
from rlft.kinds import KINDS as _KINDS

# a library logs; the application configures handlers
logging.getLogger("rlft").addHandler(logging.NullHandler())
# rlft.trainer.grpo_trainer, rlft.experimental.async_grpo, ... (TRL's module paths)
_paths.install()

__version__ = "0.2.0"

_LAZY = {
    "SFTConfig": "rlft.config:SFTConfig",
    "ModelConfig": "rlft.config.model_config:ModelConfig",
    "get_peft_config": "rlft.config.model_config:get_peft_config",
    "get_quantization_config": "rlft.config.model_config:get_quantization_config",
    "get_kbit_device_map": "rlft.config.model_config:get_kbit_device_map",
    "ScriptArguments": "rlft.config.script_args:ScriptArguments",
    "DatasetConfig": "rlft.config.script_args:DatasetConfig",
    "DatasetMixtureConfig": "rlft.config.script_args:DatasetMixtureConfig",
    "TrlParser": "rlft.config.script_args:TrlParser",
    "get_dataset": "rlft.data.mixtures:get_dataset",
    "LogCompletionsCallback": "rlft.telemetry.callbacks:LogCompletionsCallback",
}
for _kind in _KINDS.values():
    _LAZY.update({_kind.config_name: _kind.config, _kind.trainer_name: _kind.trainer})

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        from rlft.kinds import load

        value = load(_LAZY[name])
        globals()[name] = value  # later lookups skip this function
        return value
    raise AttributeError(f"module 'rlft' has no attribute {name!r}")


def __dir__():
    return sorted({*globals(), *_LAZY})
