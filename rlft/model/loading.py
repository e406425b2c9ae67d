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

from rlft.errors import ConfigError, RlftError
from rlft.quiet import known_noise

logger = logging.getLogger("rlft")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.txt", "vocab.json")


class ModelFileError(ConfigError):
    """A model file that cannot be read (truncated, corrupt); the message names the file and what to
    do."""


def bad_weight_files(folder: Path) -> list[str]:
    """'<file>: <why>' for each safetensors file in `folder` whose header cannot be read."""
    from safetensors import safe_open

    problems = []
    for path in sorted(Path(folder).glob("*.safetensors")):
        try:
            with safe_open(str(path), framework="pt") as handle:
                handle.keys()
        except Exception as err:  # safetensors raises its own error type for a malformed header
            problems.append(f"{path}: {err}")
    return problems


def from_pretrained(auto_class, source, **kwargs):
    """`auto_class.from_pretrained`, with a truncated or corrupt weight file named (transformers'
    error does not)."""
    try:
        return auto_class.from_pretrained(str(source), **kwargs)
    except Exception as err:
        if "safetensor" not in type(err).__name__.lower() and "deserializ" not in str(err):
            raise
        folder = Path(str(source))
        problems = bad_weight_files(folder) if folder.is_dir() else []
        shown = "; ".join(problems) or f"{source}: {err}"
        raise ModelFileError(f"the model's weights cannot be read: {shown}. The file is truncated "
                             "or corrupt (an interrupted download or copy): download or copy it "
                             "again, or re-save the model") from err


class GradientFlowError(RlftError, RuntimeError):
    """Trainable parameters that received no usable gradient after a backward pass."""


def shipped_policy_path(name: str = "tiny-adder") -> Path:
    """Folder of a warm-started tiny policy shipped inside the package: tiny-adder (the addition
    task) or tiny-calculator (the same task with an add tool,
    examples/build_tiny_tool_policy.py)."""
    return Path(str(resources.files("rlft") / "assets" / name))


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


def training_dtype(args, device: torch.device | None = None) -> torch.dtype:
    """The dtype the weights load and train in: `model_init_kwargs["dtype"]` when given (not
    "auto"), else bf16 / fp16, else float32 (the config resolves bf16=None to the device's:
    rlft/config/checks.py)."""
    asked = (args.model_init_kwargs or {}).get("dtype", (args.model_init_kwargs or {}).get("torch_dtype"))
    if isinstance(asked, torch.dtype):
        return asked
    if asked not in (None, "auto"):
        if asked not in ("float32", "bfloat16", "float16", "float64"):
            raise ConfigError(f"model_init_kwargs dtype={asked!r}: use 'auto', 'float32', "
                              "'bfloat16' or 'float16' ('float64' for runs that check arithmetic, "
                              "slowly)")
        return getattr(torch, asked)
    return resolve_dtype("auto", args.bf16, args.fp16, device)


def check_quantization(init_kwargs: dict) -> None:
    """bitsandbytes k-bit loading (quantization_config, load_in_4bit/8bit) needs its package and a
    CUDA GPU: say so before transformers fails deep inside from_pretrained."""
    quantization = init_kwargs.get("quantization_config")
    if quantization is None:
        return
    import importlib.util

    method = getattr(quantization, "quant_method", None) or (quantization.get("quant_method")
                                                             if isinstance(quantization, dict) else None)
    if str(getattr(method, "value", method)) != "bitsandbytes":
        return
    missing = importlib.util.find_spec("bitsandbytes") is None
    if missing or not torch.cuda.is_available():
        where = "the bitsandbytes package is not installed" + ("" if torch.cuda.is_available() else
                                                               " and this machine has no CUDA GPU") \
            if missing else "this machine has no CUDA GPU"
        raise ConfigError("quantization_config asks for bitsandbytes k-bit weights (QLoRA: "
                         "load_in_4bit / load_in_8bit), which need bitsandbytes and a CUDA GPU; "
                         f"{where}. Train without "
                         "quantization here (LoRA on full-precision weights), or run on a GPU "
                         "machine with `pip install bitsandbytes`")


def load_tokenizer(name_or_path: str | Path, padding_side: str = "left", trust_remote_code: bool = False):
    """AutoTokenizer with a pad token (eos when the tokenizer has none) and the requested padding
    side."""
    path = Path(str(name_or_path))
    if path.is_dir() and not any((path / f).exists() for f in TOKENIZER_FILES):
        raise FileNotFoundError(f"{path} holds no tokenizer files "
                                f"({', '.join(TOKENIZER_FILES[:3])}, ...): "
                                "save the tokenizer beside the model (tokenizer.save_pretrained) "
                                "or pass processing_class=")
    _check_model_path(name_or_path)
    tokenizer = AutoTokenizer.from_pretrained(str(name_or_path), trust_remote_code=trust_remote_code)
    tokenizer.padding_side = padding_side
    return ensure_pad_token(tokenizer, str(name_or_path))


