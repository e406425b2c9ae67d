"""What rlft does with each TRL / TrainingArguments field it does not act on.

Every field of TRL's GRPOConfig and RewardConfig exists on rlft's configs with TRL's default
(rlft/config/classes.py). Most are implemented. The rest fall in two groups:

- `NO_EFFECT`: accepted at any value because it changes nothing rlft computes (a DataLoader knob
  where there is no DataLoader, a kernel choice where rlft has its own); set away from its
  default, the run's first lines name it and say why it has no effect.
- `REFUSED`: a value away from the default would change the run in a way rlft does not do; the
  error names the field and what to use instead.

`tests/test_trl_surface.py` checks that every TRL field name is a field of rlft's configs, and
docs/migration.md lists both groups.
"""

from __future__ import annotations

import dataclasses
import json
from functools import cache
from importlib import resources
from typing import Any

_NO_DATALOADER = "rlft tokenizes up front and batches from memory; there is no DataLoader"
_EVAL = "rlft's evaluate() scores every eval row itself (generation and rewards, or pair scores)"
_OWN_LOGPROBS = (
    "rlft computes log-probs in float32 blocks itself (rlft/core/logprobs.py); no kernel is patched in"
)
_KEEP = "rlft keeps checkpoints by save_steps / save_total_limit; pick one from metrics.jsonl"
_GENERATE = "rlft generates with model.generate (or vLLM with use_vllm)"

NO_EFFECT: dict[str, str] = {
    "average_tokens_across_devices": "rlft always normalises the loss over every process's tokens",
    "label_smoothing_factor": "RL and reward losses have no labels to smooth",
    "bf16_full_eval": "evaluation runs in the training dtype",
    "fp16_full_eval": "evaluation runs in the training dtype",
    "torch_compile": "rlft's loop does not compile the model (same results, no compile speed-up)",
    "torch_compile_backend": "rlft's loop does not compile the model",
    "torch_compile_mode": "rlft's loop does not compile the model",
    "use_liger_kernel": _OWN_LOGPROBS,
    "liger_kernel_config": _OWN_LOGPROBS,
    "use_cache": "generation always uses the KV cache and training never does",
    "log_on_each_node": "only the main process logs in rlft",
    "logging_nan_inf_filter": "rlft logs the real value; a non-finite step is skipped and counted",
    "log_level": "rlft logs through the `rlft` logger; configure it with Python logging",
    "log_level_replica": "only the main process logs in rlft",
    "include_num_input_tokens_seen": "rlft always logs num_tokens",
    "prediction_loss_only": _EVAL,
    "eval_do_concat_batches": _EVAL,
    "eval_use_gather_object": _EVAL,
    "eval_accumulation_steps": _EVAL,
    "include_for_metrics": _EVAL,
    "batch_eval_metrics": _EVAL,
    "save_only_model": "rlft checkpoints always hold optimizer, scheduler and RNG state, for exact resume",
    "save_on_each_node": "the main process writes checkpoints for the whole run",
    "enable_jit_checkpoint": "rlft writes checkpoints atomically at save_steps",
    "ignore_data_skip": "a resumed rlft run continues at the saved position without replaying data",
    "restore_callback_states_from_checkpoint": "rlft restores TrainerControl only",
    "accelerator_config": "rlft builds its Accelerator itself (rlft/train/state.py)",
    "dataloader_drop_last": "rlft always trains on whole steps; a partial last batch is never used",
    "dataloader_num_workers": _NO_DATALOADER,
    "dataloader_pin_memory": _NO_DATALOADER,
    "dataloader_persistent_workers": _NO_DATALOADER,
    "dataloader_prefetch_factor": _NO_DATALOADER,
    "dataloader_multiprocessing_context": _NO_DATALOADER,
    "dataloader_in_order": _NO_DATALOADER,
    "remove_unused_columns": "rlft passes every extra dataset column to reward functions (TRL's False)",
    "label_names": "RL and reward losses have no labels",
    "length_column_name": "rlft does not group batches by length",
    "train_sampling_strategy": "rlft shuffles rows per epoch (GRPO: shuffle_dataset)",
    "debug": "no transformers debug hooks in rlft's loop",
    "skip_memory_metrics": "rlft does not collect Trainer memory metrics",
    "metric_for_best_model": _KEEP,
    "greater_is_better": _KEEP,
    "trackio_space_id": "rlft's trackio tracker logs locally",
    "trackio_bucket_id": "rlft's trackio tracker logs locally",
    "trackio_static_space_id": "rlft's trackio tracker logs locally",
    "ds3_gather_for_generation": "under ZeRO-3 rlft gathers each layer in turn while generating",
    "vllm_group_port": "rlft's server mode sends weights over HTTP, not an NCCL group",
    "log_multimodal": "rlft has no multimodal inputs",
    "num_completions_to_print": "rlft writes num_completions_to_log completions to completions.jsonl instead",
    "log_unique_prompts": "rlft writes num_completions_to_log completions to completions.jsonl",
    "use_transformers_continuous_batching": _GENERATE,
    "transformers_continuous_batching_config": _GENERATE,
    "use_transformers_paged": _GENERATE,
    "dataset_num_proc": "rlft tokenizes pairs in the main process",
}

