"""Normalising and checking a config: every problem found at once, each naming its field, value and
fix.

Run by the configs' `__post_init__` (before transformers' own checks, which name fields less
clearly) and again by the trainers, so a config changed after construction is checked too: first
each value's type, then each field's own check (its `option(check=...)` declaration:
rlft/config/options.py), then the rules across fields. Each config class picks those: its
`_check(errors)` calls its parent's (`super()._check(errors)`) and then the functions here for the
fields it adds (`check_common`, `check_grpo`, `check_rloo`, `check_async`); `_normalize()` chains
the same way. The rules a trainer applies again with the process count are in rlft/config/rules.py.
"""

from __future__ import annotations

import logging
import math
import types
import typing
from typing import Any

import yaml

from rlft.config.compat import unimplemented_errors
from rlft.config.options import CONVERTED_BY_TRANSFORMERS, dict_fields, field_types, option_problems
from rlft.config.rules import generation_batch_problems, staleness
from rlft.errors import ConfigError

# accelerate's tracker names ("all": every one that is installed, as in transformers).
TRACKERS = ("tensorboard", "wandb", "comet_ml", "aim", "mlflow", "clearml", "dvclive", "swanlab", "trackio")
# Largest learning rate accepted: far above any that trains, far below what overflows float32
# optimizer state.
MAX_LEARNING_RATE = 1e3


def read_dict_value(name: str, value: Any) -> Any:
    """A dict field given as a JSON/YAML string on the command line or in a config ('{min_lr:
    1e-6}')."""
    if isinstance(value, str) and value.strip().startswith("{"):
        parsed = yaml.safe_load(value)
        if not isinstance(parsed, dict):
            raise ConfigError(f"{name}={value!r} is not a mapping; write it as {{key: value}}")
        return parsed
    return value


def to_dict(cfg) -> dict[str, Any]:
    """TrainingArguments.to_dict (enums as values, tokens masked)."""
    return cfg.to_dict()


def normalize_report_to(value: Any) -> list[str]:
    """transformers' semantics: "none" -> [], "all" -> every installed tracker, a name -> [name], a
    list."""
    if value is None or value == "none":
        return []
    if isinstance(
        value, str
    ):  # the command line: "tensorboard", "tensorboard,trackio", "[tensorboard, trackio]"
        value = [v.strip() for v in value.strip("[]").split(",") if v.strip()]
    names = [str(v) for v in value]
    if "all" in names:
        from accelerate.utils import is_tensorboard_available, is_trackio_available, is_wandb_available

        found = {
            "tensorboard": is_tensorboard_available(),
            "wandb": is_wandb_available(),
            "trackio": is_trackio_available(),
        }
        return [name for name, ok in found.items() if ok]
    return [n for n in names if n != "none"]


def _bf16_device() -> bool:
    import torch

    return torch.cuda.is_available() and torch.cuda.is_bf16_supported()


def normalize_before(cfg) -> None:
    """TRL/transformers spellings to one form, before any check runs (each config class its own
    fields)."""
    cfg._normalize()


def normalize_common(cfg) -> None:
    """The fields every config has; every field that takes a mapping (its JSON / YAML string
    read)."""
    for name in dict_fields(type(cfg)):
        setattr(cfg, name, read_dict_value(name, getattr(cfg, name)))
    cfg.report_to = normalize_report_to(cfg.report_to)
    cfg.disable_tqdm = bool(cfg.disable_tqdm)
    if cfg.activation_checkpointing is None and cfg.gradient_checkpointing is not None:
        # transformers 5's name; no FutureWarning
        cfg.activation_checkpointing = cfg.gradient_checkpointing
    if cfg.activation_checkpointing_kwargs is None and cfg.gradient_checkpointing_kwargs is not None:
        cfg.activation_checkpointing_kwargs = cfg.gradient_checkpointing_kwargs
    # TRL: "True unless fp16"; rlft: True where the device has bfloat16 (not on a CPU)
    if cfg.bf16 is None:
        cfg.bf16 = not cfg.fp16 and not cfg.use_cpu and _bf16_device()
    if isinstance(cfg.pad_to_multiple_of, str) and cfg.pad_to_multiple_of != "auto":
        text = cfg.pad_to_multiple_of.lower()
        cfg.pad_to_multiple_of = None if text in ("none", "null") else int(text) if text.isdigit() else text
    if cfg.eval_strategy == "steps" and not cfg.eval_steps:
        cfg.eval_steps = cfg.logging_steps  # transformers' rule
    elif cfg.eval_steps is not None and cfg.eval_strategy == "no":
        logging.getLogger("rlft").warning(
            "eval_steps=%s is set but eval_strategy='no': no evaluation will run (set "
            "eval_strategy='steps')",
            cfg.eval_steps,
        )


