"""TRL compatibility of the config surface: every TRL GRPOConfig / RewardConfig field name (which
include transformers' TrainingArguments) is accepted.

The names and TRL's defaults come from `rlft/trl_fields.json` (written by `tools/trl_fields.py`
from TRL itself). A name rlft implements is a real field of its config class. A name it does not
implement becomes a field holding TRL's default; set to anything else, validation fails naming
the field and what to use instead. Nothing a user sets is silently ignored.
"""

from __future__ import annotations

import dataclasses
import json
from functools import cache
from importlib import resources
from typing import Any

# Accepted with no effect on training, with the reason (docs/migration.md lists them).
NO_EFFECT = {
    "do_train": "a flag for scripts; the trainer does not read it",
    "do_eval": "a flag for scripts; the trainer does not read it",
    "do_predict": "a flag for scripts; the trainer does not read it",
    "local_rank": "set by the launcher; rlft reads the process rank from accelerate",
    "log_level": "rlft logs through the `rlft` logger; configure it with Python logging",
    "log_level_replica": "only the main process logs in rlft",
    "log_on_each_node": "only the main process logs in rlft",
    "dataloader_pin_memory": "rlft tokenizes up front and batches from memory; there is no DataLoader",
    "dataloader_persistent_workers": "rlft tokenizes up front and batches from memory; there is no DataLoader",
    "dataloader_prefetch_factor": "rlft tokenizes up front and batches from memory; there is no DataLoader",
    "dataloader_multiprocessing_context": "rlft tokenizes up front and batches from memory; there is no DataLoader",
    "dataloader_drop_last": "rlft always uses whole rollouts/steps; a partial last batch is never trained on",
    "dataloader_in_order": "rlft tokenizes up front and batches from memory; there is no DataLoader",
    "remove_unused_columns": "rlft passes every extra dataset column to reward functions (TRL's False)",
    "skip_memory_metrics": "rlft does not collect Trainer memory metrics",
    "include_num_input_tokens_seen": "rlft always logs num_tokens (TRL's meaning)",
    "ds3_gather_for_generation": "under ZeRO-3 rlft generates with synced_gpus (every forward gathers its layer)",
    "log_multimodal": "rlft has no multimodal inputs",
}

# What to use instead, for fields people set often. Others get a generic message.
HINTS = {
    "deepspeed": "launch with `accelerate launch --config_file examples/accelerate/deepspeed_zero3.yaml ...` "
                 "(docs/distributed.md); the engine comes from the accelerate config",
    "fsdp": "launch with `accelerate launch --config_file examples/accelerate/fsdp2.yaml ...` (docs/distributed.md); "
            "the engine comes from the accelerate config",
    "fsdp_config": "launch with `accelerate launch --config_file ...` (docs/distributed.md)",
    "push_to_hub": "call trainer.save_model(dir) and push that folder yourself",
    "hub_model_id": "call trainer.save_model(dir) and push that folder yourself",
    "use_liger_kernel": "rlft computes log-probs in float32 chunks itself (rlft/core/logprobs.py)",
    "torch_compile": "not supported by rlft's loop yet",
    "load_best_model_at_end": "checkpoints are kept per save_steps; pick one from metrics.jsonl",
    "metric_for_best_model": "checkpoints are kept per save_steps; pick one from metrics.jsonl",
    "auto_find_batch_size": "set per_device_train_batch_size yourself; `rlft doctor` checks a config quickly",
    "neftune_noise_alpha": "not supported",
    "resume_from_checkpoint": "pass it to trainer.train(resume_from_checkpoint=...) or the CLI flag",
    "use_transformers_paged": "rlft generates with model.generate",
    "use_transformers_continuous_batching": "rlft generates with model.generate",
}


@cache
def trl_fields(kind: str) -> dict[str, Any]:
    """TRL's field names and defaults for 'GRPOConfig' or 'RewardConfig'."""
    text = (resources.files("rlft") / "trl_fields.json").read_text()
    return json.loads(text)[kind]


def compat_fields(kind: str, implemented: set[str]) -> list[tuple[str, Any, dataclasses.Field]]:
    """make_dataclass field specs for the TRL names rlft does not implement, each holding TRL's default."""
    specs = []
    for name, default in sorted(trl_fields(kind).items()):
        if name in implemented:
            continue
        if isinstance(default, list | dict):
            spec = dataclasses.field(default_factory=lambda d=default: type(d)(d), metadata={"trl_compat": True})
        else:
            spec = dataclasses.field(default=default, metadata={"trl_compat": True})
        specs.append((name, Any, spec))
    return specs


def _same(value: Any, default: Any) -> bool:
    if value == default:
        return True
    if default in (None, "", [], {}) and value in (None, "", [], {}):
        return True
    return hasattr(value, "value") and value.value == default  # transformers' enums (IntervalStrategy.STEPS)


def unimplemented_errors(cfg: Any) -> list[str]:
    """One message per TRL field rlft does not implement that is set to something other than TRL's default."""
    errors = []
    for field in dataclasses.fields(cfg):
        if not field.metadata.get("trl_compat") or field.name in NO_EFFECT:
            continue
        value = getattr(cfg, field.name)
        if _same(value, field.default if field.default is not dataclasses.MISSING else field.default_factory()):
            continue
        hint = HINTS.get(field.name, f"rlft does not implement it; remove it (TRL's default: {field.default!r})")
        errors.append(f"{field.name}={value!r} is a TRL/transformers field rlft does not implement: {hint}")
    return errors
