"""TRL's `ModelConfig` (which model, its dtype, LoRA, k-bit loading) and the helpers scripts build
from it: `get_peft_config`, `get_quantization_config`, `get_kbit_device_map`.

One deliberate difference: `dtype` defaults to "auto", rlft's meaning: the precision rlft trains in
(bf16/fp16 when set, else bfloat16 on a GPU that has it, float32 on a CPU). TRL's "float32" default
pairs float32 weights with bf16 autocast; rlft trains in the weights' own dtype, so a float32
default would train in float32 on a GPU (docs/migration.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rlft.errors import ConfigError

MODEL_DTYPES = ("auto", "bfloat16", "float16", "float32")
# peft takes target modules as a list of names or one string ("all-linear", a regex), as a YAML
# gives it.
WIDER_TYPES = {"lora_target_modules": str | list[str] | None}


@dataclass
class ModelConfig:
    """The model and how to adapt it (TRL's names): `model_name_or_path`, `dtype`, LoRA and k-bit
    fields."""

    model_name_or_path: str | None = field(
        default=None, metadata={"help": "policy (GRPO) or reward model: a local folder or a hub "
                                        "id"})
    model_revision: str = field(
        default="main", metadata={"help": "the model's hub revision (branch, tag or commit)"})
    dtype: str | None = field(
        default="auto", metadata={"help": "weights dtype: auto (bf16/fp16 when set, else bfloat16 "
                                          "on a GPU that has it, else float32), float32, bfloat16, "
                                          "float16"})
    attn_implementation: str | None = field(
        default=None, metadata={"help": "transformers' attention implementation (eager, sdpa, "
                                        "flash_attention_2, ...)"})
    use_peft: bool = field(default=False, metadata={"help": "train LoRA adapters instead of all "
                                                            "weights"})
    lora_r: int = field(default=16, metadata={"help": "LoRA rank"})
    lora_alpha: int = field(default=32, metadata={"help": "LoRA scaling numerator (scale = alpha / "
                                                          "r)"})
    lora_dropout: float = field(
        default=0.05, metadata={"help": "dropout on the LoRA path (set 0 with use_vllm: see "
                                        "disable_dropout)"})
    lora_target_modules: list[str] | None = field(
        default=None, metadata={"help": "module names to adapt, or all-linear (default: peft's "
                                        "per-architecture choice)"})
    lora_target_parameters: list[str] | None = field(
        default=None, metadata={"help": "parameter names to adapt (peft's target_parameters, e.g. "
                                        "MoE experts)"})
    lora_modules_to_save: list[str] | None = field(
        default=None, metadata={"help": "modules trained in full beside the adapters"})
    lora_task_type: str = field(
        default="CAUSAL_LM", metadata={"help": "peft task type; rlft sets CAUSAL_LM (GRPO) / "
                                               "SEQ_CLS (reward, trains the head)"})
    use_rslora: bool = field(default=False, metadata={"help": "rank-stabilised LoRA: scale alpha / "
                                                              "sqrt(r)"})
    use_dora: bool = field(default=False, metadata={"help": "DoRA: weight-decomposed LoRA"})
    load_in_8bit: bool = field(
        default=False, metadata={"help": "bitsandbytes 8-bit base weights (LoRA only; needs a CUDA "
                                         "GPU)"})
    load_in_4bit: bool = field(
        default=False, metadata={"help": "bitsandbytes 4-bit base weights, QLoRA (LoRA only; needs "
                                         "a CUDA GPU)"})
    bnb_4bit_quant_type: str = field(
        default="nf4", metadata={"help": "4-bit quantisation type: nf4 or fp4", "choices": ["fp4", "nf4"]}
    )
    use_bnb_nested_quant: bool = field(
        default=False, metadata={"help": "nested (double) quantisation of the 4-bit constants"})
    bnb_4bit_quant_storage: str | None = field(
        default=None, metadata={"help": "storage dtype of the 4-bit weights"})

    def __post_init__(self):
        from rlft.config.recipe_types import check_field_types

        check_field_types(self, WIDER_TYPES)  # the checks below assume the types are right
        errors = []
        if self.load_in_8bit and self.load_in_4bit:
            errors.append("load_in_8bit and load_in_4bit are both true: pick one")
        if self.dtype is not None and self.dtype not in MODEL_DTYPES:
            errors.append(
                f"dtype={self.dtype!r} is not allowed; choose one of "
                f"{', '.join(map(repr, MODEL_DTYPES))}"
            )
        if not 0 <= self.lora_dropout < 1:
            errors.append(f"lora_dropout={self.lora_dropout!r} must be in [0, 1)")
        if self.lora_r <= 0:
            errors.append(f"lora_r={self.lora_r!r} must be > 0")
        if errors:
            raise ConfigError("invalid ModelConfig:\n  - " + "\n  - ".join(errors))
        if isinstance(self.lora_target_modules, list) and len(self.lora_target_modules) == 1:
            # ["all-linear"] -> "all-linear", as TRL
            self.lora_target_modules = self.lora_target_modules[0]


def get_peft_config(model_args: ModelConfig):
    """A peft `LoraConfig` from the LoRA fields, or None without use_peft."""
    if not model_args.use_peft:
        return None
    from peft import LoraConfig

    extra = (
        {}
        if model_args.lora_target_parameters is None
        else {"target_parameters": model_args.lora_target_parameters}
    )
    return LoraConfig(
        task_type=model_args.lora_task_type,
        r=model_args.lora_r,
        lora_alpha=model_args.lora_alpha,
        lora_dropout=model_args.lora_dropout,
        target_modules=model_args.lora_target_modules,
        bias="none",
        use_rslora=model_args.use_rslora,
        use_dora=model_args.use_dora,
        modules_to_save=model_args.lora_modules_to_save,
        **extra,
    )


def get_quantization_config(model_args: ModelConfig):
    """A transformers `BitsAndBytesConfig` for load_in_4bit / load_in_8bit, else None. Building one
    needs no GPU; loading a model with it does (rlft/model/loading.py says so clearly where it
    cannot run)."""
    from transformers import BitsAndBytesConfig

    if model_args.load_in_4bit:
        compute = None if model_args.dtype in (None, "auto") else model_args.dtype
        return BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_compute_dtype=compute,
            bnb_4bit_quant_type=model_args.bnb_4bit_quant_type,
            bnb_4bit_use_double_quant=model_args.use_bnb_nested_quant,
            bnb_4bit_quant_storage=model_args.bnb_4bit_quant_storage,
        )
    if model_args.load_in_8bit:
        return BitsAndBytesConfig(load_in_8bit=True)
    return None


def get_kbit_device_map() -> dict[str, int] | None:
    """Where a k-bit model loads: this process's GPU ({"": local index}), or None without one."""
    import torch

    if not torch.cuda.is_available():
        return None
    from accelerate import PartialState

    return {"": PartialState().local_process_index}


def _loading_kwargs(model_args: ModelConfig) -> dict[str, Any]:
    """Attention and dtype from ModelConfig, as TRL's scripts pass them to both models."""
    kwargs: dict[str, Any] = {}
    if model_args.attn_implementation is not None:
        kwargs["attn_implementation"] = model_args.attn_implementation
    if model_args.dtype not in (None, "auto"):
        kwargs["dtype"] = model_args.dtype
    return kwargs


def model_init_kwargs(model_args: ModelConfig, training_args) -> dict | None:
    """TRL's scripts' model_init_kwargs: revision, attention, dtype from ModelConfig, then
    training_args'."""
    kwargs = _loading_kwargs(model_args)
    if model_args.model_revision != "main":
        kwargs["revision"] = model_args.model_revision
    kwargs.update(training_args.model_init_kwargs or {})
    return kwargs or None


def teacher_init_kwargs(model_args: ModelConfig, training_args) -> dict | None:
    """`trl distillation`'s teacher kwargs: attention and dtype from ModelConfig, then
    teacher_model_init_kwargs (the revision is teacher_model_revision's); a served teacher loads
    none."""
    if training_args.teacher_model_server_url:
        return training_args.teacher_model_init_kwargs
    kwargs = {**_loading_kwargs(model_args), **(training_args.teacher_model_init_kwargs or {})}
    return kwargs or None

