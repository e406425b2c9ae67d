"""Self-distillation's per-token objectives, as TRL 1.16's SDFTTrainer and SDPOTrainer define their
`distillation_mode`s.

SDFT (Shenfeld, Damani, Hubotter, Agrawal 2026, "Self-Distillation Enables Continual Learning",
arXiv:2601.19897): the teacher is the student itself, shown a privileged context (a demonstration,
the answer) its prompt lacks; the student learns, on its own completions y, to predict what it
would have predicted with that context. SDPO (Hubotter et al. 2026, "Reinforcement Learning via
Self-Distillation") takes the same objective with the context built from the group's successful
rollouts. At a completion position, with the student's and the teacher's next-token distributions
p_s, p_t at temperature T and the divergence D_alpha at mix alpha (GKD's generalized Jensen-Shannon
divergence, rlft/core/distill.py: 0 forward KL(p_t || p_s), 1 reverse KL(p_s || p_t)):

    full_logits     L = D_alpha(p_s, p_t) over the whole vocabulary (rlft/core/distill.py)
    topk_logits     S = the student's k most likely tokens at the position (ties: torch.topk's);
                    both restricted to S and renormalised,
                        p~_j = p_j / sum_{i in S} p_i                  (tail=False)
                    or S plus one bucket holding the rest, p(tail) = 1 - sum_{i in S} p_i (tail=True);
                    L = D_alpha(p~_s, p~_t). S is chosen by the student's values: no gradient flows
                    through the choice, only through p_s on S (and its tail).
    sampled_token   L = sg(log p_s(y) - log p_t(y)) * log p_s(y) at the sampled token y, where sg
                    stops the gradient: grad L = (log p_s(y) - log p_t(y)) grad log p_s(y), the
                    score-function estimate of the reverse KL's gradient (alpha must be 1).

Importance clipping (a rollout trained on again after the weights moved): L is weighted by
sg(min(exp(clamp(log p_s(y) - log p_old(y), -20, 20)), c)). The step's loss is a sequence mean: each
row's token mean of L over its trained tokens, averaged over the rows.

The top-k divergence is computed tile by tile from the two models' hidden states, never [N, V] at
once; each tile reads the vocabulary once per pass (rlft/core/tile_buckets.py: Triton where it runs)
and its gradient with respect to the student's logits comes from the buckets' own gradients. Logits
are float32 whatever the models' dtype. Shapes: N positions, H hidden size, V vocabulary, k the
support.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlft.core.distill import (
    Divergence,
    Head,
    _tile_logits,
    divergence_from_logprobs,
    local_tile,
    no_positions,
)
from rlft.core.fused_head import HeadGrads
from rlft.core.sparse_distill import bucketed_logprobs, support_tile, support_tile_grad
from rlft.core.tile_softmax import tile_stats

MODES = ("full_logits", "topk_logits", "sampled_token")


@dataclass(frozen=True)
class SelfDistillMode:
    """Which of the module docstring's objectives, and its settings (TRL's `distillation_mode`,
    `distillation_topk`, `distillation_add_tail`)."""
    name: str = "topk_logits"
    topk: int | None = 100
    tail: bool = False

    def __post_init__(self):
        if self.name not in MODES:
            raise ValueError(f"distillation_mode={self.name!r}: choose one of {MODES}")
        if self.name == "topk_logits" and (self.topk is None or self.topk < 1):
            raise ValueError("distillation_mode='topk_logits' needs distillation_topk >= 1, got "
                             f"{self.topk!r}")


def topk_support_logprobs(log_ps: torch.Tensor, log_pt: torch.Tensor, k: int, tail: bool):
    """(student, teacher) log-probs [t, k (+1)] over the student's top-k support (module docstring)
    from both full log-prob rows [t, V]. Differentiable in log_ps."""
    ids = log_ps.detach().topk(min(k, log_ps.shape[-1]), dim=-1).indices  # [t, k]
    return bucketed_logprobs(log_ps, ids, log_pt.gather(-1, ids), tail)


def _topk_tile(z_s, z_t, k: int, lse_t):
    """The student's top-k ids [t, k] of one tile's logits and the teacher's log-probs there."""
    ids = z_s.topk(min(k, z_s.shape[-1]), dim=-1).indices
    return ids, z_t.gather(-1, ids).to(lse_t.dtype) - lse_t[:, None]


