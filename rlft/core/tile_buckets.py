"""One tile of a student's logits z [R, V] (temperature applied) and a support S per row (a served teacher's
top-k and sampled token; `inside` [R, V] marks it) -> the statistics and the gradient the coarse-grained
divergence of rlft/core/sparse_distill.py needs from the whole vocabulary, in one pass each: the Triton
kernels of top-k distillation's tiles, the same formulas in torch where Triton cannot run.

Forward, per row: lse = logsumexp(z), H = lse - E_p[z], and the tail's logsumexp over the tokens outside S,
lse_out = logsumexp_{v not in S} z_v (-inf when S is the whole vocabulary), all online over vocabulary
blocks as rlft/core/tile_softmax.py keeps them. The buckets' log-probs are then a_j = z_{S_j} - lse and
a_tail = lse_out - lse (a gather of K columns).

Backward: with G_j = dD/da_j and G_tail = dD/da_tail (autograd on the [R, K + 1] buckets, never the
vocabulary), since da_j/dz_v = [v = S_j] - p_v and da_tail/dz_v = [v not in S] p_v / P_tail - p_v,

    dD/dz_v = c p_v + [v not in S] G_tail exp(z_v - lse_out) + sum_j G_j [v = S_j]
    c = -(sum_j G_j + G_tail)

the kernel forms the first two terms (exp(z_v - lse_out) rather than p_v / P_tail, which underflows when
the tail is tiny) and the K columns of the third are added after.
"""

from __future__ import annotations

import functools

import torch

from rlft.core.tile_softmax import BLOCK_V, _acc_constant, _accumulator, _triton, launched, triton_runs


# ---- the torch path (the definitions) -------------------------------------------------------------
def _stats_torch(z, inside):
    z = z.to(_accumulator(z))
    lse = torch.logsumexp(z, -1)
    log_p = z - lse[:, None]
    return lse, -(log_p.exp() * log_p).sum(-1), torch.logsumexp(z.masked_fill(inside, float("-inf")), -1)


def _grad_torch(z, inside, lse, lse_out, c, g_tail):
    s = z.to(lse.dtype)
    outside = torch.exp(s - lse_out[:, None]).masked_fill(inside, 0.0) * g_tail[:, None]
    return (torch.exp(s - lse[:, None]) * c[:, None] + outside).to(z.dtype)


# ---- the Triton kernels ------------------------------------------------------------------------------
@functools.cache
def _kernels():
    """(the statistics kernel, the gradient kernel), compiled when first launched."""
    return _stats_kernel(), _grad_kernel()


