"""On-policy distillation's per-token divergence, tile by tile from the two models' hidden states.

Generalized Jensen-Shannon divergence (Agarwal et al. 2024, "On-Policy Distillation of Language
Models: Learning from Self-Generated Mistakes", arXiv:2306.13649, GKD), as TRL's DistillationTrainer
defines `beta`: with the student's and the teacher's next-token distributions at one position, both
at temperature T,

    p_s = softmax(z_s),  z_s = c_s (h_s W_s^T + b_s) / T          (the student's, differentiable)
    p_t = softmax(z_t),  z_t = c_t (h_t W_t^T + b_t) / T          (the teacher's, no gradient)

    beta = 0:      D = KL(p_t || p_s) = sum_j p_t,j (log p_t,j - log p_s,j)          (forward KL)
    beta = 1:      D = KL(p_s || p_t) = sum_j p_s,j (log p_s,j - log p_t,j)   (reverse KL, TRL
                   default)
    0 < beta < 1:  m = (1 - beta) p_s + beta p_t
                   D = beta KL(p_t || m) + (1 - beta) KL(p_s || m)

(the mixture's formula goes to 0 at both ends; 0 and 1 are the two KLs, as TRL has them). c is a
model's logit scale (and Gemma-2's softcapping k tanh(u / k) where set, rlft/core/fused_head.py).
The gradient with respect to the student's logits, per position:

    beta = 0:      dD/dz_s = p_s - p_t
    beta = 1:      dD/dz_s = p_s (log p_s - log p_t - D)
    0 < beta < 1:  dD/dz_s = (1 - beta) p_s (log p_s - log m - KL(p_s || m))

The vocabulary is never held for all positions: each tile of positions is projected through both
heads, reduced to D (and the student's entropy, a metric) and dropped; the backward recomputes the
tile. Each tile's reductions and gradient are rlft/core/tile_divergence.py's: Triton kernels where
they run (one pass over the vocabulary each; two for the mixture's forward), torch elsewhere. Logits
are float32 whatever the models' dtype. Shapes: N positions, H_s / H_t hidden sizes, V vocabulary.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from rlft.core.fused_head import HeadGrads, _logits, tile_positions, vocabulary_rows
from rlft.core.tile_divergence import divergence_grad, divergence_stats


@dataclass(frozen=True)
class Head:
    """One model's LM head as the divergence reads it: weight [V, H], bias [V] or None, logit scale,
    softcapping, `whole()`: a context in which a partitioned weight is whole (ZeRO-3), and `vocab`:
    only its first `vocab` rows are the vocabulary (a teacher whose embedding matrix is padded past
    the student's, with the same tokenizer: the rows after are never a token; None: all)."""
    weight: torch.Tensor
    bias: torch.Tensor | None = None
    scale: float = 1.0
    softcap: float | None = None
    whole: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    vocab: int | None = None


def divergence_from_logprobs(log_ps: torch.Tensor, log_pt: torch.Tensor, beta: float) -> torch.Tensor:
    """D [t] from log p_s, log p_t [t, V] (the module docstring's three cases)."""
    if beta == 0.0:
        return (log_pt.exp() * (log_pt - log_ps)).sum(-1)
    if beta == 1.0:
        return (log_ps.exp() * (log_ps - log_pt)).sum(-1)
    log_m = torch.logaddexp(log_ps + math.log(1 - beta), log_pt + math.log(beta))
    return (beta * (log_pt.exp() * (log_pt - log_m)).sum(-1)
            + (1 - beta) * (log_ps.exp() * (log_ps - log_m)).sum(-1))


def divergence_terms(log_ps: torch.Tensor, log_pt: torch.Tensor, beta: float) -> torch.Tensor:
    """D's terms [..., V] before the sum over the vocabulary (the module docstring's three cases, one
    term per token): D = divergence_terms(...).sum(-1). For whole [B, T, V] logits a caller already
    holds (TRL's `generalized_jsd_loss`); rlft's own steps never form them."""
    if beta == 0.0:
        return log_pt.exp() * (log_pt - log_ps)
    if beta == 1.0:
        return log_ps.exp() * (log_ps - log_pt)
    log_m = torch.logaddexp(log_ps + math.log(1 - beta), log_pt + math.log(beta))
    return beta * log_pt.exp() * (log_pt - log_m) + (1 - beta) * log_ps.exp() * (log_ps - log_m)


class _TiledDivergence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden_s, weight_s, bias_s, hidden_t, student: Head, teacher: Head, beta, temperature,
                tile):
        n = hidden_s.shape[0]
        work = torch.promote_types(hidden_s.dtype, torch.float32)
        # [N] each, at temperature T: D, both entropies, both lse, KL(p_s || m) (the backward's)
        stats = torch.empty(6, n, dtype=work, device=hidden_s.device)
        with student.whole(), teacher.whole():
            for start in range(0, n, tile):
                rows = slice(start, start + tile)
                z_s, z_t, _ = _tile_logits(hidden_s[rows], hidden_t[rows], student, teacher, temperature)
                for row, value in zip(stats, divergence_stats(z_s, z_t, beta)):
                    row[rows] = value
        d, entropy, teacher_entropy, lse_s, lse_t, kl_sm = stats
        ctx.save_for_backward(hidden_s, hidden_t, d, lse_s, lse_t, kl_sm)
        ctx.settings = (student, teacher, beta, temperature, tile)
        ctx.mark_non_differentiable(entropy, teacher_entropy)
        return d, entropy, teacher_entropy

    @staticmethod
    def backward(ctx, grad_d, grad_entropy, grad_teacher_entropy):
        hidden_s, hidden_t, d, lse_s, lse_t, kl_sm = ctx.saved_tensors
        student, teacher, beta, temperature, tile = ctx.settings
        with student.whole(), teacher.whole():  # (a partitioned weight has its shape only inside)
            grads = HeadGrads(hidden_s, student.weight, student.bias, ctx.needs_input_grad[:3])
            for start in range(0, hidden_s.shape[0], tile):
                rows = slice(start, start + tile)
                z_s, z_t, squashed = _tile_logits(hidden_s[rows], hidden_t[rows], student, teacher,
                                                  temperature)
                grad_z = divergence_grad(z_s, z_t, lse_s[rows], lse_t[rows], d[rows], kl_sm[rows],
                                         grad_d[rows], beta, out=z_s)  # written over z_s
                grads.add(rows, grad_z, squashed, student.scale / temperature)
            return (*grads.result(), None, None, None, None, None, None)


