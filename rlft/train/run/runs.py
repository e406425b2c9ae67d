"""Which run an output folder and a checkpoint belong to.

A new run never writes into a folder that already holds a run's results (metrics, samples,
checkpoints, a saved model) unless the user says so with `overwrite_output_dir=True`
(transformers' name; transformers 5 dropped the field, rlft keeps it because a reused folder mixes
two runs' checkpoints and a later resume picks the wrong one). While a run trains, its main process
holds an OS lock on the folder (`OutputDirLock`), so a second run started on it at the same time is
refused too.

Each checkpoint records the config that wrote it and its hash. A resume compares it with the new
config: a change that would make the continued run differ from an uninterrupted one (batch shape,
num_generations, loss, seed, model, rewards, the LoRA settings field by field, ...) is refused with
the list of differences; fields that only change what is logged, saved or evaluated, how long the
run lasts, the peak learning rate (the schedule is rebuilt from the new value at the resumed step)
or LoRA dropout are applied and reported.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import time
from pathlib import Path
from typing import Any

import torch

from rlft.config import MAY_CHANGE, to_dict  # MAY_CHANGE: the fields a resumed run may change
from rlft.errors import ConfigError, OutputDirBusyError

RUN_FILES = ("metrics.jsonl", "completions.jsonl")
MODEL_FILES = ("config.json", "adapter_config.json", "model.safetensors", "adapter_model.safetensors")
# The saved model's weight and config files (save_model writes the final model to output_dir, as
# TRL's scripts do): with overwrite_output_dir they go with the earlier run, so a LoRA run's adapter
# never lands beside an earlier full run's weights (or the reverse) in the folder a pipeline loads.
MODEL_FILE_PATTERNS = (*MODEL_FILES, "generation_config.json", "model-*-of-*.safetensors",
                       "model.safetensors.index.json")


# The LoRA (peft) settings a checkpoint records, from the model's own peft_config: all but
# lora_dropout change what the saved adapter weights mean (their shapes, scale, the modules they sit
# on); dropout acts only while training, from the resumed step on, so a change to it is applied and
# reported.
LORA_FIELDS = ("peft_type", "r", "lora_alpha", "use_rslora", "use_dora", "target_modules", "exclude_modules",
               "target_parameters", "modules_to_save", "bias", "lora_bias", "fan_in_fan_out",
               "init_lora_weights", "layers_to_transform", "layers_pattern", "rank_pattern", "alpha_pattern",
               "layer_replication", "trainable_token_indices", "lora_dropout")
LORA_MAY_CHANGE = frozenset({"lora_dropout"})
# The same setting's name in ModelConfig (rlft grpo / rlft reward, TRL's scripts), where it differs.
LORA_MODEL_CONFIG_NAMES = {"r": "lora_r", "target_modules": "lora_target_modules",
                           "modules_to_save": "lora_modules_to_save",
                           "target_parameters": "lora_target_parameters"}


def _plain(value: Any) -> Any:
    """A peft setting as a JSON value (sets sorted, enums by value)."""
    if isinstance(value, set | frozenset):
        return sorted(_plain(v) for v in value)
    if hasattr(value, "value") and not isinstance(value, int | float | str):
        return _plain(value.value)
    return json.loads(json.dumps(value, default=str))


def peft_record(model) -> dict[str, dict[str, Any]] | None:
    """{adapter name: its LoRA settings} from the model's peft_config; None for a model without
    adapters."""
    configs = getattr(model, "peft_config", None)
    if not isinstance(configs, dict) or not configs:
        return None
    return {str(adapter): {name: _plain(getattr(config, name)) for name in LORA_FIELDS
                           if hasattr(config, name)}
            for adapter, config in configs.items()}


def model_record(model, weights: bool = False) -> dict[str, Any]:
    """Class, name and size; with `weights` (a frozen model: a teacher, a reward model), a
    fingerprint of its weights too, so that weights replaced in place (the same folder, other
    values) are told apart."""
    config = getattr(model, "config", None)
    record = {"class": type(model).__name__, "name_or_path": str(getattr(config, "_name_or_path", "")),
              "parameters": sum(p.numel() for p in model.parameters())}
    if weights:
        record["weights"] = weights_fingerprint(model)
    return record


# elements hashed at a time (bounds the weights' memory); a multiplier
_CHUNK, _K = 1 << 22, 2654435761


def weights_fingerprint(model) -> str | None:
    """16 hex digits that change when any weight's bits do: each tensor's bits read as integers,
    weighted by a multiplier per position and summed modulo 2^64 on the tensor's own device (integer
    sums are exact in any order, so any device and split gives the same digits), then hashed with
    the names and shapes. None where the weights are partitioned (ZeRO-3): no process holds them
    whole."""
    digest, bases = hashlib.sha256(), {}
    for name, value in model.state_dict().items():
        if hasattr(value, "ds_id") or value.numel() == 0 and value.dim() > 0:
            return None
        flat = value.detach().contiguous().reshape(-1)
        bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()]
        ints, total = flat.view(bits), torch.zeros((), dtype=torch.int64, device=flat.device)
        # position i weighs (i * K + 97); a chunk at `start` adds start * K
        if flat.device not in bases:
            bases[flat.device] = torch.arange(_CHUNK, device=flat.device, dtype=torch.int64) * _K + 97
        for start in range(0, ints.numel(), _CHUNK):
            part = ints[start:start + _CHUNK].to(torch.int64)
            total += (part * bases[flat.device][:part.numel()]).sum() + part.sum() * (start * _K)
        digest.update(f"{name}:{tuple(value.shape)}:{value.dtype}:{int(total)};".encode())
    return digest.hexdigest()[:16]


def run_record(args, model, reward_names: list[str] | tuple = (), teacher=None,
               reward_models: dict | None = None) -> dict[str, Any]:
    """The config of this run as JSON values, plus what a Python caller passed outside the config:
    the model, its LoRA settings (`_peft`, when it has adapters), the reward functions (the reward
    models' weights: `reward_models`, name -> model) and a distillation teacher (its weights'
    fingerprint too)."""
    record = json.loads(json.dumps(to_dict(args), default=str))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    record["_model"] = {**model_record(model), "trainable": trainable}
    if hasattr(teacher, "record"):  # a served teacher
        record["_teacher"] = teacher.record()
    elif teacher is not None:  # (a ZeRO-3 engine wraps it)
        record["_teacher"] = model_record(getattr(teacher, "module", teacher), weights=True)
    peft = peft_record(model)
    if peft is not None:
        record["_peft"] = peft
    if reward_names:
        record["_reward_funcs"] = list(reward_names)
    if reward_models:
        record["_reward_models"] = {name: model_record(m, weights=True) for name, m in reward_models.items()}
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
    """Stop a new run that would mix with an earlier one; with overwrite_output_dir, clear the
    earlier run's metrics, samples, checkpoints and saved model files (the user's own files stay).
    Returns a note."""
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
        for pattern in MODEL_FILE_PATTERNS:
            for target in path.glob(pattern):
                target.unlink()
    accelerator.wait_for_everyone()
    return f"overwrite_output_dir=True: removed the earlier run's {shown} from {args.output_dir}"


# ---- one run at a time in a folder
# ------------------------------------------------------------------
LOCK_FILE = ".rlft.lock"


class OutputDirLock:
    """An OS lock (`flock`) on output_dir/.rlft.lock, taken by the run's main process for the whole
    of train(): a second run started on the folder is refused before it reads or writes anything
    there, naming the process that holds it. The OS drops the lock when its process ends, however it
    ends, so the file a killed run leaves behind never blocks a resume. The other processes of the
    same run (torchrun / accelerate launch) take no lock; they learn the main process's outcome and
    stop with it."""

    def __init__(self, accelerator, output_dir: str | Path):
        self.accelerator, self.path = accelerator, Path(output_dir) / LOCK_FILE
        self.fd: int | None = None

    def __enter__(self) -> OutputDirLock:
        refusal = self._acquire() if self.accelerator.is_main_process else None
        if self.accelerator.num_processes > 1:  # every process of this run stops, or none
            from accelerate.utils import broadcast_object_list

            refusal = broadcast_object_list([refusal], from_process=0)[0]
        if refusal is not None:
            raise OutputDirBusyError(refusal)
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def _acquire(self) -> str | None:
        """None when this process holds the lock now, else the refusal's message."""
        try:
            import fcntl
        except ImportError:  # no flock (Windows): runs are not guarded
            return None
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.pread(fd, 4096, 0).decode(errors="replace").strip() or \
                "a process that has not written its id yet"
            os.close(fd)
            return (f"output_dir={str(self.path.parent)!r} is in use by another training run "
                    f"({holder}; lock {self.path}): two runs in one folder would interleave "
                    "metrics.jsonl and overwrite each other's checkpoints. Wait for that run to "
                    "end (or stop it), then resume or overwrite; or give this run another "
                    "output_dir")
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}, since "
                      f"{time.strftime('%Y-%m-%d %H:%M:%S')}\n".encode(), 0)
        self.fd = fd
        return None

    def release(self) -> None:
        """Unlock (the file stays: removing it could let a third run lock a new file while a second
        holds the old one)."""
        if self.fd is not None:
            import fcntl

            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None


