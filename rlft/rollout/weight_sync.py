"""What a weight sync sends to a vLLM engine, in pieces of bounded size (docs/vllm.md, "Weight
sync").

- **Full weights in buckets** (`weight_buckets`): the state dict in vLLM's checkpoint names
  (`lm_head.weight` included), cut into buckets of at most `vllm_sync_bucket_mb`; under FSDP2 /
  ZeRO-3 every process gathers one bucket's parameters at a time (the training engine's
  `full_weights(model, params)`), never the whole model.
- **LoRA as an adapter** (`adapter_entries` + `adapter_config_text`): the adapter tensors in PEFT's
  saved names and its adapter_config.json, served by vLLM on top of the base weights it holds
  (pushed once, unmerged). The base weights are never merged, pushed again or modified.
- **Merged** (`synced_weights` in vllm.py): LoRA merged into the whole model, the fallback for
  adapters vLLM cannot serve (`lora_sync_mode` says which and why).
"""

from __future__ import annotations

import contextlib
import logging
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch

# vLLM's allowed max_lora_rank values (vllm.config.lora.MaxLoRARanks)
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# PEFT inits that only set the adapter's first values (the others -- PiSSA, OLoRA, CorDA, LoftQ --
# change the base weights, which the engine would then not hold)
SERVABLE_INITS = ("gaussian", "eva", "orthogonal", "mica", "lora_ga")


def module_tensors(model) -> list[tuple[str, torch.Tensor]]:
    """The model's state dict entries (tied parameters under each of their names, persistent
    buffers), read without `state_dict()`, whose FSDP2 hook would swap the shards back in while a
    sync reads full weights."""
    out = list(model.named_parameters(remove_duplicate=False))
    for prefix, module in model.named_modules(remove_duplicate=False):
        out += [(f"{prefix}.{name}" if prefix else name, buffer) for name, buffer in module._buffers.items()
                if buffer is not None and name not in module._non_persistent_buffers_set]
    return out


def full_numel(param: torch.Tensor) -> int:
    """Elements of the whole tensor: a DTensor's shape is already global; a ZeRO-3 partitioned
    parameter keeps its whole size in ds_numel."""
    return int(getattr(param, "ds_numel", None) or param.numel())


def plan_buckets(entries: list[tuple[str, torch.Tensor]], element_size: int | None,
                 bucket_bytes: int) -> list[list[tuple[str, torch.Tensor]]]:
    """Consecutive entries grouped so that each group's whole size is at most `bucket_bytes` (a
    tensor larger than that is a bucket of its own). A parameter listed under two names (tied
    embeddings) counts once. `element_size` None: each tensor's own."""
    buckets, current, size, seen = [], [], 0, set()
    for name, param in entries:
        whole = full_numel(param) * (element_size or param.element_size())
        extra = 0 if id(param) in seen else whole
        if current and size + extra > bucket_bytes:
            buckets.append(current)
            current, size, seen = [], 0, set()
            extra = whole
        current.append((name, param))
        size += extra
        seen.add(id(param))
    return buckets + ([current] if current else [])


def weight_buckets(model, entries_of, full_weights, dtype: torch.dtype | None,
                   bucket_bytes: int, saved_layout: bool = True) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Yields [(name, tensor in `dtype`, or its own when None)] one bucket at a time.
    `entries_of(model)`: the (name, parameter) pairs to send, read again inside each bucket's gather
    (FSDP2 swaps whole copies in); `full_weights`: the training engine's context (every process must
    iterate this generator to the end together), None when the weights are not sharded. The tensors
    are valid until the next bucket is asked for. `saved_layout`: as the checkpoint holds them
    (`saved_layout`), what an engine loads; False: as the model holds them."""
    first = entries_of(model)
    for bucket in plan_buckets(first, dtype.itemsize if dtype else None, bucket_bytes):
        names = {name for name, _ in bucket}
        params = list({id(p): p for _, p in bucket}.values())
        with (full_weights(model, params) if full_weights else contextlib.nullcontext()):
            out = [(name, tensor.detach().to(dtype or tensor.dtype)) for name, tensor in entries_of(model)
                   if name in names]
            yield saved_layout_of(model, out) if saved_layout else out


def saved_layout_of(model, entries: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) as the model's checkpoint holds them, which is what an engine (vLLM) loads:
    transformers 5 keeps some weights in another layout than it saves (a Mixture-of-Experts layer's
    experts fused into one [E, 2I, H] gate_up_proj and one down_proj, saved one expert at a time), and
    a push in the in-memory layout loads wrong expert weights into vLLM (measured: log-probs 0.53 off
    after one push, tests/test_vllm.py). transformers' own revert_weight_conversion, as save_pretrained
    does; unchanged for a model without such conversions."""
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # (transformers before 5: weights are held as saved)
        return entries
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    reverted = revert_weight_conversion(base, dict(entries))
    if set(reverted) == {name for name, _ in entries}:  # nothing changed: the entries as they came, in order
        return entries
    return list(reverted.items())


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for _, t in tensors)


# ---- LoRA ----------------------------------------------------------------------------------------------
def adapter_name(model) -> str:
    active = model.active_adapter
    return active if isinstance(active, str) else active[0]


def adapter_entries(model) -> list[tuple[str, torch.Tensor]]:
    """The active adapter's tensors under the names PEFT saves them with
    (`...q_proj.lora_A.weight`): what vLLM reads from an adapter folder."""
    tag = f".{adapter_name(model)}."
    out = []
    for name, tensor in module_tensors(model):
        if (".lora_A." in name or ".lora_B." in name) and tag in name:
            out.append((name.replace(tag, ".", 1), tensor))
    return out