def normalize_grpo(cfg) -> None:
    """The GRPO family's fields."""
    value = cfg.scale_rewards
    if isinstance(value, str) and value.lower() in ("true", "false"):
        value = value.lower() == "true"
    cfg.scale_rewards = {True: "group", False: "none"}.get(value, value)  # TRL's spellings
    if cfg.vllm_importance_sampling_cap is not None:  # TRL's deprecated name
        cfg.vllm_importance_sampling_clip_max = cfg.vllm_importance_sampling_cap
    # TRL: "<= 0 disables token budgeting"
    if cfg.token_budget is not None and cfg.token_budget <= 0:
        cfg.token_budget = None


# ---- checks ---------------------------------------------------------------------------------------------
def _value(value: Any) -> Any:
    return getattr(value, "value", value)  # transformers' str enums


def _check_learning_rate(cfg, errors: list[str]) -> None:
    rate = cfg.learning_rate
    if not math.isfinite(rate) or rate <= 0:
        errors.append(f"learning_rate={rate!r} must be a finite number > 0")
    elif rate > MAX_LEARNING_RATE:
        errors.append(
            f"learning_rate={rate!r} is far above any rate that trains (at most "
            f"{MAX_LEARNING_RATE:g} "
            "is accepted; typical: 1e-6 to 1e-4 full fine-tuning, 1e-5 to 1e-3 LoRA)"
        )


def check_common(cfg, errors: list[str]) -> None:
    """The fields every config has (TrainingArguments' and rlft's common ones)."""
    _check_learning_rate(cfg, errors)
    if cfg.max_steps == 0 or cfg.max_steps < -1:
        errors.append(f"max_steps={cfg.max_steps!r} must be > 0, or -1 to run num_train_epochs")
    if cfg.bf16 and cfg.fp16:
        errors.append("bf16=True and fp16=True together: pick one")
    if cfg.eval_steps is not None and cfg.eval_steps <= 0:
        errors.append(f"eval_steps={cfg.eval_steps!r} must be > 0 or null")
    unknown = [r for r in cfg.report_to if r not in TRACKERS]
    if unknown:
        errors.append(
            f"report_to has unknown tracker(s) {unknown}; use 'none', 'all' or any of "
            f"{list(TRACKERS)}"
        )
    if not (
        cfg.pad_to_multiple_of in (None, "auto")
        or (isinstance(cfg.pad_to_multiple_of, int) and cfg.pad_to_multiple_of > 0)
    ):
        errors.append(f"pad_to_multiple_of={cfg.pad_to_multiple_of!r} must be a positive int, "
                      "'auto' or null")
    errors.extend(unimplemented_errors(cfg))


def check_grpo(cfg, errors: list[str]) -> None:
    """The GRPO family's rules across fields (GRPOConfig, RLOOConfig, AsyncGRPOConfig,
    DistillationConfig)."""
    if cfg.num_generations is None or cfg.num_generations < cfg.min_generations:
        why = (": group-relative advantages compare completions of the same prompt, so a group of "
               "1 has no signal")
        errors.append(f"num_generations={cfg.num_generations!r} must be >= {cfg.min_generations}"
                      + (why if cfg.min_generations == 2 else ""))
        return
    errors.extend(generation_batch_problems(cfg))  # what holds for any process count
    _validate_vllm(cfg, errors)
    _validate_algorithm_options(cfg, errors)