# ---- a resumed run
# ----------------------------------------------------------------------------------
def field_defaults(args) -> dict[str, Any]:
    """The config class's defaults as JSON values: what a field added since a checkpoint was written
    meant there (a checkpoint of an older rlft records no value for it)."""
    import dataclasses

    defaults = {f.name: f.default for f in dataclasses.fields(type(args))
                if f.default is not dataclasses.MISSING}
    return json.loads(json.dumps(defaults, default=str))


def compare(saved: dict[str, Any], new: dict[str, Any], defaults: dict[str, Any] | None = None
            ) -> tuple[list[str], list[str]]:
    """(refused, applied): one 'field: old -> new' line per difference; a field the saved config
    lacks counts as its default."""
    refused, applied, defaults = [], [], defaults or {}
    for name in sorted(set(saved) | set(new)):
        old, now = saved.get(name, defaults.get(name, "<unset>")), new.get(name, "<unset>")
        if old == now:
            continue
        (applied if name in MAY_CHANGE else refused).append(f"{name}: {old!r} -> {now!r}")
    return refused, applied


def _lora_label(name: str, adapter: str) -> str:
    alias = LORA_MODEL_CONFIG_NAMES.get(name)
    where = "" if adapter == "default" else f" (adapter {adapter!r})"
    return f"LoRA {name}{f' ({alias})' if alias else ''}{where}"


