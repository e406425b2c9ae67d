"""Weights and optimizer state of an FSDP2 or DeepSpeed (ZeRO-2/3) run, gathered whole and written without pickle.

Every process calls these (gathering is a collective); the main process writes. A sharded checkpoint holds,
besides the normal `model/` folder (a transformers or peft folder of the gathered weights):
  engine/weights.safetensors    every trainable parameter in full, by its name in the model
                                (DeepSpeed: its fp32 master copy, so a bf16 run resumes exactly)
  engine/optimizer.safetensors  every optimizer state tensor in full, as "<parameter name>::<state key>"
  engine/optimizer.json         scalar state: param groups / step counts
Saved whole, not per process, so nothing in the files depends on how the state was split (resume still asks for
the same number of processes, for the RNG states and data order; rlft/train/checkpoint.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from rlft.models import trainable_parameters
from rlft.train.safe_files import check_finite, load_json, load_safetensors


def save_pretrained(accelerator, engine, model, folder: Path, tokenizer=None) -> dict | None:
    """`save_pretrained` of the full weights, gathered on every process (FSDP2, ZeRO-3), written by the main one.
    Returns the gathered state dict (the main process's; None when nothing had to be gathered)."""

    unwrapped = accelerator.unwrap_model(model)
    state_dict = accelerator.get_state_dict(model) if engine.sharded else None
    if accelerator.is_main_process:
        check_finite(unwrapped if state_dict is None else state_dict)
        unwrapped.save_pretrained(folder, **({} if state_dict is None else
                                              {"state_dict": _without_tied(unwrapped, state_dict)}))
        if tokenizer is not None:
            tokenizer.save_pretrained(folder)
    accelerator.wait_for_everyone()
    return state_dict


def _without_tied(model, state_dict: dict) -> dict:
    """A gathered state dict holds tied weights (lm_head = embeddings) as separate tensors, so save_pretrained
    cannot see the tie and would save both: keep the first name of each shared parameter only."""
    seen, tied = set(), set()
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in seen:
            tied.add(name)
        seen.add(id(param))
    return {k: v for k, v in state_dict.items() if k not in tied}


def merged_copy(peft_model, state_dict=None):
    """A LoRA model with its adapters merged into a new plain model; from `state_dict` (gathered full weights) when
    the model's own are in pieces. Built with the model class itself; under ZeRO-3 call it inside
    `Engine.unpartitioned()` (or transformers partitions the new model too)."""
    import copy

    if state_dict is None:
        return copy.deepcopy(peft_model).merge_and_unload()
    from peft import get_peft_model

    base = peft_model.get_base_model()
    fresh = get_peft_model(type(base)(base.config), copy.deepcopy(peft_model.peft_config["default"]))
    fresh.to(next(iter(state_dict.values())).dtype).load_state_dict(state_dict, strict=True)
    return fresh.merge_and_unload()


def save_engine_state(accelerator, engine, model, optimizer, folder: Path, gathered: dict | None = None) -> None:
    """Write engine/ (see the module docstring); every process calls this. `gathered`: the full state dict
    save_pretrained just gathered (FSDP2's weights are taken from it rather than gathered again)."""
    names = [name for name, _ in trainable_parameters(accelerator.unwrap_model(model))]
    if engine.fsdp:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        osd = get_optimizer_state_dict(model, optimizer.optimizer,
                                       options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        gathered = gathered or {}  # the main process holds it; the others write nothing
        weights = {name: gathered[name] for name in names if name in gathered}
        tensors = {f"{name}::{key}": value for name, state in osd.get("state", {}).items()
                   for key, value in state.items() if torch.is_tensor(value)}
        scalars = {"param_groups": osd.get("param_groups", [])}
    else:
        weights, tensors, scalars = _deepspeed_states(accelerator, model)
    if accelerator.is_main_process:
        from safetensors.torch import save_file

        folder.mkdir(parents=True, exist_ok=True)
        save_file({k: v.detach().cpu().contiguous() for k, v in weights.items()}, str(folder / "weights.safetensors"))
        save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()},
                  str(folder / "optimizer.safetensors"))
        (folder / "optimizer.json").write_text(json.dumps(scalars, default=list))
    accelerator.wait_for_everyone()


