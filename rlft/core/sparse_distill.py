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
the backward by autograd over that tile's [t, V] logits (the tile is all that is ever held). Logits
are float32 whatever the model's dtype; the teacher's log-probs are taken as given (the server's, at
temperature 1). Shapes: N positions, H hidden size, V vocabulary, K support columns (-1 padding,
left-aligned: column 0 is always a token).
"""

from __future__ import annotations

import torch

from rlft.core.distill import Divergence, Head, divergence_from_logprobs, no_positions
from rlft.core.fused_head import HeadGrads, _logits, tile_positions, vocabulary_rows

# a padding column's log-prob on both sides: exp(PAD) is 0, adding nothing to D or its gradient
PAD = -1e4
# log(1e-7): the least tail mass a top-k leaves (rounding can say less)
LOG_TINY = -16.118095650958317


def bucketed_logprobs(log_ps: torch.Tensor, ids: torch.Tensor, teacher: torch.Tensor, tail: bool = True):
    """(student, teacher) log-probs over the buckets [t, K (+1)] from the student's full log-probs
    log_ps [t, V], the support ids [t, K] (-1 padding) and the teacher's log-probs there [t, K]
    (module docstring). Differentiable in log_ps."""
    valid = ids >= 0
    # padding repeats column 0's token (never a second token)
    safe = torch.where(valid, ids, ids[:, :1])
    a = log_ps.gather(-1, safe)
    q = teacher.to(log_ps.dtype)
    if tail:
        inside = torch.zeros_like(log_ps, dtype=torch.bool).scatter_(-1, safe, True)
        a_tail = torch.logsumexp(log_ps.masked_fill(inside, float("-inf")), dim=-1)  # [t]
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


def _tile(z: torch.Tensor, ids, teacher, beta: float, tail: bool, entropies: bool = True):
    """(D [t], the student's entropy [t], the teacher's over the buckets [t]) from one tile's logits
    (D alone without `entropies`)."""
    log_ps = z - torch.logsumexp(z, dim=-1, keepdim=True)
    a, q = bucketed_logprobs(log_ps, ids, teacher, tail)
    d = divergence_from_logprobs(a, q, beta)
    if not entropies:
        return d
    entropy = -(log_ps.exp() * log_ps).sum(-1)
    return d, entropy, -(q.exp() * q).sum(-1)


class _SparseDivergence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, ids, teacher_logps, student: Head, beta, temperature, tail, tile):
        n = hidden.shape[0]
        d = torch.empty(n, dtype=torch.promote_types(hidden.dtype, torch.float32), device=hidden.device)
        entropy, teacher_entropy = torch.empty_like(d), torch.empty_like(d)
        with student.whole():
            for start in range(0, n, tile):
                rows = slice(start, start + tile)
                z, _ = _logits(hidden[rows], student.weight, student.bias, student.scale, student.softcap,
                               temperature)
                values = _tile(z, ids[rows], teacher_logps[rows], beta, tail)
                d[rows], entropy[rows], teacher_entropy[rows] = values
        ctx.save_for_backward(hidden, ids, teacher_logps)
        ctx.settings = (student, beta, temperature, tail, tile)
        ctx.mark_non_differentiable(entropy, teacher_entropy)
        return d, entropy, teacher_entropy

    @staticmethod
    def backward(ctx, grad_d, grad_entropy, grad_teacher_entropy):
        hidden, ids, teacher_logps = ctx.saved_tensors
        student, beta, temperature, tail, tile = ctx.settings
        with student.whole():
            grads = HeadGrads(hidden, student.weight, student.bias, ctx.needs_input_grad[:3])
            for start in range(0, hidden.shape[0], tile):
                rows = slice(start, start + tile)
                z, squashed = _logits(hidden[rows], student.weight, student.bias, student.scale,
                                      student.softcap, temperature)
                with torch.enable_grad():
                    z = z.detach().requires_grad_(True)
                    d = _tile(z, ids[rows], teacher_logps[rows], beta, tail, entropies=False)
                    (grad_z,) = torch.autograd.grad(d, z, grad_d[rows].to(d.dtype))
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