class _TiledTopkDivergence(torch.autograd.Function):
    """Each tile: the student's top-k support, the teacher's log-probs there, and the coarse-grained
    divergence of rlft/core/sparse_distill.py on it (the vocabulary read once per pass,
    rlft/core/tile_buckets.py; Triton where it runs); the backward recomputes the tile from the saved
    logsumexps."""

    @staticmethod
    def forward(ctx, hidden_s, weight_s, bias_s, hidden_t, student: Head, teacher: Head, beta, temperature,
                k, tail, tile):
        n = hidden_s.shape[0]
        d = torch.empty(n, dtype=torch.promote_types(hidden_s.dtype, torch.float32), device=hidden_s.device)
        entropy, teacher_entropy = torch.empty_like(d), torch.empty_like(d)
        # the backward's
        lse_s, lse_out, lse_t = torch.empty_like(d), torch.empty_like(d), torch.empty_like(d)
        with student.whole(), teacher.whole():
            for start in range(0, n, tile):
                rows = slice(start, start + tile)
                z_s, z_t, _ = _tile_logits(hidden_s[rows], hidden_t[rows], student, teacher, temperature)
                no_target = torch.full((z_t.shape[0],), -1, dtype=torch.long, device=z_t.device)
                _, teacher_entropy[rows], lse_t[rows], _ = tile_stats(z_t, no_target)
                ids, teacher_at = _topk_tile(z_s, z_t, k, lse_t[rows])
                values = support_tile(z_s, ids, teacher_at, beta, tail)
                d[rows], entropy[rows], _, lse_s[rows], lse_out[rows] = values
        ctx.save_for_backward(hidden_s, hidden_t, lse_s, lse_out, lse_t)
        ctx.settings = (student, teacher, beta, temperature, k, tail, tile)
        ctx.mark_non_differentiable(entropy, teacher_entropy)
        return d, entropy, teacher_entropy

    @staticmethod
    def backward(ctx, grad_d, grad_entropy, grad_teacher_entropy):
        hidden_s, hidden_t, lse_s, lse_out, lse_t = ctx.saved_tensors
        student, teacher, beta, temperature, k, tail, tile = ctx.settings
        with student.whole(), teacher.whole():
            grads = HeadGrads(hidden_s, student.weight, student.bias, ctx.needs_input_grad[:3])
            for start in range(0, hidden_s.shape[0], tile):
                rows = slice(start, start + tile)
                z_s, z_t, squashed = _tile_logits(hidden_s[rows], hidden_t[rows], student, teacher,
                                                  temperature)
                ids, teacher_at = _topk_tile(z_s, z_t, k, lse_t[rows])
                grad_z = support_tile_grad(z_s, ids, teacher_at, beta, tail, lse_s[rows], lse_out[rows],
                                           grad_d[rows])
                grads.add(rows, grad_z, squashed, student.scale / temperature)
            return (*grads.result(), None, None, None, None, None, None, None, None)


def topk_divergence(hidden_s: torch.Tensor, hidden_t: torch.Tensor, student: Head, teacher: Head, k: int,
                    beta: float = 0.5, temperature: float = 1.0, tail: bool = False,
                    tile: int | None = None) -> Divergence:
    """D_alpha [N] on the student's top-k support (module docstring) and both models' full
    entropies [N], from the student's hidden states [N, H_s] (differentiable, as are its head's
    weight and bias) and the teacher's [N, H_t] (no gradient). Never allocates [N, V]."""
    tile = local_tile(hidden_s, student, teacher, beta, tile)
    return no_positions(hidden_s) or Divergence(*_TiledTopkDivergence.apply(
        hidden_s, student.weight, student.bias, hidden_t.detach(), student, teacher, float(beta),
        float(temperature), int(k), bool(tail), int(tile)))


