"""Per-token log-probabilities and entropy from logits, in float32, chunked.

    log pi(y_t) = z_{t, y_t} / T - logsumexp_v(z_{t, v} / T)

The full [batch, seq, vocab] float32 tensor is never materialised: about `chunk_size`
positions are processed at a time, taken as 3-D blocks so that a sliced view such as
`logits[:, :-1]` is not copied whole, and the backward pass recomputes each block's softmax
instead of keeping float32 copies alive: extra memory is O(chunk_size * vocab) in both passes.
"""

from __future__ import annotations

import torch

# float32 elements per block on a CPU: 4 MiB, a block that stays in cache
CPU_CHUNK_ELEMENTS = 1 << 20
ACCELERATOR_CHUNK_POSITIONS = 1024  # on a GPU, fewer and larger blocks: kernel launches dominate


def default_chunk_size(logits: torch.Tensor) -> int:
    """Positions per block when the user sets none (`logprob_chunk_size: null`).

    On a CPU the softmax passes are memory-bound: blocks of ~1M elements (4 MiB in float32) stay in
    cache and ran about 3x faster than 1024-position blocks on 32k and 152k vocabularies
    (`python benchmarks/logprob_chunks.py`). On an accelerator, 1024 positions: each block costs
    several kernel launches, so fewer blocks win.
    """
    if logits.device.type != "cpu":
        return ACCELERATOR_CHUNK_POSITIONS
    return max(CPU_CHUNK_ELEMENTS // max(logits.shape[-1], 1), 1)


def _blocks(batch: int, seq: int, chunk_size: int):
    """(batch slice, seq slice) pieces of about `chunk_size` positions each.

    Pieces are taken from the 3-D tensor directly: reshaping a non-contiguous view such as
    `logits[:, :-1]` to 2-D would silently copy all of it, which is what chunking avoids.
    """
    if seq <= chunk_size:
        rows = max(chunk_size // max(seq, 1), 1)
        for start in range(0, batch, rows):
            yield slice(start, min(start + rows, batch)), slice(0, seq)
    else:
        for b in range(batch):
            for start in range(0, seq, chunk_size):
                yield slice(b, b + 1), slice(start, min(start + chunk_size, seq))


def _work_dtype(logits: torch.Tensor) -> torch.dtype:
    """float32 for half/bfloat16/float32 input; float64 stays float64 (for gradcheck)."""
    return torch.promote_types(logits.dtype, torch.float32)


class _SelectiveLogSoftmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, token_ids, temperature, chunk_size):
        work = _work_dtype(logits)
        out = torch.empty(token_ids.shape, dtype=work, device=logits.device)  # [B, T]
        lse = torch.empty_like(out)
        for b, t in _blocks(*token_ids.shape, chunk_size):
            scaled = logits[b, t].to(work) / temperature  # [b, t, vocab]
            lse[b, t] = torch.logsumexp(scaled, dim=-1)
            out[b, t] = scaled.gather(-1, token_ids[b, t, None]).squeeze(-1) - lse[b, t]
        ctx.save_for_backward(logits, token_ids, lse)
        ctx.temperature, ctx.chunk_size = temperature, chunk_size
        return out

    @staticmethod
    def backward(ctx, grad_out):
        logits, token_ids, lse = ctx.saved_tensors
        grad_out = grad_out.to(lse.dtype)
        grad_logits = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        for b, t in _blocks(*token_ids.shape, ctx.chunk_size):
            # d logp_y / d z_v = (1[v == y] - softmax_v) / T
            # [b, t, vocab]
            grad = -torch.exp(logits[b, t].to(lse.dtype) / ctx.temperature - lse[b, t, None])
            grad.scatter_add_(-1, token_ids[b, t, None], torch.ones_like(grad[..., :1]))
            grad *= grad_out[b, t, None] / ctx.temperature
            grad_logits[b, t] = grad.to(logits.dtype)
        return grad_logits, None, None, None


def selective_log_softmax(logits: torch.Tensor, token_ids: torch.Tensor, temperature: float = 1.0,
                          chunk_size: int = 1024) -> torch.Tensor:
    """log softmax(logits / temperature) gathered at `token_ids`, in float32.

    logits: [batch, seq, vocab] (any float dtype); token_ids: [batch, seq] -> [batch, seq] float32.
    Differentiable with respect to `logits`; extra memory stays O(chunk_size * vocab).
    """
    if logits.shape[:-1] != token_ids.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and token_ids {tuple(token_ids.shape)} "
                         "disagree")
    if chunk_size <= 0:
        raise ValueError(f"chunk_size={chunk_size} must be > 0")
    return _SelectiveLogSoftmax.apply(logits, token_ids, float(temperature), int(chunk_size))


