"""One tile of logits z [R, V] -> each row's log-probability of its target, entropy, logsumexp and
E_p[s], and the gradient of any combination of the first two, in one pass over the vocabulary each
(forward: online logsumexp; backward: one read of z, one write of the gradient).

With s = z / T and p = softmax(s) (rlft/core/logprobs.py):

    lse = logsumexp_v s_v,   logp = s_y - lse,   E_p[s] = sum_v p_v s_v,   H = lse - E_p[s]
    d logp / d z_v = (1[v = y] - p_v) / T,        d H / d z_v = -p_v (s_v - E_p[s]) / T

The forward keeps a running max m, l = sum exp(s - m) and a = sum exp(s - m) s over vocabulary
blocks, rescaling both when m grows (Milakov & Gimelshein 2018, "Online normalizer calculation for
softmax"): lse = m + log l, E_p[s] = a / l. Accumulation is float32 for bfloat16 / float16 / float32
tiles, float64 for float64 ones. Rows whose target is negative (padding) get logp 0.

`tile_stats` / `tile_stats_grad` run the Triton kernels where `triton_runs(z)` says they can (CUDA,
or TRITON_INTERPRET=1 on a CPU), else the same formulas in torch.
"""

from __future__ import annotations

import functools
import os
import warnings
from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")

BLOCK_V = 1024  # vocabulary columns a program reads at a time


@functools.cache
def _triton():
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None
    return triton, tl


# why the kernels stopped being used in this process (a launch that failed), or None
_FAILED: list[str] = []


def triton_runs(z: torch.Tensor) -> bool:
    """Whether the Triton kernels can run on `z`: triton installed, `z` on CUDA (or every kernel
    interpreted on the CPU: TRITON_INTERPRET=1), not switched off (RLFT_TRITON=0), and no launch has
    failed in this process (one that does is warned about once; the torch path takes over)."""
    if _triton() is None or _FAILED or os.environ.get("RLFT_TRITON", "1") == "0":
        return False
    return z.device.type == "cuda" or (z.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1")


def _failed(error: Exception) -> None:
    """A kernel launch failed (a device or Triton version it does not compile for): warn once, and the
    torch path computes the same thing from now on."""
    _FAILED.append(repr(error))
    warnings.warn(f"rlft's Triton tile kernels failed ({error!r}); the torch path computes the same values "
                  "from now on (RLFT_TRITON=0 skips the kernels)", RuntimeWarning, stacklevel=3)


def launched(launch: Callable[[], T], torch_path: Callable[[], T]) -> T:
    """`launch()`'s outputs (a kernel launch), or `torch_path()`'s when the launch fails to compile or
    run (warned once, `_failed`; a compile fails before anything is written)."""
    try:
        return launch()
    except Exception as error:  # noqa: BLE001 (any failure to compile or launch: the torch path)
        _failed(error)
        return torch_path()


def _accumulator(z: torch.Tensor) -> torch.dtype:
    return torch.float64 if z.dtype == torch.float64 else torch.float32


# ---- the torch path (the definitions) -------------------------------------------------------------
def _stats_torch(z, targets, temperature):
    s = z.to(_accumulator(z)) / temperature
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse[:, None])
    mean_s = (p * s).sum(-1)
    picked = s.gather(1, targets.clamp(min=0)[:, None])[:, 0]
    logp = torch.where(targets >= 0, picked - lse, torch.zeros_like(lse))
    return logp, lse - mean_s, lse, mean_s


def _grad_torch(z, targets, lse, mean_s, grad_logp, grad_entropy, temperature):
    s = z.to(lse.dtype) / temperature
    p = torch.exp(s - lse[:, None])
    grad = -p * (grad_logp[:, None] + grad_entropy[:, None] * (s - mean_s[:, None]))
    valid = targets >= 0
    rows = torch.nonzero(valid)[:, 0]
    grad[rows, targets[rows]] += grad_logp[rows]
    return (grad / temperature).to(z.dtype)