def check_rloo(cfg, errors: list[str]) -> None:
    """RLOOConfig's own fields."""
    clip = cfg.reward_clip_range
    if clip is not None and (len(clip) != 2 or not clip[0] < clip[1]):
        errors.append(f"reward_clip_range={list(clip)!r} must be two numbers (min, max) with min < "
                      "max")


def _check_replay(cfg, errors: list[str]) -> None:
    """replay_sampling_mask=True where the sampler's distribution cannot be replayed exactly."""
    from rlft.config.rules import replay_plan

    try:
        replay_plan(cfg)
    except ConfigError as err:
        errors.append(str(err))


def _check_kl_in_reward(cfg, errors: list[str]) -> None:
    """kl_in_reward shapes the one summed sequence reward of a sequence-level estimator."""
    from rlft.core.advantages import ADVANTAGE_ESTIMATORS

    if not cfg.kl_in_reward:
        return
    spec = ADVANTAGE_ESTIMATORS.get(cfg.advantage_estimator)
    if spec is not None and (spec.token_level or spec.kl_in_reward):
        errors.append(f"kl_in_reward=True with advantage_estimator {cfg.advantage_estimator}: it "
                      "puts the KL in its per-token rewards itself; set kl_in_reward: false")
    if cfg.multi_objective_aggregation != "sum_then_normalize":
        errors.append("kl_in_reward=True penalises the summed reward: use "
                      "multi_objective_aggregation: sum_then_normalize")


def _validate_algorithm_options(cfg, errors: list[str]) -> None:
    from rlft.core.importance import CORRECTIONS
    from rlft.core.losses import LOSSES

    if cfg.entropy_coef_min > cfg.entropy_coef_max:
        errors.append(
            f"entropy_coef_min={cfg.entropy_coef_min} exceeds "
            f"entropy_coef_max={cfg.entropy_coef_max}"
        )
    if cfg.advantage_estimator == "reinforce_pp" and cfg.multi_objective_aggregation != "sum_then_normalize":
        errors.append("advantage_estimator reinforce_pp whitens token-level returns of the summed "
                      "reward: use multi_objective_aggregation: sum_then_normalize")
    _check_kl_in_reward(cfg, errors)
    _check_replay(cfg, errors)
    if cfg.sync_ref_model and cfg.kl_coef == 0:
        errors.append(
            "sync_ref_model=True with beta=0: there is no reference model to update (the KL term "
            "is off); set beta > 0 or sync_ref_model: false"
        )
    if cfg.rollout_correction_bypass and not cfg.use_vllm and not cfg.producer_logps:
        errors.append("rollout_correction_bypass=True takes the sampler's log-probs as pi_old, and "
                      "transformers' generate here returns none: set use_vllm: true, or train with "
                      "AsyncGRPOTrainer (its producer records them)")
    if (
        getattr(LOSSES.get(cfg.loss_type), "folds_sampling_weights", False)
        and cfg.use_vllm
        and cfg.vllm_importance_sampling_correction
        and getattr(CORRECTIONS.get(cfg.vllm_importance_sampling_mode), "per_sequence", False)
    ):
        errors.append(
            f"loss_type {cfg.loss_type} folds the sampling correction into its sequence weight "
            "token by token: set vllm_importance_sampling_mode to token_truncate or token_mask "
            f"(or icepop; not {cfg.vllm_importance_sampling_mode})"
        )


def _validate_vllm(cfg, errors: list[str]) -> None:
    low, high = cfg.vllm_importance_sampling_clip_min, cfg.vllm_importance_sampling_clip_max
    if low is not None and high is not None and low > high:
        errors.append(
            f"vllm_importance_sampling_clip_min={low} exceeds "
            f"vllm_importance_sampling_clip_max={high}"
        )