def _looks_local(name: str) -> bool:
    return name.startswith((".", "/", "~")) or name.count("/") > 1 or name.endswith((".json", ".safetensors"))


def ensure_pad_token(tokenizer, where: str = "the tokenizer"):
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ValueError(f"tokenizer of {where} has neither a pad nor an eos token; add a pad "
                             "token (tokenizer.add_special_tokens({'pad_token': ...})) "
                             "or set pad_token in the config")
        logger.info("tokenizer has no pad token; using eos %r as pad", tokenizer.eos_token)
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def prepare_tokenizer(processing_class, source, args, padding_side: str):
    """The run's tokenizer: the one passed in or loaded from `source`, with the config's
    chat_template_path, pad_token and eos_token applied, and a pad token guaranteed."""
    if processing_class is None:
        if source is None:
            raise ValueError("the model object has no name_or_path to load a tokenizer from: "
                             "pass processing_class=")
        processing_class = load_tokenizer(source, padding_side, args.trust_remote_code)
    # a processor wraps its tokenizer
    tokenizer = getattr(processing_class, "tokenizer", processing_class)
    tokenizer.padding_side = padding_side
    if args.chat_template_path:
        template = Path(args.chat_template_path)
        if template.is_dir():
            template = template / "chat_template.jinja"
        if not template.is_file():
            raise FileNotFoundError(f"chat_template_path={args.chat_template_path!r}: no such "
                                    "template file")
        tokenizer.chat_template = template.read_text()
    for field in ("pad_token", "eos_token"):
        value = getattr(args, field)
        if value:
            _check_in_vocabulary(tokenizer, field, value, source)
            setattr(tokenizer, field, value)
    return ensure_pad_token(tokenizer, str(source))


def _check_in_vocabulary(tokenizer, field: str, value: str, source) -> None:
    """A pad / eos token the vocabulary lacks would have no id (transformers sets it all the
    same)."""
    token_id = tokenizer.convert_tokens_to_ids(value)
    if token_id is None or (token_id == tokenizer.unk_token_id and value != tokenizer.unk_token):
        raise ConfigError(f"{field}={value!r} is not a token of the tokenizer of {source}: name "
                          f"one it has (its eos token is {tokenizer.eos_token!r}), or add it to "
                          "the tokenizer (tokenizer.add_special_tokens) and resize the model's "
                          "embeddings, then pass processing_class=")


def _init_kwargs(dtype: torch.dtype, model_init_kwargs: dict | None, trust_remote_code: bool) -> dict:
    """from_pretrained's keyword arguments; `dtype` is the one `training_dtype` resolved."""
    extra = {k: v for k, v in (model_init_kwargs or {}).items() if k not in ("dtype", "torch_dtype")}
    kwargs = {"trust_remote_code": trust_remote_code, **extra, "dtype": dtype}
    check_quantization(kwargs)
    if kwargs.get("quantization_config") is not None and "device_map" not in kwargs:
        from rlft.config.model_config import get_kbit_device_map

        kwargs["device_map"] = get_kbit_device_map()
    return kwargs


def _check_model_path(model) -> None:
    if not Path(str(model)).exists() and _looks_local(str(model)):
        raise FileNotFoundError(f"model path {model} does not exist (and is not a hub id "
                                "'org/name')")


def load_causal_lm(model, dtype: torch.dtype, model_init_kwargs: dict | None = None,
                   trust_remote_code: bool = False) -> PreTrainedModel:
    if isinstance(model, torch.nn.Module):
        if model_init_kwargs:
            raise ValueError("model_init_kwargs only applies when the model is given as a name or "
                             "path; the model passed in is already loaded")
        return model
    _check_model_path(model)
    return from_pretrained(AutoModelForCausalLM, model,
                           **_init_kwargs(dtype, model_init_kwargs, trust_remote_code))


def load_sequence_classifier(model, dtype: torch.dtype, pad_token_id: int | None,
                             model_init_kwargs: dict | None = None,
                             trust_remote_code: bool = False) -> PreTrainedModel:
    if not isinstance(model, torch.nn.Module):
        _check_model_path(model)
        kwargs = {"num_labels": 1, **_init_kwargs(dtype, model_init_kwargs, trust_remote_code)}
        model = from_pretrained(AutoModelForSequenceClassification, model, **kwargs)
    check_single_score(model)
    if pad_token_id is not None:
        model.config.pad_token_id = pad_token_id
    return model


