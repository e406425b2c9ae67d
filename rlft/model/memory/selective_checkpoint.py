"""`recompute_attention: false`: gradient checkpointing that keeps each layer's attention output
from the forward instead of recomputing the attention in the backward (selective activation
checkpointing, the policy torchtitan's "op" mode and Megatron's selective recomputation are built
on).

With gradient checkpointing a layer's backward first runs the layer's forward again. For long
sequences the attention kernel is the costly part of that forward (quadratic in the length) while
its output is small: [tokens, heads x head_dim] plus one log-sum-exp per head and token, what the
fused kernels' backward reads. Kept, the recomputation runs every other operation of the layer
(norms, projections, the MLP) and takes the attention's outputs from the forward: the backward never
re-runs the attention forward. Memory: about hidden_size x 2 bytes (bfloat16) + 4 x heads bytes more
per token and layer, held from the forward to the layer's backward. Values and gradients are those
of full recomputation (the kept outputs are the ones the recomputation would produce;
tests/test_selective_checkpoint.py).

Applies to the fused attention kernels torch dispatches to (SDPA's flash / memory-efficient / cuDNN
/ CPU flash kernels and the varlen kernel packed scoring calls on a GPU): a model on eager
attention, or an SDPA call that falls back to its math path, has no such operation, and then
everything is recomputed as before (the trainer says so once). Needs non-reentrant checkpointing
(torch's selective checkpointing API).
"""

from __future__ import annotations

import functools

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

_KERNELS = (
    ("aten", "_scaled_dot_product_flash_attention_for_cpu"),
    ("aten", "_scaled_dot_product_flash_attention"),
    ("aten", "_scaled_dot_product_efficient_attention"),
    ("aten", "_scaled_dot_product_cudnn_attention"),
    ("aten", "_scaled_dot_product_fused_attention_overrideable"),
    ("aten", "_flash_attention_forward"),
    ("aten", "_efficient_attention_forward"),
    ("torch_attn", "_varlen_attn"),  # torch.nn.attention.varlen (rlft's packed attention on a GPU)
    # the flash-attn package (attn_implementation flash_attention_2)
    ("flash_attn", "_flash_attn_forward"),
    ("flash_attn", "_flash_attn_varlen_forward"),
)
_DROPOUT_ARGUMENTS = ("dropout_p", "p_dropout")


class AttentionKeeper:
    """The checkpoint policy: keep the outputs of fused attention kernels, recompute the rest.
    `kept` counts the attention outputs kept since construction; where a checkpointed region (a
    layer) ran without one (no fused kernel: eager attention, SDPA's math path), `say` is told once,
    when the next region begins."""

    def __init__(self, say=None):
        self.kept, self.regions, self.say, self.told = 0, 0, say, False

    @functools.cached_property
    def kernels(self) -> frozenset:
        found = set()
        for namespace, name in _KERNELS:
            packet = getattr(getattr(torch.ops, namespace), name, None)
            for overload in (packet.overloads() if packet is not None else []):
                found.add(getattr(packet, overload))
        return frozenset(found)

    def policy(self, ctx, op, *args, **kwargs) -> CheckpointPolicy:
        # dropout: kept, the recomputation's RNG
        if op in self.kernels and not _dropout(op, args, kwargs):
            # would not advance past it and later random ops of the layer would draw other masks
            if not ctx.is_recompute:
                self.kept += 1
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    def context_fn(self):
        self.regions += torch.is_grad_enabled()
        if self.regions > 1 and not self.kept and not self.told:
            self.told = True
            if self.say is not None:
                self.say("recompute_attention: false kept no attention output: the model's "
                         "attention ran no fused kernel rlft knows, or ran one with dropout (eager "
                         "attention, SDPA's math path, attention_dropout > 0), so the backward "
                         "recomputes it as with recompute_attention: true")
        return create_selective_checkpoint_contexts(self.policy)


def checkpointing_kwargs(args, keeper: AttentionKeeper | None) -> dict | None:
    """The config's gradient_checkpointing_kwargs, with the attention-keeping policy when `keeper`
    is given (the config's checks refuse recompute_attention: false with reentrant
    checkpointing)."""
    if keeper is None:
        return args.gradient_checkpointing_kwargs
    kwargs = dict(args.gradient_checkpointing_kwargs or {})
    return {**kwargs, "use_reentrant": False, "context_fn": keeper.context_fn}


def attention_keeper(args, say=None) -> AttentionKeeper | None:
    """An AttentionKeeper where the config asks to keep attention outputs (recompute_attention:
    false)."""
    return None if getattr(args, "recompute_attention", True) else AttentionKeeper(say)


def _dropout(op, args: tuple, kwargs: dict) -> float:
    """The dropout probability an attention kernel's call asks for (0 where its schema has none)."""
    for index, argument in enumerate(op._schema.arguments):
        if argument.name in _DROPOUT_ARGUMENTS:
            value = kwargs.get(argument.name, args[index] if index < len(args) else 0.0)
            return float(value or 0.0)
    return 0.0
