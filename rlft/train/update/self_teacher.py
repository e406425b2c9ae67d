"""The student as its own teacher (SDFT's and SDPO's `teacher_model_kind`, TRL 1.16's meanings;
rlft/train/sdft.py, rlft/train/sdpo.py):

    live   the student as it is now (a forward under no_grad, adapters on)
    base   the student as it was loaded: with LoRA the model under its adapters (turned off for the
           teacher's forward); with full fine-tuning a frozen copy made before the first step
    ema    an exponential moving average of the student, starting from the student as loaded: every
           `teacher_sync_steps` optimiser steps
               theta_t <- (1 - r) theta_t + r theta_s        (r = teacher_update_rate)
           with LoRA over the adapter's trainable tensors (swapped in for the teacher's forward),
           otherwise over a frozen copy's parameters

What the scorer reads (rlft/model/scoring.py: teacher_states): `module`, the model whose backbone
and head the teacher's forward runs, and `scoring()`, the context it runs in. The average goes into
checkpoints (`state_dict`), so a resumed run goes on with the teacher it had; a base copy is the
student as loaded, which a resume loads again.
"""

from __future__ import annotations

import contextlib
import copy
import logging

import torch

from rlft.core.regularizers import mix_reference
from rlft.errors import ConfigError
from rlft.train.run.checkpoint import PartState
from rlft.train.update.distill_objective import _plain_student_head

KINDS = ("base", "live", "ema")
PREFIX = "self_teacher."


class SelfTeacher:
    """The run's teacher made from the student (module docstring)."""

    def __init__(self, kind: str, policy, unwrap, frozen=None, update_rate: float = 0.05,
                 sync_steps: int = 1):
        self.kind, self.policy, self.unwrap, self.frozen = kind, policy, unwrap, frozen
        self.update_rate, self.sync_steps, self.syncs = update_rate, sync_steps, 0
        self.average = None  # LoRA ema: name -> the averaged adapter tensor
        if kind == "ema" and frozen is None:
            self.average = {name: p.detach().clone() for name, p in self._adapter().items()}

    @classmethod
    def build(cls, args, policy, unwrap, engine, is_peft: bool, given_adapter: bool = False) -> SelfTeacher:
        """The teacher the config's teacher_model_kind names, for the engine-wrapped `policy`
        (`given_adapter`: the caller passed a model with its own adapter, no peft_config)."""
        _plain_student_head(unwrap(policy))
        if given_adapter:
            logging.getLogger("rlft").warning(
                "The student model given already contains a PEFT adapter: `teacher_model_kind='base'` may "
                "refer to the underlying base weights (the model under the adapter, turned off), not the "
                "student as given, and 'ema' averages the adapter from its values now. For a teacher equal "
                "to the student as given, merge the adapter first (merge_and_unload) and pass peft_config=")
        kind = args.teacher_model_kind
        if kind == "live" or is_peft:
            return cls(kind, policy, unwrap, None, args.teacher_update_rate, args.teacher_sync_steps)
        if engine.sharded:
            raise ConfigError(f"teacher_model_kind={kind!r} with full fine-tuning under {engine.name}: "
                              "a frozen copy of weights that are in pieces is not built; train with "
                              "LoRA, under DDP, or with teacher_model_kind: live")
        frozen = copy.deepcopy(unwrap(policy)).eval().requires_grad_(False)
        return cls(kind, policy, unwrap, engine.prepare_reference(frozen), args.teacher_update_rate,
                   args.teacher_sync_steps)

    @property
    def module(self):
        """The model the teacher's forward runs."""
        if self.frozen is None:
            return self.unwrap(self.policy)
        return getattr(self.frozen, "module", self.frozen)

    def scoring(self) -> contextlib.AbstractContextManager:
        """The context of the teacher's forward: LoRA's adapters off (base), the averaged adapter
        tensors in (ema), nothing otherwise."""
        if self.frozen is not None or self.kind == "live":
            return contextlib.nullcontext()
        if self.kind == "base":
            return self.unwrap(self.policy).disable_adapter()
        return self._averaged_adapter()

    @contextlib.contextmanager
    def _averaged_adapter(self):
        params = self._adapter()
        with torch.no_grad():
            saved = {name: p.detach().clone() for name, p in params.items()}
            for name, p in params.items():
                p.copy_(self.average[name])
        try:
            yield
        finally:
            with torch.no_grad():
                for name, p in params.items():
                    p.copy_(saved[name])

    def _adapter(self) -> dict[str, torch.Tensor]:
        return {name: p for name, p in self.unwrap(self.policy).named_parameters() if p.requires_grad}

    @torch.no_grad()
    def after_step(self, step: int) -> dict[str, float]:
        """After optimiser step `step` (1-based): the average moves toward the student every
        teacher_sync_steps steps."""
        if self.kind != "ema" or step % self.sync_steps:
            return {}
        if self.average is not None:
            for name, p in self._adapter().items():
                mix_reference(self.average[name], p.detach(), self.update_rate)
        else:
            student = self.unwrap(self.policy)
            for mine, current in zip(self.module.parameters(), student.parameters(), strict=True):
                mix_reference(mine.data, current.data, self.update_rate)
        self.syncs += 1
        return {"self_teacher/syncs": float(self.syncs)}

    def record(self) -> dict:
        """For the run record (what a resume must match)."""
        return {"self_teacher": self.kind, "update_rate": self.update_rate, "sync_steps": self.sync_steps}

    def state_dict(self) -> PartState:
        """The average (ema) and the sync count, for checkpoints."""
        if self.kind != "ema":
            return PartState()
        tensors = self.average if self.average is not None else dict(self.module.state_dict())
        return PartState(state={"self_teacher_syncs": self.syncs},
                         tensors={PREFIX + k: v.detach().clone() for k, v in tensors.items()})

    @torch.no_grad()
    def load_state_dict(self, part: PartState) -> None:
        if self.kind != "ema":
            return
        saved = {k[len(PREFIX):]: v for k, v in part.tensors.items() if k.startswith(PREFIX)}
        if not saved:
            raise ConfigError("the checkpoint holds no EMA teacher (teacher_model_kind was not 'ema' "
                              "when it was saved): resume with the run's own teacher_model_kind")
        self.syncs = int(part.state.get("self_teacher_syncs", 0))
        if self.average is not None:
            for name, value in saved.items():
                self.average[name].copy_(value)
        else:
            self.module.load_state_dict(saved, strict=True)
