"""The sequence dimension in chunks where a layer allows it: each decoder layer's MLP
(position-wise, so any split of the positions computes the same values) run over `mlp_chunk_size`
positions at a time in a training forward. The forward keeps no intermediate of the MLP, only its
input; the backward recomputes one chunk's MLP at a time and differentiates it before the next.

What it bounds: with gradient checkpointing a layer's backward holds that layer's activations for
every position of the micro-batch at once, and the MLP's (gate, up, their product: about 4 x
intermediate_size floats per position, 3-5 times the hidden size) are most of them. Chunked, the MLP
holds `mlp_chunk_size` positions' worth.

What it costs: nothing in the usual layer. The MLP's input is saved first, by an autograd function
of its own (`_Anchor`), and the chunks run in a second one that saves nothing (`_Chunks`), so a
checkpointed layer's recomputation, which stops once every tensor the layer saved is back (torch's
early stop), stops at the MLP's input when nothing after the MLP saves a tensor (Llama, Qwen2/3,
Mistral: the residual add): the MLP's forward runs twice in all, as unchunked. Unchunked, torch's
early stop also spares the down projection's forward (nothing saved comes after it); chunked, the
same holds where the down projection is a plain linear layer whose output the MLP returns (full
fine-tuning): the chunk's recomputation stops at its input and its backward is written out.
Elsewhere (a peft-adapted down projection) it runs once more per chunk, a third of the MLP's
matmuls. A layer that normalises the MLP's output (Gemma 2/3's post-feed-forward norm) saves it, so
its recomputation runs the chunks too, one MLP forward more. Values and gradients are the unchunked
ones (the same operations on the same positions; float sums of a parameter's gradient over chunks
may round differently). The parameters' gradients are the autograd function's outputs, so they reach
the parameters once per layer (DDP's and ZeRO's gradient hooks as usual). Forwards without gradient
(old-policy, reference, generation) run unchanged; so does a forward of fewer positions than a
chunk.

Applies to a model whose decoder layers have an `mlp` module that maps hidden states [..., T, H] to
a tensor of the same shape (Llama, Qwen2/3, Mistral, Gemma, Phi-3, ...); a Mixture-of-Experts block
(its router reads all positions together, and returns router logits) and an MLP with dropout (the
recomputation would draw other masks) are refused, naming the field.
"""

from __future__ import annotations

import contextlib
import types

import torch

from rlft.errors import ConfigError, RlftError


def _mlps(model) -> list[torch.nn.Module]:
    """Each decoder layer's `mlp`: layers under `layers` (Llama, Qwen, Mistral, Gemma, ...), a
    language model's `layers` (multimodal models), `h` (GPT-2, GPT-J, Falcon, Bloom) or `blocks`."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    backbone = getattr(inner, inner.base_model_prefix, inner)
    places = (backbone, getattr(backbone, "language_model", None))
    for layers in (getattr(place, name, None) for place in places for name in ("layers", "h", "blocks")):
        if isinstance(layers, torch.nn.ModuleList) and len(layers):
            return [layer.mlp for layer in layers if isinstance(getattr(layer, "mlp", None), torch.nn.Module)]
    return []


def chunk_mlps(model, chunk: int) -> int:
    """Make every decoder layer's MLP of `model` run chunked in training forwards (module
    docstring). Returns how many it changed; raises ConfigError for a model it cannot apply to."""
    mlps = _mlps(model)
    if not mlps:
        raise ConfigError(f"mlp_chunk_size={chunk}: {type(model).__name__} has no decoder layers "
                          "(under layers, h or blocks) with an `mlp` module to chunk; leave "
                          "mlp_chunk_size unset")
    for mlp in mlps:
        name = type(mlp).__name__
        if any(hasattr(mlp, attr) for attr in ("gate", "router", "experts")) or "moe" in name.lower():
            raise ConfigError(f"mlp_chunk_size={chunk}: {name} is a Mixture-of-Experts block (its "
                              "router reads all positions together); leave mlp_chunk_size unset "
                              "for this model")
        if any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in mlp.modules()):
            raise ConfigError(f"mlp_chunk_size={chunk}: {name} has dropout, which its "
                              "recomputation in the backward would draw again differently; leave "
                              "mlp_chunk_size unset")
        if getattr(mlp, "_rlft_chunk", None) is None:
            mlp.forward = types.MethodType(_chunked_forward, mlp)
        mlp._rlft_chunk = chunk
    return len(mlps)


def _chunked_forward(self, hidden: torch.Tensor, *args, **kwargs):
    """The module's class forward over `_rlft_chunk` positions at a time (the class's, not a bound
    method kept in a closure: a deep copy of the model, such as a reference, must run its own
    weights)."""
    own = type(self).forward.__get__(self)
    chunk = self._rlft_chunk
    if not torch.is_grad_enabled() or hidden.shape[-2] <= chunk or args or kwargs:
        return own(hidden, *args, **kwargs)
    params = [p for p in self.parameters() if p.requires_grad]
    anchored = _Anchor.apply(hidden)
    return _Chunks.apply(anchored, own, chunk, type(self).__name__, *params)


class _Anchor(torch.autograd.Function):
    """The identity, saving its input: the MLP's input for `_Chunks`'s backward, saved before the
    MLP runs (a checkpointed layer's recomputation can stop here)."""

    @staticmethod
    def forward(ctx, hidden):
        ctx.save_for_backward(hidden)
        return hidden.view_as(hidden)

    @staticmethod
    def backward(ctx, grad):
        return grad


class _Chunks(torch.autograd.Function):
    """The MLP over chunks of positions, saving nothing: the forward without gradient; the backward
    reads the input `_Anchor` saved, and for each chunk recomputes the MLP with gradient and
    differentiates it, the parameters' gradients summed over chunks."""

    @staticmethod
    def forward(ctx, anchored, own, chunk, name, *params):
        ctx.own, ctx.chunk, ctx.params, ctx.anchor = own, chunk, params, anchored.grad_fn
        # the input takes no gradient (only the MLP's parameters do): saved here
        if ctx.anchor is None:
            ctx.save_for_backward(anchored)
        ctx.amp = [(device, torch.get_autocast_dtype(device)) for device in ("cuda", "cpu", "xpu")
                   if torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device)]
        down, outputs = _plain_down(own.__self__, anchored.dtype) if not ctx.amp else None, []
        watch = None if down is None else down.register_forward_hook(lambda m, a, out: outputs.append(out))
        # (contiguous: an MLP may view its input flat, as GPT-2's Conv1D does)
        with torch.no_grad():
            parts = [own(piece.contiguous()) for piece in anchored.split(chunk, dim=-2)]
        if watch is not None:
            watch.remove()
        # the MLP returns its down projection's output as it is: the backward can stop at that input
        last = down is not None and all(p is o for p, o in zip(parts, outputs)) and len(outputs) == len(parts)
        ctx.down = down if last else None
        pieces = anchored.split(chunk, dim=-2)
        if not all(isinstance(p, torch.Tensor) and p.shape == q.shape for p, q in zip(parts, pieces)):
            raise ConfigError(f"mlp_chunk_size: {name} does not map hidden states to hidden states "
                              "of the same shape, so its positions cannot be split; leave "
                              "mlp_chunk_size unset")
        return torch.cat(parts, dim=-2)

    @staticmethod
    def backward(ctx, grad):
        (hidden,) = ctx.saved_tensors if ctx.anchor is None else ctx.anchor.saved_tensors
        params, wants = ctx.params, ctx.needs_input_grad[0]
        grad_hidden = torch.empty_like(hidden) if wants else None
        grad_params = [None] * len(params)
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.enable_grad())
            for device, dtype in ctx.amp:  # the forward's autocast, as checkpointing restores it
                stack.enter_context(torch.autocast(device, dtype=dtype))
            start = 0
            for piece, up in zip(hidden.split(ctx.chunk, dim=-2), grad.split(ctx.chunk, dim=-2)):
                x = piece.detach().contiguous().requires_grad_(wants)
                inputs = ([x] if wants else []) + list(params)
                got = _chunk_grads(ctx, x, inputs, up)
                if wants:
                    grad_hidden.narrow(-2, start, piece.shape[-2]).copy_(got[0])
                for k, g in enumerate(got[1:] if wants else got):
                    if g is not None:
                        grad_params[k] = g if grad_params[k] is None else grad_params[k].add_(g)
                start += piece.shape[-2]
        return (grad_hidden, None, None, None, *grad_params)