def adapter_tensors(model, full_weights, dtype: torch.dtype) -> list[tuple[str, torch.Tensor]]:
    """The adapter's tensors (gathered under FSDP2 / ZeRO-3: one bucket, adapters are small), copied
    out so they outlive the gather."""
    buckets = weight_buckets(model, adapter_entries, full_weights, dtype, 1 << 62)
    return [(name, t.clone()) for bucket in buckets for name, t in bucket]


def whole_tensors(model, entries_of, full_weights, bucket_bytes: int) -> dict[str, torch.Tensor]:
    """{name: tensor} of `entries_of(model)`, whole: as they are when the weights are not sharded
    (`full_weights` None), else gathered one bucket at a time by the training engine (every process
    together) and copied to the CPU, each in its own dtype."""
    if full_weights is None:
        return dict(entries_of(model))
    return {name: t.to("cpu", copy=True) for bucket in weight_buckets(model, entries_of, full_weights, None,
                                                                        bucket_bytes, saved_layout=False)
            for name, t in bucket}


def save_engine_folder(model, folder, state_dict: dict) -> None:
    """The base model's folder for an engine this process starts (a producer, a colocated vLLM),
    written on every process: transformers' save_pretrained writes only on rank 0 once a process
    group is up."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    base.should_save_on_this_rank = lambda is_main_process: True  # this process's own engine folder
    try:
        base.save_pretrained(folder, state_dict=state_dict)
    finally:
        del base.should_save_on_this_rank
    if not (Path(folder) / "config.json").is_file():
        raise RuntimeError(f"save_pretrained wrote no config.json into {folder} on this process (a "
                           "transformers change in who saves under torch.distributed; an rlft bug "
                           "to report)")


def adapter_config_text(model) -> str:
    """adapter_config.json as PEFT writes it."""
    config = model.peft_config[adapter_name(model)]
    with tempfile.TemporaryDirectory(prefix="rlft-adapter-config-") as folder:
        config.save_pretrained(folder)
        return (Path(folder) / "adapter_config.json").read_text()


def lora_rank_limit(model) -> int:
    """The smallest max_lora_rank vLLM accepts that holds the adapter's largest rank."""
    config = model.peft_config[adapter_name(model)]
    rank = max([config.r, *(config.rank_pattern or {}).values()])
    return next((r for r in VLLM_LORA_RANKS if r >= rank), rank)


def unservable_reasons(model) -> list[str]:
    """Why vLLM cannot serve this adapter on the base weights it holds (empty: it can)."""
    config = model.peft_config[adapter_name(model)]
    reasons = []
    if getattr(config, "use_dora", False):
        reasons.append("DoRA (use_dora=True)")
    if getattr(config, "bias", "none") != "none" or getattr(config, "lora_bias", False):
        reasons.append(f"adapter biases (bias={config.bias!r})")
    if config.modules_to_save:
        reasons.append(f"modules_to_save={sorted(config.modules_to_save)}")
    if getattr(config, "trainable_token_indices", None):
        reasons.append("trainable_token_indices")
    init = config.init_lora_weights
    if isinstance(init, str) and init.lower() not in SERVABLE_INITS:
        reasons.append(f"init_lora_weights={init!r} (it changes the base weights)")
    if any(isinstance(m, torch.nn.Embedding) for n, m in model.named_modules() if n.endswith(".base_layer")):
        reasons.append("LoRA on an embedding layer")
    outside = [n for n, p in model.named_parameters() if p.requires_grad and "lora_" not in n]
    if outside:
        reasons.append(f"trainable weights outside the adapter ({', '.join(outside[:3])})")
    return reasons


def lora_sync_mode(args, model, restarts_requests: bool = False) -> str | None:
    """"adapter" (push only the adapter), "merged" (push the whole model with LoRA merged) or None
    (no LoRA), from `vllm_lora_sync`: auto picks adapter when vLLM can serve it and says why when it
    cannot. `restarts_requests`: an engine whose running requests are stopped and sent again after a
    push (a vLLM server, rlft/rollout/vllm_requests.py), so in-flight updates can take adapters."""
    from peft import PeftModel

    from rlft.errors import ConfigError

    if not isinstance(model, PeftModel):
        return None
    choice = args.vllm_lora_sync
    if choice == "merged":
        return "merged"
    if getattr(args, "inflight_weight_updates", False) and not restarts_requests:  # (AsyncGRPOConfig's)
        # a running request keeps the adapter it was added with: newer weights reach it only merged
        if choice == "adapter":
            raise ConfigError("vllm_lora_sync='adapter' with inflight_weight_updates: a running vLLM "
                              "request keeps the adapter it started with, so weights loaded between "
                              "its steps must be the merged model; set vllm_lora_sync to 'merged' "
                              "(or 'auto')")
        return "merged"
    reasons = unservable_reasons(model)
    if not reasons:
        return "adapter"
    why = "; ".join(reasons)
    if choice == "adapter":
        raise ConfigError(f"vllm_lora_sync='adapter': vLLM cannot serve this adapter ({why}); set "
                          "vllm_lora_sync to 'merged' (or 'auto') to push the merged model instead")
    logging.getLogger("rlft").warning(
        "vLLM cannot serve this LoRA adapter as an adapter (%s): each weight sync pushes the whole "
        "model with LoRA merged instead (vllm_lora_sync='merged' says so without this message)", why)
    return "merged"


def adapter_files(model, tensors: list[tuple[str, torch.Tensor]]) -> dict[str, bytes]:
    """The adapter folder's two files as bytes (safetensors and JSON)."""
    from safetensors.torch import save

    return {"adapter_model.safetensors": save({n: t.contiguous() for n, t in tensors}),
            "adapter_config.json": adapter_config_text(model).encode()}


def bucket_bytes_of(args) -> int:
    return int(float(args.vllm_sync_bucket_mb) * 2**20)