class _Entropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, temperature, chunk_size):
        work = _work_dtype(logits)
        out = torch.empty(logits.shape[:-1], dtype=work, device=logits.device)  # [B, T]
        lse, mean_s = torch.empty_like(out), torch.empty_like(out)
        for b, t in _blocks(*logits.shape[:-1], chunk_size):
            scaled = logits[b, t].to(work) / temperature  # [b, t, vocab]
            lse[b, t] = torch.logsumexp(scaled, dim=-1)
            mean_s[b, t] = (torch.exp(scaled - lse[b, t, None]) * scaled).sum(-1)  # E_p[s]
            out[b, t] = lse[b, t] - mean_s[b, t]
        ctx.save_for_backward(logits, lse, mean_s)
        ctx.temperature, ctx.chunk_size = temperature, chunk_size
        return out

    @staticmethod
    def backward(ctx, grad_out):
        logits, lse, mean_s = ctx.saved_tensors
        grad_out = grad_out.to(lse.dtype)
        grad_logits = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        for b, t in _blocks(*logits.shape[:-1], ctx.chunk_size):
            # dH / dz_v = -p_v (s_v - E_p[s]) / T, s = z / T
            scaled = logits[b, t].to(lse.dtype) / ctx.temperature  # [b, t, vocab]
            grad = -torch.exp(scaled - lse[b, t, None]) * (scaled - mean_s[b, t, None])
            grad *= grad_out[b, t, None] / ctx.temperature
            grad_logits[b, t] = grad.to(logits.dtype)
        return grad_logits, None, None


def entropy_from_logits(logits: torch.Tensor, temperature: float = 1.0,
                        chunk_size: int = 1024) -> torch.Tensor:
    """Per-position entropy H = logsumexp(s) - sum_v p_v s_v of p = softmax(s), s = logits / T,
    float32, chunked.

    logits: [batch, seq, vocab] -> [batch, seq]. Differentiable (dH/dz_v = -p_v (s_v - E_p[s]) / T,
    for an entropy bonus); pass `logits.detach()` for a metric. Extra memory stays O(chunk_size *
    vocab).
    """
    if chunk_size <= 0:
        raise ValueError(f"chunk_size={chunk_size} must be > 0")
    return _Entropy.apply(logits, float(temperature), int(chunk_size))


def kept_log_softmax(logits: torch.Tensor, token_ids: torch.Tensor, kept: torch.Tensor,
                     temperature: float = 1.0) -> torch.Tensor:
    """log p_K(y): softmax(logits / T) renormalised over each position's kept token ids (what a
    top-k / top-p / min-p sampler drew from), gathered at `token_ids`; dense, a reference for the
    fused head's tiled path (rlft/core/fused_head.py). logits [..., V], token_ids [...], kept [...,
    K] (-1 padding; a position with no id, or whose token is not among them, gets the full softmax)
    -> [...] float32."""
    z = logits.to(_work_dtype(logits)) / temperature
    lse = torch.logsumexp(z, dim=-1)
    valid = kept >= 0
    has = valid.any(-1) & (kept == token_ids[..., None]).any(-1)
    picked = z.gather(-1, kept.clamp(min=0).long()).masked_fill(~valid, float("-inf"))
    used = torch.where(has, torch.logsumexp(picked, dim=-1), lse)
    return z.gather(-1, token_ids[..., None]).squeeze(-1) - used


def finite_ids(scores: torch.Tensor) -> torch.Tensor:
    """The token ids a sampler kept at each row of its processed scores [B, V] (the finite ones:
    top-k / top-p / min-p set the rest to -inf), as [B, K] padded with -1, K the largest count in
    the batch."""
    finite = torch.isfinite(scores)  # [B, V]
    counts = finite.sum(-1)  # [B]
    width = max(int(counts.max()) if counts.numel() else 0, 1)
    ids = torch.full((scores.shape[0], width), -1, dtype=torch.int32, device=scores.device)
    rows, cols = finite.nonzero(as_tuple=True)
    slot = torch.arange(rows.numel(), device=scores.device) - (counts.cumsum(0) - counts)[rows]
    ids[rows, slot] = cols.to(torch.int32)
    return ids
