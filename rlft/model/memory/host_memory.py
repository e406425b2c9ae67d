"""`trim_host_memory`: on a CPU, give the heap memory glibc holds free back to the system between
decoder layers of a training forward and backward.

glibc's allocator raises its mmap threshold (up to 32 MiB) as the program frees large blocks, then
serves blocks below it from its heap. A training forward with gradient checkpointing keeps one block
per layer (the layer's input) and frees the layer's temporaries; the heap cannot shrink below the
newest kept block, so the freed pages stay resident and, when the next layer's blocks do not fit the
holes, the heap grows past them. At workload d's shape (vocabulary 151,936, 16 x 552 tokens, LoRA,
checkpointing) that held the scoring step's peak at 1,789 MB above the model for a 245 MB working
set; trimmed (this module's first gate, free bytes alone), 663 MB for 6% more time
(benchmarks/cpu_allocator.py, docs/benchmarks.md).

`malloc_trim(0)` returns every whole free page of the heap to the system (glibc >= 2.8 releases the
middle of the heap too, not only its top) without changing how later blocks are allocated: unlike
MALLOC_MMAP_THRESHOLD_, which makes every block above it a fresh mapping for the whole process, it
costs one page fault per released page that is used again, once per layer at most. Called at the
start of each decoder layer's grad-enabled forward and before its backward (when its output's
gradient is formed), it trims only when the resident set has grown by `THRESHOLD` bytes since the
last trim and glibc holds that much free: where the next layer reuses what the last one freed
(workload b: a trim there released 40-110 MB that the next layer faulted back in, and made the
backward ~0.3 s slower) the resident set stays level and nothing is trimmed; a check is one read of
/proc/self/statm. No effect on a GPU (its activations are in device memory), on a C library without
`malloc_trim` / `mallinfo2` (musl, macOS), or in forwards without gradient (generation, old-policy
and reference scoring).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os

import torch

# resident growth since the last trim, and free bytes glibc holds, before a trim
THRESHOLD = 256 << 20
_FIELDS = ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
           "keepcost")


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in _FIELDS]


@functools.cache
def _libc():
    """glibc's malloc_trim and mallinfo2 (glibc >= 2.33), or None where the C library lacks them."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        trim, info = libc.malloc_trim, libc.mallinfo2
    except (OSError, AttributeError, TypeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    info.argtypes, info.restype = [], _MallInfo2
    return libc


def held_free() -> int | None:
    """Bytes glibc's heaps hold free (mallinfo2's fordblks), None without glibc."""
    libc = _libc()
    return None if libc is None else int(libc.mallinfo2().fordblks)


def resident_bytes() -> int | None:
    """The process's resident set in bytes (/proc/self/statm), None where there is no /proc."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


class HostMemoryTrimmer:
    """Hooks of decoder layers; `checks` and `trims` count its calls since construction. `threshold`
    (None: THRESHOLD): a trim needs the resident set grown by that many bytes since the last trim
    (or the first check) and glibc holding that many free. Growth is what tells pages that pile up
    (holes later blocks do not fit, d's case) from pages the next layer reuses (a steady resident
    set, where a trim would only cost faults)."""

    def __init__(self, threshold: int | None = None):
        self.threshold = THRESHOLD if threshold is None else threshold
        self.checks = self.trims = 0
        self.low: int | None = None  # the resident set after the last trim (the lowest seen since)

    def give_back(self) -> bool:
        """malloc_trim(0) when the resident set grew by `threshold` bytes since the last trim and
        glibc holds at least `threshold` bytes free; whether it trimmed."""
        libc = _libc()
        if libc is None:
            return False
        self.checks += 1
        resident = resident_bytes()
        if resident is not None:
            self.low = resident if self.low is None else min(self.low, resident)
            if resident - self.low < self.threshold:
                return False
        if libc.mallinfo2().fordblks < self.threshold:
            return False
        libc.malloc_trim(0)
        self.trims += 1
        self.low = resident_bytes()
        return True

    def before_forward(self, module, args, kwargs) -> None:
        """Forward pre-hook: before a layer's grad-enabled forward on a CPU."""
        hidden = args[0] if args else kwargs.get("hidden_states")
        if torch.is_grad_enabled() and isinstance(hidden, torch.Tensor) and hidden.device.type == "cpu":
            self.give_back()

    def after_forward(self, module, args, kwargs, output) -> None:
        """Forward hook: once the layer's output has its gradient, before the layer's backward (and,
        under checkpointing, its recomputation) begins, give back what the later layers' backward
        freed."""
        hidden = output[0] if isinstance(output, tuple | list) else output
        if torch.is_grad_enabled() and isinstance(hidden, torch.Tensor) and hidden.requires_grad \
                and hidden.device.type == "cpu":
            hidden.register_hook(self._before_backward)

    def _before_backward(self, grad: torch.Tensor) -> None:
        self.give_back()


def decoder_layers(model) -> list[torch.nn.Module]:
    """The decoder layers of `model` (peft-wrapped or not): transformers' GradientCheckpointingLayer
    modules, the regions gradient checkpointing recomputes."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def trim_between_layers(model, device: torch.device | str, threshold: int | None = None,
                        ) -> HostMemoryTrimmer | None:
    """Install a trimmer on every decoder layer of `model` not yet given one (each layer's
    `_rlft_trimmer`) where it trains on a CPU (`device`: the training device; the model may not be
    there yet). None on another device (no hook on its layers' forwards), where the C library has no
    malloc_trim / mallinfo2, or where the model has no decoder layers transformers marks."""
    if torch.device(device).type != "cpu" or _libc() is None:
        return None
    layers = [layer for layer in decoder_layers(model) if getattr(layer, "_rlft_trimmer", None) is None]
    if not layers:
        return None
    trimmer = HostMemoryTrimmer(threshold)
    for layer in layers:
        layer.register_forward_pre_hook(trimmer.before_forward, with_kwargs=True)
        layer.register_forward_hook(trimmer.after_forward, with_kwargs=True)
        layer._rlft_trimmer = trimmer
    return trimmer