def _deepspeed_base(model):
    return model.optimizer.optimizer  # DeepSpeedEngine -> ZeRO optimizer -> the torch optimizer over fp32 pieces


def _state_keys(model) -> list[str]:
    keys = set()
    for state in _deepspeed_base(model).state.values():
        keys.update(k for k, v in state.items() if torch.is_tensor(v) and v.dim() > 0)
    return sorted(keys)


def _deepspeed_states(accelerator, model):
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    weights, tensors = {}, {}
    keys = _state_keys(model)
    for name, param in trainable_parameters(accelerator.unwrap_model(model)):
        weights[name] = safe_get_full_fp32_param(param)
        for key in keys:
            tensors[f"{name}::{key}"] = safe_get_full_optimizer_state(param, key)
    base = _deepspeed_base(model)
    steps = [float(s["step"]) for s in base.state.values() if "step" in s]
    return weights, tensors, {"step": steps[0] if steps else None, "lr": [g["lr"] for g in base.param_groups]}


def load_engine_state(accelerator, engine, model, optimizer, folder: Path) -> None:
    """Read engine/ back into the sharded model and optimizer; every process calls this."""

    weights = load_safetensors(folder / "weights.safetensors")
    tensors = load_safetensors(folder / "optimizer.safetensors")
    scalars = load_json(folder / "optimizer.json")
    if engine.fsdp:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        options = StateDictOptions(full_state_dict=True, strict=False)
        set_model_state_dict(model, weights, options=options)
        state: dict = {}
        for flat, value in tensors.items():
            name, key = flat.rsplit("::", 1)
            state.setdefault(name, {})[key] = value
        set_optimizer_state_dict(model, optimizer.optimizer, {"state": state, "param_groups": scalars["param_groups"]},
                                 options=StateDictOptions(full_state_dict=True))
    else:
        _load_deepspeed(accelerator, model, weights, tensors, scalars)
    accelerator.wait_for_everyone()


def _load_deepspeed(accelerator, model, weights, tensors, scalars) -> None:
    import deepspeed
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

    base = _deepspeed_base(model)
    if tensors and not base.state:
        _create_optimizer_state(model)
    for name, param in trainable_parameters(accelerator.unwrap_model(model)):
        with deepspeed.zero.GatheredParameters([param], modifier_rank=0, enabled=hasattr(param, "ds_id")):
            param.data.copy_(weights[name].to(param.dtype))
        safe_set_full_fp32_param(param, weights[name].to(accelerator.device))
        for flat in (k for k in tensors if k.startswith(f"{name}::")):
            safe_set_full_optimizer_state(param, tensors[flat].to(accelerator.device), flat.rsplit("::", 1)[1])
    for state in base.state.values():
        if "step" in state and scalars.get("step") is not None:
            state["step"] = torch.full_like(torch.as_tensor(state["step"]), scalars["step"])
    for group, lr in zip(base.param_groups, scalars["lr"], strict=True):
        group["lr"] = lr


def _create_optimizer_state(model) -> None:
    """The torch optimizer under ZeRO creates its state at its first step: take one with zero gradients and a
    learning rate of 0 (weights unchanged), so the saved state has somewhere to go."""
    base = _deepspeed_base(model)
    rates = [group["lr"] for group in base.param_groups]
    for group in base.param_groups:
        group["lr"] = 0.0
    ids = torch.zeros(1, 1, dtype=torch.long, device=model.device)
    model.backward(model(input_ids=ids).logits.float().sum() * 0.0, scale_wrt_gas=False)
    model.step()
    relink_optimizer_state(model.optimizer)
    for group, lr in zip(base.param_groups, rates, strict=True):
        group["lr"] = lr


def relink_optimizer_state(zero) -> None:
    """ZeRO-1/2 link each parameter to its optimizer state after the first step, but already after the first
    param group's step, before the later groups have any state (transformers' decay / no-decay groups): link
    again once every group has stepped, so each parameter's full optimizer state can be read and written."""
    if getattr(zero, "_rlft_states_relinked", False) or not hasattr(zero, "_lazy_init_hp_params_optimizer_state"):
        return
    if all(zero.optimizer.state.get(p) for group in zero.optimizer.param_groups for p in group["params"]):
        zero._hp_optimizer_states_linked = False
        zero._lazy_init_hp_params_optimizer_state()
        zero._rlft_states_relinked = True
