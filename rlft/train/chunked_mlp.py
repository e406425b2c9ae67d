"""The sequence dimension in chunks where a layer allows it: each decoder layer's MLP (position-wise, so any
split of the positions computes the same values) run over `mlp_chunk_size` positions at a time in a
training forward, each chunk checkpointed (torch.utils.checkpoint, non-reentrant): the forward keeps no
intermediate of the MLP, and the backward recomputes one chunk's at a time.

What it bounds: with gradient checkpointing a layer's backward holds that layer's activations for every
position of the micro-batch at once, and the MLP's (gate, up, their product: about 4 x intermediate_size
floats per position, 3-5 times the hidden size) are most of them. Chunked, the MLP holds
`mlp_chunk_size` positions' worth. The price: each chunk's MLP forward runs once more in the backward.
Values and gradients are the unchunked ones (the same operations on the same positions; float sums of a
parameter's gradient over chunks may round differently). Forwards without gradient (old-policy, reference,
generation) run unchanged; so does a forward of fewer positions than a chunk.

Applies to a model whose decoder layers have an `mlp` module that maps hidden states [..., T, H] to a tensor
of the same shape (Llama, Qwen2/3, Mistral, Gemma, Phi-3, ...); a Mixture-of-Experts block (its router
reads all positions together, and returns router logits) is refused, naming the field.
"""

from __future__ import annotations

import types

import torch
from torch.utils.checkpoint import checkpoint

from rlft.errors import ConfigError


def _mlps(model) -> list[torch.nn.Module]:
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    backbone = getattr(inner, inner.base_model_prefix, inner)
    layers = getattr(backbone, "layers", None)
    if layers is None:
        layers = getattr(getattr(backbone, "language_model", None), "layers", None)
    return [layer.mlp for layer in (layers or []) if isinstance(getattr(layer, "mlp", None), torch.nn.Module)]


def chunk_mlps(model, chunk: int) -> int:
    """Make every decoder layer's MLP of `model` run chunked in training forwards (module docstring).
    Returns how many it changed; raises ConfigError for a model it cannot apply to."""
    mlps = _mlps(model)
    if not mlps:
        raise ConfigError(f"mlp_chunk_size={chunk}: {type(model).__name__} has no decoder layers with an "
                          "`mlp` module to chunk; leave mlp_chunk_size unset")
    for mlp in mlps:
        name = type(mlp).__name__
        if any(hasattr(mlp, attr) for attr in ("gate", "router", "experts")) or "moe" in name.lower():
            raise ConfigError(f"mlp_chunk_size={chunk}: {name} is a Mixture-of-Experts block (its router "
                              "reads all positions together); leave mlp_chunk_size unset for this model")
        if getattr(mlp, "_rlft_chunk", None) is None:
            mlp.forward = types.MethodType(_chunked_forward, mlp)
        mlp._rlft_chunk = chunk
    return len(mlps)


def _chunked_forward(self, hidden: torch.Tensor, *args, **kwargs):
    """The module's class forward over `_rlft_chunk` positions at a time (the class's, not a bound method
    kept in a closure: a deep copy of the model, such as a reference, must run its own weights)."""
    own = type(self).forward.__get__(self)
    chunk = self._rlft_chunk
    if not torch.is_grad_enabled() or hidden.shape[-2] <= chunk or args or kwargs:
        return own(hidden, *args, **kwargs)
    pieces = hidden.split(chunk, dim=-2)
    parts = [checkpoint(own, piece, use_reentrant=False) for piece in pieces]
    if not all(isinstance(p, torch.Tensor) and p.shape == q.shape for p, q in zip(parts, pieces)):
        raise ConfigError(f"mlp_chunk_size: {type(self).__name__} does not map hidden states to hidden "
                          "states of the same shape, so its positions cannot be split; leave mlp_chunk_size "
                          "unset")
    return torch.cat(parts, dim=-2)
