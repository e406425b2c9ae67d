"""Attention over a packed sequence, one block of queries at a time: the rows of a micro-batch
concatenated with no padding, and a group's shared prompt held once.

A packed sequence of T tokens is tiled, in order, by blocks. A block's queries are its own tokens
[start, start + length); each attends causally to the block's earlier tokens and, in full, to the
block's prefix [prefix_start, prefix_start + prefix_length) (a prompt its completions share; none
for a row packed whole). So for query i of a block with prefix p and own tokens s:

    attention(q_i) = softmax(q_i [k_p ; k_s[:i+1]]^T * scale) [v_p ; v_s[:i+1]]

which is exactly what the row (prompt + completion) computes on its own: a row never sees another
row, and a completion sees its prompt and its own past. Each block is one
scaled_dot_product_attention call, so the work is sum over blocks of length x (prefix + length), not
T^2 as one masked attention over the packed sequence would cost; gradients flow to a shared prefix
from every block that reads it (summed).

Two kernels compute it (`kernel()` says which one a tensor gets):

  "varlen flash"  on a GPU in float16/bfloat16, where torch has
                  `torch.nn.attention.varlen.varlen_attn`:
                  every block in one flash-attention call, each block's keys [prefix ; own] gathered into
                  one key sequence, the causal mask aligned to the bottom right (query i of a block sees
                  the prefix and its own keys up to i, the equation above);
  "sdpa per block" elsewhere: one scaled_dot_product_attention per block (is_causal for a block
  without a
                  prefix, a lower-right causal bias with one), a Python loop over the blocks.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

try:  # torch >= 2.10, CUDA only; its keyword arguments changed between releases (read below)
    from torch.nn.attention.varlen import varlen_attn
except ImportError:  # pragma: no cover - older torch
    varlen_attn = None
# the kernel the latest packed attention ran (said once by the trainer)
LAST_KERNEL: str | None = None
_VARLEN_ARGS = set(inspect.signature(varlen_attn).parameters) if varlen_attn is not None else set()


@dataclass(frozen=True)
class Block:
    start: int  # the block's own tokens: [start, start + length), causal among themselves
    length: int
    # tokens each query of the block sees in full (a shared prompt): 0 tokens = none
    prefix_start: int = 0
    prefix_length: int = 0
    # torch's lower-right causal mask object for a block with a prefix (no [L, S] tensor is built),
    # made with the block, outside the forward: it is a tensor subclass, which cannot be created
    # inside a region under selective checkpointing's dispatch mode (recompute_attention: false)
    mask: Any = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        if self.prefix_length and self.mask is None:
            mask = causal_lower_right(self.length, self.prefix_length + self.length)
            object.__setattr__(self, "mask", mask)


def segment_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask,
                      dropout: float = 0.0, scaling: float | None = None,
                      rlft_blocks: list[Block] | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """A transformers attention function (`AttentionInterface`): query [1, H, T, D], key / value
    [1, H_kv, T, D] (grouped-query heads repeated here) -> ([1, T, H, D], None). `rlft_blocks` tile
    [0, T)."""
    if rlft_blocks is None:
        raise ValueError("segment attention needs the packed sequence's blocks (rlft_blocks=)")
    if kwargs.get("softcap") is not None:
        raise ValueError("segment attention does not apply attention logit softcapping")
    window = kwargs.get("sliding_window")
    if window is not None and any(b.prefix_length + b.length > window for b in rlft_blocks):
        raise ValueError(f"a packed block is longer than the model's sliding window ({window})")
    global LAST_KERNEL
    LAST_KERNEL = kernel(query, dropout, window, scaling)
    if LAST_KERNEL == "varlen flash":
        return _varlen(query, key, value, rlft_blocks, scaling), None
    # grouped-query heads: SDPA repeats the kv heads, no copy here
    gqa = query.shape[1] != key.shape[1]
    # [1, T, H, D]
    out = query.new_empty(query.shape[0], query.shape[2], query.shape[1], query.shape[3])
    for block in rlft_blocks:
        own = slice(block.start, block.start + block.length)
        q, k, v = query[:, :, own], key[:, :, own], value[:, :, own]
        if block.prefix_length == 0:
            part = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True, scale=scaling,
                                                  enable_gqa=gqa)
        # the prefix in full, then causal: a lower-right causal mask over [prefix ; own], never
        # built
        else:
            prefix = slice(block.prefix_start, block.prefix_start + block.prefix_length)
            k = torch.cat([key[:, :, prefix], k], dim=2)
            v = torch.cat([value[:, :, prefix], v], dim=2)
            if gqa:  # the lower-right kernels take as many kv heads as query heads
                groups = query.shape[1] // key.shape[1]
                k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
            part = F.scaled_dot_product_attention(q, k, v, attn_mask=block.mask, dropout_p=dropout,
                                                  scale=scaling)
        out[:, own] = part.transpose(1, 2)
    return out, None


def one_call(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a packed attention on tensors of this device and dtype runs as one varlen call (no
    loop over the blocks), the head size and options permitting."""
    return varlen_attn is not None and device.type == "cuda" and dtype in (torch.float16, torch.bfloat16)