def check_single_score(model) -> None:
    """A Bradley-Terry reward model outputs one score per sequence."""
    labels = getattr(model.config, "num_labels", 1)
    if labels != 1:
        raise ValueError(f"reward models require `num_labels=1`; this one has num_labels={labels} "
                         "(one score per sequence is what Bradley-Terry trains). "
                         "Load it with AutoModelForSequenceClassification.from_pretrained(..., "
                         "num_labels=1)")


def context_length(model, trust_remote_code: bool = False) -> int | None:
    from transformers import AutoConfig

    if hasattr(model, "config"):
        config = model.config
    else:
        _check_model_path(model)
        config = AutoConfig.from_pretrained(str(model), trust_remote_code=trust_remote_code)
    return getattr(config, "max_position_embeddings", None)


def disable_dropout(model) -> None:
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0


def cast_lm_head_to_fp32(model) -> None:
    """ScaleRL's float32 LM head (arXiv:2510.13786): the head's weights and its input in float32, so
    the logits behind the log-probs are computed in full precision. A head tied to the input
    embeddings (TRL's rule) makes the shared weight float32; the embeddings' output is cast back to
    the model's dtype, so only the logits change precision."""
    head = model.get_output_embeddings()
    original = head.weight.dtype
    head.float()
    head.register_forward_pre_hook(lambda module, inputs: tuple(x.float() for x in inputs))
    if getattr(model.config, "tie_word_embeddings", False) and original != torch.float32:
        model.get_input_embeddings().register_forward_hook(lambda module, inputs, output: output.to(original))


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
        logger.warning("peft_config.task_type=%r; rlft sets it to %r for this model", task_type,
                       expected_task_type)
        peft_config.task_type = expected_task_type
    with known_noise():  # peft reads transformers' deprecated is_gradient_checkpointing
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


def router_loss_coef(model, asked: float | None) -> float:
    """A Mixture-of-Experts policy's router load-balancing coefficient (TRL's rule): the config's
    own `router_aux_loss_coef` unless asked otherwise; 0 for a model without router logits (asking
    is then an error)."""
    config = getattr(model, "config", None)
    config = getattr(config, "text_config", None) or config
    moe = hasattr(config, "output_router_logits")
    if asked and not moe:
        raise ConfigError(f"router_aux_loss_coef={asked} is set but {type(model).__name__} is not "
                          "a Mixture-of-Experts model (its config has no output_router_logits); "
                          "leave router_aux_loss_coef unset")
    if not moe:
        return 0.0
    return float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0) if asked is None else float(asked)


def trainable_parameters(model) -> list[tuple[str, torch.nn.Parameter]]:
    return [(name, p) for name, p in model.named_parameters() if p.requires_grad]


def full_numel(param) -> int:
    """A parameter's full size, also under ZeRO-3 (whose local tensors are empty)."""
    return int(getattr(param, "ds_numel", param.numel()))


def parameter_summary(model) -> dict:
    trainable = trainable_parameters(model)
    total = sum(full_numel(p) for p in model.parameters())
    count = sum(full_numel(p) for _, p in trainable)
    return {"trainable": count, "total": total, "trainable_fraction": count / max(total, 1),
            "trainable_tensors": len(trainable)}


def check_gradient_flow(model_or_grads) -> None:
    """After a backward pass: every trainable parameter must hold a finite, non-zero gradient. Takes
    a model (its param.grad) or (name, full gradient) pairs (rlft/train/engines/:
    TrainingEngine.grads, for DeepSpeed)."""
    if isinstance(model_or_grads, torch.nn.Module):
        grads = [(name, p.grad) for name, p in trainable_parameters(model_or_grads)]
    else:
        grads = list(model_or_grads)
    trainable = grads
    if not trainable:
        raise GradientFlowError(
            "the model has no trainable parameters. Likely cause: every parameter was frozen "
            "(requires_grad=False) or LoRA target_modules matched nothing; check "
            "lora_target_modules.")
    missing, zero, nonfinite = [], [], []
    for name, grad in grads:
        if grad is None:
            missing.append(name)
            continue
        norm = grad.detach().float().norm().item()
        if not math.isfinite(norm):
            nonfinite.append(name)
        elif norm == 0.0:
            zero.append(name)
    problems = []
    if missing:
        problems.append(f"{len(missing)} got no gradient at all (e.g. {missing[:3]}): they are not "
                        "connected to the loss (unused module, detached graph, or checkpointing "
                        "without input grads)")
    if nonfinite:
        problems.append(f"{len(nonfinite)} got inf/NaN gradients (e.g. {nonfinite[:3]}): lower the "
                        "learning rate or use float32/bfloat16 instead of float16")
    if zero and len(zero) == len(trainable):
        problems.append(f"all {len(zero)} got exactly zero gradients (e.g. {zero[:3]}): the loss "
                        "does not depend on them (all advantages zero, or every completion masked)")
    if problems:
        raise GradientFlowError("gradient check after the first backward failed: " + "; ".join(problems))
