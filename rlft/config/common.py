"""What every rlft config shares: the `config_class` decorator (a dataclass whose fields carry their
argparse help, inherited where a subclass only changes a default) and `_BaseConfig`, the
TrainingArguments subclass with TRL's defaults that GRPOConfig, RLOOConfig, AsyncGRPOConfig,
RewardConfig and SFTConfig extend (rlft/config/classes.py).

Each field rlft declares says what it does in `metadata={"help": ...}` beside its default;
HfArgumentParser shows it in `rlft grpo --help`. Fields of TrainingArguments that rlft does not
declare keep transformers' help.
"""

import types
from dataclasses import dataclass
from functools import cached_property

import torch
from transformers import TrainingArguments

from rlft.config.checks import check_common, normalize_before, normalize_common, validate
from rlft.config.compat import TRAINING_ARGUMENTS
from rlft.config.options import NON_NEGATIVE, POSITIVE, option, take_facts


def _inherited_help(cls: type, name: str) -> str | None:
    for base in cls.__mro__[1:]:
        inherited = getattr(base, "__dataclass_fields__", {}).get(name)
        if inherited is not None and inherited.metadata.get("help"):
            return inherited.metadata["help"]
    return None


def config_class(cls: type) -> type:
    """`dataclass(cls)`, then for each field `cls` declares itself: its help with "%" escaped for
    argparse, or, where it gives none (a subclass that only changes a default), the help of the same
    field in the nearest base class that has one; then the facts each `option(...)` declared move to
    the class (`take_facts`). Only the "help" key stays in a field's metadata: HfArgumentParser
    passes the others to `add_argument`."""
    cls = dataclass(cls)
    for f in cls.__dataclass_fields__.values():
        if any(getattr(base, "__dataclass_fields__", {}).get(f.name) is f for base in cls.__mro__[1:]):
            continue  # declared by a base class, already done there
        text = f.metadata.get("help")
        text = text.replace("%", "%%") if text else _inherited_help(cls, f.name)
        if text:
            f.metadata = types.MappingProxyType({**f.metadata, "help": text})
    take_facts(cls)
    return cls


