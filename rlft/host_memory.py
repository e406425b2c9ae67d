"""Training on a CPU: freed tensors go back to the system instead of staying in glibc's heap.

glibc's malloc serves blocks below its mmap threshold from a heap. Each time the program frees a block that
had its own mapping, glibc raises the threshold to that block's size (up to 32 MiB on 64-bit), so a step's
layer-sized temporaries are soon served from the heap; and a long-lived block above them (a checkpointed
layer's input, kept to the backward) keeps the heap from shrinking, so each layer's temporaries stack on the
last. At workload d's shape that was 86% of rlft's CPU step peak (`benchmarks/cpu_allocator.py`). A fixed
threshold (`mallopt(M_MMAP_THRESHOLD, ...)`, what the MALLOC_MMAP_THRESHOLD_ variable sets at start) turns
the raising off: every block above it is its own mapping, returned when freed, in the same step time.

The trainers set it once per process when they train on a CPU, and say so (at info level). Generation is
the exception: its per-token blocks (the logits of every row, a KV cache grown by a token) are short-lived
and reused from the heap, and a fresh mapping for each costs page faults (+30% of workload d's generation
time at 64 KiB), so `generation_heap` serves them from the heap while transformers' generate runs and gives
the heap back after. A run whose environment sets MALLOC_MMAP_THRESHOLD_ (or glibc.malloc.mmap_threshold in
GLIBC_TUNABLES) keeps its own; nothing is set where the C library is not glibc, nor for a run on an
accelerator (its tensors are not malloc's).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os

import torch

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
THRESHOLD = 64 * 1024
TRIM = 128 * 1024  # glibc's default trim threshold
GENERATION_THRESHOLD = 32 * 1024 * 1024  # glibc's largest: as far as its own raising would take it
_SET: list = []  # the C library, once this process has set the threshold


def _user_chose() -> bool:
    return "MALLOC_MMAP_THRESHOLD_" in os.environ or "mmap_threshold" in os.environ.get("GLIBC_TUNABLES", "")


def _glibc():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "gnu_get_libc_version") and hasattr(libc, "mallopt") else None


def return_freed_host_memory(device: torch.device) -> str | None:
    """On a CPU with glibc: fix the mmap threshold at 64 KiB, once per process; the note to log the first time
    (None when nothing was set: another device, another C library, the user's own setting, or already set)."""
    if device.type != "cpu" or _SET or _user_chose():
        return None
    libc = _glibc()
    if libc is None or libc.mallopt(M_MMAP_THRESHOLD, THRESHOLD) != 1:
        return None
    _SET.append(libc)
    return ("training on a CPU: glibc's mmap threshold fixed at 64 KiB, so that freed activations go back to "
            "the system instead of growing its heap (set MALLOC_MMAP_THRESHOLD_ to choose another)")


@contextlib.contextmanager
def generation_heap():
    """While generate runs: blocks up to 32 MiB from the heap, which is not trimmed; after, the 64 KiB
    threshold again and the heap's free pages given back (malloc_trim). Nothing where this process set no
    threshold."""
    if not _SET:
        yield
        return
    libc = _SET[0]
    libc.mallopt(M_MMAP_THRESHOLD, GENERATION_THRESHOLD)
    libc.mallopt(M_TRIM_THRESHOLD, 2 * GENERATION_THRESHOLD)
    try:
        yield
    finally:
        libc.mallopt(M_MMAP_THRESHOLD, THRESHOLD)
        libc.mallopt(M_TRIM_THRESHOLD, TRIM)
        libc.malloc_trim(0)
