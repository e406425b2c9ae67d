"""Per-token log-probs (and entropy) straight from hidden states and the LM head, tile by tile.

For hidden states h [N, H] at the positions that predict tokens y [N], an LM head (W [V, H], b [V]):

    u = h W^T + b                       raw logits                       [tile, V], never [N, V]
    s = c * u;  s = k tanh(s / k)       logit scaling c; Gemma-2 final-logit softcapping k (when
                set)
    z = s / T                           temperature T
    log p(y) = z_y - logsumexp(z)
    H = logsumexp(z) - sum_j softmax(z)_j z_j                         (entropy, when asked)

Each tile of positions is projected, reduced to its log-sum-exp and the target's logit, and dropped;
backward recomputes each tile and accumulates dL/dh (per tile) and dL/dW, dL/db (over tiles) in
float32. With g = dL/dlog p and e = dL/dH:

    dL/dz_j = g ([j = y] - p_j) - e p_j (z_j - lse + H)
    dL/du   = dL/dz * c (1 - tanh^2(c u / k)) / T      (without softcapping: c / T)

Truncated sampling -- top-k (Fan et al. 2018, arXiv:1805.04833), top-p (Holtzman et al. 2020,
arXiv:1904.09751), min-p (Nguyen et al. 2024, arXiv:2407.01082) -- draws y from the distribution
renormalised over the tokens the sampler kept, K; given those ids (`kept` [N, K], -1 padding), the
log-prob is that distribution's (no ids at a position, or y not among them: the full one):

    log p_K(y) = z_y - logsumexp_{j in K} z_j
    log m      = logsumexp_{j in K} z_j - logsumexp(z)      the log of the mass the sampler kept
    dL/dz_j    = g ([j = y] - p_K,j [j in K]) - ...         (the entropy term stays the full
               distribution's)

A frozen head (LoRA: W and b take no gradient) needs dL/dh only, and that is linear in g: dL/dh = g
a with a = dz/du ([j = y] - p) W, which the forward forms from its own tile of logits (one more
matmul there) and keeps ([N, H], the size of h). The backward then scales a by g and recomputes
nothing: two passes over the vocabulary instead of three. Not when the entropy's gradient is asked
for (`entropy_grad`, an entropy bonus): that term's basis is another matmul, so the backward
recomputes the tiles as before (as it does when an entropy gradient arrives unannounced).

A head that trains (full fine-tuning) needs dL/dW, which is not linear in a per-token basis; but a
loss whose gradient at each token depends on that token's log-prob alone (GRPO's clipped token
terms, with their constant normalisers) can say g while the tile's logits are still there
(`predict`: log-probs -> dL/dlog p at a tile's rows). The forward then forms dL/dh, dL/dW and dL/db
itself, three passes over the vocabulary and no recomputation, and keeps them. The backward checks
that the g it is given is the predicted one times one scalar c (gradient accumulation, a process
count) and returns the kept gradients times c; any other g (a loss that was not token-separable
after all) gets the recomputing backward, so the result is exact either way. The prediction is the
loss's closed form (rlft/core/loss_grads.py: a few elementwise operations on the tile's rows) where
it has one, else the loss's own code under autograd on every log-prob once per tile; on a GPU that
second kind costs about what the saved pass saves (benchmarks/gpu/long-fused-h100.md), so a GPU takes
the closed form only (not yet measured there).

Logits are float32 whatever the model's dtype (a bf16/fp16 matmul, then float32 from there on). This
is the selective log-softmax of rlft/core/logprobs.py without ever holding a [B, T, V] tensor: the
memory of a scoring pass is one tile of logits, not a sequence's (Liger-Kernel's fused linear
cross-entropy and TRL 1.15's fused LM head are the same idea). Shapes in comments: N positions, H
hidden size, V vocabulary.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable

import torch

from rlft.core import tile_softmax

# float32 logits per tile (64 MiB): large enough that re-reading W per tile is amortised
TILE_ELEMENTS = 1 << 24
# on a GPU (256 MiB): a tile's matmuls are too small to fill the device at 64 MiB, and each tile is
# a dozen kernel launches (benchmarks/gpu/README.md measures the choice)
GPU_TILE_ELEMENTS = 1 << 26


def vocabulary_rows(weight: torch.Tensor) -> int:
    """V of an LM head weight [V, H], also while it is partitioned (ZeRO-3 keeps the full shape in
    `ds_shape` and leaves the tensor empty outside a gather)."""
    return int(getattr(weight, "ds_shape", weight.shape)[0])


def tile_positions(vocab: int, tile_elements: int | None = None, device: torch.device | str | None = None,
                   ) -> int:
    """Positions per tile so that one tile of float32 logits holds about `tile_elements` values (by
    default TILE_ELEMENTS, GPU_TILE_ELEMENTS on a CUDA `device`)."""
    if tile_elements is None:
        cuda = device is not None and torch.device(device).type == "cuda"
        tile_elements = GPU_TILE_ELEMENTS if cuda else TILE_ELEMENTS
    return max(1, tile_elements // max(vocab, 1))


def _logits(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, scale: float,
            softcap: float | None, temperature: float, out: torch.Tensor | None = None,
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """z [t, V] float32 and, with softcapping, tanh(c u / k) [t, V] (for the backward). In place
    where it can be: one [t, V] float32 tensor, not one per step (a factor of 1 is skipped: it
    changes no bit); in `out` ([>= t, V] float32, a Workspace's) when given."""
    work = torch.promote_types(weight.dtype, torch.float32)  # float32 (float64 stays float64)
    if out is not None and weight.dtype == work:
        raw = torch.mm(hidden, weight.t(), out=out[:hidden.shape[0]])  # [t, V]
    else:
        raw = hidden @ weight.t()  # [t, V] in the model's dtype
    if bias is not None:
        raw += bias
    z = raw if raw.dtype == work else (raw.to(work) if out is None else out[:raw.shape[0]].copy_(raw))
    if scale != 1:
        z *= scale
    squashed = None
    if softcap:
        squashed = torch.tanh(z / softcap)
        z = squashed * softcap
    if temperature != 1:
        z /= temperature
    return z, squashed


class Workspace:
    """Two [tile, V] buffers a tile loop reuses: the logits and their exponentials. A fresh [tile,
    V] block per tile is, on a CPU, a fresh mapping whose page faults cost about a third of the
    tile's matmul (64 MiB is above glibc's largest mmap threshold); on a GPU it saves the
    allocator's work."""

    def __init__(self, rows: int, weight: torch.Tensor, device: torch.device):
        work = torch.promote_types(weight.dtype, torch.float32)
        self.z = torch.empty(rows, vocabulary_rows(weight), dtype=work, device=device)
        self._e = None

    @property
    def e(self) -> torch.Tensor:
        """The second buffer, allocated when first used (the Triton kernels need none)."""
        if self._e is None:
            self._e = torch.empty_like(self.z)
        return self._e

    def exp(self, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(logsumexp [t], exp(z - max) [t, V] in the second buffer, its row sums [t]) of z [t, V],
        without allocating a [t, V] tensor (torch.logsumexp allocates two)."""
        top = z.amax(-1, keepdim=True)  # [t, 1]
        e = torch.sub(z, top, out=self.e[:z.shape[0]]).exp_()
        total = e.sum(-1)  # [t]
        return top.squeeze(-1) + total.log(), e, total

    def probabilities(self, z: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
        """softmax(z) [t, V] = exp(z - lse), in the second buffer (z is left as it was)."""
        return torch.sub(z, lse[:, None], out=self.e[:z.shape[0]]).exp_()


def _accumulate(total: torch.Tensor, grad_u: torch.Tensor, low: torch.Tensor, hidden: torch.Tensor) -> None:
    """dL/dW (float32 `total` [V, H]) += dL/du^T h for one tile. On a GPU with a bfloat16/float16
    model, the product of `low` (dL/du in the model's dtype, as dL/dh uses it) and h in the tensor
    cores, accumulated in float32 by the matmul itself (never rounded to the half type: summed over
    tiles, that rounding biases the gradient); elsewhere the float32 (float64) dL/du times h cast
    up, as before."""
    if total.device.type == "cuda" and low.dtype in (torch.float16, torch.bfloat16):
        torch.addmm(total, low.t(), hidden, out_dtype=torch.float32, out=total)
    else:
        total.addmm_(grad_u.t(), hidden.to(total.dtype))


def kept_lse(z: torch.Tensor, kept: torch.Tensor, targets: torch.Tensor,
             lse: torch.Tensor) -> torch.Tensor:
    """logsumexp of each row's kept logits: z [t, V], kept [t, K] token ids (-1: padding), targets
    [t]; `lse` [t] (the full one) where a row has no kept id or its target is not among them."""
    valid = kept >= 0  # [t, K]
    has = valid.any(-1) & (kept == targets[:, None]).any(-1)  # [t]
    picked = z.gather(-1, kept.clamp(min=0)).masked_fill(~valid, float("-inf"))  # [t, K]
    return torch.where(has, torch.logsumexp(picked, dim=-1), lse)


class HeadGrads:
    """dL/dh [N, H], dL/dW [V, H] and dL/db [V] of an LM head, filled tile by tile from each tile's
    dL/dz; W's and b's accumulated in float32 (float64 stays float64). `needs`: the autograd
    function's needs_input_grad for (hidden, weight, bias)."""

    def __init__(self, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, needs):
        need_h, need_w, need_b = needs
        work = torch.promote_types(weight.dtype, torch.float32)
        self.hidden, self.weight, self.bias = hidden, weight, bias
        self.h = torch.empty_like(hidden) if need_h else None
        self.w = torch.zeros(weight.shape, dtype=work, device=weight.device) if need_w else None
        self.b = torch.zeros(weight.shape[0], dtype=work, device=weight.device) \
            if need_b and bias is not None else None

    def add(self, rows: slice, grad_z: torch.Tensor, squashed: torch.Tensor | None, chain: float) -> None:
        """One tile's dL/dz [t, V] (scaled in place) back through the logit transform -- dz/du =
        chain, times 1 - tanh^2 with softcapping -- and the head."""
        if squashed is not None:
            grad_z *= chain * (1 - squashed**2)
        elif chain != 1:
            grad_z *= chain
        low = grad_z.to(self.weight.dtype)  # dL/du [t, V] in the model's dtype
        if self.h is not None:
            self.h[rows] = (low @ self.weight).to(self.hidden.dtype)
        if self.w is not None:
            _accumulate(self.w, grad_z, low, self.hidden[rows])
        if self.b is not None:
            self.b += grad_z.sum(0)

    def result(self) -> tuple:
        """(dL/dh, dL/dW, dL/db) in the inputs' dtypes, None where not needed."""
        return (self.h, None if self.w is None else self.w.to(self.weight.dtype),
                None if self.b is None else self.b.to(self.bias.dtype))


def _logp_grad_(z: torch.Tensor, p: torch.Tensor, lse: torch.Tensor, used: torch.Tensor,
                targets: torch.Tensor, kept: torch.Tensor | None, g: torch.Tensor,
                e: torch.Tensor | None = None, entropy: torch.Tensor | None = None) -> torch.Tensor:
    """dL/dz [t, V] of one tile, in p's memory (p = softmax(z) [t, V] is consumed; z [t, V] too when
    e is given), for g = dL/dlog p [t, 1] and, when given, e = dL/dH [t, 1] (entropy [t]):
    g ([j = y] - p_j) - e p_j (z_j - lse + H), with p renormalised over the kept ids on rows whose
    target is among them. lse, used [t]: full and renormalising lse."""
    if kept is not None:
        ids, renormalised = kept.clamp(min=0).long(), used != lse
        picked = z.gather(-1, ids).masked_fill(kept < 0, float("-inf"))  # [t, K]
    ent = None
    if e is not None:  # e p (z - lse + H), in z's memory
        ent = z.add_((entropy - lse)[:, None]).mul_(p).mul_(e)
    grad_z = p.mul_(-g)
    if kept is not None:  # rows renormalised over their kept tokens: p_K there, 0 elsewhere
        grad_z.masked_fill_(renormalised[:, None], 0.0)
        kept_grad = -torch.exp(picked - used[:, None]) * g * renormalised[:, None]  # [t, K]
        grad_z.scatter_add_(-1, ids, kept_grad)
    grad_z.scatter_add_(-1, targets[:, None], g)  # + g [j = y]
    if ent is not None:
        grad_z -= ent
    return grad_z


def _kernel_logp_grad_(z: torch.Tensor, lse: torch.Tensor, mean_z: torch.Tensor, used: torch.Tensor,
                       targets: torch.Tensor, kept: torch.Tensor | None, g: torch.Tensor,
                       e: torch.Tensor | None = None) -> torch.Tensor:
    """`_logp_grad_` by the Triton kernel (rlft/core/tile_softmax.py), written over z [t, V]:
    mean_z [t] = sum_j p_j z_j (the forward's; lse - H). On rows renormalised over their kept ids the
    kernel forms the entropy term alone, and -g p_K over the K ids and g at the target are added
    after."""
    g = g[:, 0]
    renormalised = None
    if kept is not None:  # read before z is overwritten
        ids, renormalised = kept.clamp(min=0).long(), used != lse
        picked = z.gather(-1, ids).masked_fill(kept < 0, float("-inf"))  # [t, K]
        kept_grad = -torch.exp(picked - used[:, None]) * (g * renormalised)[:, None]
    full = g if renormalised is None else g.masked_fill(renormalised, 0.0)
    grad_e = torch.zeros_like(g) if e is None else e[:, 0]
    grad_z = tile_softmax.tile_stats_grad(z, targets, lse, mean_z, full, grad_e, out=z)
    if renormalised is not None:
        grad_z.scatter_add_(-1, ids, kept_grad)
        grad_z.scatter_add_(-1, targets[:, None], (g * renormalised)[:, None])
    return grad_z


MISPREDICTED = ("the LM head's gradient formed in the forward from the loss's predicted dL/dlog p "
                "does not match the loss's gradient (a loss that is not token-separable, or an "
                "entropy term): recomputed exactly, at the cost of the forward's extra passes")
# |g - c g_predicted| allowed per token: float32 rounding of the two ways of computing the same product
SCALE_RTOL, SCALE_ATOL = 1e-5, 1e-6


class FusedLoss:
    """A trainable head's gradients formed in the forward from the loss's predicted dL/dlog p
    (`predicted` [N]), and whether the g the backward is given is that one times a scalar."""

    def __init__(self, grads: HeadGrads, predicted: torch.Tensor):
        self.grads, self.predicted = grads, predicted

    def scale(self, actual: torch.Tensor | None) -> float | None:
        """c with actual = c x predicted (within float32 rounding), or None when there is none."""
        if actual is None:  # the loss does not use the log-probs: its gradient is 0
            return 0.0
        want, have = actual.double(), self.predicted.double()
        norm = float((have * have).sum())
        c = float((want * have).sum()) / norm if norm > 0 else 0.0
        bound = SCALE_RTOL * want.abs() + SCALE_ATOL * float(want.abs().max())
        return c if bool(((want - c * have).abs() <= bound).all()) else None

    def result(self, actual: torch.Tensor | None) -> tuple | None:
        """(dL/dh, dL/dW, dL/db) for the backward's g, or None when it is not a multiple of the
        predicted."""
        c = self.scale(actual)
        if c is None:
            return None
        grads = self.grads
        if c != 1.0:
            for part in (grads.h, grads.w, grads.b):
                if part is not None:
                    part *= c
        return grads.result()


class _TiledLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, kept, temperature, scale, softcap, tile, with_entropy,
                whole, basis, predict):
        # an output the loss leaves out (the logged entropy): None, no work
        ctx.set_materialize_grads(False)
        with whole():
            return _TiledLogProbs._forward(ctx, hidden, weight, bias, targets, kept, temperature, scale,
                                           softcap, tile, with_entropy, whole, basis, predict)

    @staticmethod
    def _forward(ctx, hidden, weight, bias, targets, kept, temperature, scale, softcap, tile, with_entropy,
                 whole, basis, predict):
        n = hidden.shape[0]
        work = torch.promote_types(hidden.dtype, torch.float32)
        # [N] (zeros: what `predict` reads ahead)
        logps = torch.zeros(n, dtype=work, device=hidden.device)
        # [N] full and renormalising lse
        lses, used = torch.empty_like(logps), torch.empty_like(logps)
        entropy = torch.empty_like(logps) if with_entropy else None  # [N]
        # a [N, H]
        frozen = HeadGrads(hidden, weight, bias, (True, False, False)) if basis else None
        ones = torch.ones(min(tile, n), 1, dtype=work, device=hidden.device) if basis else None
        fused = None if predict is None else \
            FusedLoss(HeadGrads(hidden, weight, bias, ctx.needs_input_grad[:3]), torch.empty_like(logps))
        space = Workspace(min(tile, n), weight, hidden.device)
        for start in range(0, n, tile):
            rows = slice(start, start + tile)
            # [t, V]
            z, squashed = _logits(hidden[rows], weight, bias, scale, softcap, temperature, space.z)
            kernel = tile_softmax.triton_runs(z)
            if kernel:  # one pass: [t] each (mean_z = sum_j p_j z_j)
                _, ent, lse, mean_z = tile_softmax.tile_stats(z, targets[rows])
            else:
                lse, e, total = space.exp(z)  # [t], exp(z - max) [t, V], [t]
            lses[rows] = lse
            used[rows] = lse if kept is None else kept_lse(z, kept[rows], targets[rows], lse)
            logps[rows] = z.gather(-1, targets[rows, None]).squeeze(-1) - used[rows]
            if with_entropy and kernel:
                entropy[rows] = ent
            elif with_entropy:  # H = lse - sum_j p_j z_j, the sum as one dot product per row
                entropy[rows] = lse - torch.bmm(e.unsqueeze(1), z.unsqueeze(2)).view(-1) / total
            head = frozen if frozen is not None else None if fused is None else fused.grads
            if head is None:
                continue
            if frozen is not None:  # dL/dh per unit dL/dlog p, while the tile's logits are here
                g = ones[:z.shape[0]]
            else:  # the loss's dL/dlog p for this tile, and the head's gradients from it
                g = fused.predicted[rows] = predict(logps, rows)
                g = g[:, None].to(z.dtype)
            kept_rows = None if kept is None else kept[rows]
            grad_z = _kernel_logp_grad_(z, lse, mean_z, used[rows], targets[rows], kept_rows, g) if kernel \
                else _logp_grad_(z, e.div_(total[:, None]), lse, used[rows], targets[rows], kept_rows, g)
            head.add(rows, grad_z, squashed, scale / temperature)
        ctx.save_for_backward(hidden, weight, bias, targets, kept, lses, used, entropy,
                              None if frozen is None else frozen.h)
        ctx.settings, ctx.fused = (temperature, scale, softcap, tile, whole), fused
        logmass = used - lses  # [N] log of the kept mass, 0 where nothing was kept
        ctx.mark_non_differentiable(logmass)
        return logps, entropy, logmass

    @staticmethod
    def backward(ctx, grad_logps, grad_entropy, grad_logmass):
        hidden, weight, bias, targets, kept, lses, used, entropy, basis = ctx.saved_tensors
        if grad_logps is None:
            grad_logps = torch.zeros_like(lses)
        nothing = (None,) * 12  # W, b and the settings
        # a frozen head: dL/dh = g a, nothing recomputed
        if basis is not None and grad_entropy is None:
            return ((basis.to(grad_logps.dtype) * grad_logps[:, None]).to(hidden.dtype), *nothing)
        fused, ctx.fused = ctx.fused, None
        if fused is not None:
            grads = fused.result(grad_logps) if grad_entropy is None else None
            # the g the loss predicted, times c: the forward's gradients, times c
            if grads is not None:
                return (*grads, *nothing[2:])
            # (a non-finite step is skipped: nothing to say)
            if bool(torch.isfinite(grad_logps).all()):
                warnings.warn(MISPREDICTED, stacklevel=2)
        with ctx.settings[4]():
            return _TiledLogProbs._backward(ctx, grad_logps, grad_entropy, hidden, weight, bias, targets,
                                            kept, lses, used, entropy)

    @staticmethod
    def _backward(ctx, grad_logps, grad_entropy, hidden, weight, bias, targets, kept, lses, used, entropy):
        temperature, scale, softcap, tile, _ = ctx.settings
        grads = HeadGrads(hidden, weight, bias, ctx.needs_input_grad[:3])
        space = Workspace(min(tile, hidden.shape[0]), weight, hidden.device)
        for start in range(0, hidden.shape[0], tile):
            rows = slice(start, start + tile)
            # [t, V]
            z, squashed = _logits(hidden[rows], weight, bias, scale, softcap, temperature, space.z)
            e = None if grad_entropy is None else grad_entropy[rows, None].to(z.dtype)
            g, kept_rows = grad_logps[rows, None].to(z.dtype), None if kept is None else kept[rows]
            if tile_softmax.triton_runs(z):
                mean_z = torch.zeros_like(lses[rows]) if e is None else lses[rows] - entropy[rows]
                grad_z = _kernel_logp_grad_(z, lses[rows], mean_z, used[rows], targets[rows], kept_rows, g, e)
            else:
                p = space.probabilities(z, lses[rows])  # [t, V]
                grad_z = _logp_grad_(z, p, lses[rows], used[rows], targets[rows], kept_rows, g, e,
                                     None if e is None else entropy[rows])
            grads.add(rows, grad_z, squashed, scale / temperature)
        return (*grads.result(), None, None, None, None, None, None, None, None, None, None)


def fused_token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                         bias: torch.Tensor | None = None, temperature: float = 1.0, logit_scale: float = 1.0,
                         softcap: float | None = None, entropy: bool = False, tile: int | None = None,
                         whole: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
                         entropy_grad: bool = False, predict: Callable | None = None,
                         ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(targets) [N] (float32) and, with `entropy`, the entropy [N] of each position's
    next-token distribution, from hidden states [N, H] and an LM head weight [V, H] (bias [V]).
    Differentiable in hidden, weight and bias; the entropy only when it is used in the loss (its
    gradient is exact too). Never allocates [N, V]. `whole()`: a context in which the weight is
    whole, entered around the forward and the backward tile loops (a partitioned weight gathered for
    them). `entropy_grad`: the entropy's gradient will be asked for (an entropy bonus; otherwise a
    frozen head's backward takes dL/dh from the forward, module docstring). `predict`: (log-probs [N]
    so far, a tile's rows) -> the loss's dL/dlog p at those rows, for a loss whose gradient at a
    token depends on that token's log-prob alone (a trainable head then forms its gradients in the
    forward; on a GPU only when `predict.closed_form` says it runs no autograd)."""
    logps, ent, _ = fused_kept_logprobs(hidden, weight, targets, None, bias, temperature, logit_scale,
                                        softcap, entropy, tile, whole, entropy_grad, predict)
    return logps, ent


def fused_kept_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                        kept: torch.Tensor | None, bias: torch.Tensor | None = None, temperature: float = 1.0,
                        logit_scale: float = 1.0, softcap: float | None = None, entropy: bool = False,
                        tile: int | None = None,
                        whole: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
                        entropy_grad: bool = False, predict: Callable | None = None,
                        ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """`fused_token_logprobs` renormalised over each position's kept token ids (`kept` [N, K], -1
    padding; None: the full vocabulary), and the log of the kept mass [N] (0 where nothing was kept;
    no gradient)."""
    if hidden.shape[0] == 0:
        empty = hidden.sum(-1).float()  # [0], still connected to the graph
        return empty, (empty if entropy else None), empty.detach()
    tile = tile or tile_positions(vocabulary_rows(weight), device=hidden.device)
    grad = torch.is_grad_enabled() and not (entropy and entropy_grad)
    trains = weight.requires_grad or (bias is not None and bias.requires_grad)
    frozen = grad and hidden.requires_grad and not trains
    # a frozen head's basis needs no prediction; on a GPU the loss's own code under autograd once per
    # tile cost what the saved pass saves (H100, Qwen2.5-0.5B: 131 vs 129 ms for the head, a 16%
    # slower 2 x 8,192 step; benchmarks/gpu/long-fused-h100.md), so there only a closed form is used
    closed = getattr(predict, "closed_form", False)
    predict = predict if grad and trains and (hidden.device.type == "cpu" or closed) else None
    return _TiledLogProbs.apply(hidden, weight, bias, targets, kept, float(temperature), float(logit_scale),
                                softcap, int(tile), bool(entropy), whole, frozen, predict)
