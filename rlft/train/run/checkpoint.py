"""Checkpoints that hold no pickle, verified by checksums, written atomically.

`output_dir/checkpoint-<step>/` holds, like transformers' checkpoints, the model at its top level (a
normal transformers or peft folder: `from_pretrained("checkpoint-<step>")` loads it), and beside it:
  optimizer.pt           the optimizer's state dict: tensors and plain containers, loaded with
weights_only=True
  scheduler.json         the LR scheduler's state dict
  rng_state_<rank>.json  every process's python / numpy / torch RNG states
  extra.safetensors      tensors the trainer needs to continue (a GRPO rollout in flight), +
                         extra.json;
                         with several processes each one's own: extra_<rank>.safetensors / .json
  trainer_state.json     transformers' TrainerState (global_step, log_history, ...)
  rlft_state.json        written last: rlft's own state and the sha256 of every file above

Nothing is unpickled on resume: a planted file cannot run code, it can only fail to load, and the
error names it. A checkpoint is written to a temporary folder and renamed into place; a write that
fails (a full disk) removes the temporary folder and stops the run naming the file, the OS's reason,
the free space and the previous checkpoint, which is intact. Resume verifies the checksums;
`resume_from_checkpoint=True` falls back to the previous complete checkpoint when the newest is
corrupt (with a warning), a checkpoint named explicitly stops.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
import random
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rlft.train.run.safe_files import (
    CheckpointError,
    CheckpointWriteError,
    load_json,
    load_safetensors,
    os_reason,
    writing,
)

logger = logging.getLogger("rlft")
CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")
STATE_FILE = "rlft_state.json"


# ---- RNG states as JSON
# ---------------------------------------------------------------------------
def _tensor_b64(tensor: torch.Tensor) -> str:
    return base64.b64encode(tensor.numpy().tobytes()).decode()


def _b64_tensor(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8).clone()


def rng_state() -> dict[str, Any]:
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"python": [version, list(internal), gauss],
             "numpy": [name, keys.tolist(), pos, has_gauss, cached],
             "torch": _tensor_b64(torch.get_rng_state())}
    if torch.cuda.is_available():
        state["cuda"] = [_tensor_b64(s) for s in torch.cuda.get_rng_state_all()]
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(_b64_tensor(state["torch"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([_b64_tensor(s) for s in state["cuda"]])


# ---- finding and verifying -----------------------------------------------------------------------
def _checkpoints(output_dir: Path) -> list[tuple[int, Path]]:
    found = []
    if output_dir.is_dir():
        for child in output_dir.iterdir():
            match = CHECKPOINT_RE.match(child.name)
            if match and (child / STATE_FILE).is_file():
                found.append((int(match.group(1)), child))
    return sorted(found)


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    found = _checkpoints(Path(output_dir))
    return found[-1][1] if found else None


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def read_state(path: Path) -> dict[str, Any]:
    try:
        state = json.loads((path / STATE_FILE).read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{path / STATE_FILE} cannot be read as JSON ({err}); "
                              "not an rlft checkpoint") from err
    if not isinstance(state, dict) or not isinstance(state.get("files"), dict):
        raise CheckpointError(f"{path / STATE_FILE} has no file checksums: "
                              "not a checkpoint written by this rlft")
    return state


def verify(path: Path) -> dict[str, Any]:
    """Check every file against the checksum recorded when it was written; return rlft's state."""
    state = read_state(path)
    for name, expected in state["files"].items():
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"{file} is missing from the checkpoint")
        if _sha256(file) != expected:
            raise CheckpointError(f"{file} is corrupt or truncated "
                                  "(its sha256 differs from the one recorded)")
    return state


def resolve_resume(resume: bool | str | Path | None, output_dir: str | Path) -> Path | None:
    """None/False -> None; True/'true' -> the newest checkpoint in output_dir that verifies (a
    corrupt one is skipped with a warning); a path -> that checkpoint, which must verify."""
    if resume in (None, False, "false", "False", ""):
        return None
    if resume in (True, "true", "True"):
        found = _checkpoints(Path(output_dir))
        if not found:
            raise FileNotFoundError(f"resume_from_checkpoint=True but {output_dir} "
                                    "holds no complete checkpoint")
        for _, path in reversed(found):
            try:
                verify(path)
                return path
            except CheckpointError as err:
                logger.warning("%s; falling back to the previous checkpoint", err)
        raise CheckpointError(f"no checkpoint in {output_dir} verifies (see the warnings above)")
    path = Path(resume)
    if not (path / STATE_FILE).is_file():
        raise FileNotFoundError(f"{path} is not a complete rlft checkpoint (no {STATE_FILE})")
    verify(path)
    return path