def sampled_token_loss(logps: torch.Tensor, teacher_logps: torch.Tensor) -> torch.Tensor:
    """sg(log p_s(y) - log p_t(y)) * log p_s(y) per token (module docstring), differentiable in
    `logps`."""
    return (logps - teacher_logps).detach() * logps


def clipped_ratio(logps: torch.Tensor, old_logps: torch.Tensor, clip: float) -> torch.Tensor:
    """sg(min(exp(clamp(log p_s - log p_old, -20, 20)), clip)) per token: the weight of a token
    sampled by older weights."""
    return (logps.detach() - old_logps).clamp(-20.0, 20.0).exp().clamp(max=clip)


def sequence_means(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each row's mean of `values` [b, c] over its `mask`ed tokens [b] (0 for a row with none)."""
    mask = mask.to(values.dtype)
    return (values * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)


# ---- TRL's loss_utils names (`trl.experimental.sdft.loss_utils`), for logits a caller holds [B, T, V] ----
def compute_divergence(student_log_probs: torch.Tensor, teacher_log_probs: torch.Tensor, alpha: float):
    """D_alpha per position [...] from log-prob rows [..., V] (rlft/core/distill.py)."""
    return divergence_from_logprobs(student_log_probs, teacher_log_probs, alpha)


def add_tail_bucket(log_probs: torch.Tensor) -> torch.Tensor:
    """Log-probs over a support [..., k] with one more entry, the log of the mass outside it."""
    held = torch.logsumexp(log_probs, dim=-1, keepdim=True).clamp(max=-1e-7)
    return torch.cat([log_probs, torch.log(-torch.expm1(held))], dim=-1)


def apply_importance_sampling_clipping(per_token_loss, student_log_probs, old_log_probs, clip_coeff: float):
    """`per_token_loss` weighted by the clipped ratio (module docstring)."""
    return per_token_loss * clipped_ratio(student_log_probs, old_log_probs, clip_coeff)


def compute_topk_self_distillation_loss(student_logits, teacher_logits, *, distillation_topk: int,
                                        distillation_alpha: float, distillation_add_tail: bool):
    """The topk_logits objective per position from whole logits (module docstring)."""
    log_ps, log_pt = torch.log_softmax(student_logits, -1), torch.log_softmax(teacher_logits, -1)
    shape = log_ps.shape
    a, q = topk_support_logprobs(log_ps.reshape(-1, shape[-1]), log_pt.reshape(-1, shape[-1]),
                                 distillation_topk, distillation_add_tail)
    return divergence_from_logprobs(a, q, distillation_alpha).reshape(shape[:-1])


def compute_full_logit_self_distillation_loss(student_logits, teacher_logits, *, distillation_alpha: float):
    """The full_logits objective per position from whole logits."""
    log_ps, log_pt = torch.log_softmax(student_logits, -1), torch.log_softmax(teacher_logits, -1)
    return divergence_from_logprobs(log_ps, log_pt, distillation_alpha)


def compute_sampled_token_self_distillation_loss(student_logits, teacher_logits, completion_ids, *,
                                                 distillation_alpha: float):
    """The sampled_token objective per position from whole logits (reverse KL only: alpha 1)."""
    if distillation_alpha != 1.0:
        raise ValueError("distillation_mode='sampled_token' estimates the reverse KL only: "
                         f"distillation_alpha must be 1.0, got {distillation_alpha}")
    index = completion_ids.unsqueeze(-1)
    logps = torch.log_softmax(student_logits, -1).gather(-1, index).squeeze(-1)
    teacher = torch.log_softmax(teacher_logits, -1).gather(-1, index).squeeze(-1)
    return sampled_token_loss(logps, teacher)