def _tile_logits(h_s, h_t, student: Head, teacher: Head, temperature: float):
    """z_s, z_t [t, V] float32 for one tile (z_t a view of the teacher's first V columns) and the
    student's tanh(c u / k) for the backward."""
    z_s, squashed = _logits(h_s, student.weight, student.bias, student.scale, student.softcap, temperature)
    z_t, _ = _logits(h_t, teacher.weight, teacher.bias, teacher.scale, teacher.softcap, temperature)
    if teacher.vocab is not None:  # (the softmax over the vocabulary's rows alone)
        z_t = z_t[:, :teacher.vocab]
    return z_s, z_t, squashed


class Divergence(NamedTuple):
    """Per position [N]: D (differentiable) and both models' entropies at temperature T
    (metrics)."""
    value: torch.Tensor
    entropy: torch.Tensor
    teacher_entropy: torch.Tensor


def no_positions(hidden: torch.Tensor) -> Divergence | None:
    """For a tile loop over no position: zeros of length 0, still connected to the graph (else None)."""
    if hidden.shape[0]:
        return None
    empty = hidden.sum(-1).float()
    return Divergence(empty, empty.detach(), empty.detach())


def local_tile(hidden_s: torch.Tensor, student: Head, teacher: Head, beta: float, tile: int | None) -> int:
    """Positions per tile of a divergence to a local teacher's head, once what it needs is checked:
    one vocabulary (V) and beta in [0, 1]."""
    vocab, teacher_vocab = vocabulary_rows(student.weight), teacher.vocab or vocabulary_rows(teacher.weight)
    if vocab != teacher_vocab:
        raise ValueError(f"the student's vocabulary ({vocab}) and the teacher's ({teacher_vocab}) "
                         "differ: distillation compares their next-token distributions token by "
                         "token, so both must use the same tokenizer")
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be in [0, 1] (0 forward KL, 1 reverse KL), got {beta}")
    return tile or tile_positions(vocab, device=hidden_s.device)


def tiled_divergence(hidden_s: torch.Tensor, hidden_t: torch.Tensor, student: Head, teacher: Head,
                     beta: float = 1.0, temperature: float = 1.0, tile: int | None = None) -> Divergence:
    """D [N] and the two entropies [N] at N positions from the student's hidden states [N, H_s]
    (differentiable, as are the student head's weight and bias) and the teacher's [N, H_t] (no
    gradient). Never allocates [N, V]. The heads must share the vocabulary (V)."""
    tile = local_tile(hidden_s, student, teacher, beta, tile)
    return no_positions(hidden_s) or Divergence(*_TiledDivergence.apply(
        hidden_s, student.weight, student.bias, hidden_t.detach(), student, teacher, float(beta),
        float(temperature), int(tile)))
