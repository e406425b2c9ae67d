"""One tile of a student's and a teacher's logits z_s, z_t [R, V] (temperature already applied) -> GKD's
divergence D per row and both entropies, and D's gradient in z_s, in one pass over the vocabulary each
(two for the mixture, 0 < beta < 1): the Triton kernels of on-policy distillation's tiles
(rlft/core/distill.py has the definitions and their paper, Agarwal et al. 2024, arXiv:2306.13649).

With p = softmax(z) and lse = logsumexp(z) for each side, the forward keeps, per side and online over
vocabulary blocks (rescaled when the running max grows, as rlft/core/tile_softmax.py does),

    l = sum e,   A = sum e z,   X = sum e (z - z_other),        e = exp(z - running max)

so that H = lse - A / l and, since log p_s - log p_t = z_s - z_t - lse_s + lse_t,

    KL(p_s || p_t) = X_s / l_s - lse_s + lse_t        (beta = 1, reverse KL)
    KL(p_t || p_s) = X_t / l_t - lse_t + lse_s        (beta = 0, forward KL)

The mixture m = (1 - beta) p_s + beta p_t needs both lse first: a second pass sums
beta p_t (log p_t - log m) + (1 - beta) p_s (log p_s - log m) and keeps KL(p_s || m) for the gradient

    beta = 0:  dD/dz_s = p_s - p_t;   beta = 1:  p_s (log p_s - log p_t - D);
    else:      (1 - beta) p_s (log p_s - log m - KL(p_s || m)).

Accumulation is float32 for bfloat16 / float16 / float32 tiles, float64 for float64 ones.
`divergence_stats` / `divergence_grad` run the kernels where `triton_runs` says they can, else the same
formulas in torch.
"""

from __future__ import annotations

import functools
import math

import torch

from rlft.core.tile_softmax import BLOCK_V, _acc_constant, _accumulator, _triton, launched, triton_runs


def _mode(beta: float) -> int:
    return 0 if beta == 0.0 else 1 if beta == 1.0 else 2


# ---- the torch path (the definitions) -------------------------------------------------------------
def _log_mixture(log_ps: torch.Tensor, log_pt: torch.Tensor, beta: float) -> torch.Tensor:
    return torch.logaddexp(log_ps + math.log(1 - beta), log_pt + math.log(beta))


def _stats_torch(z_s, z_t, beta):
    acc = _accumulator(z_s)
    z_s, z_t = z_s.to(acc), z_t.to(acc)
    lse_s, lse_t = torch.logsumexp(z_s, -1), torch.logsumexp(z_t, -1)
    log_ps, log_pt = z_s - lse_s[:, None], z_t - lse_t[:, None]
    p_s, p_t = log_ps.exp(), log_pt.exp()
    kl_sm = torch.zeros_like(lse_s)
    if beta == 0.0:
        d = (p_t * (log_pt - log_ps)).sum(-1)
    elif beta == 1.0:
        d = (p_s * (log_ps - log_pt)).sum(-1)
    else:
        log_m = _log_mixture(log_ps, log_pt, beta)
        kl_sm = (p_s * (log_ps - log_m)).sum(-1)
        d = beta * (p_t * (log_pt - log_m)).sum(-1) + (1 - beta) * kl_sm
    return d, -(p_s * log_ps).sum(-1), -(p_t * log_pt).sum(-1), lse_s, lse_t, kl_sm


def _grad_torch(z_s, z_t, lse_s, lse_t, d, kl_sm, grad_d, beta):
    acc = lse_s.dtype
    log_ps, log_pt = z_s.to(acc) - lse_s[:, None], z_t.to(acc) - lse_t[:, None]
    p_s = log_ps.exp()
    if beta == 0.0:
        grad = p_s - log_pt.exp()
    elif beta == 1.0:
        grad = p_s * (log_ps - log_pt - d[:, None])
    else:
        grad = (1 - beta) * p_s * (log_ps - _log_mixture(log_ps, log_pt, beta) - kl_sm[:, None])
    return (grad * grad_d[:, None]).to(z_s.dtype)


# ---- the Triton kernels ------------------------------------------------------------------------------
@functools.cache
def _kernels():
    """(the statistics kernel, the gradient kernel), compiled when first launched."""
    return _stats_kernel(), _grad_kernel()


