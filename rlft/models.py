"""Load models and tokenizers, choose dtypes, apply LoRA, enable checkpointing, check gradients.

The same code loads a 0.5M-parameter test model and a 7B hub model: `from_pretrained` on a
folder or hub id, peft for adapters, transformers' own activation checkpointing.
"""

from __future__ import annotations

import logging
import math
from importlib import resources
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    PreTrainedModel,
)

logger = logging.getLogger("rlft")


class GradientFlowError(RuntimeError):
    """Trainable parameters that received no usable gradient after a backward pass."""


def shipped_policy_path() -> Path:
    """Folder of the warm-started tiny addition policy shipped inside the package."""
    return Path(str(resources.files("rlft") / "assets" / "tiny-adder"))


def resolve_dtype(dtype: str = "auto", bf16: bool | None = None, fp16: bool | None = None,
                  device: torch.device | None = None) -> torch.dtype:
    """'auto' -> bfloat16 on a GPU that supports it, float32 otherwise (CPU)."""
    if bf16:
        return torch.bfloat16
    if fp16:
        return torch.float16
    if dtype != "auto":
        return getattr(torch, dtype)
    on_gpu = (device.type == "cuda") if device is not None else torch.cuda.is_available()
    if on_gpu and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return torch.float32


def load_tokenizer(name_or_path: str | Path, padding_side: str = "left"):
    """AutoTokenizer with a pad token (eos when the tokenizer has none) and the requested padding side."""
    tokenizer = AutoTokenizer.from_pretrained(str(name_or_path))
    tokenizer.padding_side = padding_side
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ValueError(f"tokenizer at {name_or_path} has neither a pad nor an eos token; add a pad token "
                             "(tokenizer.add_special_tokens({'pad_token': ...})) and save it")
        logger.info("tokenizer has no pad token; using eos %r as pad", tokenizer.eos_token)
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_causal_lm(model: str | Path | PreTrainedModel, dtype: torch.dtype) -> PreTrainedModel:
    if isinstance(model, torch.nn.Module):
        return model
    return AutoModelForCausalLM.from_pretrained(str(model), dtype=dtype)


def load_sequence_classifier(model: str | Path | PreTrainedModel, dtype: torch.dtype,
                             pad_token_id: int | None) -> PreTrainedModel:
    if not isinstance(model, torch.nn.Module):
        model = AutoModelForSequenceClassification.from_pretrained(str(model), num_labels=1, dtype=dtype)
    if pad_token_id is not None:
        model.config.pad_token_id = pad_token_id
    return model


def lora_config_from(cfg, task_type: str):
    """A peft LoraConfig from TRL ModelConfig-style fields (use_peft, lora_r, ...)."""
    from peft import LoraConfig

    return LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                      target_modules=cfg.lora_target_modules, task_type=cfg.lora_task_type or task_type)


def apply_lora(model, peft_config, expected_task_type: str):
    """Wrap `model` with LoRA adapters; a config without task_type gets `expected_task_type`."""
    from peft import PeftModel, get_peft_model

    if isinstance(model, PeftModel):
        return model
    if peft_config is None:
        return model
    task_type = getattr(peft_config, "task_type", None)
    task_type = getattr(task_type, "value", task_type)
    if task_type != expected_task_type:
        logger.warning("peft_config.task_type=%r; rlft sets it to %r for this model", task_type, expected_task_type)
        peft_config.task_type = expected_task_type
    return get_peft_model(model, peft_config)


def enable_checkpointing(model, kwargs: dict | None = None) -> None:
    """Activation checkpointing that works with LoRA, reentrant or not.

    With reentrant checkpointing a block whose inputs do not require grad produces outputs that
    do not either, and with frozen embeddings (LoRA) the loss ends up with no grad_fn ("element
    0 of tensors does not require grad"). `enable_input_require_grads` makes the embedding output
    require grad, which fixes it for both variants.
    """
    kwargs = {"use_reentrant": False, **(kwargs or {})}
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    enable = getattr(base, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs=kwargs)
    else:  # transformers < 5.2x
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    base.enable_input_require_grads()
    base.config.use_cache = False


def trainable_parameters(model) -> list[tuple[str, torch.nn.Parameter]]:
    return [(name, p) for name, p in model.named_parameters() if p.requires_grad]


def parameter_summary(model) -> dict:
    trainable = trainable_parameters(model)
    total = sum(p.numel() for p in model.parameters())
    count = sum(p.numel() for _, p in trainable)
    return {"trainable": count, "total": total, "trainable_fraction": count / max(total, 1),
            "trainable_tensors": len(trainable)}


def check_gradient_flow(model) -> None:
    """After a backward pass: every trainable parameter must hold a finite, non-zero gradient."""
    trainable = trainable_parameters(model)
    if not trainable:
        raise GradientFlowError(
            "the model has no trainable parameters. Likely cause: every parameter was frozen "
            "(requires_grad=False) or LoRA target_modules matched nothing; check lora_target_modules.")
    missing, zero, nonfinite = [], [], []
    for name, param in trainable:
        if param.grad is None:
            missing.append(name)
            continue
        norm = param.grad.detach().float().norm().item()
        if not math.isfinite(norm):
            nonfinite.append(name)
        elif norm == 0.0:
            zero.append(name)
    problems = []
    if missing:
        problems.append(f"{len(missing)} got no gradient at all (e.g. {missing[:3]}): they are not connected "
                        "to the loss (unused module, detached graph, or checkpointing without input grads)")
    if nonfinite:
        problems.append(f"{len(nonfinite)} got inf/NaN gradients (e.g. {nonfinite[:3]}): lower the learning "
                        "rate or use float32/bfloat16 instead of float16")
    if zero and len(zero) == len(trainable):
        problems.append(f"all {len(zero)} got exactly zero gradients (e.g. {zero[:3]}): the loss does not "
                        "depend on them (all advantages zero, or every completion masked)")
    if problems:
        raise GradientFlowError("gradient check after the first backward failed: " + "; ".join(problems))