# ---- the Triton kernels ------------------------------------------------------------------------------
@functools.cache
def _kernels():
    triton, tl = _triton()

    @triton.jit
    def stats_kernel(z_ptr, targets_ptr, logp_ptr, entropy_ptr, lse_ptr, mean_ptr, vocab, stride,
                     inv_t, BLOCK: tl.constexpr, ACC: tl.constexpr):
        row = tl.program_id(0)
        base = z_ptr + row.to(tl.int64) * stride
        m = tl.full((), -float("inf"), ACC)
        l = tl.zeros((), ACC)  # noqa: E741
        a = tl.zeros((), ACC)
        for start in range(0, vocab, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            s = tl.load(base + cols, mask=cols < vocab, other=-float("inf")).to(ACC) * inv_t
            new_m = tl.maximum(m, tl.max(s, 0))
            scale = tl.exp(m - new_m)
            e = tl.where(cols < vocab, tl.exp(s - new_m), 0.0)
            l = l * scale + tl.sum(e, 0)  # noqa: E741
            a = a * scale + tl.sum(e * tl.where(cols < vocab, s, 0.0), 0)
            m = new_m
        lse = m + tl.log(l)
        mean_s = a / l
        target = tl.load(targets_ptr + row)
        picked = tl.load(base + tl.maximum(target, 0)).to(ACC) * inv_t
        tl.store(logp_ptr + row, tl.where(target >= 0, picked - lse, 0.0))
        tl.store(entropy_ptr + row, lse - mean_s)
        tl.store(lse_ptr + row, lse)
        tl.store(mean_ptr + row, mean_s)

    @triton.jit
    def grad_kernel(z_ptr, targets_ptr, lse_ptr, mean_ptr, gl_ptr, ge_ptr, out_ptr, vocab, stride, out_stride,
                    inv_t, BLOCK: tl.constexpr, ACC: tl.constexpr):
        row = tl.program_id(0)
        base = z_ptr + row.to(tl.int64) * stride
        out = out_ptr + row.to(tl.int64) * out_stride
        lse, mean_s = tl.load(lse_ptr + row), tl.load(mean_ptr + row)
        gl, ge = tl.load(gl_ptr + row).to(ACC), tl.load(ge_ptr + row).to(ACC)
        target = tl.load(targets_ptr + row)
        for start in range(0, vocab, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            inside = cols < vocab
            s = tl.load(base + cols, mask=inside, other=0.0).to(ACC) * inv_t
            p = tl.exp(s - lse)
            grad = -p * (gl + ge * (s - mean_s)) + tl.where(cols == target, gl, 0.0)
            tl.store(out + cols, (grad * inv_t).to(out_ptr.dtype.element_ty), mask=inside)

    return stats_kernel, grad_kernel


def _acc_constant(dtype: torch.dtype):
    tl = _triton()[1]
    return tl.float64 if dtype == torch.float64 else tl.float32


# ---- the entry points ----------------------------------------------------------------------------------
def tile_stats(z: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0):
    """(logp, entropy, lse, E_p[s]) per row of `z` [R, V] at `targets` [R] (negative: no target, logp
    0), in the accumulation dtype; Triton where it runs (module docstring)."""
    if z.ndim != 2 or targets.shape != z.shape[:1]:
        raise ValueError(f"z {tuple(z.shape)} must be [rows, vocab] and targets "
                         f"{tuple(targets.shape)} [rows]")
    if not triton_runs(z):
        return _stats_torch(z, targets, temperature)
    z = z if z.stride(-1) == 1 else z.contiguous()
    acc = _accumulator(z)
    outs = [torch.empty(z.shape[0], dtype=acc, device=z.device) for _ in range(4)]

    def launch():
        stats_kernel, _ = _kernels()
        stats_kernel[(z.shape[0],)](z, targets.contiguous(), *outs, z.shape[1], z.stride(0),
                                    1.0 / temperature, BLOCK=BLOCK_V, ACC=_acc_constant(acc))
        return tuple(outs)
    return launched(launch, lambda: _stats_torch(z, targets, temperature))


def tile_stats_grad(z: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, mean_s: torch.Tensor,
                    grad_logp: torch.Tensor, grad_entropy: torch.Tensor, temperature: float = 1.0,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """d(sum grad_logp * logp + grad_entropy * H) / dz, [R, V] in z's dtype, from the forward's lse and
    E_p[s] (one pass over z). `out` ([R, V], z's dtype; z itself is allowed: each block is read
    before it is written): where the kernel writes it."""
    acc = lse.dtype
    grad_logp = torch.where(targets >= 0, grad_logp.to(acc), torch.zeros_like(lse))
    grad_entropy = grad_entropy.to(acc)
    def torch_path():
        grad = _grad_torch(z, targets, lse, mean_s, grad_logp, grad_entropy, temperature)
        return grad if out is None else out.copy_(grad)

    if not (triton_runs(z) and z.stride(-1) == 1 and (out is None or out.stride(-1) == 1)):
        return torch_path()
    target = torch.empty_like(z) if out is None else out

    def launch():
        _, grad_kernel = _kernels()
        grad_kernel[(z.shape[0],)](z, targets.contiguous(), lse, mean_s, grad_logp.contiguous(),
                                   grad_entropy.contiguous(), target, z.shape[1], z.stride(0),
                                   target.stride(0), 1.0 / temperature, BLOCK=BLOCK_V, ACC=_acc_constant(acc))
        return target
    return launched(launch, torch_path)
