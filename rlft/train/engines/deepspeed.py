"""DeepSpeed ZeRO-2 and ZeRO-3: the optimizer state (and gradients) in pieces on the processes;
under ZeRO-3 the weights too, from the moment transformers builds the model inside zero.Init.

What differs from the plain engine: the DeepSpeed config is filled from rlft's settings (bf16,
clipping, rlft's own accumulation), DeepSpeed runs backward / clipping / the step itself and keeps
gradients in its own buffers (the flow check reads them through hooks), and checkpoints gather the
fp32 master weights and optimizer state whole through deepspeed.utils' safe_get/set_full_* helpers.
The zero stage decides the rest (`zero_stage`).
"""

from __future__ import annotations

import contextlib

import torch

from rlft.errors import ConfigError
from rlft.train.engines.engine_base import GatheringEngine, State

FLOAT16 = "float16 weights under DeepSpeed: rlft trains bfloat16 or float32 (dtype: bfloat16)"
FLOAT64 = ("float64 weights under DeepSpeed: its engines train bfloat16, float16 or float32 and "
           "would cast the model to float32 without a word (dtype: float32, or train float64 under "
           "DDP or FSDP2)")


class DeepSpeedEngine(GatheringEngine):
    """DeepSpeed through accelerate's plugin; `zero_stage` is 2 or 3 (engine_plugins refuses the
    others)."""

    def __init__(self, accelerator):
        super().__init__(accelerator)
        self.zero_stage = accelerator.state.deepspeed_plugin.zero_stage

    @property
    def name(self) -> str:
        return f"zero{self.zero_stage}"

    @property
    def sharded(self) -> bool:
        return self.zero_stage == 3

    @property
    def partitions_on_load(self) -> bool:
        return self.zero_stage == 3

    @property
    def _plugin(self):
        return self.accelerator.state.deepspeed_plugin

    # ---- preparing --------------------------------------------------------------------------------
    def before_loading(self, dtype: torch.dtype) -> None:
        """The config's bf16 follows the dtype asked for, before any model is loaded: under ZeRO-3
        transformers builds the model inside zero.Init, which casts every weight to the config's
        dtype (float32 unless bf16 is enabled there: a bfloat16 run trained and saved float32
        weights, measured)."""
        if dtype in (torch.float16, torch.float64):
            raise ConfigError(FLOAT16 if dtype == torch.float16 else FLOAT64)
        self._plugin.deepspeed_config["bf16"] = {"enabled": dtype == torch.bfloat16}
        if self._plugin.zero3_init_flag:  # transformers' zero.Init reads the copy registered here
            self._plugin.set_deepspeed_weakref()

    def prepare(self, model, optimizer, max_grad_norm: float | None):
        """accelerate builds the DeepSpeed engine from the plugin's config: fill that from rlft
        first."""
        self._fill_config(model, max_grad_norm)
        return self.accelerator.prepare(model, optimizer)

    def _fill_config(self, model, max_grad_norm: float | None) -> None:
        """rlft accumulates micro-batches itself and steps once per rlft step (DeepSpeed's unmanaged
        accumulation), clips at max_grad_norm, and trains bf16 weights with DeepSpeed's fp32 master
        copy."""
        config = self._plugin.deepspeed_config
        clip = float(max_grad_norm or 0.0)
        asked = config.get("gradient_clipping", "auto")
        if asked != "auto" and float(asked) != clip:
            raise ConfigError(f"the DeepSpeed config's gradient_clipping={asked} differs from "
                              f"max_grad_norm={clip}; set one of them to the other "
                              "(or gradient_clipping: auto)")
        accumulation = config.get("gradient_accumulation_steps", "auto")
        if accumulation not in ("auto", 1):
            raise ConfigError(f"the DeepSpeed config's gradient_accumulation_steps={accumulation}: "
                              "rlft accumulates itself (gradient_accumulation_steps in the rlft "
                              "config); set it to 1 or auto there")
        dtype = next(model.parameters()).dtype
        if dtype in (torch.float16, torch.float64):  # a loaded model passed in
            raise ConfigError(FLOAT16 if dtype == torch.float16 else FLOAT64)
        bf16 = dtype == torch.bfloat16
        config.update({"gradient_clipping": clip, "gradient_accumulation_steps": 1,
                       "train_micro_batch_size_per_gpu": 1, "managed_gradient_accumulation": False,
                       "zero_allow_untested_optimizer": True, "bf16": {"enabled": bf16},
                       "fp16": {"enabled": False}})
        config["zero_optimization"].setdefault("stage3_gather_16bit_weights_on_model_save", True)
        config.pop("train_batch_size", None)

    def prepare_reference(self, reference):
        """Under ZeRO-3 a ZeRO-3 inference engine, sharded like the policy; under ZeRO-2 a full copy
        on every process, as TRL keeps it."""
        if self.zero_stage != 3:
            return super().prepare_reference(reference)
        import deepspeed

        config = self._plugin.deepspeed_config
        threshold = config["zero_optimization"].get("stage3_param_persistence_threshold", 1e5)
        inference = {"train_micro_batch_size_per_gpu": 1, "bf16": config.get("bf16", {"enabled": False}),
                     "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": threshold}}
        engine, *_ = deepspeed.initialize(model=reference, config=inference)
        engine.eval()
        return engine

    @contextlib.contextmanager
    def unpartitioned(self):
        """Under ZeRO-3 transformers would otherwise build the plain model inside zero.Init, a
        collective only that process enters (it hangs). accelerate's
        zero3_init_context_manager(enable=False) re-registers the same ZeRO-3 config with
        transformers (accelerate 1.15), so the registration is lifted here for the duration."""
        from transformers.integrations.deepspeed import set_hf_deepspeed_config, unset_hf_deepspeed_config

        registered = self._plugin.dschf
        unset_hf_deepspeed_config()
        try:
            yield
        finally:
            if registered is not None:
                set_hf_deepspeed_config(registered)

    @contextlib.contextmanager
    def full_weights(self, model, params=None):
        """ZeRO-3: all parameters (or only `params`) gathered on every process for the duration
        (ZeRO-3 gathers per forward during generation, kept in step by synced_gpus, so
        for_generation needs nothing). ZeRO-2: whole already."""
        if self.zero_stage != 3:
            yield
            return
        import deepspeed

        chosen = list(model.parameters()) if params is None else list(params)
        with deepspeed.zero.GatheredParameters(chosen, modifier_rank=None):
            yield

    # ---- one optimiser step ---------------------------------------------------------------------
    def micro_batch(self, model, last: bool):
        """DeepSpeed's unmanaged accumulation reduces per micro-batch and steps once: no sync to
        skip."""
        return contextlib.nullcontext()

    def backward(self, model, loss: torch.Tensor) -> None:
        """Not accelerator.backward: that runs engine.step() after every micro-batch."""
        model.backward(loss, scale_wrt_gas=False)

    def clip(self, model, max_grad_norm: float | None) -> float | None:
        """None: DeepSpeed clips inside its step, which reports the norm (`step`)."""
        return None

    def step(self, model, optimizer) -> tuple[bool, float | None]:
        """DeepSpeed skips a step whose gradient norm is not finite; the norm is the one it clipped
        with."""
        model.step()
        relink_optimizer_state(model.optimizer)
        norm = model.get_global_grad_norm()
        return bool(model.was_step_applied()), None if norm is None else float(norm)

    def zero_grad(self, model, optimizer) -> None:
        """The engine holds its own gradient buffers besides the optimizer's parameters: clear
        both."""
        optimizer.zero_grad(set_to_none=True)
        model.zero_grad()

    def watch_grads(self, model) -> None:
        """DeepSpeed keeps gradients in its own buffers (and reduces them inside its step), so hooks
        note each trainable parameter's gradient as autograd makes it."""
        from functools import partial

        self._seen: dict[str, float] = {}
        self._hooks = [p.register_hook(partial(self._note, name)) for name, p in self._trainable(model)]

    def _note(self, name: str, grad: torch.Tensor) -> None:
        self._seen[name] = self._seen.get(name, 0.0) + float(grad.detach().float().pow(2).sum())

    def grads(self, model) -> list[tuple[str, torch.Tensor | None]]:
        """The hooked squares summed over processes: per-parameter gradient norms, alike on all
        processes."""
        named = self._trainable(model)
        for hook in self._hooks:
            hook.remove()
        squares = torch.tensor([self._seen.get(name, -1.0) for name, _ in named], dtype=torch.float64,
                               device=self.accelerator.device)
        # a missing gradient is missing on every process
        squares = self.accelerator.reduce(squares, "sum")
        return [(name, None if value < 0 else value.sqrt().reshape(1))
                for (name, _), value in zip(named, squares)]

    # ---- engine/ in a checkpoint
    # ------------------------------------------------------------------
    def _gather_state(self, model, optimizer, gathered: dict | None) -> State:
        """The fp32 master weights (a bf16 run resumes exactly) and every optimizer state tensor,
        whole."""
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

        weights, tensors = {}, {}
        keys = _state_keys(model)
        for name, param in self._trainable(model):
            weights[name] = safe_get_full_fp32_param(param)
            for key in keys:
                tensors[f"{name}::{key}"] = safe_get_full_optimizer_state(param, key)
        base = _torch_optimizer(model)
        steps = [float(s["step"]) for s in base.state.values() if "step" in s]
        scalars = {"step": steps[0] if steps else None, "lr": [g["lr"] for g in base.param_groups]}
        return weights, tensors, scalars

    def _scatter_state(self, model, optimizer, weights: dict, tensors: dict, scalars: dict) -> None:
        """The trained weights (ZeRO-3: gathered to write them), their fp32 master copies and the
        optimizer state, each into this process's pieces; step counts and learning rates set on the
        torch optimizer."""
        import deepspeed
        from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

        base, device = _torch_optimizer(model), self.accelerator.device
        if tensors and not base.state:
            _create_optimizer_state(model)
        for name, param in self._trainable(model):
            with deepspeed.zero.GatheredParameters([param], modifier_rank=0, enabled=hasattr(param, "ds_id")):
                param.data.copy_(weights[name].to(param.dtype))
            safe_set_full_fp32_param(param, weights[name].to(device))
            for flat in (k for k in tensors if k.startswith(f"{name}::")):
                safe_set_full_optimizer_state(param, tensors[flat].to(device), flat.rsplit("::", 1)[1])
        for state in base.state.values():
            if "step" in state and scalars.get("step") is not None:
                state["step"] = torch.full_like(torch.as_tensor(state["step"]), scalars["step"])
        for group, lr in zip(base.param_groups, scalars["lr"], strict=True):
            group["lr"] = lr


