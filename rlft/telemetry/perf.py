"""How close a run is to the machine's limit: the device's measured matmul peak (a probe, once per
process) and the model FLOPs utilisation of each phase of a GRPO step (rlft/core/flops.py counts the
FLOPs).

The peak is measured, not looked up: a square matmul in the training dtype, timed after a warm-up,
best of a few runs. On a GPU this lands near the datasheet's dense peak; on a CPU it is what the
cores and their vector units (AVX-512, AMX) deliver to torch. `rlft doctor` prints it; every GRPO
step logs

    perf/mfu_fwd_bwd                  training forward + backward (the optimiser step's
                                      micro-batches), in %
    perf/mfu_generation               sampling the step's completions, in %
    perf/forwarded_tok_s_fwd_bwd      prompt + completion tokens trained per second (this process)
    perf/generated_tok_s              completion tokens sampled per second (this process)
"""

from __future__ import annotations

import functools
import time

import torch

from rlft.core.flops import generation_flops, mfu, scoring_flops


@functools.cache
def matmul_peak(device: str = "cpu", dtype: torch.dtype = torch.float32) -> float:
    """FLOP/s of an n x n matmul on `device` in `dtype` (n = 4096 on an accelerator, 1024 on a CPU):
    best of 5 timed runs after one warm-up. Cached per (device, dtype) for the process."""
    size = 1024 if device == "cpu" else 4096
    # its own: the run's RNG streams stay untouched
    generator = torch.Generator(device).manual_seed(0)
    a = torch.randn(size, size, device=device, generator=generator).to(dtype)
    b = torch.randn(size, size, device=device, generator=generator).to(dtype)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    torch.mm(a, b)
    sync()
    best = float("inf")
    for _ in range(5):
        started = time.perf_counter()
        torch.mm(a, b)
        sync()
        best = min(best, time.perf_counter() - started)
    return 2.0 * size**3 / best


class Throughput:
    """A GRPO run's MFU and tokens/s per phase, for one process on its device."""

    def __init__(self, config, device: torch.device, dtype: torch.dtype):
        self.config = config
        self.kind = "cpu" if device.type == "cpu" else str(device)
        self.dtype = dtype if dtype.is_floating_point else torch.float32

    @functools.cached_property
    def peak(self) -> float:
        """The device's matmul peak, probed at the first use (not when a trainer is built)."""
        return matmul_peak(self.kind, self.dtype)

    def generation(self, rollout, seconds: float, group: int) -> dict[str, float]:
        prompts, completions = _lengths(rollout)
        flops = generation_flops(self.config, prompts, completions, group)
        return {"perf/mfu_generation": mfu(flops, seconds, self.peak),
                "perf/generated_tok_s": sum(completions) / seconds if seconds > 0 else float("nan")}

    def training(self, rollout, seconds: float) -> dict[str, float]:
        prompts, completions = _lengths(rollout)
        flops = 3.0 * scoring_flops(self.config, prompts, completions)  # backward = 2x forward
        tokens = sum(prompts) + sum(completions)
        return {"perf/mfu_fwd_bwd": mfu(flops, seconds, self.peak),
                "perf/forwarded_tok_s_fwd_bwd": tokens / seconds if seconds > 0 else float("nan")}


def _lengths(rollout) -> tuple[list[int], list[int]]:
    return rollout.prompt_mask.sum(dim=1).tolist(), rollout.completion_mask.sum(dim=1).tolist()