def kernel(query: torch.Tensor, dropout: float = 0.0, window: int | None = None,
           scaling: float | None = None) -> str:
    """Which kernel `segment_attention` runs for this query (module docstring): "varlen flash" or
    "sdpa per block"."""
    flash = (varlen_attn is not None and query.is_cuda and query.dtype in (torch.float16, torch.bfloat16)
             and dropout == 0.0 and window is None and query.shape[-1] <= 256 and query.shape[-1] % 8 == 0)
    # the first release takes no scale: the default one only
    if flash and "scale" not in _VARLEN_ARGS:
        flash = scaling is None or abs(scaling - query.shape[-1] ** -0.5) < 1e-9
    return "varlen flash" if flash else "sdpa per block"


@lru_cache(maxsize=16)
def _varlen_layout(blocks: tuple[Block, ...], device: torch.device):
    """For the blocks: the key positions (each block's prefix, then its own tokens), the cumulative
    query and key lengths (int32) and the longest of each."""
    keys, cu_q, cu_k = [], [0], [0]
    for b in blocks:
        keys += list(range(b.prefix_start, b.prefix_start + b.prefix_length))
        keys += list(range(b.start, b.start + b.length))
        cu_q.append(cu_q[-1] + b.length)
        cu_k.append(cu_k[-1] + b.prefix_length + b.length)
    shared = any(b.prefix_length for b in blocks)
    index = torch.tensor(keys, dtype=torch.long, device=device) if shared else None
    as_int = lambda values: torch.tensor(values, dtype=torch.int32, device=device)  # noqa: E731
    return (index, as_int(cu_q), as_int(cu_k), max(b.length for b in blocks),
            max(b.prefix_length + b.length for b in blocks))


def _varlen(query, key, value, blocks: list[Block], scaling: float | None) -> torch.Tensor:
    """All blocks in one varlen flash-attention call: [1, H, T, D] query -> [1, T, H, D]."""
    index, cu_q, cu_k, max_q, max_k = _varlen_layout(tuple(blocks), query.device)
    q = query[0].transpose(0, 1)  # [T, H, D]
    k, v = key[0].transpose(0, 1), value[0].transpose(0, 1)  # [T, H_kv, D]
    if index is not None:  # a shared prefix read by several blocks: gathered once per reader
        k, v = k.index_select(0, index), v.index_select(0, index)
    options = {}
    if "window_size" in _VARLEN_ARGS:  # (-1, 0): causal, bottom-right aligned
        options["window_size"] = (-1, 0)
    else:
        options["is_causal"] = True
    if "scale" in _VARLEN_ARGS:
        options["scale"] = scaling
    if query.shape[1] != key.shape[1]:
        if "enable_gqa" in _VARLEN_ARGS:
            options["enable_gqa"] = True
        else:
            groups = query.shape[1] // key.shape[1]
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    out = varlen_attn(q.contiguous(), k.contiguous(), v.contiguous(), cu_q, cu_k, max_q, max_k, **options)
    return out[None]
