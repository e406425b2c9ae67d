"""The GRPO policy as it is loaded: weights in the training dtype, scored through the fused LM head,
LoRA when asked, dropout and checkpointing as configured, checked trainable; and its reference
policy (none at beta 0; LoRA's base with the adapters off; otherwise a frozen copy, loaded again
under ZeRO-3)."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch
from peft import PeftModel

from rlft.errors import ConfigError
from rlft.model import routing
from rlft.model.loading import (
    GradientFlowError,
    apply_lora,
    cast_lm_head_to_fp32,
    disable_dropout,
    load_causal_lm,
    parameter_summary,
    router_loss_coef,
    training_dtype,
)
from rlft.model.memory import apply_memory
from rlft.model.scoring import install_scoring


@dataclass
class Policy:
    model: torch.nn.Module
    reference: torch.nn.Module | None
    is_peft: bool
    param_summary: dict
    router_aux_loss_coef: float
    notes: list[str] = field(default_factory=list)  # said when training starts


def add_model_tags(model, tags: list[str]) -> None:
    """TRL's tags (so hub filters for TRL-trained models find these too) and rlft's."""
    add = getattr(model, "add_model_tags", None)
    if add is not None:
        add(list(tags))


def load_policy(model, source, args, engine, device, peft_config, quantization_config, tags,
                routes_recorded: bool = False) -> Policy:
    """The policy (and its reference) from a hub id, a folder or a loaded model, for
    `engine.prepare`; `routes_recorded`: the rollout engine records a MoE policy's routes
    (routing_replay)."""
    dtype = training_dtype(args, device)
    engine.before_loading(dtype)
    quantization = {} if quantization_config is None else {"quantization_config": quantization_config}
    init_kwargs = {**(args.model_init_kwargs or {}), **quantization}
    model = load_causal_lm(model, dtype, init_kwargs, args.trust_remote_code)
    # log-probs from hidden states through the LM head in tiles (rlft/model/scoring.py)
    install_scoring(model)
    if args.cast_lm_head_to_fp32:
        cast_lm_head_to_fp32(model)
    replays, note = routing.resolve(getattr(args, "routing_replay", "none"), model, routes_recorded)
    if replays:  # the trainer routes as the sampler did (rlft/model/routing.py)
        routing.install(model)
    model = apply_lora(model, peft_config, "CAUSAL_LM")
    add_model_tags(model, tags)
    coef, notes = router_loss_coef(model, args.router_aux_loss_coef), [note] if note else []
    if args.disable_dropout:  # after LoRA: its adapters' dropout too
        disable_dropout(model)
    elif args.use_vllm and args.vllm_importance_sampling_correction and any(
            isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules()):
        notes.append("dropout is on (lora_dropout or the model's own) while vLLM samples without "
                     "it: the sampling correction then also weighs dropout noise, and the "
                     "sampling/ mismatch metrics show it although the weights match. Set "
                     "disable_dropout: true for vLLM runs")
    is_peft = isinstance(model, PeftModel)
    _check(model, args, is_peft)
    notes += apply_memory(model, args, device)  # checkpointing, chunked MLPs, offloading, trimming
    summary = parameter_summary(model)
    if summary["trainable"] == 0:
        raise GradientFlowError("the model has no trainable parameters (all requires_grad=False); "
                                "unfreeze them or pass a peft_config whose target_modules match "
                                "the model")
    reference = reference_policy(model, source, args, engine, dtype, is_peft)
    return Policy(model, reference, is_peft, summary, coef, notes)


def _check(model, args, is_peft: bool) -> None:
    if args.sync_ref_model and is_peft:
        raise ConfigError("sync_ref_model=True with a LoRA model: the reference is the base model "
                          "under the adapters, not a copy that can move; use full fine-tuning or "
                          "sync_ref_model: false")
    if next(model.parameters()).dtype == torch.float16 and not is_peft:
        raise ConfigError("float16 full fine-tuning is refused: AdamW would keep float16 state and "
                          "overflow within a step (inf/NaN weights). Use bf16 / dtype: bfloat16, "
                          "float32, or LoRA")


def reference_policy(model, source, args, engine, dtype, is_peft: bool):
    """Reference policy: none at beta 0; LoRA's base with adapters off; else a frozen copy. Under
    ZeRO-3 the loaded weights are already in pieces, so the reference is loaded again (sharded the
    same way)."""
    if args.kl_coef == 0 or is_peft:
        return None
    if args.sync_ref_model and engine.sharded:
        raise ConfigError(f"sync_ref_model under {engine.name}: moving a reference whose weights "
                          "are in pieces is not built; use DDP, or sync_ref_model: false")
    if not engine.partitions_on_load:
        return copy.deepcopy(model).eval().requires_grad_(False)
    if source is None or isinstance(source, torch.nn.Module):
        raise ConfigError("ZeRO-3 full fine-tuning with beta > 0 loads the reference model a "
                          "second time: pass the model as a hub id or folder, not a loaded model "
                          "object")
    reference = load_causal_lm(source, dtype, args.model_init_kwargs, args.trust_remote_code)
    install_scoring(reference)
    return reference.eval().requires_grad_(False)
