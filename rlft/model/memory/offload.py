"""Activation offloading (TRL's `activation_offloading` name): the activations a training forward
saves for its backward are moved to pinned host memory as they are saved and brought back when the
backward needs them, so the accelerator holds a layer's worth of them at a time instead of every
layer's.

How (torch.autograd.graph.saved_tensors_hooks around the decoder backbone's forward when gradients
are on): each saved tensor that lives on a CUDA device, is at least `MIN_BYTES`, lies on the
gradient's path and is not a weight (a parameter, a view of one, autocast's copy of one: a weight
saved for a matmul stays where it is) nor an expanded view (`selected`) is copied to pinned host
memory on a side stream (the copy overlaps the next layer's compute; the device tensor is freed once
the copy is done) and copied back on the compute stream when the backward unpacks it. With gradient
checkpointing (non-reentrant, rlft's default) the only tensors the backbone saves outside the
checkpointed layers are each layer's input (torch keeps a checkpoint's inputs as saved tensors):
those go to the host, so the device holds the layer inputs of none of the layers and, in the
backward, one layer's recomputed activations. Without checkpointing every activation goes (more
traffic; most of the memory). The fused LM head's saved hidden states and anything outside the
backbone stay on the device.

Values and gradients are exactly the ones without offloading (the same tensors, copied and copied
back). The price is the copies' time where the compute does not hide them (host memory bandwidth:
about 1 GB per 20-50 ms on a PCIe 4/5 link) and pinned host memory: what was moved, rounded up by
torch's pinned-memory allocator (to a power of two), which keeps freed blocks for reuse rather than
giving them back. On a CPU there is nothing to move (activations are in host memory already): the
option is a said no-op there.

Learned from torchtune's OffloadActivations (which TRL 1.16 uses): side stream, parameter skipping,
a size floor; written here for rlft's forwards (no prefetch in the backward: each copy back waits on
the stream).
"""

from __future__ import annotations

import types
import weakref
from dataclasses import dataclass

import torch

# smaller saved tensors stay: their copies would cost more in latency than they save
MIN_BYTES = 1 << 20


def selected(tensor: torch.Tensor) -> bool:
    """Whether a saved tensor is an activation worth moving (on any device; `_Offload.pack` moves
    only those on an accelerator): a plain dense tensor (not a subclass such as DTensor or a
    quantised weight, not an expanded view whose elements share memory), at least MIN_BYTES, part of
    the gradient's path, and not a weight: neither a parameter, a view of one, nor autocast's copy
    of a trained one."""
    if type(tensor) is not torch.Tensor or tensor.layout != torch.strided or not tensor.requires_grad:
        return False
    if tensor.numel() * tensor.element_size() < MIN_BYTES:
        return False
    if any(stride == 0 and size > 1 for stride, size in zip(tensor.stride(), tensor.shape)):
        return False  # expanded: a copy would hold every repeat
    if isinstance(tensor._base, torch.nn.Parameter):
        return False
    cast = tensor.grad_fn
    return not (cast is not None and type(cast).__name__ == "ToCopyBackward0" and any(
        type(f).__name__ == "AccumulateGrad" for f, _ in cast.next_functions if f is not None))


@dataclass
class _Held:
    host: torch.Tensor
    device: torch.device


class _Offload:
    """One training forward's pack / unpack hooks (one side stream per process, made on first
    use)."""

    streams: dict[torch.device, torch.cuda.Stream] = {}

    def __init__(self):
        self.moved_bytes = 0
        # a tensor saved by several ops moves once (keyed by its version too: one changed in place
        # is new)
        self.seen: dict[tuple[int, int], tuple[weakref.ref, weakref.ref]] = {}

    def pack(self, tensor: torch.Tensor):
        if not (tensor.is_cuda and selected(tensor)):
            return tensor
        key = (id(tensor), tensor._version)
        ref, held_ref = self.seen.get(key, (None, None))
        held = held_ref() if held_ref is not None else None
        if held is not None and ref() is tensor:
            return held
        side = self.streams.get(tensor.device)
        if side is None:
            side = self.streams[tensor.device] = torch.cuda.Stream(tensor.device)
        # the tensor is computed before the copy
        side.wait_stream(torch.cuda.current_stream(tensor.device))
        with torch.cuda.stream(side):
            host = torch.empty_like(tensor, device="cpu", pin_memory=True)
            host.copy_(tensor, non_blocking=True)
        tensor.record_stream(side)  # its memory is not reused before the copy has read it
        self.moved_bytes += host.numel() * host.element_size()
        held = _Held(host, tensor.device)
        self.seen[key] = (weakref.ref(tensor), weakref.ref(held))
        return held

    def unpack(self, held):
        if not isinstance(held, _Held):
            return held
        # the copy out is done
        torch.cuda.current_stream(held.device).wait_stream(self.streams[held.device])
        return held.host.to(held.device, non_blocking=True)


def offload_activations(model) -> int:
    """Run `model`'s decoder backbone (the module its base_model_prefix names, under LoRA too) with
    its saved activations offloaded in training forwards (module docstring). Returns the number of
    backbones changed (0: the model has no separate backbone, and its whole forward is wrapped
    instead)."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    backbone = getattr(inner, getattr(inner, "base_model_prefix", ""), None)
    target = backbone if isinstance(backbone, torch.nn.Module) else inner
    if getattr(target, "_rlft_offload", False):
        return int(target is backbone)
    target.forward = types.MethodType(_offloaded_forward, target)
    target._rlft_offload = True
    return int(target is backbone)


def _offloaded_forward(self, *args, **kwargs):
    """The module's class forward (not a bound method in a closure: a deep copy, such as a reference
    model, runs its own weights) under the offloading hooks when gradients are on."""
    own = type(self).forward.__get__(self)
    if not torch.is_grad_enabled():
        return own(*args, **kwargs)
    hooks = _Offload()
    with torch.autograd.graph.saved_tensors_hooks(hooks.pack, hooks.unpack):
        out = own(*args, **kwargs)
    # what the last training forward moved to the host
    self._rlft_offloaded_bytes = hooks.moved_bytes
    return out


def offload_note(device: torch.device) -> str | None:
    """What a run on `device` is told about activation_offloading (None where it moves
    activations)."""
    if device.type == "cuda":
        return None
    return (f"activation_offloading: no effect on {device.type} (activations are moved from a CUDA "
            "device to host memory; on a CPU they are in host memory already)")
