"""Memory techniques that rewrite a model's modules: chunked MLPs, activation offloading,
host-memory trimming between layers, selective checkpointing. `apply_memory(model, args, device)`
applies what a config asks for, the same way for every trainer (the policy's and the reward
model's)."""

from __future__ import annotations

import logging

from rlft.model.loading import enable_checkpointing
from rlft.model.memory.chunked_mlp import chunk_mlps
from rlft.model.memory.host_memory import trim_between_layers
from rlft.model.memory.offload import offload_activations, offload_note
from rlft.model.memory.selective_checkpoint import attention_keeper, checkpointing_kwargs


def apply_memory(model, args, device) -> list[str]:
    """To a loaded model (after LoRA and dropout): gradient checkpointing (keeping attention outputs
    with recompute_attention: false), MLPs over `mlp_chunk_size` positions at a time, activations
    offloaded to host memory, freed heap memory trimmed between layers (a CPU). Returns the lines to
    say when training starts."""
    notes = []
    if args.gradient_checkpointing:  # recompute_attention: false keeps attention outputs
        keeper = attention_keeper(args, logging.getLogger("rlft").warning)
        enable_checkpointing(model, checkpointing_kwargs(args, keeper))
    if args.mlp_chunk_size:  # the sequence dimension in chunks (chunked_mlp.py)
        chunk_mlps(model, args.mlp_chunk_size)
    if args.activation_offloading:  # saved activations to host memory (offload.py)
        offload_activations(model)
        notes += [note for note in [offload_note(device)] if note]
    # freed heap memory back to the system between layers (host_memory.py)
    if args.trim_host_memory:
        trim_between_layers(model, device)
    return notes