def _stats_kernel():
    triton, tl = _triton()

    @triton.jit
    def stats_kernel(z_ptr, in_ptr, lse_ptr, h_ptr, out_ptr, vocab, stride, in_stride, BLOCK: tl.constexpr,
                     ACC: tl.constexpr):
        row = tl.program_id(0)
        base, marks = z_ptr + row.to(tl.int64) * stride, in_ptr + row.to(tl.int64) * in_stride
        m = tl.full((), -float("inf"), ACC)
        m_out = tl.full((), -float("inf"), ACC)
        l, a, l_out = tl.zeros((), ACC), tl.zeros((), ACC), tl.zeros((), ACC)  # noqa: E741
        for start in range(0, vocab, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            inside = cols < vocab
            s = tl.load(base + cols, mask=inside, other=-float("inf")).to(ACC)
            member = tl.load(marks + cols, mask=inside, other=1) != 0
            new_m = tl.maximum(m, tl.max(s, 0))
            scale = tl.exp(m - new_m)
            e = tl.where(inside, tl.exp(s - new_m), 0.0)
            l = l * scale + tl.sum(e, 0)  # noqa: E741
            a = a * scale + tl.sum(e * tl.where(inside, s, 0.0), 0)
            m = new_m
            s_out = tl.where(member, -float("inf"), s)
            new_out = tl.maximum(m_out, tl.max(s_out, 0))
            # (no token outside S so far: both -inf, nothing to rescale)
            scale_out = tl.where(new_out == -float("inf"), 1.0, tl.exp(m_out - new_out))
            e_out = tl.where(member, 0.0, tl.exp(s_out - new_out))
            l_out = l_out * scale_out + tl.sum(e_out, 0)
            m_out = new_out
        lse = m + tl.log(l)
        tl.store(lse_ptr + row, lse)
        tl.store(h_ptr + row, lse - a / l)
        tl.store(out_ptr + row, tl.where(l_out > 0, m_out + tl.log(l_out), -float("inf")))

    return stats_kernel


def _grad_kernel():
    triton, tl = _triton()

    @triton.jit
    def grad_kernel(z_ptr, in_ptr, lse_ptr, out_lse_ptr, c_ptr, gt_ptr, out_ptr, vocab, stride, in_stride,
                    out_stride, BLOCK: tl.constexpr, ACC: tl.constexpr):
        row = tl.program_id(0)
        base, marks = z_ptr + row.to(tl.int64) * stride, in_ptr + row.to(tl.int64) * in_stride
        out = out_ptr + row.to(tl.int64) * out_stride
        lse, lse_out = tl.load(lse_ptr + row), tl.load(out_lse_ptr + row)
        c, g_tail = tl.load(c_ptr + row).to(ACC), tl.load(gt_ptr + row).to(ACC)
        for start in range(0, vocab, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            inside = cols < vocab
            s = tl.load(base + cols, mask=inside, other=0.0).to(ACC)
            member = tl.load(marks + cols, mask=inside, other=1) != 0
            grad = tl.exp(s - lse) * c + tl.where(member, 0.0, tl.exp(s - lse_out) * g_tail)
            tl.store(out + cols, grad.to(out_ptr.dtype.element_ty), mask=inside)

    return grad_kernel


# ---- the entry points ----------------------------------------------------------------------------------
def support_stats(z: torch.Tensor, inside: torch.Tensor):
    """(lse, H, lse_out) per row of z [R, V] and the support marks `inside` [R, V] (bool), in the
    accumulation dtype (module docstring)."""
    if z.ndim != 2 or inside.shape != z.shape:
        raise ValueError(f"z {tuple(z.shape)} and inside {tuple(inside.shape)} must both be [rows, vocab]")
    if not (triton_runs(z) and z.stride(-1) == 1 and inside.stride(-1) == 1):
        return _stats_torch(z, inside)
    acc = _accumulator(z)
    outs = [torch.empty(z.shape[0], dtype=acc, device=z.device) for _ in range(3)]

    def launch():
        stats_kernel, _ = _kernels()
        stats_kernel[(z.shape[0],)](z, inside.view(torch.uint8), *outs, z.shape[1], z.stride(0),
                                    inside.stride(0), BLOCK=BLOCK_V, ACC=_acc_constant(acc))
        return tuple(outs)
    return launched(launch, lambda: _stats_torch(z, inside))


def support_grad(z: torch.Tensor, inside: torch.Tensor, lse: torch.Tensor, lse_out: torch.Tensor,
                 c: torch.Tensor, g_tail: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """c p_v + [v not in S] g_tail exp(z_v - lse_out) [R, V] in z's dtype (one pass); g_tail must be 0
    where lse_out is -inf. `out` (z itself is allowed): where the kernel writes it."""
    acc = lse.dtype
    c, g_tail = c.to(acc).contiguous(), g_tail.to(acc).contiguous()
    def torch_path():
        grad = _grad_torch(z, inside, lse, lse_out, c, g_tail)
        return grad if out is None else out.copy_(grad)

    dense = z.stride(-1) == 1 and inside.stride(-1) == 1 and (out is None or out.stride(-1) == 1)
    if not (triton_runs(z) and dense):
        return torch_path()
    target = torch.empty_like(z) if out is None else out

    def launch():
        _, grad_kernel = _kernels()
        grad_kernel[(z.shape[0],)](z, inside.view(torch.uint8), lse, lse_out, c, g_tail, target, z.shape[1],
                                   z.stride(0), inside.stride(0), target.stride(0), BLOCK=BLOCK_V,
                                   ACC=_acc_constant(acc))
        return target
    return launched(launch, torch_path)
