"""Pieces both trainers share: optimizer and schedule, RNG state, atomic checkpoints, resume.

A checkpoint is `output_dir/checkpoint-<step>/` holding the model (a normal transformers or
peft folder under `model/`), optimizer, scheduler, every process's RNG states, any extra
tensors the trainer needs (a GRPO rollout in flight) and `trainer_state.json`. It is written
to a temporary folder and renamed into place, so a kill mid-write never leaves a folder that
looks complete; resume only considers folders with `trainer_state.json`.
"""

from __future__ import annotations

import gc
import json
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import get_scheduler

from rlft.config import ConfigError

CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")
STATE_FILE = "trainer_state.json"


def make_accelerator(cfg):
    """The run's Accelerator. Launched as several processes on a machine without CUDA (torchrun,
    `accelerate launch --multi_gpu` on CPUs), accelerate only forms the gloo process group when told
    cpu=True; without it every process would train alone as rank 0."""
    from accelerate import Accelerator

    world = int(os.environ.get("WORLD_SIZE", "1"))
    return Accelerator(log_with=[r for r in cfg.report_to if r != "none"] or None, project_dir=cfg.output_dir,
                       cpu=world > 1 and not torch.cuda.is_available())


def release_processes(accelerator) -> None:
    """Free the (DDP-wrapped) model while the process group is still registered, then destroy the group.

    Left to interpreter exit, the last DDP Reducer destroys the gloo group while holding the GIL, and
    a gloo worker finishing its last work item waits for the GIL: a hang or 'terminate called without
    an active exception' after all work is saved (seen about 1 run in 8 on 2 CPU processes)."""
    accelerator.wait_for_everyone()
    accelerator.free_memory()  # the caller holds no trainer any more: this drops the last model references
    gc.collect()
    accelerator.wait_for_everyone()
    accelerator.state.destroy_process_group()


def check_writable(output_dir: str | Path) -> None:
    """Fail before any model is loaded when output_dir cannot be written."""
    path = Path(output_dir)
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".rlft-write-test-{os.getpid()}"  # one per process: ranks probe at the same time
        probe.write_text("ok")
        probe.unlink()
    except OSError as err:
        raise ConfigError(f"output_dir={str(path)!r} is not writable ({err.strerror}); choose another folder") from err


def build_optimizer(model, cfg) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    if cfg.optim == "sgd":  # plain gradient steps: what the distributed equivalence tests compare
        return torch.optim.SGD(params, lr=cfg.learning_rate, weight_decay=cfg.weight_decay)
    return torch.optim.AdamW(params, lr=cfg.learning_rate, betas=(cfg.adam_beta1, cfg.adam_beta2),
                             eps=cfg.adam_epsilon, weight_decay=cfg.weight_decay)


def build_scheduler(optimizer, cfg, total_steps: int):
    warmup = cfg.warmup_steps or int(round(cfg.warmup_ratio * total_steps))
    return get_scheduler(cfg.lr_scheduler_type, optimizer, num_warmup_steps=warmup, num_training_steps=total_steps)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _checkpoints(output_dir: Path) -> list[tuple[int, Path]]:
    found = []
    if output_dir.is_dir():
        for child in output_dir.iterdir():
            match = CHECKPOINT_RE.match(child.name)
            if match and (child / STATE_FILE).is_file():
                found.append((int(match.group(1)), child))
    return sorted(found)


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    found = _checkpoints(Path(output_dir))
    return found[-1][1] if found else None


def resolve_resume(resume: bool | str | Path | None, output_dir: str | Path) -> Path | None:
    """None/False -> None; True/'true' -> latest complete checkpoint in output_dir; else that path."""
    if resume in (None, False, "false", "False", ""):
        return None
    if resume in (True, "true", "True"):
        path = latest_checkpoint(output_dir)
        if path is None:
            raise FileNotFoundError(f"resume_from_checkpoint=True but {output_dir} holds no complete checkpoint")
        return path
    path = Path(resume)
    if not (path / STATE_FILE).is_file():
        raise FileNotFoundError(f"{path} is not a complete rlft checkpoint (no {STATE_FILE})")
    return path


def save_checkpoint(accelerator, model, tokenizer, optimizer, scheduler, output_dir: str | Path, step: int,
                    state: dict[str, Any], extra: dict[str, Any] | None = None,
                    save_total_limit: int | None = None) -> Path:
    """Write checkpoint-<step> atomically (all processes call this; rank 0 writes shared files)."""
    output_dir = Path(output_dir)
    final = output_dir / f"checkpoint-{step}"
    tmp = output_dir / f".tmp-checkpoint-{step}"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    torch.save(rng_state(), tmp / f"rng_state_{accelerator.process_index}.pt")
    if accelerator.is_main_process:
        accelerator.unwrap_model(model).save_pretrained(tmp / "model")
        tokenizer.save_pretrained(tmp / "model")
        torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
        torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
        if extra:
            torch.save(extra, tmp / "extra.pt")
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        (tmp / STATE_FILE).write_text(json.dumps({"global_step": step, **state}, indent=2))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        _rotate(output_dir, save_total_limit)
    accelerator.wait_for_everyone()
    return final


def _rotate(output_dir: Path, limit: int | None) -> None:
    if not limit:
        return
    for _, path in _checkpoints(output_dir)[:-limit]:
        shutil.rmtree(path, ignore_errors=True)


def load_model_weights(model, folder: Path) -> None:
    """Load trainable weights saved by `save_pretrained` (peft adapter or full model) in place."""
    from peft import PeftModel, set_peft_model_state_dict
    from safetensors.torch import load_file

    if isinstance(model, PeftModel):
        set_peft_model_state_dict(model, load_file(str(folder / "adapter_model.safetensors")))
        return
    state = {}
    for shard in sorted(folder.glob("*.safetensors")):
        state.update(load_file(str(shard)))
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {name for name in missing if "lm_head" in name}  # tied to the embeddings, not saved twice
    if unexpected or set(missing) - tied:
        raise RuntimeError(f"checkpoint {folder} does not match the model: missing {sorted(set(missing) - tied)[:5]}, "
                           f"unexpected {unexpected[:5]}")


def load_checkpoint(accelerator, model, optimizer, scheduler, path: Path) -> tuple[dict, dict]:
    """Restore weights, optimizer, scheduler and this process's RNG; return (trainer_state, extra)."""
    load_model_weights(accelerator.unwrap_model(model), path / "model")
    optimizer.load_state_dict(torch.load(path / "optimizer.pt", map_location="cpu", weights_only=False))
    scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=False))
    set_rng_state(torch.load(path / f"rng_state_{accelerator.process_index}.pt", weights_only=False))
    extra_path = path / "extra.pt"
    extra = torch.load(extra_path, weights_only=False) if extra_path.exists() else {}
    return json.loads((path / STATE_FILE).read_text()), extra
