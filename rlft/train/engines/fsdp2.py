"""FSDP2 (torch's fully_shard, through accelerate's FSDP plugin with fsdp_version 2): weights,
gradients and optimizer state in pieces on the processes, as DTensors.

What differs from the plain engine: the root module is fixed at preparation, generation gathers
every layer once, a weight sync swaps full copies in, and checkpoints gather the state whole through
torch.distributed.checkpoint's state_dict helpers.
"""

from __future__ import annotations

import contextlib

import torch

from rlft.train.engines.engine_base import GatheringEngine, State


class FSDP2Engine(GatheringEngine):
    """FSDP2: every parameter a DTensor shard; accumulation, backward, clipping and step are
    accelerate's."""

    @property
    def name(self) -> str:
        return "fsdp2"

    @property
    def sharded(self) -> bool:
        return True

    def prepare(self, model, optimizer, max_grad_norm: float | None):
        """FSDP2 finds its root module at the first forward: make it the whole model, not the inner
        model peft's generate calls (each layer a root). The root keeps its weights gathered after a
        forward: back to pieces."""
        from torch.distributed.fsdp import FSDPModule

        model, optimizer = self.accelerator.prepare(model, optimizer)
        with torch.no_grad():
            model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=self.accelerator.device))
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()
        return model, optimizer

    @contextlib.contextmanager
    def for_generation(self, model):
        """Gather every layer once for the whole of generate (peft's generate calls the inner model,
        not the sharded root; and one gather beats one per token)."""
        from torch.distributed.fsdp import FSDPModule

        modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
        for module in modules:
            module.unshard()
            module.set_reshard_after_forward(False)
        try:
            yield
        finally:
            reshard = self.accelerator.state.fsdp_plugin.reshard_after_forward
            for module in modules:
                module.reshard()
                module.set_reshard_after_forward(bool(reshard))

    @contextlib.contextmanager
    def full_weights(self, model, params=None):
        """Each DTensor parameter is replaced by a full copy for the duration (read them with
        named_parameters: FSDP2's state_dict hook swaps its own shards back in; and peft's merge on
        DTensors is wrong by up to 0.17 and leaves the shards changed, measured); the shards are put
        back on exit, unchanged. `params`: only these (by identity), in the same order on every
        process."""
        from torch.distributed.tensor import DTensor

        wanted = None if params is None else {id(p) for p in params}
        swapped = [(module, name, param) for module in model.modules()
                   for name, param in module._parameters.items()
                   if isinstance(param, DTensor) and (wanted is None or id(param) in wanted)]
        for module, name, param in swapped:
            module._parameters[name] = torch.nn.Parameter(param.full_tensor(), requires_grad=False)
        try:
            yield
        finally:
            for module, name, param in swapped:
                module._parameters[name] = param

    # ---- engine/ in a checkpoint
    # ------------------------------------------------------------------
    def _gather_state(self, model, optimizer, gathered: dict | None) -> State:
        """The optimizer state gathered whole (to the CPU) by torch.distributed.checkpoint; the
        weights taken from the state dict save_pretrained just gathered (the main process holds it;
        the others write nothing)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        names = [name for name, _ in self._trainable(model)]
        osd = get_optimizer_state_dict(model, optimizer.optimizer,
                                       options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        gathered = gathered or {}
        weights = {name: gathered[name] for name in names if name in gathered}
        tensors = {f"{name}::{key}": value for name, state in osd.get("state", {}).items()
                   for key, value in state.items() if torch.is_tensor(value)}
        return weights, tensors, {"param_groups": osd.get("param_groups", [])}

    def _scatter_state(self, model, optimizer, weights: dict, tensors: dict, scalars: dict) -> None:
        """torch.distributed.checkpoint splits the full weights and optimizer state into this
        process's pieces."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        set_model_state_dict(model, weights, options=StateDictOptions(full_state_dict=True, strict=False))
        state: dict = {}
        for flat, value in tensors.items():
            name, key = flat.rsplit("::", 1)
            state.setdefault(name, {})[key] = value
        set_optimizer_state_dict(model, optimizer.optimizer,
                                 {"state": state, "param_groups": scalars["param_groups"]},
                                 options=StateDictOptions(full_state_dict=True))