def _torch_optimizer(model):
    """DeepSpeedEngine -> ZeRO optimizer -> the torch optimizer over fp32 pieces."""
    return model.optimizer.optimizer


def _state_keys(model) -> list[str]:
    """The optimizer's per-parameter state tensors by key (exp_avg, exp_avg_sq, ...), scalars left
    out."""
    keys = set()
    for state in _torch_optimizer(model).state.values():
        keys.update(k for k, v in state.items() if torch.is_tensor(v) and v.dim() > 0)
    return sorted(keys)


def _create_optimizer_state(model) -> None:
    """The torch optimizer under ZeRO creates its state at its first step: take one with zero
    gradients and a learning rate of 0 (weights unchanged), so the saved state has somewhere to
    go."""
    base = _torch_optimizer(model)
    rates = [group["lr"] for group in base.param_groups]
    for group in base.param_groups:
        group["lr"] = 0.0
    ids = torch.zeros(1, 1, dtype=torch.long, device=model.device)
    model.backward(model(input_ids=ids).logits.float().sum() * 0.0, scale_wrt_gas=False)
    model.step()
    relink_optimizer_state(model.optimizer)
    for group, lr in zip(base.param_groups, rates, strict=True):
        group["lr"] = lr


def relink_optimizer_state(zero) -> None:
    """ZeRO-1/2 link each parameter to its optimizer state after the first step, but already after
    the first param group's step, before the later groups have any state (transformers' decay /
    no-decay groups): link again once every group has stepped, so each parameter's full optimizer
    state can be read and written."""
    if getattr(zero, "_rlft_states_relinked", False) or not hasattr(zero,
                                                                    "_lazy_init_hp_params_optimizer_state"):
        return
    if all(zero.optimizer.state.get(p) for group in zero.optimizer.param_groups for p in group["params"]):
        zero._hp_optimizer_states_linked = False
        zero._lazy_init_hp_params_optimizer_state()
        zero._rlft_states_relinked = True
