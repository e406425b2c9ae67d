"""How this process joins the run: the accelerate process state that rlft's configs and trainers
share.

A config's `device` / `world_size` / `process_index` (TrainingArguments' properties) and the
trainer's Accelerator must describe the same processes. On a machine without CUDA, accelerate only
forms the gloo group of a multi-process launch (torchrun, `accelerate launch --multi_gpu`) when told
cpu=True; without it every process would train alone as rank 0.
"""

from __future__ import annotations

import os
from datetime import timedelta

DEFAULT_DDP_TIMEOUT, CPU_DDP_TIMEOUT = 1800, 600  # seconds


def collective_timeout(cfg) -> int:
    """TrainingArguments' ddp_timeout; left at its default (30 min) on a machine without CUDA, 10
    min: a CPU rank that stops answering should not hold the others for half an hour."""
    import torch

    if cfg.ddp_timeout == DEFAULT_DDP_TIMEOUT and not torch.cuda.is_available():
        return CPU_DDP_TIMEOUT
    return cfg.ddp_timeout


def on_cpu_processes(cfg=None) -> bool:
    """Several processes without CUDA, or use_cpu: accelerate must be told cpu=True."""
    import torch

    if cfg is not None and getattr(cfg, "use_cpu", False):
        return True
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 and not torch.cuda.is_available()


def partial_state_kwargs(cfg) -> dict:
    """accelerate.PartialState arguments for this launch and config."""
    kwargs = {"cpu": on_cpu_processes(cfg), "timeout": timedelta(seconds=collective_timeout(cfg))}
    if cfg.ddp_backend:
        kwargs["backend"] = cfg.ddp_backend
    return kwargs