REFUSED: dict[str, str] = {
    "deepspeed": "launch with `accelerate launch --config_file examples/accelerate/deepspeed_zero3.yaml ...` "
    "(docs/distributed.md); the engine comes from the accelerate config",
    "fsdp": "launch with `accelerate launch --config_file examples/accelerate/fsdp2.yaml ...` "
    "(docs/distributed.md); the engine comes from the accelerate config",
    "fsdp_config": "launch with `accelerate launch --config_file examples/accelerate/fsdp2.yaml ...` "
    "(docs/distributed.md)",
    "parallelism_config": "shard with FSDP2 or ZeRO from an accelerate config (docs/distributed.md)",
    "neftune_noise_alpha": "embedding noise is not implemented in rlft",
    "load_best_model_at_end": "rlft keeps checkpoints by save_steps / save_total_limit; load the best "
    "(metrics.jsonl has every eval)",
    "log_completions_hub_repo": "rlft writes completions.jsonl in output_dir; push that file yourself",
    "vllm_structured_outputs_regex": "guided decoding is not implemented in rlft's rollouts",
}

# TRL refuses these for GRPO itself (its own reason).
GRPO_REFUSED: dict[str, str] = {
    "auto_find_batch_size": "GRPO's generation batch must hold whole groups of num_generations completions; "
    "shrinking it on out-of-memory breaks that (TRL refuses it too); lower "
    "per_device_train_batch_size instead",
}
ASYNC_NO_EFFECT = {
    "max_inflight_tasks": "rlft's producer runs one rollout request at a time, in the trainer's order",
    "queue_maxsize": "at most rollout_lag + 1 rollouts are ever requested ahead (docs/async.md)",
    "weight_sync_timeout": "weights reach the producer as a file it reads, not over NCCL",
    "fork_threshold_tokens": "multi-turn (tool) rollouts are not built for AsyncGRPOTrainer",
}
REWARD_NO_EFFECT = {"auto_find_batch_size": "rlft does not shrink the batch on out-of-memory"}


@cache
def trl_fields(kind: str) -> dict[str, Any]:
    """TRL 1.16's field names and defaults for 'GRPOConfig', 'RewardConfig' or 'DistillationConfig' (written
    to rlft/trl_fields.json by tools/trl_fields.py from TRL itself)."""
    text = (resources.files("rlft") / "trl_fields.json").read_text()
    return json.loads(text)[kind]


def _default(cfg: Any, name: str) -> Any:
    f = next(f for f in dataclasses.fields(cfg) if f.name == name)
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def _same(value: Any, default: Any) -> bool:
    value = getattr(value, "value", value)  # transformers' str enums
    if value == default:
        return True
    if default is None and hasattr(value, "to_dict"):  # transformers' AcceleratorConfig() built from None
        return value == type(value)()
    empty = (None, "", [], {}, "no")
    return value in empty and default in empty


def _changed(cfg: Any, table: dict[str, str]) -> list[tuple[str, Any, str]]:
    names = {f.name for f in dataclasses.fields(cfg)}
    return [
        (name, getattr(cfg, name), why)
        for name, why in table.items()
        if name in names and not _same(getattr(cfg, name), _default(cfg, name))
    ]


def _tables(cfg: Any) -> tuple[dict[str, str], dict[str, str]]:
    grpo = hasattr(cfg, "num_generations")
    refused = {**REFUSED, **(GRPO_REFUSED if grpo else {})}
    no_effect = {**NO_EFFECT, **({} if grpo else REWARD_NO_EFFECT),
                 **(ASYNC_NO_EFFECT if hasattr(cfg, "rollout_lag") else {})}
    return refused, no_effect


def unimplemented_errors(cfg: Any) -> list[str]:
    """One message per field set to a value rlft would not honour."""
    refused, _ = _tables(cfg)
    return [
        f"{name}={value!r} is not supported by rlft: {why}" for name, value, why in _changed(cfg, refused)
    ]


def no_effect_notes(cfg: Any) -> list[str]:
    """One line per field set away from its default that changes nothing in rlft (logged at the start)."""
    import torch

    _, no_effect = _tables(cfg)
    notes = [
        f"{name}={getattr(value, 'value', value)!r} has no effect in rlft: {why}"
        for name, value, why in _changed(cfg, no_effect)
    ]
    if cfg.push_to_hub:
        notes.append(
            "push_to_hub=True: rlft pushes when trainer.push_to_hub() is called (TRL's scripts do after "
            "training), not checkpoints during training (hub_strategy)"
        )
    if cfg.tf32 and not torch.cuda.is_available():
        notes.append(
            "tf32=True has no effect on a machine without a CUDA GPU (TensorFloat-32 is a GPU matmul mode)"
        )
    return notes
