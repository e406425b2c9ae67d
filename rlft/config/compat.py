"""What rlft knows about the fields transformers' TrainingArguments declares and rlft does not
redeclare: `TRAINING_ARGUMENTS`, name -> Facts (rlft/config/options.py), which `_BaseConfig` states
as its `inherited_facts`. The fields rlft declares carry their facts in their own `option(...)`
declaration.

Every field of TRL's GRPOConfig and RewardConfig exists on rlft's configs with TRL's default
(rlft/config/classes.py). Most are implemented. The rest fall in two groups, both queries of the
facts:

- no effect (`options.no_effect(cls)`): accepted at any value because it changes nothing rlft
  computes (a DataLoader knob where there is no DataLoader, a kernel choice where rlft has its own);
  set away from its default, the run's first lines name it and say why it has no effect
  (`no_effect_notes`).
- refused (`options.refused(cls)`): a value away from the default would change the run in a way rlft
  does not do; the error names the field and what to use instead (`unimplemented_errors`).

`tests/test_trl_surface.py` checks that every TRL field name is a field of rlft's configs, and
docs/migration.md lists both groups.
"""

from __future__ import annotations

import dataclasses
import json
from functools import cache
from importlib import resources
from typing import Any

from rlft.config.options import NON_NEGATIVE, POSITIVE, Facts, no_effect, one_of, refused

_NO_DATALOADER = "rlft tokenizes up front and batches from memory; there is no DataLoader"
_EVAL = "rlft's evaluate() scores every eval row itself (generation and rewards, or pair scores)"
_OWN_LOGPROBS = (
    "rlft computes log-probs in float32 blocks itself (rlft/core/logprobs.py); no kernel is "
    "patched in"
)
_KEEP = "rlft keeps checkpoints by save_steps / save_total_limit; pick one from metrics.jsonl"
_COMPILE = "rlft's loop does not compile the model"
_TRACKIO = "rlft's trackio tracker logs locally"
_ONE_LOGGER = "only the main process logs in rlft"
_LAUNCH = ("launch with `accelerate launch --config_file examples/accelerate/{}.yaml ...` "
           "(docs/distributed.md)")
STRATEGIES = ("no", "steps", "epoch")
SAVE_STRATEGIES = ("no", "steps", "epoch", "best")


def _schedulers() -> tuple[str, ...]:
    from transformers.trainer_utils import SchedulerType

    return tuple(s.value for s in SchedulerType)


def _optimizers() -> tuple[str, ...]:
    from transformers.training_args import OptimizerNames

    return tuple(o.value for o in OptimizerNames)


