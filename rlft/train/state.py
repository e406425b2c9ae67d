"""Pieces both trainers share: the Accelerator, optimizer and schedule, seeding, clean exit.

Checkpoint files are written and read by `rlft/train/run/checkpoint.py`.
"""

from __future__ import annotations

import gc
import math
import os
import random
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
from transformers import get_scheduler

from rlft.config.launch import collective_timeout, on_cpu_processes
from rlft.errors import ConfigError, RlftError


def make_accelerator(cfg):
    """The run's Accelerator, running the engine the launch asks for (rlft/train/engines/), on the
    process state the config already describes (rlft/config/launch.py). The LR scheduler is never
    handed to accelerate: a
    prepared scheduler advances once per process per optimiser step."""
    import torch
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.utils import DistributedDataParallelKwargs, InitProcessGroupKwargs

    from rlft.train.engines import asked_engine, check_engine, engine_plugins, force_engine

    engine, cuda = asked_engine(), torch.cuda.is_available()
    if engine != "ddp" and int(os.environ.get("WORLD_SIZE", "1")) == 1 and not cuda:
        raise ConfigError(f"the launch asks for {engine} on one process of a machine without CUDA; "
                          "sharding needs several processes there (accelerate launch "
                          "--num_processes 2 ..., docs/distributed.md)")
    # A second Accelerator in one process (a second trainer) shares the first one's state and
    # plugin.
    plugins = engine_plugins(engine) if not AcceleratorState._shared_state else {}
    handlers = [InitProcessGroupKwargs(timeout=timedelta(seconds=collective_timeout(cfg)))]
    ddp = {name: getattr(cfg, f"ddp_{name}") for name in DDP_OPTIONS
           if getattr(cfg, f"ddp_{name}") is not None}
    # TrainingArguments' ddp_find_unused_parameters, ddp_bucket_cap_mb, ddp_broadcast_buffers, ...
    if ddp:
        handlers.append(DistributedDataParallelKwargs(**ddp))
    accelerator = Accelerator(log_with=cfg.report_to or None, project_dir=cfg.output_dir,
                              cpu=on_cpu_processes(cfg), kwargs_handlers=handlers, **plugins)
    if engine != "ddp" and not cuda and plugins:
        force_engine(accelerator, engine, plugins)
    check_engine(accelerator, engine)
    return accelerator


DDP_OPTIONS = ("find_unused_parameters", "bucket_cap_mb", "broadcast_buffers", "static_graph")


class CollectiveTimeoutError(RlftError, RuntimeError):
    """Another process did not reach a collective within ddp_timeout; the message names it."""


@contextmanager
def named_timeouts(accelerator, cfg):
    """Turn a collective's timeout into an error naming the rank(s) that did not answer.

    A process that times out marks itself in the process group's store, waits a moment for the other
    processes that time out too, and names the ones that never marked themselves: those are stuck
    (in a reward function, the data, the model) or dead."""
    if accelerator.num_processes == 1:
        yield
        return
    try:
        yield
    except RuntimeError as err:
        # rlft's own errors name their cause (a producer's request_timeout)
        if isinstance(err, RlftError):
            raise
        if "timed out" not in str(err).lower() and "timeout" not in str(err).lower():
            raise
        silent = _silent_ranks(accelerator.process_index, accelerator.num_processes)
        who = f"rank(s) {silent}" if silent else "another process"
        raise CollectiveTimeoutError(
            f"rank {accelerator.process_index}: {who} did not answer a collective within "
            f"ddp_timeout={collective_timeout(cfg)} s; that process is stuck (a reward function, "
            "the dataset, the model) or died. Raise ddp_timeout if it is only slow") from err


def _silent_ranks(rank: int, world: int, wait_s: float = 5.0) -> list[int]:
    import time

    import torch.distributed as dist

    try:
        store = dist.distributed_c10d._get_default_store()
        store.set(f"rlft/timed_out/{rank}", "1")
        deadline, silent = time.monotonic() + wait_s, []
        while time.monotonic() < deadline:
            silent = [r for r in range(world) if r != rank and not store.check([f"rlft/timed_out/{r}"])]
            if not silent:
                break
            time.sleep(0.2)
        return silent
    # the store went with the dead process: no names, the message still says what happened
    except Exception:
        return []


