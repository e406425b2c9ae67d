"""Which run an output folder and a checkpoint belong to.

A new run never writes into a folder that already holds a run's results (metrics, samples,
checkpoints, a saved model) unless the user says so with `overwrite_output_dir=True`
(transformers' name; transformers 5 dropped the field, rlft keeps it because a reused folder mixes
two runs' checkpoints and a later resume picks the wrong one).

Each checkpoint records the config that wrote it and its hash. A resume compares it with the new
config: a change that would make the continued run differ from an uninterrupted one (batch shape,
num_generations, loss, seed, LoRA, model, rewards, ...) is refused with the list of differences;
fields that only change what is logged, saved or evaluated, how long the run lasts, or the peak
learning rate (the schedule is rebuilt from the new value at the resumed step) are applied and
reported.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

from rlft.compat import NO_EFFECT
from rlft.config import to_dict
from rlft.errors import ConfigError

# Fields a resumed run may change: they do not touch what is computed up to the resumed step.
MAY_CHANGE = frozenset({
    "output_dir", "overwrite_output_dir", "resume_from_checkpoint", "run_name", "report_to", "disable_tqdm",
    "logging_strategy", "logging_steps", "logging_first_step", "log_completions", "num_completions_to_log",
    "save_strategy", "save_steps", "save_total_limit", "eval_strategy", "eval_steps", "eval_delay",
    "eval_on_start", "eval_dataset", "per_device_eval_batch_size", "num_generations_eval", "ddp_timeout",
    "max_nonfinite_steps", "zero_signal_warning_steps", "dataloader_num_workers", "max_steps",
    "num_train_epochs", "learning_rate", "logprob_chunk_size", "token_budget", "push_to_hub", "hub_model_id",
    "hub_strategy", "hub_token", "hub_private_repo", "hub_always_push", "hub_revision", "do_train", "do_eval",
    "do_predict", "local_rank", "project", "tf32", "vllm_sync_bucket_mb", "producer_restarts", *NO_EFFECT,
})
RUN_FILES = ("metrics.jsonl", "completions.jsonl")
MODEL_FILES = ("config.json", "adapter_config.json", "model.safetensors", "adapter_model.safetensors")


def run_record(args, model, reward_names: list[str] | tuple = ()) -> dict[str, Any]:
    """The config of this run as JSON values, plus what a Python caller passed outside the config."""
    record = json.loads(json.dumps(to_dict(args), default=str))
    config = getattr(model, "config", None)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    record["_model"] = {"class": type(model).__name__,
                        "name_or_path": str(getattr(config, "_name_or_path", "")),
                        "parameters": sum(p.numel() for p in model.parameters()), "trainable": trainable}
    if reward_names:
        record["_reward_funcs"] = list(reward_names)
    return record


def config_hash(record: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()[:16]


# ---- a new run --------------------------------------------------------------------------------------
def earlier_run(output_dir: str | Path) -> list[str]:
    """The names in output_dir that an earlier run wrote (empty when there are none)."""
    path = Path(output_dir)
    if not path.is_dir():
        return []
    found = sorted(p.name for p in path.iterdir() if p.name.startswith(("checkpoint-", ".tmp-checkpoint-"))
                   and p.is_dir())
    return found + [name for name in RUN_FILES + MODEL_FILES if (path / name).is_file()]


def claim_output_dir(accelerator, args) -> str | None:
    """Stop a new run that would mix with an earlier one; with overwrite_output_dir, clear the earlier run's
    metrics, samples and checkpoints (a saved model is replaced when this run saves). Returns a note."""
    found = earlier_run(args.output_dir)
    if not found:
        return None
    shown = ", ".join(found[:6]) + (f" and {len(found) - 6} more" if len(found) > 6 else "")
    if not getattr(args, "overwrite_output_dir", False):
        raise ConfigError(
            f"output_dir={args.output_dir!r} already holds a run ({shown}). Continue it with "
            "resume_from_checkpoint=True (CLI: --resume_from_checkpoint true), replace it with "
            "overwrite_output_dir=True, or choose another output_dir")
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        path = Path(args.output_dir)
        for name in found:
            target = path / name
            if target.is_dir():
                shutil.rmtree(target)
            elif name in RUN_FILES:
                target.unlink()
    accelerator.wait_for_everyone()
    return f"overwrite_output_dir=True: removed the earlier run's {shown} from {args.output_dir}"


# ---- a resumed run ----------------------------------------------------------------------------------
def field_defaults(args) -> dict[str, Any]:
    """The config class's defaults as JSON values: what a field added since a checkpoint was written meant
    there (a checkpoint of an older rlft records no value for it)."""
    import dataclasses

    defaults = {f.name: f.default for f in dataclasses.fields(type(args))
                if f.default is not dataclasses.MISSING}
    return json.loads(json.dumps(defaults, default=str))


def compare(saved: dict[str, Any], new: dict[str, Any], defaults: dict[str, Any] | None = None
            ) -> tuple[list[str], list[str]]:
    """(refused, applied): one 'field: old -> new' line per difference; a field the saved config lacks
    counts as its default."""
    refused, applied, defaults = [], [], defaults or {}
    for name in sorted(set(saved) | set(new)):
        old, now = saved.get(name, defaults.get(name, "<unset>")), new.get(name, "<unset>")
        if old == now:
            continue
        (applied if name in MAY_CHANGE else refused).append(f"{name}: {old!r} -> {now!r}")
    return refused, applied


def check_resume(path: Path, state: dict[str, Any], record: dict[str, Any],
                 defaults: dict[str, Any] | None = None) -> list[str]:
    """Refuse a resume whose config differs in a field that breaks exactness; return the applied changes.
    `defaults` (field_defaults): what fields the checkpoint's rlft did not have yet meant."""
    saved = state.get("config")
    if saved is None:
        return [f"{path} records no config (written by an older rlft): "
                "the new config is not compared with it"]
    refused, applied = compare(saved, record, defaults)
    if refused:
        raise ConfigError(
            f"{path} was written by a run with a different config; resuming would not continue that run. "
            "Differences that change the computation:\n  " + "\n  ".join(refused)
            + "\nRestore those values, or start a new run in another output_dir")
    return applied


def apply_learning_rate(optimizer, scheduler, learning_rate: float) -> None:
    """Rebuild the schedule from a new peak learning rate at the resumed step (the loaded optimizer and
    scheduler states carry the old one)."""
    lambdas = getattr(scheduler, "lr_lambdas", None)
    if lambdas is None:
        raise ConfigError(f"learning_rate changed on resume but the scheduler {type(scheduler).__name__} is "
                          "not a LambdaLR that rlft can rebuild; restore the old learning_rate")
    scheduler.base_lrs = [learning_rate] * len(optimizer.param_groups)
    lrs = [learning_rate * fn(scheduler.last_epoch) for fn in lambdas]
    for group, lr in zip(optimizer.param_groups, lrs):
        group["initial_lr"], group["lr"] = learning_rate, lr
    scheduler._last_lr = lrs
