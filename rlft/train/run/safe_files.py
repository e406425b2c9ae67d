"""Reading and writing the files of a checkpoint without pickle: the checks both the checkpoint
logic (rlft/train/run/checkpoint.py) and the engines' state files (rlft/train/engines/) use, in one
module below both so neither imports the other."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
from pathlib import Path
from typing import Any

import torch

from rlft.errors import RlftError


class CheckpointError(RlftError, RuntimeError):
    """A checkpoint that is incomplete, corrupt, or not rlft's; the message names the file."""


class CheckpointWriteError(CheckpointError):
    """Writing one file of a checkpoint failed (a full disk, a file size limit, a lost mount):
    `file` is the file, `reason` the OS's reason when one is known ('ENOSPC: No space left on
    device')."""

    def __init__(self, message: str, file: Path | None = None, reason: str | None = None):
        super().__init__(message)
        self.file, self.reason = file, reason


def os_reason(err: BaseException) -> str | None:
    """The OS's reason behind a failed write, from the error or the one it was raised while handling
    (torch.save reports a failed write as a RuntimeError 'unexpected pos ...' raised during the
    OSError), or from safetensors' message ('os error 28'); None when there is none."""
    seen: BaseException | None = err
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno:
            return f"{errno.errorcode.get(seen.errno, seen.errno)}: {os.strerror(seen.errno)}"
        seen = seen.__cause__ or seen.__context__
    match = re.search(r"os error (\d+)", str(err))
    if match:
        number = int(match.group(1))
        return f"{errno.errorcode.get(number, number)}: {os.strerror(number)}"
    return None


@contextlib.contextmanager
def writing(file: Path, what: str | None = None):
    """Around writing one checkpoint file (or the files `what` names in the folder `file`): an I/O
    failure becomes a CheckpointWriteError naming it and the OS's reason (refusals such as
    check_finite pass through)."""
    from safetensors import SafetensorError

    try:
        yield
    except CheckpointError:
        raise
    except (OSError, RuntimeError, SafetensorError) as err:
        reason = os_reason(err)
        shown = f"{what} in {file}" if what else str(file)
        raise CheckpointWriteError(f"writing {shown} failed: "
                                   f"{reason or f'{type(err).__name__}: {err}'}",
                                   file, reason) from err


# elements tested at a time: torch.isfinite(t) holds an |t| copy and masks of t's size
FINITE_CHUNK = 1 << 22


def finite(tensor: torch.Tensor) -> bool:
    """No inf/NaN in `tensor`, tested FINITE_CHUNK elements at a time: whole, the test's temporaries
    were about twice a float32 tensor's size (520 MB for a 151,936 x 512 embedding, at every
    checkpoint)."""
    flat = tensor.detach().reshape(-1)  # a view of a contiguous tensor
    return all(bool(torch.isfinite(part).all()) for part in flat.split(FINITE_CHUNK))


def check_finite(model_or_state_dict) -> None:
    """Refuse to write weights that hold inf/NaN (a run must never save, then resume, a broken
    model). Takes a model or a (gathered) state dict."""
    named = model_or_state_dict.items() if isinstance(model_or_state_dict, dict) else \
        model_or_state_dict.named_parameters()
    bad = [name for name, p in named if p.is_floating_point() and not finite(p)]
    if bad:
        raise CheckpointError(f"refusing to save: {len(bad)} parameter tensors hold inf/NaN (e.g. "
                              f"{bad[:3]})")


def load_safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except Exception as err:  # safetensors raises its own error types for a malformed header
        raise CheckpointError(f"{path} is not a valid safetensors file ({err})") from err


def load_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{path} cannot be read as JSON ({err})") from err


def model_folder(path: Path) -> Path:
    """Where a checkpoint's model files are: its top level (older rlft checkpoints: its model/
    folder)."""
    return path / "model" if (path / "model" / "config.json").is_file() else path


def _converted_state(model, folder: Path, names: list[str]) -> dict:
    """The weights `names` of `folder` as `model` names and shapes them, loaded by transformers in
    their own dtype (the saved values exactly; the others were loaded as saved already)."""
    params = dict(model.named_parameters())
    dtype = params[names[0]].dtype if names and names[0] in params else next(model.parameters()).dtype
    fresh = type(model).from_pretrained(str(folder), dtype=dtype)
    state = fresh.state_dict()
    return {name: state[name] for name in names if name in state}


def load_model_weights(model, folder: Path) -> None:
    """Load trainable weights saved by `save_pretrained` (peft adapter or full model) in place."""
    from peft import PeftModel, set_peft_model_state_dict

    if isinstance(model, PeftModel):
        set_peft_model_state_dict(model, load_safetensors(folder / "adapter_model.safetensors"))
        return
    state = {}
    # model.safetensors or model-0000k-of-0000n shards
    for shard in sorted(folder.glob("model*.safetensors")):
        state.update(load_safetensors(shard))
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected and hasattr(type(model), "from_pretrained"):
        # save_pretrained wrote transformers' hub layout of weights the model holds converted (a
        # Mixture-of-Experts model's fused experts are saved one expert at a time): read them back
        # through transformers' own conversion
        converted = _converted_state(model, folder, missing)
        model.load_state_dict(converted, strict=False)
        missing = [n for n in missing if n not in converted]
        unexpected = [] if not [n for n in missing if "lm_head" not in n] else unexpected
    # tied to the embeddings, not saved twice
    tied = {name for name in missing if "lm_head" in name}
    if unexpected or set(missing) - tied:
        raise CheckpointError(f"checkpoint {folder} does not match the model: missing "
                              f"{sorted(set(missing) - tied)[:5]}, unexpected {unexpected[:5]}")