def release_processes(accelerator) -> None:
    """Free the (DDP-wrapped) model while the process group is still registered, then destroy the
    group.

    Left to interpreter exit, the last DDP Reducer destroys the gloo group while holding the GIL,
    and a gloo worker finishing its last work item waits for the GIL: a hang or 'terminate called
    without an active exception' after all work is saved (seen about 1 run in 8 on 2 CPU
    processes)."""
    accelerator.wait_for_everyone()
    # the caller holds no trainer any more: this drops the last model references
    accelerator.free_memory()
    gc.collect()
    accelerator.wait_for_everyone()
    accelerator.state.destroy_process_group()


def check_writable(output_dir: str | Path) -> None:
    """Fail before any model is loaded when output_dir cannot be written."""
    path = Path(output_dir)
    try:
        path.mkdir(parents=True, exist_ok=True)
        # one per process: ranks probe at the same time
        probe = path / f".rlft-write-test-{os.getpid()}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as err:
        raise ConfigError(f"output_dir={str(path)!r} is not writable ({err.strerror}); "
                          "choose another folder") from err


def build_optimizer(model, cfg) -> torch.optim.Optimizer:
    """transformers' own optimizer for `cfg.optim` (every name
    `Trainer.get_optimizer_cls_and_kwargs` knows: adamw_torch_fused, adamw_8bit, paged_adamw_32bit,
    adafactor, lion_*, sgd, ...) with transformers' weight-decay groups (none on biases and norms).
    One that cannot run here is an error naming it, its package and the device."""
    from transformers import Trainer

    decay = set(Trainer.get_decay_parameter_names(None, model))
    trainable = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    groups = [{"params": [p for n, p in trainable if n in decay], "weight_decay": cfg.weight_decay},
              {"params": [p for n, p in trainable if n not in decay], "weight_decay": 0.0}]
    groups = [g for g in groups if g["params"]]
    try:
        optimizer_cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(cfg, model)
        # GaLore, LOMO, layer-wise: their own parameter sets
        for key in ("params", "model", "optimizer_dict"):
            if key in kwargs:
                groups = kwargs.pop(key)
        return optimizer_cls(groups, **kwargs)
    except (ImportError, ModuleNotFoundError, RuntimeError, ValueError) as err:
        raise ConfigError(optimizer_unavailable(str(getattr(cfg.optim, "value", cfg.optim)), err)) from err


def optimizer_unavailable(name: str, err: Exception) -> str:
    device = "a CUDA GPU" if torch.cuda.is_available() else "this machine's CPU (no CUDA GPU)"
    package = next((p for p in ("bitsandbytes", "torchao", "galore_torch", "apollo_torch", "lomo_optim",
                                "grokadamw", "schedulefree", "torch_optimi") if p in str(err) or
                    (p == "bitsandbytes" and ("8bit" in name or "paged" in name or "bnb" in name))), None)
    needs = f"; it needs the {package} package" if package else ""
    return (f"optim={name!r} cannot run on {device}{needs} ({type(err).__name__}: {err}). "
            f"Install it where it runs, or choose an optimizer that runs here (adamw_torch, "
            "adamw_torch_fused, sgd, adafactor)")


def build_scheduler(optimizer, cfg, total_steps: int):
    """transformers' schedulers; warmup_steps below 1 is a fraction of the steps (transformers'
    rule)."""
    warmup = cfg.warmup_steps
    warmup = int(math.ceil(warmup * total_steps)) if 0 < warmup < 1 else int(warmup)
    warmup = warmup or int(round(cfg.warmup_ratio * total_steps))
    return get_scheduler(cfg.lr_scheduler_type, optimizer, num_warmup_steps=warmup,
                         num_training_steps=total_steps, scheduler_specific_kwargs=cfg.lr_scheduler_kwargs)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)