class _Stop(RlftError):
    """Raised by a forward pre-hook to end a forward at a module's input (`value`); caught where it
    is raised for, never seen outside this module."""

    def __init__(self, value: torch.Tensor):
        super().__init__()
        self.value = value


def _plain_down(mlp, dtype: torch.dtype) -> torch.nn.Linear | None:
    """The MLP's `down_proj` where it is a plain linear layer in the activations' dtype (full
    fine-tuning; not a peft layer, not quantised, not partitioned by ZeRO-3, whose hooks must see
    its forward end), else None."""
    down = getattr(mlp, "down_proj", None)
    if type(down) is not torch.nn.Linear or hasattr(down.weight, "ds_id"):
        return None
    return down if down.weight.dtype == dtype else None


def _chunk_grads(ctx, x: torch.Tensor, inputs: list, up: torch.Tensor) -> list:
    """The chunk's gradients for `inputs` given the output's gradient `up`. With a plain `down_proj`
    whose output the MLP returns, the recomputation stops at its input a and its backward is written
    out (dL/da = g W, dL/dW = g^T a, dL/db = sum g): its forward, a third of the MLP's matmuls, is
    not run again."""
    down = ctx.down
    slots = {id(t): k for k, t in enumerate(inputs)}
    wanted = [p for p in (down.weight, down.bias) if p is not None and p.requires_grad] if down else []
    if down is None or any(id(p) not in slots for p in wanted):
        return list(torch.autograd.grad(ctx.own(x), inputs, up, allow_unused=True))
    handle = down.register_forward_pre_hook(_stop_here)
    try:
        ctx.own(x)
        raise RuntimeError("mlp_chunk_size: the MLP's recomputation did not reach its down_proj")
    except _Stop as stopped:
        a = stopped.value
    finally:
        handle.remove()
    flat_up, flat_a = up.reshape(-1, up.shape[-1]), a.detach().reshape(-1, a.shape[-1])
    got = [None] * len(inputs)  # (a takes no gradient where only the down projection trains)
    if a.requires_grad:
        got = list(torch.autograd.grad(a, inputs, (flat_up @ down.weight).view_as(a), allow_unused=True))
    if down.weight.requires_grad:
        got[slots[id(down.weight)]] = flat_up.t() @ flat_a
    if down.bias is not None and down.bias.requires_grad:
        got[slots[id(down.bias)]] = flat_up.sum(0)
    return got


def _stop_here(module, args):
    raise _Stop(args[0])
