"""`TrainingEngine`: the one set of calls the loops make for what differs between DDP, FSDP2 and DeepSpeed.

The base class is the plain case (one process, or DDP: every process holds every weight and all optimizer
state whole), so an engine overrides only what it does differently, and the loops never ask which engine runs.

It also owns the format of a gathered checkpoint's engine/ folder, so the sharded engines only say how to
gather their state whole and how to put it back:
  engine/weights.safetensors    every trainable parameter in full, by its name in the model
                                (DeepSpeed: its fp32 master copy, so a bf16 run resumes exactly)
  engine/optimizer.safetensors  every optimizer state tensor in full, as "<parameter name>::<state key>"
  engine/optimizer.json         scalar state: param groups / step counts
Saved whole, not per process, so nothing in the files depends on how the state was split (resume still asks
for the same number of processes, for the RNG states and data order; rlft/train/checkpoint.py).
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch

from rlft.train.safe_files import load_json, load_safetensors

State = tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict]  # weights, optimizer tensors, scalars


class TrainingEngine:
    """The plain engine's behaviour, the default for every call; subclasses override what differs."""

    def __init__(self, accelerator):
        self.accelerator = accelerator

    @property
    def name(self) -> str:
        """What the run log and the tests call the engine (`engine <name> on N process(es)`)."""
        raise NotImplementedError

    @property
    def sharded(self) -> bool:
        """Weights live in pieces on the processes (FSDP2, ZeRO-3): generation keeps every process in step."""
        return False

    @property
    def gathers_checkpoints(self) -> bool:
        """Checkpoints go through full gathered weights and optimizer state (engine/, `save_state`) when the
        optimizer state is in pieces on the processes; otherwise rlft/train/checkpoint.py writes the plain
        optimizer.pt itself."""
        return False

    @property
    def partitions_on_load(self) -> bool:
        """The model is already in pieces as it loads (ZeRO-3's zero.Init), so a copy of the loaded policy is
        a copy of pieces: a full reference policy has to be loaded again from its source instead."""
        return False

    # ---- preparing --------------------------------------------------------------------------------
    def before_loading(self, dtype: torch.dtype) -> None:
        """Settings the engine needs before any model is loaded; none for the unsharded engines."""

    def prepare(self, model, optimizer, max_grad_norm: float | None):
        """The model and optimizer wrapped for the engine (accelerate's prepare)."""
        return self.accelerator.prepare(model, optimizer)

    def prepare_reference(self, reference):
        """The frozen reference policy: a full copy on every process (as TRL does: DDP, ZeRO-2 and FSDP keep
        it whole)."""
        return reference.to(self.accelerator.device)

    @contextlib.contextmanager
    def unpartitioned(self):
        """Context for building a plain model on one process (the merged LoRA copy save_model writes); nothing
        to lift unless the engine partitions models as transformers builds them."""
        yield

    @contextlib.contextmanager
    def for_generation(self, model):
        """Context around the whole of one generation; nothing to gather when the weights are whole."""
        yield

    @contextlib.contextmanager
    def full_weights(self, model, params=None):
        """Every process holds every weight whole inside (what a weight sync to vLLM reads; every process must
        enter it together), as plain tensors; whatever is done to them inside is dropped on exit by the
        sharded engines. `params`: only these parameters (a bucketed sync gathers one bucket at a time).
        Unsharded: the weights already are whole."""
        yield

    # ---- one optimiser step ---------------------------------------------------------------------
    def micro_batch(self, model, last: bool):
        """Context for one accumulation micro-batch: the gradient sync is skipped but on the last one, so one
        optimiser step costs one all-reduce."""
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
        """Called before the backward passes the flow check reads; nothing to do where grads land in .grad."""

    def grads(self, model) -> list[tuple[str, torch.Tensor | None]]:
        """Every trainable parameter's gradient after the backward passes, the same on every process (FSDP2's
        sharded gradients reduce when their norm is taken); None for a parameter that got no gradient."""
        return [(name, p.grad) for name, p in self._trainable(model)]

    def _trainable(self, model) -> list[tuple[str, torch.nn.Parameter]]:
        from rlft.models import trainable_parameters

        return trainable_parameters(self.accelerator.unwrap_model(model))

    # ---- engine/ in a checkpoint ------------------------------------------------------------------
    def save_state(self, model, optimizer, folder: Path, gathered: dict | None = None) -> None:
        """Write engine/ (the module docstring) from the engine's state gathered whole; every process calls
        this (gathering is a collective), the main process writes. `gathered`: the full state dict
        save_pretrained just gathered, which an engine may take its weights from rather than gather them
        again."""
        weights, tensors, scalars = self._gather_state(model, optimizer, gathered)
        if self.accelerator.is_main_process:
            from safetensors.torch import save_file

            folder.mkdir(parents=True, exist_ok=True)
            save_file({k: v.detach().cpu().contiguous() for k, v in weights.items()},
                      str(folder / "weights.safetensors"))
            save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()},
                      str(folder / "optimizer.safetensors"))
            (folder / "optimizer.json").write_text(json.dumps(scalars, default=list))
        self.accelerator.wait_for_everyone()

    def load_state(self, model, optimizer, folder: Path) -> None:
        """Read engine/ back into the model and optimizer, split the engine's way (every process calls it)."""
        weights = load_safetensors(folder / "weights.safetensors")
        tensors = load_safetensors(folder / "optimizer.safetensors")
        scalars = load_json(folder / "optimizer.json")
        self._scatter_state(model, optimizer, weights, tensors, scalars)
        self.accelerator.wait_for_everyone()

    def _gather_state(self, model, optimizer, gathered: dict | None) -> State:
        """(weights, optimizer tensors, scalars), whole, for the engines whose checkpoints gather."""
        raise NotImplementedError(f"{self.name} checkpoints are the plain ones rlft/train/checkpoint.py "
                                  "writes (gathers_checkpoints is False): nothing is in pieces")

    def _scatter_state(self, model, optimizer, weights: dict, tensors: dict, scalars: dict) -> None:
        """Put gathered state back, split the engine's way."""
        raise NotImplementedError(f"{self.name} checkpoints are the plain ones rlft/train/checkpoint.py "
                                  "reads (gathers_checkpoints is False)")
