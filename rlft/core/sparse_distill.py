"""On-policy distillation from a teacher known only by its top-k log-probs per position (a teacher
served by `rlft vllm-serve`), tile by tile from the student's hidden states.

The divergence D at `beta` is GKD's (Agarwal et al. 2024, arXiv:2306.13649; rlft/core/distill.py),
computed on a coarse-grained vocabulary. At one position the server names a support S: the teacher's
k most likely tokens and the sampled token (|S| <= k + 1), with the teacher's log-probs q_j there.
The vocabulary is cut into the |S| tokens of S and, with `tail`, one more bucket holding every other
token:

    p_t(S_j) = exp(q_j),            p_t(tail) = 1 - sum_j exp(q_j)
    p_s(S_j) = softmax(z_s)_{S_j},  p_s(tail) = sum_{v not in S} softmax(z_s)_v

The student's side is exact (its full softmax, one tile at a time). D is taken between these two
(|S| + 1)-way distributions. Each of forward KL, reverse KL and the
generalized JSD is an f-divergence, so by the data-processing inequality coarse-graining can only
lower it:

    D_bucketed(k) <= D_bucketed(k') <= D_exact    for k <= k' (nested supports)

with equality when S is the whole vocabulary. The approximation is a lower bound that tightens as k
grows; how close it is at k = 1, 5, 20, 100 is measured in docs/distillation.md. Without `tail`,
both distributions are renormalised over S instead (TRL's `loss_add_tail=False`): not a bound, exact
only where the teacher's mass outside S is zero.

The gradient with respect to the student's logits z_s is the bucketed D's, recomputed per tile in
the backward from the buckets' own gradients (autograd on [t, K + 1]) and one pass over the tile's
[t, V] logits (rlft/core/tile_buckets.py: Triton where it runs; the tile is all that is ever held).
Logits are float32 whatever the model's dtype; the teacher's log-probs are taken as given (the server's, at
temperature 1). Shapes: N positions, H hidden size, V vocabulary, K support columns (-1 padding,
left-aligned: column 0 is always a token).
"""

from __future__ import annotations

import torch

from rlft.core.distill import Divergence, Head, divergence_from_logprobs, no_positions
from rlft.core.fused_head import HeadGrads, _logits, tile_positions, vocabulary_rows
from rlft.core.tile_buckets import support_grad, support_stats

# a padding column's log-prob on both sides: exp(PAD) is 0, adding nothing to D or its gradient
PAD = -1e4
# log(1e-7): the least tail mass a top-k leaves (rounding can say less)
LOG_TINY = -16.118095650958317


def bucketed_logprobs(log_ps: torch.Tensor, ids: torch.Tensor, teacher: torch.Tensor, tail: bool = True):
    """(student, teacher) log-probs over the buckets [t, K (+1)] from the student's full log-probs
    log_ps [t, V], the support ids [t, K] (-1 padding) and the teacher's log-probs there [t, K]
    (module docstring). Differentiable in log_ps."""
    valid, safe = ids >= 0, _safe(ids)
    a_tail = None
    if tail:
        inside = torch.zeros_like(log_ps, dtype=torch.bool).scatter_(-1, safe, True)
        a_tail = torch.logsumexp(log_ps.masked_fill(inside, float("-inf")), dim=-1)  # [t]
    return buckets(log_ps.gather(-1, safe), a_tail, valid, teacher)


def _safe(ids: torch.Tensor) -> torch.Tensor:
    """The support ids with padding repeating column 0's token (never a second token)."""
    return torch.where(ids >= 0, ids, ids[:, :1])


def buckets(a: torch.Tensor, a_tail: torch.Tensor | None, valid: torch.Tensor, teacher: torch.Tensor):
    """`bucketed_logprobs` from the student's log-probs at the support a [t, K] and its tail's a_tail [t]
    (-inf: no tail; None: renormalised over the support instead). Differentiable in a and a_tail."""
    q = teacher.to(a.dtype)
    if a_tail is not None:
        held = torch.logsumexp(q.masked_fill(~valid, float("-inf")), dim=-1).clamp(max=-1e-7)
        q_tail = torch.log(-torch.expm1(held)).clamp(min=LOG_TINY)  # log(1 - sum_S p_t)
        has_tail = torch.isfinite(a_tail)  # (S the whole vocabulary: no tail bucket)
        a = torch.cat([a, torch.where(has_tail, a_tail, PAD)[:, None]], dim=-1)
        q = torch.cat([q, torch.where(has_tail, q_tail, PAD)[:, None]], dim=-1)
        valid = torch.cat([valid, has_tail[:, None]], dim=-1)
    else:
        a = a - torch.logsumexp(a.masked_fill(~valid, float("-inf")), dim=-1, keepdim=True)
        q = q - torch.logsumexp(q.masked_fill(~valid, float("-inf")), dim=-1, keepdim=True)
    return torch.where(valid, a, PAD), torch.where(valid, q, PAD)


def support_tile(z: torch.Tensor, ids, teacher, beta: float, tail: bool):
    """(D [t], the student's entropy [t], the teacher's over the buckets [t], lse [t], lse_out [t]) from one
    tile's logits: the vocabulary read once (rlft/core/tile_buckets.py), the buckets from K columns."""
    inside = torch.zeros_like(z, dtype=torch.bool).scatter_(-1, _safe(ids), True)
    lse, entropy, lse_out = support_stats(z, inside)
    a, q = _tile_buckets(z, ids, teacher, tail, lse, lse_out)
    return divergence_from_logprobs(a, q, beta), entropy, -(q.exp() * q).sum(-1), lse, lse_out