def compare_peft(saved: dict | None, new: dict | None) -> tuple[list[str], list[str]]:
    """(refused, applied) for the LoRA settings, one 'LoRA <field>: old -> new' line per difference;
    a dropout change is applied (it acts only while training), every other one refused (the saved
    adapter weights would mean something else: another rank, scale or set of modules)."""
    if not saved or not new:
        return ([] if saved == new else [f"LoRA adapters: {saved!r} -> {new!r}"]), []
    refused, applied = [], []
    for adapter in sorted(set(saved) | set(new)):
        old_fields, new_fields = saved.get(adapter), new.get(adapter)
        if old_fields is None or new_fields is None:
            refused.append(f"LoRA adapter {adapter!r}: {old_fields!r} -> {new_fields!r}")
            continue
        for name in [n for n in LORA_FIELDS if n in old_fields or n in new_fields]:
            old, now = old_fields.get(name, "<unset>"), new_fields.get(name, "<unset>")
            if old == now:
                continue
            line = f"{_lora_label(name, adapter)}: {old!r} -> {now!r}"
            if name in LORA_MAY_CHANGE:
                applied.append(f"{line} (applied from the resumed step: dropout acts only while "
                               "training, the saved adapter weights mean the same)")
            else:
                refused.append(line)
    return refused, applied


def _older_weight_records(path: Path, saved: dict, record: dict) -> list[str]:
    """A checkpoint of an older rlft records no weights fingerprint of the teacher or the reward
    models: those are not compared (and the run says so), the rest of their records are."""
    notes = []
    teacher = record.get("_teacher")
    if isinstance(teacher, dict) and "weights" in teacher and "weights" not in (saved.get("_teacher") or {}):
        record["_teacher"] = {k: v for k, v in teacher.items() if k != "weights"}
        notes.append(f"{path} records no fingerprint of the teacher's weights (an older rlft): "
                     "they are not compared with this run's")
    if "_reward_models" in record and "_reward_models" not in saved:
        record.pop("_reward_models")
        notes.append(f"{path} records no fingerprint of the reward models' weights (an older "
                     "rlft): they are not compared with this run's")
    return notes


def check_resume(path: Path, state: dict[str, Any], record: dict[str, Any],
                 defaults: dict[str, Any] | None = None) -> list[str]:
    """Refuse a resume whose config differs in a field that breaks exactness; return the applied
    changes. `defaults` (field_defaults): what fields the checkpoint's rlft did not have yet meant.
    The LoRA settings are compared field by field (compare_peft); a checkpoint that records none (an
    older rlft) is not compared on them, and the run says so."""
    saved = state.get("config")
    if saved is None:
        return [f"{path} records no config (written by an older rlft): "
                "the new config is not compared with it"]
    saved, record = dict(saved), dict(record)
    applied = _older_weight_records(path, saved, record)
    saved_peft, new_peft = saved.pop("_peft", None), record.pop("_peft", None)
    refused, changed = compare(saved, record, defaults)
    applied += changed
    # same model
    older = "_peft" not in state["config"] and saved.get("_model") == record.get("_model")
    if saved_peft is None and new_peft is not None and older:
        applied.append(f"{path} records no LoRA settings (written by an older rlft): this run's "
                       "lora_r, lora_alpha, target modules, ... are not compared with the "
                       "checkpoint's")
    else:
        lora_refused, lora_applied = compare_peft(saved_peft, new_peft)
        refused, applied = lora_refused + refused, applied + lora_applied
    if refused:
        raise ConfigError(
            f"{path} was written by a run with a different config; resuming would not continue "
            "that run. Differences that change the computation:\n  " + "\n  ".join(refused)
            + "\nRestore those values, or start a new run in another output_dir")
    return applied


def apply_learning_rate(optimizer, scheduler, learning_rate: float) -> None:
    """Rebuild the schedule from a new peak learning rate at the resumed step (the loaded optimizer
    and scheduler states carry the old one)."""
    lambdas = getattr(scheduler, "lr_lambdas", None)
    if lambdas is None:
        raise ConfigError("learning_rate changed on resume but the scheduler "
                          f"{type(scheduler).__name__} is "
                          "not a LambdaLR that rlft can rebuild; restore the old learning_rate")
    scheduler.base_lrs = [learning_rate] * len(optimizer.param_groups)
    lrs = [learning_rate * fn(scheduler.last_epoch) for fn in lambdas]
    for group, lr in zip(optimizer.param_groups, lrs):
        group["initial_lr"], group["lr"] = learning_rate, lr
    scheduler._last_lr = lrs