# ---- writing --------------------------------------------------------------------------------------
@dataclass
class PartState:
    """What one part of a trainer (the policy update, the rollout source, a rollout in progress, the
    run itself) puts in a checkpoint: scalars for rlft_state.json (`state`), this process's JSON for
    extra.json (`extra`), tensors for extra.safetensors (`tensors`). A checkpoint is the parts'
    states merged, plus the model files; on resume each part reads its own keys back from the merged
    ones."""

    state: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)

    @classmethod
    def merged(cls, parts: list[PartState]) -> PartState:
        out = cls()
        for part in parts:
            out.state.update(part.state)
            out.extra.update(part.extra)
            out.tensors.update(part.tensors)
        return out


def save_checkpoint(accelerator, output_dir: str | Path, step: int, trained, tokenizer, flow,
                    parts: PartState, save_total_limit: int | None = None) -> Path:
    """Write checkpoint-<step> atomically (all processes call this; rank 0 writes shared files):
    `trained` (rlft/train/update/optimization.py) saves the model files, optimizer state and
    schedule, its engine's way (gathered whole under FSDP2 and DeepSpeed); `parts` are what the
    trainer's parts carry."""
    output_dir = Path(output_dir)
    final, tmp = output_dir / f"checkpoint-{step}", output_dir / f".tmp-checkpoint-{step}"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    try:
        rng_file = tmp / f"rng_state_{accelerator.process_index}.json"
        with writing(rng_file):
            rng_file.write_text(json.dumps(rng_state()))
        _write_carried(accelerator, tmp, parts.tensors, parts.extra or None)
        trained.save(tmp, tokenizer)
        if accelerator.is_main_process:
            with writing(tmp, "trainer_state.json"):
                flow.save(tmp)
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            files = {str(f.relative_to(tmp)): _sha256(f) for f in sorted(tmp.rglob("*")) if f.is_file()}
            state = {"global_step": step, **parts.state, "files": files}
            with writing(tmp / STATE_FILE):
                (tmp / STATE_FILE).write_text(json.dumps(state, indent=1))
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            _rotate(output_dir, save_total_limit)
    except BaseException as err:
        if accelerator.is_main_process:  # the previous checkpoints stay as they were
            shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(err, CheckpointWriteError | OSError):
            raise write_failure(output_dir, step, err) from err
        raise
    accelerator.wait_for_everyone()
    return final