def _tile_buckets(z, ids, teacher, tail: bool, lse, lse_out, a=None, a_tail=None):
    """The buckets' (student, teacher) log-probs; `a`, `a_tail`: the student's, given (a leaf to
    differentiate), else gathered from z."""
    if a is None:
        a = z.gather(-1, _safe(ids)).to(lse.dtype) - lse[:, None]
        a_tail = lse_out - lse
    return buckets(a, a_tail if tail else None, ids >= 0, teacher)


def support_tile_grad(z, ids, teacher, beta: float, tail: bool, lse, lse_out, grad_d) -> torch.Tensor:
    """grad_d x dD/dz [t, V], written over z (module docstring of rlft/core/tile_buckets.py): G = dD/da
    and G_tail = dD/da_tail by autograd on the [t, K + 1] buckets."""
    safe = _safe(ids)
    a = (z.gather(-1, safe).to(lse.dtype) - lse[:, None]).requires_grad_(True)
    a_tail = (lse_out - lse).requires_grad_(True)
    with torch.enable_grad():
        d = divergence_from_logprobs(*_tile_buckets(z, ids, teacher, tail, lse, lse_out, a, a_tail), beta)
        g, g_tail = torch.autograd.grad(d, (a, a_tail), grad_d.to(d.dtype), allow_unused=True)
    g_tail = torch.zeros_like(lse) if g_tail is None else torch.where(torch.isfinite(lse_out), g_tail, 0.0)
    inside = torch.zeros_like(z, dtype=torch.bool).scatter_(-1, safe, True)
    grad_z = support_grad(z, inside, lse, lse_out, -(g.sum(-1) + g_tail), g_tail, out=z)
    return grad_z.scatter_add_(-1, safe, g.to(grad_z.dtype))


class _SparseDivergence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, ids, teacher_logps, student: Head, beta, temperature, tail, tile):
        n = hidden.shape[0]
        d = torch.empty(n, dtype=torch.promote_types(hidden.dtype, torch.float32), device=hidden.device)
        entropy, teacher_entropy = torch.empty_like(d), torch.empty_like(d)
        lse, lse_out = torch.empty_like(d), torch.empty_like(d)  # the backward's
        with student.whole():
            for start in range(0, n, tile):
                rows = slice(start, start + tile)
                z, _ = _logits(hidden[rows], student.weight, student.bias, student.scale, student.softcap,
                               temperature)
                values = support_tile(z, ids[rows], teacher_logps[rows], beta, tail)
                d[rows], entropy[rows], teacher_entropy[rows], lse[rows], lse_out[rows] = values
        ctx.save_for_backward(hidden, ids, teacher_logps, lse, lse_out)
        ctx.settings = (student, beta, temperature, tail, tile)
        ctx.mark_non_differentiable(entropy, teacher_entropy)
        return d, entropy, teacher_entropy

    @staticmethod
    def backward(ctx, grad_d, grad_entropy, grad_teacher_entropy):
        hidden, ids, teacher_logps, lse, lse_out = ctx.saved_tensors
        student, beta, temperature, tail, tile = ctx.settings
        with student.whole():
            grads = HeadGrads(hidden, student.weight, student.bias, ctx.needs_input_grad[:3])
            for start in range(0, hidden.shape[0], tile):
                rows = slice(start, start + tile)
                z, squashed = _logits(hidden[rows], student.weight, student.bias, student.scale,
                                      student.softcap, temperature)
                grad_z = support_tile_grad(z, ids[rows], teacher_logps[rows], beta, tail, lse[rows],
                                           lse_out[rows], grad_d[rows])
                grads.add(rows, grad_z, squashed, student.scale / temperature)
            return (*grads.result(), None, None, None, None, None, None, None)


def sparse_divergence(hidden: torch.Tensor, student: Head, ids: torch.Tensor, teacher_logps: torch.Tensor,
                      beta: float = 1.0, temperature: float = 1.0, tail: bool = True,
                      tile: int | None = None) -> Divergence:
    """D [N] between the student (hidden states [N, H], differentiable, as are its head's weight and
    bias) and a teacher given by its log-probs `teacher_logps` [N, K] at the support `ids` [N, K]
    (-1 padding; column 0 always a token), and the two entropies [N] (the teacher's over the
    buckets). Never allocates [N, V]."""
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be in [0, 1] (0 forward KL, 1 reverse KL), got {beta}")
    if ids.shape != teacher_logps.shape or ids.shape[0] != hidden.shape[0]:
        raise ValueError(f"support ids {tuple(ids.shape)}, teacher log-probs "
                         f"{tuple(teacher_logps.shape)} and hidden states {tuple(hidden.shape)} "
                         "must agree on positions and columns")
    vocab = vocabulary_rows(student.weight)
    if ids.numel() and int(ids.max()) >= vocab:
        raise ValueError(f"the teacher's support names token {int(ids.max())} but the student's "
                         f"vocabulary has {vocab} tokens: both must use the same tokenizer")
    if ids.numel() and bool((ids[:, 0] < 0).any()):
        raise ValueError("a position has no teacher token (its support's column 0 is padding): the "
                         "answers were not placed at the scored positions")
    if hidden.shape[0] == 0:
        return no_positions(hidden)
    tile = tile or tile_positions(vocab, device=hidden.device)
    return Divergence(*_SparseDivergence.apply(hidden, student.weight, student.bias, ids,
                                               teacher_logps.detach(), student, float(beta),
                                               float(temperature), bool(tail), int(tile)))
