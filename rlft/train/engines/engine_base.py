"""`TrainingEngine`: the one set of calls the loops make for what differs between DDP, FSDP2 and
DeepSpeed.

The base class is the plain case (one process, or DDP: every process holds every weight and all
optimizer state whole), so an engine overrides only what it does differently, and the loops never
ask which engine runs.

Each engine saves and loads its own part of a checkpoint (`save_checkpoint` / `load_checkpoint`):
the model files at the checkpoint's top level (a normal transformers or peft folder) and the
optimizer state. The plain engine writes them from the whole weights it holds (optimizer.pt: a plain
state dict, read back with weights_only); the sharded ones (`GatheringEngine`: FSDP2, DeepSpeed)
gather them whole into an engine/ folder whose format this module owns, so they only say how to
gather their state whole and how to put it back:
  engine/weights.safetensors    every trainable parameter in full, by its name in the model
                                (DeepSpeed: its fp32 master copy, so a bf16 run resumes exactly)
  engine/optimizer.safetensors  every optimizer state tensor in full, as "<parameter name>::<state
                                key>"
  engine/optimizer.json         scalar state: param groups / step counts
Saved whole, not per process, so nothing in the files depends on how the state was split (resume
still asks for the same number of processes, for the RNG states and data order;
rlft/train/run/checkpoint.py).
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch

from rlft.train.run.safe_files import (
    CheckpointError,
    check_finite,
    load_json,
    load_model_weights,
    load_safetensors,
    model_folder,
    writing,
)

# weights, optimizer tensors, scalars
State = tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict]


class TrainingEngine:
    """The plain engine's behaviour, the default for every call; subclasses override what
    differs."""

    def __init__(self, accelerator):
        self.accelerator = accelerator

    @property
    def name(self) -> str:
        """What the run log and the tests call the engine (`engine <name> on N process(es)`)."""
        raise NotImplementedError

    @property
    def sharded(self) -> bool:
        """Weights live in pieces on the processes (FSDP2, ZeRO-3): generation keeps every process
        in step."""
        return False

    @property
    def gathers_checkpoints(self) -> bool:
        """Checkpoints hold the weights and optimizer state gathered whole (engine/:
        `GatheringEngine`), since they are in pieces on the processes; the plain engine writes
        optimizer.pt."""
        return False

    @property
    def partitions_on_load(self) -> bool:
        """The model is already in pieces as it loads (ZeRO-3's zero.Init), so a copy of the loaded
        policy is a copy of pieces: a full reference policy has to be loaded again from its source
        instead."""
        return False

    # ---- preparing --------------------------------------------------------------------------------
    def before_loading(self, dtype: torch.dtype) -> None:
        """Settings the engine needs before any model is loaded; none for the unsharded engines."""

    def prepare(self, model, optimizer, max_grad_norm: float | None):
        """The model and optimizer wrapped for the engine (accelerate's prepare)."""
        return self.accelerator.prepare(model, optimizer)

    def prepare_reference(self, reference):
        """The frozen reference policy: a full copy on every process (as TRL does: DDP, ZeRO-2 and
        FSDP keep it whole)."""
        return reference.to(self.accelerator.device)

    @contextlib.contextmanager
    def unpartitioned(self):
        """Context for building a plain model on one process (the merged LoRA copy save_model
        writes); nothing to lift unless the engine partitions models as transformers builds them."""
        yield

    @contextlib.contextmanager
    def for_generation(self, model):
        """Context around the whole of one generation; nothing to gather when the weights are
        whole."""
        yield

    @contextlib.contextmanager
    def full_weights(self, model, params=None):
        """Every process holds every weight whole inside (what a weight sync to vLLM reads; every
        process must enter it together), as plain tensors; whatever is done to them inside is
        dropped on exit by the sharded engines. `params`: only these parameters (a bucketed sync
        gathers one bucket at a time). Unsharded: the weights already are whole."""
        yield

    # ---- one optimiser step ---------------------------------------------------------------------
    def micro_batch(self, model, last: bool):
        """Context for one accumulation micro-batch: the gradient sync is skipped but on the last
        one, so one optimiser step costs one all-reduce."""
        if last:
            return contextlib.nullcontext()
        return self.accelerator.no_sync(model)

    def backward(self, model, loss: torch.Tensor) -> None:
        self.accelerator.backward(loss)

    def clip(self, model, max_grad_norm: float | None) -> float | None:
        """The gradient norm before clipping (None where the engine clips inside its own step)."""
        return float(self.accelerator.clip_grad_norm_(model.parameters(), max_grad_norm))

    def step(self, model, optimizer) -> tuple[bool, float | None]:
        """(was the step applied, gradient norm where only the engine knows it)."""
        optimizer.step()
        return True, None

    def zero_grad(self, model, optimizer) -> None:
        optimizer.zero_grad(set_to_none=True)

    def watch_grads(self, model) -> None:
        """Called before the backward passes the flow check reads; nothing to do where grads land in
        .grad."""

    def grads(self, model) -> list[tuple[str, torch.Tensor | None]]:
        """Every trainable parameter's gradient after the backward passes, the same on every process
        (FSDP2's sharded gradients reduce when their norm is taken); None for a parameter that got
        no gradient."""
        return [(name, p.grad) for name, p in self._trainable(model)]

    def _trainable(self, model) -> list[tuple[str, torch.nn.Parameter]]:
        from rlft.model.loading import trainable_parameters

        return trainable_parameters(self.accelerator.unwrap_model(model))

    # ---- saving ---------------------------------------------------------------------------------
    def save_pretrained(self, model, folder: Path, tokenizer=None) -> dict | None:
        """`save_pretrained` of the full weights (gathered on every process where they are in
        pieces), written by the main process. Returns the gathered state dict (the main process's;
        None when nothing had to be gathered)."""
        acc = self.accelerator
        unwrapped = acc.unwrap_model(model)
        state_dict = acc.get_state_dict(model) if self.sharded else None
        if acc.is_main_process:
            check_finite(unwrapped if state_dict is None else state_dict)
            with writing(folder, "the model files (save_pretrained)"):
                unwrapped.save_pretrained(folder, **({} if state_dict is None else
                                                      {"state_dict": _without_tied(unwrapped, state_dict)}))
            if tokenizer is not None:
                with writing(folder, "the tokenizer files"):
                    tokenizer.save_pretrained(folder)
        acc.wait_for_everyone()
        return state_dict

    def save_checkpoint(self, model, optimizer, folder: Path, tokenizer) -> None:
        """The model files at `folder`'s top level and the optimizer state; every process calls
        this. Whole weights and optimizer state on every process: checked finite everywhere, written
        by the main one (optimizer.pt, a plain state dict). A failed write names its file and the
        OS's reason (safe_files.writing; optimizer.pt is written through a Python file, so the OS
        error behind torch's own error survives)."""
        unwrapped = self.accelerator.unwrap_model(model)
        check_finite(unwrapped)
        if self.accelerator.is_main_process:
            with writing(folder, "the model files (save_pretrained)"):
                unwrapped.save_pretrained(folder)
            with writing(folder, "the tokenizer files"):
                tokenizer.save_pretrained(folder)
            with writing(folder / "optimizer.pt"), (folder / "optimizer.pt").open("wb") as handle:
                torch.save(optimizer.state_dict(), handle)

    def load_checkpoint(self, model, optimizer, folder: Path) -> None:
        """What `save_checkpoint` wrote, back into the model and optimizer (every process)."""
        self._same_kind(folder)
        load_model_weights(self.accelerator.unwrap_model(model), model_folder(folder))
        try:
            state = torch.load(folder / "optimizer.pt", map_location="cpu", weights_only=True)
        except Exception as err:  # weights_only refuses anything but tensors and plain containers
            raise CheckpointError(f"{folder / 'optimizer.pt'} is not a plain optimizer state dict; "
                                  f"refusing to load it ({type(err).__name__})") from err
        optimizer.load_state_dict(state)

    def _same_kind(self, folder: Path) -> None:
        """A checkpoint is resumed by the kind of engine that wrote it (whole files or a gathered
        engine/)."""
        if self.gathers_checkpoints != (folder / "engine").is_dir():
            written = "FSDP2 or DeepSpeed" if (folder / "engine").is_dir() else "DDP or one process"
            raise CheckpointError(f"{folder} was written by {written}; this run is {self.name}: "
                                  "resume with the engine that wrote it (or start a new run from "
                                  "its model files)")


def _without_tied(model, state_dict: dict) -> dict:
    """A gathered state dict holds tied weights (lm_head = embeddings) as separate tensors, so
    save_pretrained cannot see the tie and would save both: keep the first name of each shared
    parameter only."""
    seen, tied = set(), set()
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in seen:
            tied.add(name)
        seen.add(id(param))
    return {k: v for k, v in state_dict.items() if k not in tied}


class GatheringEngine(TrainingEngine):
    """An engine whose weights or optimizer state are in pieces on the processes: a checkpoint holds
    them gathered whole (the model files, and engine/ in the module docstring's format)."""

    @property
    def gathers_checkpoints(self) -> bool:
        return True

    def save_checkpoint(self, model, optimizer, folder: Path, tokenizer) -> None:
        gathered = self.save_pretrained(model, folder, tokenizer)
        self.save_state(model, optimizer, folder / "engine", gathered)

    def load_checkpoint(self, model, optimizer, folder: Path) -> None:
        self._same_kind(folder)
        self.load_state(model, optimizer, folder / "engine")

    def save_state(self, model, optimizer, folder: Path, gathered: dict | None = None) -> None:
        """Write engine/ (the module docstring) from the engine's state gathered whole; every
        process calls this (gathering is a collective), the main process writes. `gathered`: the
        full state dict save_pretrained just gathered, which an engine may take its weights from
        rather than gather them again."""
        weights, tensors, scalars = self._gather_state(model, optimizer, gathered)
        if self.accelerator.is_main_process:
            from safetensors.torch import save_file

            folder.mkdir(parents=True, exist_ok=True)
            with writing(folder / "weights.safetensors"):
                save_file({k: v.detach().cpu().contiguous() for k, v in weights.items()},
                          str(folder / "weights.safetensors"))
            with writing(folder / "optimizer.safetensors"):
                save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()},
                          str(folder / "optimizer.safetensors"))
            with writing(folder / "optimizer.json"):
                (folder / "optimizer.json").write_text(json.dumps(scalars, default=list))
        self.accelerator.wait_for_everyone()

    def load_state(self, model, optimizer, folder: Path) -> None:
        """Read engine/ back into the model and optimizer, split the engine's way (every process
        calls it)."""
        weights = load_safetensors(folder / "weights.safetensors")
        tensors = load_safetensors(folder / "optimizer.safetensors")
        scalars = load_json(folder / "optimizer.json")
        self._scatter_state(model, optimizer, weights, tensors, scalars)
        self.accelerator.wait_for_everyone()

    def _gather_state(self, model, optimizer, gathered: dict | None) -> State:
        """(weights, optimizer tensors, scalars), whole."""
        raise NotImplementedError

    def _scatter_state(self, model, optimizer, weights: dict, tensors: dict, scalars: dict) -> None:
        """Put gathered state back, split the engine's way."""
        raise NotImplementedError
