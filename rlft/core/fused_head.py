"""Per-token log-probs (and entropy) straight from hidden states and the LM head, tile by tile.

For hidden states h [N, H] at the positions that predict tokens y [N], an LM head (W [V, H], b [V]):

    u = h W^T + b                       raw logits                       [tile, V], never [N, V]
    s = c * u;  s = k tanh(s / k)       logit scaling c; Gemma-2 final-logit softcapping k (when set)
    z = s / T                           temperature T
    log p(y) = z_y - logsumexp(z)
    H = logsumexp(z) - sum_j softmax(z)_j z_j                         (entropy, when asked)

Each tile of positions is projected, reduced to its log-sum-exp and the target's logit, and dropped; backward
recomputes each tile and accumulates dL/dh (per tile) and dL/dW, dL/db (over tiles) in float32. With
g = dL/dlog p and e = dL/dH:

    dL/dz_j = g ([j = y] - p_j) - e p_j (z_j - lse + H)
    dL/du   = dL/dz * c (1 - tanh^2(c u / k)) / T      (without softcapping: c / T)

Logits are float32 whatever the model's dtype (a bf16/fp16 matmul, then float32 from there on). This is the
selective log-softmax of rlft/core/logprobs.py without ever holding a [B, T, V] tensor: the memory of a
scoring pass is one tile of logits, not a sequence's (Liger-Kernel's fused linear cross-entropy and TRL 1.15's
fused LM head are the same idea). Shapes in comments: N positions, H hidden size, V vocabulary.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

# float32 logits per tile (64 MiB): large enough that re-reading W per tile is amortised
TILE_ELEMENTS = 1 << 24


def tile_positions(vocab: int, tile_elements: int = TILE_ELEMENTS) -> int:
    """Positions per tile so that one tile of float32 logits holds about `tile_elements` values."""
    return max(1, tile_elements // max(vocab, 1))


def _logits(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, scale: float,
            softcap: float | None, temperature: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """z [t, V] float32 and, with softcapping, tanh(c u / k) [t, V] (for the backward)."""
    raw = hidden @ weight.t()  # [t, V] in the model's dtype
    if bias is not None:
        raw = raw + bias
    scaled = raw.to(torch.promote_types(raw.dtype, torch.float32)) * scale  # float32 (float64 stays float64)
    squashed = None
    if softcap:
        squashed = torch.tanh(scaled / softcap)
        scaled = squashed * softcap
    return scaled / temperature, squashed


class _TiledLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, scale, softcap, tile, with_entropy, whole):
        with whole():
            return _TiledLogProbs._forward(ctx, hidden, weight, bias, targets, temperature, scale, softcap,
                                           tile, with_entropy, whole)

    @staticmethod
    def _forward(ctx, hidden, weight, bias, targets, temperature, scale, softcap, tile, with_entropy, whole):
        n = hidden.shape[0]
        work = torch.promote_types(hidden.dtype, torch.float32)
        logps = torch.empty(n, dtype=work, device=hidden.device)  # [N]
        lses = torch.empty_like(logps)  # [N]
        entropy = torch.empty_like(logps) if with_entropy else None  # [N]
        for start in range(0, n, tile):
            rows = slice(start, start + tile)
            z, _ = _logits(hidden[rows], weight, bias, scale, softcap, temperature)  # [t, V]
            lse = torch.logsumexp(z, dim=-1)  # [t]
            lses[rows] = lse
            logps[rows] = z.gather(-1, targets[rows, None]).squeeze(-1) - lse
            if with_entropy:
                entropy[rows] = lse - (torch.softmax(z, dim=-1) * z).sum(-1)
        ctx.save_for_backward(hidden, weight, bias, targets, lses, entropy)
        ctx.settings = (temperature, scale, softcap, tile, whole)
        return logps, entropy

    @staticmethod
    def backward(ctx, grad_logps, grad_entropy):
        hidden, weight, bias, targets, lses, entropy = ctx.saved_tensors
        with ctx.settings[4]():
            return _TiledLogProbs._backward(ctx, grad_logps, grad_entropy, hidden, weight, bias, targets,
                                            lses, entropy)

    @staticmethod
    def _backward(ctx, grad_logps, grad_entropy, hidden, weight, bias, targets, lses, entropy):
        temperature, scale, softcap, tile, _ = ctx.settings
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = torch.empty_like(hidden) if need_h else None  # [N, H]
        # float32 accumulation (float64 stays float64)
        work = torch.promote_types(weight.dtype, torch.float32)
        grad_w = torch.zeros(weight.shape, dtype=work, device=weight.device) if need_w else None  # [V, H]
        grad_b = torch.zeros(weight.shape[0], dtype=work, device=weight.device) \
            if need_b and bias is not None else None  # [V]
        for start in range(0, hidden.shape[0], tile):
            rows = slice(start, start + tile)
            z, squashed = _logits(hidden[rows], weight, bias, scale, softcap, temperature)  # [t, V]
            probs = torch.exp(z - lses[rows, None])  # [t, V]
            g = grad_logps[rows, None].to(z.dtype)
            grad_z = -probs * g
            grad_z.scatter_add_(-1, targets[rows, None], g)  # + g [j = y]
            if grad_entropy is not None:
                shift = (entropy[rows] - lses[rows])[:, None]  # H - lse
                grad_z -= grad_entropy[rows, None].to(z.dtype) * probs * (z + shift)
            chain = scale / temperature
            grad_u = grad_z * (chain * (1 - squashed**2) if squashed is not None else chain)  # [t, V] float32
            if need_h:
                grad_h[rows] = (grad_u.to(weight.dtype) @ weight).to(hidden.dtype)
            if need_w:
                grad_w.addmm_(grad_u.t().to(work), hidden[rows].to(work))
            if grad_b is not None:
                grad_b += grad_u.sum(0)
        return (grad_h, None if grad_w is None else grad_w.to(weight.dtype),
                None if grad_b is None else grad_b.to(bias.dtype), None, None, None, None, None, None, None)


def fused_token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                         bias: torch.Tensor | None = None, temperature: float = 1.0, logit_scale: float = 1.0,
                         softcap: float | None = None, entropy: bool = False, tile: int | None = None,
                         whole: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
                         ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(targets) [N] (float32) and, with `entropy`, the entropy [N] of each position's next-token
    distribution, from hidden states [N, H] and an LM head weight [V, H] (bias [V]). Differentiable in hidden,
    weight and bias; the entropy only when it is used in the loss (its gradient is exact too). Never allocates
    [N, V]. `whole()`: a context in which the weight is whole, entered around the forward and the backward
    tile loops (a partitioned weight gathered for them)."""
    if hidden.shape[0] == 0:
        empty = hidden.sum(-1).float()  # [0], still connected to the graph
        return empty, (empty if entropy else None)
    tile = tile or tile_positions(weight.shape[0])
    return _TiledLogProbs.apply(hidden, weight, bias, targets, float(temperature), float(logit_scale),
                                softcap, int(tile), bool(entropy), whole)