@config_class
class _BaseConfig(TrainingArguments):
    """What every rlft config changes in TrainingArguments (TRL's defaults) and adds to it."""

    inherited_facts = TRAINING_ARGUMENTS  # the checks and resume facts of transformers' own fields

    logging_steps: float = option(10, "log every N optimiser steps (below 1: a fraction of all "
                                      "steps)")
    gradient_checkpointing: bool | None = option(True, "recompute activations in backward to save "
                                                       "memory")
    activation_checkpointing: bool | None = option(
        None, "transformers 5's name for gradient_checkpointing; wins when set")
    activation_checkpointing_kwargs: dict | str | None = option(
        None, "transformers 5's name for gradient_checkpointing_kwargs")
    bf16: bool | None = option(
        None, "train in bfloat16 weights (default: where the device has bfloat16; a CPU: false)")
    lr_scheduler_kwargs: dict | str | None = option(
        None, "extra arguments for the schedule (e.g. min_lr for cosine_with_min_lr)")
    model_init_kwargs: dict | str | None = option(
        None, "extra keyword arguments for from_pretrained (e.g. attn_implementation)")
    trust_remote_code: bool = option(False, "allow model code from the hub repository "
                                            "(transformers' flag)")
    disable_dropout: bool = option(False, "set every dropout probability to 0 (LoRA's included)")
    pad_to_multiple_of: int | str | None = option(
        "auto", "pad each micro-batch's completion length to a multiple of N (auto, null: no "
                "padding)")
    # rlft's own (RLFT_FIELDS)
    overwrite_output_dir: bool = option(
        False, resume=True, rlft=True,
        help="replace an earlier run's checkpoints and logs in output_dir (else refused)")
    warmup_ratio: float = option(
        0.0, "warmup as a fraction of all steps (when warmup_steps is 0)", check=NON_NEGATIVE, rlft=True)
    max_nonfinite_steps: int = option(
        3, check=POSITIVE, resume=True, rlft=True,
        help="stop after this many non-finite steps in a row (each is skipped, never applied)")
    chat_template_path: str | None = option(
        None, "a Jinja chat template file (or a tokenizer folder) to use instead of the model's", rlft=True)
    pad_token: str | None = option(
        None, "set the tokenizer's pad token (must differ from eos for reward models)", rlft=True)
    eos_token: str | None = option(None, "set the tokenizer's eos token (generation stops there)", rlft=True)

    def __post_init__(self):
        normalize_before(self)
        validate(self)  # rlft's checks first: they name the field where transformers' would not
        # transformers refuses bf16 and tf32 without a GPU; rlft trains bf16 weights on a CPU, notes
        # tf32
        cuda = torch.cuda.is_available()
        bf16, tf32, self.tf32 = self.bf16, self.tf32, self.tf32 if cuda else None
        self.bf16 = bf16 and (cuda or self.use_cpu)
        super().__post_init__()
        self.bf16, self.tf32 = bf16, tf32
        # transformers < 5.2x has no activation_* mirror
        if self.activation_checkpointing is not None:
            self.gradient_checkpointing = self.activation_checkpointing
            self.gradient_checkpointing_kwargs = self.activation_checkpointing_kwargs

    def to_dict(self) -> dict:
        """TrainingArguments.to_dict, which hides every field ending in "_token" as a secret
        (hub_token), except the tokenizer's pad_token and eos_token: names of tokens, not
        credentials, and a config rebuilt from the dict (a subprocess's, another trainer's) needs
        them as they were."""
        out = super().to_dict()
        out.update(pad_token=self.pad_token, eos_token=self.eos_token)
        return out

    # memory techniques every trainer applies (rlft/model/memory/)
    mlp_chunk_size: int | None = option(
        None, check=POSITIVE, resume=True, rlft=True,
        help="run each decoder layer's MLP over this many positions at a time in training "
             "forwards, each chunk recomputed in the backward: bounds the MLP's activations for "
             "long sequences (null: whole)")
    recompute_attention: bool = option(
        True, resume=True, rlft=True,
        help="with gradient checkpointing, run each layer's attention again in the backward "
             "(false: keep its output from the forward, about hidden_size x 2 bytes a token and "
             "layer, and skip the attention's recomputation; fused attention kernels only)")
    activation_offloading: bool = option(
        False, resume=True, rlft=True,
        help="move the activations a training forward saves to pinned host memory and back in the "
             "backward (a CUDA device; a CPU has nothing to move)")
    trim_host_memory: bool = option(
        True, resume=True, rlft=True,
        help="training on a CPU with glibc: between decoder layers, give the heap memory glibc "
             "holds free back to the system once the resident set grew by 256 MiB, which bounds a "
             "step's peak resident memory (no effect on a GPU)")

    def _normalize(self) -> None:
        """TRL/transformers spellings of this class's fields to one form; a subclass that declares
        fields needing it calls `super()._normalize()` first."""
        normalize_common(self)

    def _check(self, errors: list[str]) -> None:
        """One line in `errors` per problem with this class's fields (rlft/config/checks.py); a
        subclass that declares fields calls `super()._check(errors)`, then checks its own.
        `validate` runs it."""
        check_common(self, errors)
        # transformers 5's activation_checkpointing* win over gradient_checkpointing*
        on, kwargs = self.activation_checkpointing, self.activation_checkpointing_kwargs
        on = self.gradient_checkpointing if on is None else on
        kwargs = self.gradient_checkpointing_kwargs if kwargs is None else kwargs
        if not self.recompute_attention and not on:
            errors.append("recompute_attention=False keeps attention outputs through gradient "
                          "checkpointing, which is off (nothing is recomputed without it): set "
                          "gradient_checkpointing: true, or leave recompute_attention at true")
        if not self.recompute_attention and (kwargs or {}).get("use_reentrant"):
            errors.append("recompute_attention=False needs non-reentrant checkpointing (torch's "
                          "selective checkpointing): drop use_reentrant: true from "
                          "gradient_checkpointing_kwargs, or leave recompute_attention at true")

    @cached_property
    def _setup_devices(self):
        """The process state, built as rlft's Accelerator will use it (a gloo group for several
        processes on a machine without CUDA; the ddp_timeout on CPUs of rlft/config/launch.py),
        never resetting a state that a trainer in this process already runs on."""
        from accelerate.state import PartialState

        from rlft.config.launch import partial_state_kwargs

        self.distributed_state = PartialState(**partial_state_kwargs(self))
        device = self.distributed_state.device
        self._n_gpu = 1 if device.type == "cuda" else 0
        return device
