"""Every setting of a run: the config classes (classes.py; the distillation family's in
distill_configs.py, the self-distillation fields and SDPOConfig in self_teaching.py; GRPO's fields
in grpo_fields.py, every config's in common.py), each field declared once with its facts by
`option` (options.py, which answers every question about the fields: rlft's own, may change on
resume, takes a mapping, no effect, refused), the rules across fields (checks.py), the rules a
config and a trainer both apply (rules.py), TRL's fields rlft does not act on (compat.py),
`ModelConfig` (model_config.py), script arguments and `TrlParser` (script_args.py), and how a
launch's processes are set up (launch.py). This package imports only rlft.core and rlft.errors.

`rlft.config` keeps every name it had as a module.
"""

from rlft.config.classes import (  # noqa: F401 (public names)
    CONFIG_CLASSES,
    GRPO_ONLY,
    LOSSES,
    MAY_CHANGE,
    RLFT_FIELDS,
    AsyncDistillationConfig,
    AsyncGRPOConfig,
    ConfigError,
    DistillationConfig,
    GenerationBatch,
    GKDConfig,
    GOLDConfig,
    GRPOConfig,
    RewardConfig,
    RLOOConfig,
    SDFTConfig,
    SDPOConfig,
    ServerDistillationConfig,
    SFTConfig,
    TrainConfig,
    _BaseConfig,
    _GRPOFields,
    check_async,
    check_rloo,
    config_class,
    field_types,
    generation_batch,
    normalize_before,
    option,
    read_dict_value,
    staleness,
    to_dict,
    validate,
)