def _size(count: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if count < 1024 or unit == "TB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    return f"{count} B"


WRITE_ADVICE = {
    "ENOSPC": "the disk is full: free space there or move output_dir to a larger disk "
              "(save_total_limit keeps fewer checkpoints), then resume",
    "EDQUOT": "your disk quota is used up: free space or raise the quota, then resume",
    "EFBIG": "a file size limit (ulimit -f) stopped the write: raise it, then resume",
}


def write_failure(output_dir: Path, step: int, err: BaseException) -> CheckpointWriteError:
    """A failed checkpoint write as one error: which file and why (the OS's reason), the free space
    left, that the previous checkpoint is intact, and what to do. Called after the temporary folder
    is removed."""
    file = getattr(err, "file", None) or (Path(err.filename) if getattr(err, "filename", None) else None)
    reason = getattr(err, "reason", None) or os_reason(err)
    what = str(err) if isinstance(err, CheckpointWriteError) else \
        f"writing {file or 'a file'} failed: {reason or err}"
    # its name
    what = what.replace(str(Path(output_dir) / f".tmp-checkpoint-{step}"), f"checkpoint-{step}")
    try:
        free = f"{_size(shutil.disk_usage(output_dir).free)} free on its filesystem now"
    except OSError:
        free = "its free space cannot be read"
    previous = latest_checkpoint(output_dir)
    kept = (f"{previous.name}, the last complete checkpoint, is intact: "
            "resume_from_checkpoint=True continues from it" if previous is not None else
            "there is no earlier checkpoint to resume from")
    advice = WRITE_ADVICE.get((reason or "").split(":")[0],
                              "the OS gave no reason; a full disk is the usual cause: check the "
                              "free space, then resume")
    return CheckpointWriteError(
        f"checkpoint-{step} could not be written to {output_dir} ({what}); {free}. Nothing of "
        f"checkpoint-{step} is kept (its temporary folder was removed) and {kept}. Likely cause: "
        f"{advice}",
        file, reason)


SHARED_PREFIXES = ("ref_model.",)  # carried tensors every process holds alike: written once


def _write_carried(accelerator, tmp: Path, tensors: dict | None, extra: dict | None) -> None:
    """What the trainer carries besides weights: with several processes each one's own (a rollout in
    progress, requested rollouts) as extra_<rank>.safetensors / extra_<rank>.json, and what all hold
    alike (a moved reference) once, in extra.safetensors; one process: extra.safetensors /
    extra.json."""
    from safetensors.torch import save_file

    several, tensors = accelerator.num_processes > 1, tensors or {}
    shared = {k: v for k, v in tensors.items() if not several or k.startswith(SHARED_PREFIXES)}
    own = {k: v for k, v in tensors.items() if k not in shared}
    suffix = f"_{accelerator.process_index}" if several else ""
    for part, name, writes in ((shared, "extra.safetensors", accelerator.is_main_process),
                               (own, f"extra{suffix}.safetensors", True)):
        if part and writes:
            with writing(tmp / name):
                save_file({k: v.detach().cpu().contiguous() for k, v in part.items()}, str(tmp / name))
    if extra is not None and (several or accelerator.is_main_process):
        with writing(tmp / f"extra{suffix}.json"):
            (tmp / f"extra{suffix}.json").write_text(json.dumps(extra, default=str))


def _read_carried(accelerator, path: Path) -> tuple[dict, dict]:
    """This process's carried tensors (the shared file, then its own) and JSON."""
    rank, several = accelerator.process_index, accelerator.num_processes > 1
    shared, own = path / "extra.safetensors", path / f"extra_{rank}.safetensors"
    tensors = load_safetensors(shared) if shared.exists() else {}
    if own.exists():
        tensors.update(load_safetensors(own))
    elif several and not any(path.glob("extra_*")) and \
            any(not k.startswith(SHARED_PREFIXES) for k in tensors):
        logger.warning(f"{path} was written inside a rollout by an rlft that kept only process 0's "
                       f"rows; process {rank} continues that rollout from them, so the resumed run "
                       "is not exact (resume from a checkpoint at a rollout boundary for that)")
    json_file = path / f"extra_{rank}.json"
    json_file = json_file if json_file.exists() else path / "extra.json"
    return tensors, load_json(json_file) if json_file.exists() else {}


def _rotate(output_dir: Path, limit: int | None) -> None:
    if not limit:
        return
    for _, path in _checkpoints(output_dir)[:-limit]:
        shutil.rmtree(path, ignore_errors=True)


# ---- reading --------------------------------------------------------------------------------------
def load_checkpoint(accelerator, trained, path: Path) -> PartState:
    """Restore the model, optimizer and schedule (`trained`: rlft/train/update/optimization.py) and
    this process's RNG. Returns the parts' merged state (rlft_state.json, this process's extra JSON
    and tensors) for each part to read its own from; the TrainerState is the flow's to load."""
    state = verify(path)
    if state.get("num_processes", 1) != accelerator.num_processes:
        from rlft.errors import ConfigError

        raise ConfigError(f"{path} was written by {state['num_processes']} processes; resume with "
                          f"the same number (now {accelerator.num_processes}): the RNG states and "
                          "data order are per process")
    trained.load(path)
    rng_file = path / f"rng_state_{accelerator.process_index}.json"
    if not rng_file.is_file():
        raise CheckpointError(f"{rng_file} is missing: the checkpoint was written by fewer "
                              "processes")
    set_rng_state(load_json(rng_file))
    tensors, extra = _read_carried(accelerator, path)
    return PartState(state, extra, tensors)
