"""Per-token log-probabilities and entropy from logits, in float32, chunked.

    log pi(y_t) = z_{t, y_t} / T - logsumexp_v(z_{t, v} / T)

The full [batch, seq, vocab] float32 tensor is never materialised: rows are processed
`chunk_size` at a time, and the backward pass recomputes each chunk's softmax instead of
keeping float32 copies alive, so the extra memory is O(chunk_size * vocab) in both passes.
"""

from __future__ import annotations

import torch


def _chunks(rows: int, chunk_size: int):
    for start in range(0, rows, chunk_size):
        yield start, min(start + chunk_size, rows)


def _work_dtype(logits: torch.Tensor) -> torch.dtype:
    """float32 for half/bfloat16/float32 input; float64 stays float64 (for gradcheck)."""
    return torch.promote_types(logits.dtype, torch.float32)


class _SelectiveLogSoftmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, token_ids, temperature, chunk_size):
        flat = logits.reshape(-1, logits.shape[-1])  # [rows, vocab]
        ids = token_ids.reshape(-1)  # [rows]
        work = _work_dtype(logits)
        out = torch.empty(flat.shape[0], dtype=work, device=logits.device)
        lse = torch.empty_like(out)
        for start, end in _chunks(flat.shape[0], chunk_size):
            scaled = flat[start:end].to(work) / temperature  # [chunk, vocab]
            lse[start:end] = torch.logsumexp(scaled, dim=-1)
            out[start:end] = scaled.gather(-1, ids[start:end, None]).squeeze(-1) - lse[start:end]
        ctx.save_for_backward(logits, token_ids, lse)
        ctx.temperature, ctx.chunk_size = temperature, chunk_size
        return out.view(token_ids.shape)

    @staticmethod
    def backward(ctx, grad_out):
        logits, token_ids, lse = ctx.saved_tensors
        flat = logits.reshape(-1, logits.shape[-1])
        ids = token_ids.reshape(-1)
        work = lse.dtype
        grad_flat = grad_out.reshape(-1).to(work)
        grad_logits = torch.empty_like(flat)
        for start, end in _chunks(flat.shape[0], ctx.chunk_size):
            # d logp_y / d z_v = (1[v == y] - softmax_v) / T
            probs = torch.exp(flat[start:end].to(work) / ctx.temperature - lse[start:end, None])  # [chunk, vocab]
            grad = -probs
            grad.scatter_add_(-1, ids[start:end, None], torch.ones_like(grad[:, :1]))
            grad *= grad_flat[start:end, None] / ctx.temperature
            grad_logits[start:end] = grad.to(flat.dtype)
        return grad_logits.view_as(logits), None, None, None


def selective_log_softmax(logits: torch.Tensor, token_ids: torch.Tensor, temperature: float = 1.0,
                          chunk_size: int = 1024) -> torch.Tensor:
    """log softmax(logits / temperature) gathered at `token_ids`, in float32.

    logits: [batch, seq, vocab] (any float dtype); token_ids: [batch, seq] -> [batch, seq] float32.
    Differentiable with respect to `logits`; extra memory stays O(chunk_size * vocab).
    """
    if logits.shape[:-1] != token_ids.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and token_ids {tuple(token_ids.shape)} disagree")
    if chunk_size <= 0:
        raise ValueError(f"chunk_size={chunk_size} must be > 0")
    return _SelectiveLogSoftmax.apply(logits, token_ids, float(temperature), int(chunk_size))


@torch.no_grad()
def entropy_from_logits(logits: torch.Tensor, temperature: float = 1.0, chunk_size: int = 1024) -> torch.Tensor:
    """Per-position entropy H = logsumexp(z) - sum_v p_v z_v of softmax(logits / T), float32, chunked.

    logits: [batch, seq, vocab] -> [batch, seq]. A metric: no gradient.
    """
    flat = logits.reshape(-1, logits.shape[-1])
    out = torch.empty(flat.shape[0], dtype=_work_dtype(logits), device=logits.device)
    for start, end in _chunks(flat.shape[0], chunk_size):
        scaled = flat[start:end].to(out.dtype) / temperature  # [chunk, vocab]
        lse = torch.logsumexp(scaled, dim=-1, keepdim=True)
        out[start:end] = (lse.squeeze(-1) - (torch.exp(scaled - lse) * scaled).sum(-1))
    return out.view(logits.shape[:-1])