# ---- types --------------------------------------------------------------------------------------------
def type_ok(value: Any, annotation: Any) -> bool:
    """Whether `value` fits a field annotation (unions, lists, bool vs int); unknown annotations
    pass."""
    if annotation is Any or value is None:
        return True
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return any(type_ok(value, a) for a in typing.get_args(annotation) if a is not type(None))
    target = origin or annotation
    if target is bool:
        return isinstance(value, bool)
    if target is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if target is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if target in (list, tuple):  # a YAML or JSON list stands for a tuple
        inner = typing.get_args(annotation)
        return isinstance(value, list | tuple) and (not inner or all(type_ok(v, inner[0]) for v in value))
    if target is str:
        return isinstance(value, str)
    return isinstance(value, target) if isinstance(target, type) else True


def _validate_types(cfg, errors: list[str]) -> None:
    for name, annotation in field_types(type(cfg)).items():
        if name in CONVERTED_BY_TRANSFORMERS:
            continue
        value = getattr(cfg, name)
        if not type_ok(value, annotation):
            shown = getattr(annotation, "__name__", None) or str(annotation).replace("typing.", "")
            errors.append(f"{name}={value!r} is a {type(value).__name__}; the field takes {shown}")


def check_async(cfg, errors: list[str]) -> None:
    """AsyncGRPOConfig's own fields: the schedule's bound (at one optimiser step per rollout; the
    trainer checks it again with its own), the producer's limits."""
    if errors:
        return
    try:
        staleness(cfg, 1)
    except ConfigError as err:
        errors.append(str(err))
    server = cfg.use_vllm and cfg.vllm_mode == "server"
    if cfg.inflight_weight_updates and (cfg.repetition_penalty != 1.0 or cfg.generation_kwargs):
        errors.append("inflight_weight_updates needs each token's log-prob recorded as it is sampled "
                      "from the trainer's softmax: not with repetition_penalty or generation_kwargs; "
                      "turn one of them off")
    if cfg.partial_rollouts and (cfg.repetition_penalty != 1.0 or cfg.generation_kwargs):
        errors.append(f"partial_rollouts={cfg.partial_rollouts} needs each token's log-prob recorded "
                      "as it is sampled from the trainer's softmax (a carried token keeps the log-prob "
                      "of the weights that drew it): not with repetition_penalty or generation_kwargs; "
                      "turn one of them off")
    if server and cfg.inflight_switch_tokens is not None:
        errors.append(f"inflight_switch_tokens={cfg.inflight_switch_tokens} with vllm_mode: server: "
                      "not built (a server's requests are interrupted whenever weights arrive, "
                      "docs/async.md); leave it unset, or use vllm_mode: colocate or transformers' "
                      "generate for the reproducible mode")
    if cfg.partial_rollouts and cfg.max_completion_length is None:
        errors.append(f"partial_rollouts={cfg.partial_rollouts} needs max_completion_length: each "
                      "carried completion's budget is what is left of it")
    if cfg.inflight_switch_tokens is not None and not cfg.inflight_weight_updates:
        errors.append(f"inflight_switch_tokens={cfg.inflight_switch_tokens} needs "
                      "inflight_weight_updates: true")
    if cfg.producer_cpus is not None and (not cfg.producer_cpus
                                          or any(not isinstance(c, int) or c < 0 for c in cfg.producer_cpus)):
        errors.append(f"producer_cpus={cfg.producer_cpus!r} must be a non-empty list of CPU "
                      "numbers, e.g. [1]")


def validate(cfg):
    """Check every field; raise one ConfigError listing all problems. The types first; then the
    config's own `_check`, which runs the checks of its class and of each parent."""
    errors: list[str] = []
    _validate_types(cfg, errors)
    if errors:  # the checks below assume the types are right
        raise ConfigError(f"invalid {type(cfg).__name__}:\n  - " + "\n  - ".join(errors))
    errors.extend(option_problems(cfg))  # each field's own check (its declaration's)
    cfg._check(errors)
    if errors:
        raise ConfigError(f"invalid {type(cfg).__name__}:\n  - " + "\n  - ".join(errors))
    return cfg