_CHANGES = Facts(resume=True)  # a resumed run may change it: it does not touch what is computed
TRAINING_ARGUMENTS: dict[str, Facts] = {
    # checked values
    "per_device_train_batch_size": Facts(check=POSITIVE),
    "per_device_eval_batch_size": Facts(check=POSITIVE, resume=True),
    "gradient_accumulation_steps": Facts(check=POSITIVE),
    "learning_rate": _CHANGES,  # its own check: rlft/config/checks.py
    "logging_steps": Facts(check=POSITIVE, resume=True),
    "save_steps": Facts(check=POSITIVE, resume=True),
    "num_train_epochs": Facts(check=POSITIVE, resume=True),
    "ddp_timeout": Facts(check=POSITIVE, resume=True),
    "save_total_limit": Facts(check=POSITIVE, resume=True),
    "weight_decay": Facts(check=NON_NEGATIVE),
    "max_grad_norm": Facts(check=NON_NEGATIVE),
    "warmup_steps": Facts(check=NON_NEGATIVE),
    "eval_delay": Facts(check=NON_NEGATIVE, resume=True),
    "logging_strategy": Facts(check=one_of(STRATEGIES), resume=True),
    "save_strategy": Facts(check=one_of(SAVE_STRATEGIES), resume=True),
    "eval_strategy": Facts(check=one_of(STRATEGIES), resume=True),
    "lr_scheduler_type": Facts(check=one_of(_schedulers)),
    "optim": Facts(check=one_of(_optimizers)),
    # where output and logs go, when to stop, evaluate and save: a resumed run may change them
    **dict.fromkeys(["output_dir", "resume_from_checkpoint", "run_name", "report_to", "disable_tqdm",
                     "logging_first_step", "eval_steps", "eval_on_start", "max_steps", "push_to_hub",
                     "hub_model_id", "hub_strategy", "hub_token", "hub_private_repo", "hub_always_push",
                     "hub_revision", "do_train", "do_eval", "do_predict", "local_rank", "project", "tf32"],
                    _CHANGES),
    # no effect
    "average_tokens_across_devices": Facts(no_effect="rlft always normalises the loss over every "
                                                     "process's tokens"),
    "label_smoothing_factor": Facts(no_effect="RL and reward losses have no labels to smooth"),
    "bf16_full_eval": Facts(no_effect="evaluation runs in the training dtype"),
    "fp16_full_eval": Facts(no_effect="evaluation runs in the training dtype"),
    "torch_compile": Facts(no_effect=f"{_COMPILE} (same results, no compile speed-up)"),
    "torch_compile_backend": Facts(no_effect=_COMPILE),
    "torch_compile_mode": Facts(no_effect=_COMPILE),
    "use_liger_kernel": Facts(no_effect=_OWN_LOGPROBS),
    "liger_kernel_config": Facts(no_effect=_OWN_LOGPROBS),
    "use_cache": Facts(no_effect="generation always uses the KV cache and training never does"),
    "log_on_each_node": Facts(no_effect=_ONE_LOGGER),
    "logging_nan_inf_filter": Facts(no_effect="rlft logs the real value; a non-finite step is "
                                              "skipped and counted"),
    "log_level": Facts(no_effect="rlft logs through the `rlft` logger; configure it with Python "
                                 "logging"),
    "log_level_replica": Facts(no_effect=_ONE_LOGGER),
    "include_num_input_tokens_seen": Facts(no_effect="rlft always logs num_tokens"),
    **dict.fromkeys(["prediction_loss_only", "eval_do_concat_batches", "eval_use_gather_object",
                     "eval_accumulation_steps", "include_for_metrics", "batch_eval_metrics"],
                    Facts(no_effect=_EVAL)),
    "save_only_model": Facts(no_effect="rlft checkpoints always hold optimizer, scheduler and RNG "
                                       "state, for exact resume"),
    "save_on_each_node": Facts(no_effect="the main process writes checkpoints for the whole run"),
    "enable_jit_checkpoint": Facts(no_effect="rlft writes checkpoints atomically at save_steps"),
    "ignore_data_skip": Facts(no_effect="a resumed rlft run continues at the saved position "
                                        "without replaying data"),
    "restore_callback_states_from_checkpoint": Facts(no_effect="rlft restores TrainerControl only"),
    "accelerator_config": Facts(no_effect="rlft builds its Accelerator itself "
                                          "(rlft/train/state.py)"),
    "dataloader_drop_last": Facts(no_effect="rlft always trains on whole steps; a partial last "
                                            "batch is never used"),
    "dataloader_num_workers": Facts(check=NON_NEGATIVE, no_effect=_NO_DATALOADER),
    **dict.fromkeys(["dataloader_pin_memory", "dataloader_persistent_workers", "dataloader_prefetch_factor",
                     "dataloader_multiprocessing_context", "dataloader_in_order"],
                    Facts(no_effect=_NO_DATALOADER)),
    "remove_unused_columns": Facts(no_effect="rlft passes every extra dataset column to reward "
                                             "functions (TRL's False)"),
    "label_names": Facts(no_effect="RL and reward losses have no labels"),
    "length_column_name": Facts(no_effect="rlft does not group batches by length"),
    "train_sampling_strategy": Facts(no_effect="rlft shuffles rows per epoch (GRPO: "
                                               "shuffle_dataset)"),
    "debug": Facts(no_effect="no transformers debug hooks in rlft's loop"),
    "skip_memory_metrics": Facts(no_effect="rlft does not collect Trainer memory metrics"),
    "metric_for_best_model": Facts(no_effect=_KEEP),
    "greater_is_better": Facts(no_effect=_KEEP),
    "trackio_space_id": Facts(no_effect=_TRACKIO),
    "trackio_bucket_id": Facts(no_effect=_TRACKIO),
    "trackio_static_space_id": Facts(no_effect=_TRACKIO),
    "auto_find_batch_size": Facts(no_effect="rlft does not shrink the batch on out-of-memory"),
    # refused away from the default
    "deepspeed": Facts(refused=_LAUNCH.format("deepspeed_zero3")
                       + "; the engine comes from the accelerate config"),
    "fsdp": Facts(refused=_LAUNCH.format("fsdp2") + "; the engine comes from the accelerate "
                                                    "config"),
    "fsdp_config": Facts(refused=_LAUNCH.format("fsdp2")),
    "parallelism_config": Facts(refused="shard with FSDP2 or ZeRO from an accelerate config "
                                        "(docs/distributed.md)"),
    "neftune_noise_alpha": Facts(refused="embedding noise is not implemented in rlft"),
    "load_best_model_at_end": Facts(refused="rlft keeps checkpoints by save_steps / "
                                            "save_total_limit; load the best (metrics.jsonl has "
                                            "every eval)"),
}


@cache
def trl_fields(kind: str) -> dict[str, Any]:
    """TRL 1.16's field names and defaults for 'GRPOConfig', 'RewardConfig' or 'DistillationConfig'
    (written to rlft/trl_fields.json by tools/trl_fields.py from TRL itself)."""
    text = (resources.files("rlft") / "trl_fields.json").read_text()
    return json.loads(text)[kind]


def _default(cfg: Any, name: str) -> Any:
    f = next(f for f in dataclasses.fields(cfg) if f.name == name)
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def _same(value: Any, default: Any) -> bool:
    value = getattr(value, "value", value)  # transformers' str enums
    if value == default:
        return True
    # transformers' AcceleratorConfig() built from None
    if default is None and hasattr(value, "to_dict"):
        return value == type(value)()
    empty = (None, "", [], {}, "no")
    return value in empty and default in empty


def _changed(cfg: Any, table: dict[str, str]) -> list[tuple[str, Any, str]]:
    return [(name, getattr(cfg, name), why) for name, why in table.items()
            if not _same(getattr(cfg, name), _default(cfg, name))]


def unimplemented_errors(cfg: Any) -> list[str]:
    """One message per field set to a value rlft would not honour."""
    return [f"{name}={value!r} is not supported by rlft: {why}"
            for name, value, why in _changed(cfg, refused(type(cfg)))]


def no_effect_notes(cfg: Any) -> list[str]:
    """One line per field set away from its default that changes nothing in rlft (logged at the
    start)."""
    import torch

    notes = [f"{name}={getattr(value, 'value', value)!r} has no effect in rlft: {why}"
             for name, value, why in _changed(cfg, no_effect(type(cfg)))]
    if cfg.push_to_hub:
        notes.append(
            "push_to_hub=True: rlft pushes when trainer.push_to_hub() is called (TRL's scripts do "
            "after training), not checkpoints during training (hub_strategy)"
        )
    if cfg.tf32 and not torch.cuda.is_available():
        notes.append(
            "tf32=True has no effect on a machine without a CUDA GPU (TensorFloat-32 is a GPU "
            "matmul mode)"
        )
    return notes
