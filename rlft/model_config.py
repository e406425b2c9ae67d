"""TRL's `ModelConfig` (which model, its dtype, LoRA, k-bit loading) and the helpers scripts build from it:
`get_peft_config`, `get_quantization_config`, `get_kbit_device_map`.

One deliberate difference: `dtype` defaults to "auto", rlft's meaning: the precision rlft trains in
(bf16/fp16 when set, else bfloat16 on a GPU that has it, float32 on a CPU). TRL's "float32" default
pairs float32 weights with bf16 autocast; rlft trains in the weights' own dtype, so a float32 default
would train in float32 on a GPU (docs/migration.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rlft.config_help import FIELD_HELP
from rlft.errors import ConfigError

MODEL_DTYPES = ("auto", "bfloat16", "float16", "float32")


def _help(name: str) -> dict:
    return {"help": FIELD_HELP.get(name, "")}


@dataclass
class ModelConfig:
    """The model and how to adapt it (TRL's names): `model_name_or_path`, `dtype`, LoRA and k-bit fields."""

    model_name_or_path: str | None = field(default=None, metadata=_help("model_name_or_path"))
    model_revision: str = field(default="main", metadata=_help("model_revision"))
    dtype: str | None = field(default="auto", metadata=_help("dtype"))
    attn_implementation: str | None = field(default=None, metadata=_help("attn_implementation"))
    use_peft: bool = field(default=False, metadata=_help("use_peft"))
    lora_r: int = field(default=16, metadata=_help("lora_r"))
    lora_alpha: int = field(default=32, metadata=_help("lora_alpha"))
    lora_dropout: float = field(default=0.05, metadata=_help("lora_dropout"))
    lora_target_modules: list[str] | None = field(default=None, metadata=_help("lora_target_modules"))
    lora_target_parameters: list[str] | None = field(default=None, metadata=_help("lora_target_parameters"))
    lora_modules_to_save: list[str] | None = field(default=None, metadata=_help("lora_modules_to_save"))
    lora_task_type: str = field(default="CAUSAL_LM", metadata=_help("lora_task_type"))
    use_rslora: bool = field(default=False, metadata=_help("use_rslora"))
    use_dora: bool = field(default=False, metadata=_help("use_dora"))
    load_in_8bit: bool = field(default=False, metadata=_help("load_in_8bit"))
    load_in_4bit: bool = field(default=False, metadata=_help("load_in_4bit"))
    bnb_4bit_quant_type: str = field(
        default="nf4", metadata={**_help("bnb_4bit_quant_type"), "choices": ["fp4", "nf4"]}
    )
    use_bnb_nested_quant: bool = field(default=False, metadata=_help("use_bnb_nested_quant"))
    bnb_4bit_quant_storage: str | None = field(default=None, metadata=_help("bnb_4bit_quant_storage"))

    def __post_init__(self):
        errors = []
        if self.load_in_8bit and self.load_in_4bit:
            errors.append("load_in_8bit and load_in_4bit are both true: pick one")
        if self.dtype is not None and self.dtype not in MODEL_DTYPES:
            errors.append(
                f"dtype={self.dtype!r} is not allowed; choose one of {', '.join(map(repr, MODEL_DTYPES))}"
            )
        if not 0 <= self.lora_dropout < 1:
            errors.append(f"lora_dropout={self.lora_dropout!r} must be in [0, 1)")
        if self.lora_r <= 0:
            errors.append(f"lora_r={self.lora_r!r} must be > 0")
        if errors:
            raise ConfigError("invalid ModelConfig:\n  - " + "\n  - ".join(errors))
        if isinstance(self.lora_target_modules, list) and len(self.lora_target_modules) == 1:
            self.lora_target_modules = self.lora_target_modules[0]  # ["all-linear"] -> "all-linear", as TRL


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
    """A transformers `BitsAndBytesConfig` for load_in_4bit / load_in_8bit, else None. Building one needs
    no GPU; loading a model with it does (rlft/models.py says so clearly where it cannot run)."""
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