def _stats_kernel():
    triton, tl = _triton()

    @triton.jit
    def stats_kernel(zs_ptr, zt_ptr, d_ptr, hs_ptr, ht_ptr, lse_s_ptr, lse_t_ptr, klsm_ptr, vocab, stride_s,
                     stride_t, beta, log_b, log_1mb, MODE: tl.constexpr, BLOCK: tl.constexpr,
                     ACC: tl.constexpr):
        row = tl.program_id(0)
        base_s, base_t = zs_ptr + row.to(tl.int64) * stride_s, zt_ptr + row.to(tl.int64) * stride_t
        m_s = tl.full((), -float("inf"), ACC)
        m_t = tl.full((), -float("inf"), ACC)
        l_s, a_s, x_s = tl.zeros((), ACC), tl.zeros((), ACC), tl.zeros((), ACC)
        l_t, a_t, x_t = tl.zeros((), ACC), tl.zeros((), ACC), tl.zeros((), ACC)
        for start in range(0, vocab, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            inside = cols < vocab
            s = tl.load(base_s + cols, mask=inside, other=-float("inf")).to(ACC)
            t = tl.load(base_t + cols, mask=inside, other=-float("inf")).to(ACC)
            s0, t0 = tl.where(inside, s, 0.0), tl.where(inside, t, 0.0)
            new_s, new_t = tl.maximum(m_s, tl.max(s, 0)), tl.maximum(m_t, tl.max(t, 0))
            scale_s, scale_t = tl.exp(m_s - new_s), tl.exp(m_t - new_t)
            e_s = tl.where(inside, tl.exp(s - new_s), 0.0)
            e_t = tl.where(inside, tl.exp(t - new_t), 0.0)
            l_s = l_s * scale_s + tl.sum(e_s, 0)
            a_s = a_s * scale_s + tl.sum(e_s * s0, 0)
            x_s = x_s * scale_s + tl.sum(e_s * (s0 - t0), 0)
            l_t = l_t * scale_t + tl.sum(e_t, 0)
            a_t = a_t * scale_t + tl.sum(e_t * t0, 0)
            x_t = x_t * scale_t + tl.sum(e_t * (t0 - s0), 0)
            m_s, m_t = new_s, new_t
        lse_s, lse_t = m_s + tl.log(l_s), m_t + tl.log(l_t)
        kl_sm = tl.zeros((), ACC)
        if MODE == 0:
            d = x_t / l_t - lse_t + lse_s
        elif MODE == 1:
            d = x_s / l_s - lse_s + lse_t
        else:
            kl_tm = tl.zeros((), ACC)
            for start in range(0, vocab, BLOCK):
                cols = start + tl.arange(0, BLOCK)
                inside = cols < vocab
                log_ps = tl.load(base_s + cols, mask=inside, other=0.0).to(ACC) - lse_s
                log_pt = tl.load(base_t + cols, mask=inside, other=0.0).to(ACC) - lse_t
                u, v = log_ps + log_1mb, log_pt + log_b
                top = tl.maximum(u, v)
                log_m = top + tl.log(tl.exp(u - top) + tl.exp(v - top))
                kl_sm += tl.sum(tl.where(inside, tl.exp(log_ps) * (log_ps - log_m), 0.0), 0)
                kl_tm += tl.sum(tl.where(inside, tl.exp(log_pt) * (log_pt - log_m), 0.0), 0)
            d = beta * kl_tm + (1 - beta) * kl_sm
        tl.store(d_ptr + row, d)
        tl.store(hs_ptr + row, lse_s - a_s / l_s)
        tl.store(ht_ptr + row, lse_t - a_t / l_t)
        tl.store(lse_s_ptr + row, lse_s)
        tl.store(lse_t_ptr + row, lse_t)
        tl.store(klsm_ptr + row, kl_sm)

    return stats_kernel


def _grad_kernel():
    triton, tl = _triton()

    @triton.jit
    def grad_kernel(zs_ptr, zt_ptr, lse_s_ptr, lse_t_ptr, d_ptr, klsm_ptr, g_ptr, out_ptr, vocab, stride_s,
                    stride_t, out_stride, beta, log_b, log_1mb, MODE: tl.constexpr, BLOCK: tl.constexpr,
                    ACC: tl.constexpr):
        row = tl.program_id(0)
        base_s, base_t = zs_ptr + row.to(tl.int64) * stride_s, zt_ptr + row.to(tl.int64) * stride_t
        out = out_ptr + row.to(tl.int64) * out_stride
        lse_s, lse_t = tl.load(lse_s_ptr + row), tl.load(lse_t_ptr + row)
        d, kl_sm, g = tl.load(d_ptr + row), tl.load(klsm_ptr + row), tl.load(g_ptr + row).to(ACC)
        for start in range(0, vocab, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            inside = cols < vocab
            log_ps = tl.load(base_s + cols, mask=inside, other=0.0).to(ACC) - lse_s
            log_pt = tl.load(base_t + cols, mask=inside, other=0.0).to(ACC) - lse_t
            p_s = tl.exp(log_ps)
            if MODE == 0:
                grad = p_s - tl.exp(log_pt)
            elif MODE == 1:
                grad = p_s * (log_ps - log_pt - d)
            else:
                u, v = log_ps + log_1mb, log_pt + log_b
                top = tl.maximum(u, v)
                log_m = top + tl.log(tl.exp(u - top) + tl.exp(v - top))
                grad = (1 - beta) * p_s * (log_ps - log_m - kl_sm)
            tl.store(out + cols, (grad * g).to(out_ptr.dtype.element_ty), mask=inside)

    return grad_kernel


def _logs(beta: float) -> tuple[float, float]:
    """(log beta, log(1 - beta)), finite stand-ins at the ends (unused there)."""
    return (math.log(beta) if beta > 0 else 0.0), (math.log(1 - beta) if beta < 1 else 0.0)


# ---- the entry points ----------------------------------------------------------------------------------
def divergence_stats(z_s: torch.Tensor, z_t: torch.Tensor, beta: float):
    """(D, H_s, H_t, lse_s, lse_t, KL(p_s || m)) per row of z_s, z_t [R, V] (z_t may be a wider
    tensor's first V columns), in the accumulation dtype; KL(p_s || m) is 0 unless 0 < beta < 1.
    Triton where it runs (module docstring)."""
    if z_s.ndim != 2 or z_s.shape != z_t.shape:
        raise ValueError(f"z_s {tuple(z_s.shape)} and z_t {tuple(z_t.shape)} must both be [rows, vocab]")
    if not (triton_runs(z_s) and z_s.stride(-1) == 1 and z_t.stride(-1) == 1):
        return _stats_torch(z_s, z_t, beta)
    acc = _accumulator(z_s)
    outs = [torch.empty(z_s.shape[0], dtype=acc, device=z_s.device) for _ in range(6)]

    def launch():
        stats_kernel, _ = _kernels()
        stats_kernel[(z_s.shape[0],)](z_s, z_t, *outs, z_s.shape[1], z_s.stride(0), z_t.stride(0),
                                      float(beta), *_logs(beta), MODE=_mode(beta), BLOCK=BLOCK_V,
                                      ACC=_acc_constant(acc))
        return tuple(outs)
    return launched(launch, lambda: _stats_torch(z_s, z_t, beta))


def divergence_grad(z_s: torch.Tensor, z_t: torch.Tensor, lse_s: torch.Tensor, lse_t: torch.Tensor,
                    d: torch.Tensor, kl_sm: torch.Tensor, grad_d: torch.Tensor, beta: float,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """grad_d x dD/dz_s [R, V] in z_s's dtype from the forward's statistics (one pass). `out` ([R, V],
    z_s's dtype; z_s itself is allowed): where the kernel writes it."""
    acc = lse_s.dtype
    grad_d = grad_d.to(acc)
    def torch_path():
        grad = _grad_torch(z_s, z_t, lse_s, lse_t, d, kl_sm, grad_d, beta)
        return grad if out is None else out.copy_(grad)

    dense = z_s.stride(-1) == 1 and z_t.stride(-1) == 1 and (out is None or out.stride(-1) == 1)
    if not (triton_runs(z_s) and dense):
        return torch_path()
    target = torch.empty_like(z_s) if out is None else out

    def launch():
        _, grad_kernel = _kernels()
        grad_kernel[(z_s.shape[0],)](z_s, z_t, lse_s, lse_t, d, kl_sm, grad_d.contiguous(), target,
                                     z_s.shape[1], z_s.stride(0), z_t.stride(0), target.stride(0),
                                     float(beta), *_logs(beta), MODE=_mode(beta), BLOCK=BLOCK_V,
                                     ACC=_acc_constant(acc))
        return target
    return launched(launch, torch_path)
