"""The training engine a launch asks for, and what differs between engines: DDP (or one process), FSDP2,
DeepSpeed ZeRO-2/3.

The accelerate config (`accelerate launch --config_file`, which sets ACCELERATE_USE_FSDP /
ACCELERATE_USE_DEEPSPEED and the plugin's settings) chooses the engine. accelerate drops both plugins
when the Accelerator runs with cpu=True, which is how a gloo group forms on a machine without CUDA; there
rlft switches the state to the engine asked for (what accelerate does itself on GPUs), so the engine that
runs is the one asked for on CPUs as on GPUs, and a mismatch is an error.

The loop calls an `Engine` for the few things that differ: accumulation, backward, clipping and the
optimiser step, gradients for the flow check, and full (gathered) weights and optimizer state for
checkpoints, which `rlft/train/engine_io.py` reads and writes.
"""

from __future__ import annotations

import contextlib
import os

import torch

from rlft.errors import ConfigError

ASKED = {"ACCELERATE_USE_FSDP": "fsdp", "ACCELERATE_USE_DEEPSPEED": "deepspeed"}
NAMES = {"ddp": "DDP", "fsdp": "FSDP2", "deepspeed": "DeepSpeed"}


def asked_engine() -> str:
    """'fsdp', 'deepspeed' or 'ddp' (DDP, or nothing on one process), from what the launcher set."""
    asked = [engine for env, engine in ASKED.items() if os.environ.get(env, "").lower() == "true"]
    if len(asked) > 1:
        raise ConfigError("the launch asks for both FSDP and DeepSpeed (ACCELERATE_USE_FSDP and "
                          "ACCELERATE_USE_DEEPSPEED are both true); pick one accelerate config")
    return asked[0] if asked else "ddp"


def engine_plugins(engine: str) -> dict:
    """The accelerate plugin for the engine asked for, built from the launcher's settings."""
    if engine == "fsdp":
        from accelerate.utils import FullyShardedDataParallelPlugin

        plugin = FullyShardedDataParallelPlugin()
        if plugin.fsdp_version != 2:
            raise ConfigError(f"the accelerate config asks for FSDP version {plugin.fsdp_version}; rlft runs FSDP2 "
                              "only: set fsdp_version: 2 (examples/accelerate/fsdp2.yaml)")
        return {"fsdp_plugin": plugin}
    if engine == "deepspeed":
        from accelerate.utils import DeepSpeedPlugin, is_deepspeed_available

        if not is_deepspeed_available():
            raise ConfigError("the accelerate config asks for DeepSpeed, which is not installed: "
                              "pip install 'rlft[deepspeed]'")
        plugin = DeepSpeedPlugin()
        if plugin.zero_stage not in (2, 3):
            raise ConfigError(f"the DeepSpeed config asks for ZeRO stage {plugin.zero_stage}; rlft runs stages 2 "
                              "and 3 (use DDP for no sharding: examples/accelerate/ddp.yaml)")
        return {"deepspeed_plugin": plugin}
    return {}


def force_engine(accelerator, engine: str, plugins: dict) -> None:
    """On a machine without CUDA, accelerate (cpu=True) set up a gloo group and dropped the plugin: switch its
    state to the engine asked for, as AcceleratorState does on GPUs. FSDP2 runs on gloo as is; DeepSpeed's
    communication layer is initialised over the same gloo group."""
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    state = accelerator.state
    if engine == "fsdp":
        state.fsdp_plugin = plugins["fsdp_plugin"]
        state.distributed_type = DistributedType.FSDP
    elif engine == "deepspeed":
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
        plugin = plugins["deepspeed_plugin"]
        plugin.set_mixed_precision("no")  # rlft sets the dtype itself (bf16 below when the weights are bf16)
        plugin.select(_from_accelerator_state=True)
        state.deepspeed_plugins = plugin
        state.distributed_type = DistributedType.DEEPSPEED
    PartialState._shared_state["distributed_type"] = state.distributed_type


def check_engine(accelerator, engine: str) -> None:
    """The engine that will run is the one asked for, or a ConfigError naming both."""
    from accelerate.utils import DistributedType

    running = {DistributedType.FSDP: "fsdp", DistributedType.DEEPSPEED: "deepspeed"}.get(
        accelerator.distributed_type, "ddp")
    if running != engine:
        raise ConfigError(f"the launch asks for {NAMES[engine]} but accelerate would run {NAMES[running]} "
                          f"({accelerator.distributed_type}); check the accelerate config and the launcher")


class Engine:
    """What differs between DDP, FSDP2 and DeepSpeed, behind one set of calls the loop makes."""

    def __init__(self, accelerator):
        from accelerate.utils import DistributedType

        self.accelerator = accelerator
        self.deepspeed = accelerator.distributed_type == DistributedType.DEEPSPEED
        self.fsdp = accelerator.distributed_type == DistributedType.FSDP
        self.zero_stage = accelerator.state.deepspeed_plugin.zero_stage if self.deepspeed else 0
        self.name = "fsdp2" if self.fsdp else f"zero{self.zero_stage}" if self.deepspeed else \
            "ddp" if accelerator.num_processes > 1 else "single"

    @property
    def sharded(self) -> bool:
        """Weights live in pieces on the processes (FSDP2, ZeRO-3): generation must keep every process in step."""
        return self.fsdp or self.zero_stage == 3

    @property
    def gathers_checkpoints(self) -> bool:
        """Checkpoints go through full gathered weights and optimizer state (engine/): FSDP2 and DeepSpeed, whose
        optimizer state is in pieces on the processes."""
        return self.fsdp or self.deepspeed

    # ---- preparing --------------------------------------------------------------------------------
    def before_loading(self, dtype: torch.dtype) -> None:
        """Under DeepSpeed the config's bf16 follows the dtype asked for, before any model is loaded: under ZeRO-3
        transformers builds the model inside zero.Init, which casts every weight to the config's dtype (float32
        unless bf16 is enabled there: a bfloat16 run trained and saved float32 weights, measured)."""
        if not self.deepspeed:
            return
        if dtype == torch.float16:
            raise ConfigError("float16 weights under DeepSpeed: rlft trains bfloat16 or float32 (dtype: bfloat16)")
        plugin = self.accelerator.state.deepspeed_plugin
        plugin.deepspeed_config["bf16"] = {"enabled": dtype == torch.bfloat16}
        if plugin.zero3_init_flag:  # transformers' zero.Init reads the copy registered here
            plugin.set_deepspeed_weakref()

    def prepare(self, model, optimizer, max_grad_norm: float | None):
        if self.deepspeed:
            self._fill_deepspeed_config(model, max_grad_norm)
        model, optimizer = self.accelerator.prepare(model, optimizer)
        if self.fsdp:  # FSDP2 finds its root module at the first forward: make it the whole model, not the inner
            from torch.distributed.fsdp import FSDPModule  # model peft's generate calls (each layer a root)

            with torch.no_grad():
                model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=self.accelerator.device))
            for module in model.modules():  # the root keeps its weights gathered after a forward: back to pieces
                if isinstance(module, FSDPModule):
                    module.reshard()
        return model, optimizer

    def _fill_deepspeed_config(self, model, max_grad_norm: float | None) -> None:
        """rlft accumulates micro-batches itself and steps once per rlft step (DeepSpeed's unmanaged
        accumulation), clips at max_grad_norm, and trains bf16 weights with DeepSpeed's fp32 master copy."""
        config = self.accelerator.state.deepspeed_plugin.deepspeed_config
        clip = float(max_grad_norm or 0.0)
        asked = config.get("gradient_clipping", "auto")
        if asked != "auto" and float(asked) != clip:
            raise ConfigError(f"the DeepSpeed config's gradient_clipping={asked} differs from max_grad_norm={clip}; "
                              "set one of them to the other (or gradient_clipping: auto)")
        accumulation = config.get("gradient_accumulation_steps", "auto")
        if accumulation not in ("auto", 1):
            raise ConfigError(f"the DeepSpeed config's gradient_accumulation_steps={accumulation}: rlft accumulates "
                              "itself (gradient_accumulation_steps in the rlft config); set it to 1 or auto there")
        bf16 = next(model.parameters()).dtype == torch.bfloat16
        if next(model.parameters()).dtype == torch.float16:
            raise ConfigError("float16 weights under DeepSpeed: rlft trains bfloat16 or float32 (dtype: bfloat16)")
        config.update({"gradient_clipping": clip, "gradient_accumulation_steps": 1, "train_micro_batch_size_per_gpu": 1,
                       "managed_gradient_accumulation": False, "zero_allow_untested_optimizer": True,
                       "bf16": {"enabled": bf16}, "fp16": {"enabled": False}})
        config["zero_optimization"].setdefault("stage3_gather_16bit_weights_on_model_save", True)
        config.pop("train_batch_size", None)

    def prepare_reference(self, reference):
        """The frozen reference policy: a ZeRO-3 inference engine (sharded like the policy) under ZeRO-3, a full
        copy on every process otherwise (as TRL does: ZeRO-2 and FSDP keep it whole)."""
        if self.zero_stage != 3:
            return reference.to(self.accelerator.device)
        import deepspeed

        config = self.accelerator.state.deepspeed_plugin.deepspeed_config
        inference = {"train_micro_batch_size_per_gpu": 1, "bf16": config.get("bf16", {"enabled": False}),
                     "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold":
                                           config["zero_optimization"].get("stage3_param_persistence_threshold", 1e5)}}
        engine, *_ = deepspeed.initialize(model=reference, config=inference)
        engine.eval()
        return engine

    @contextlib.contextmanager
    def unpartitioned(self):
        """Context for building a plain model on one process (the merged LoRA copy save_model writes): under
        DeepSpeed ZeRO-3 transformers would otherwise build it inside zero.Init, a collective only that process
        enters (it hangs). accelerate's zero3_init_context_manager(enable=False) re-registers the same ZeRO-3
        config with transformers (accelerate 1.15), so the registration is lifted here for the duration."""
        if not self.deepspeed:
            yield
            return
        from transformers.integrations.deepspeed import set_hf_deepspeed_config, unset_hf_deepspeed_config

        registered = self.accelerator.state.deepspeed_plugin.dschf
        unset_hf_deepspeed_config()
        try:
            yield
        finally:
            if registered is not None:
                set_hf_deepspeed_config(registered)

    @contextlib.contextmanager
    def for_generation(self, model):
        """FSDP2: gather every layer once for the whole of generate (peft's generate calls the inner model, not the
        sharded root; and one gather beats one per token). ZeRO-3 gathers per forward, kept in step by synced_gpus."""
        if not self.fsdp:
            yield
            return
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
    def full_weights(self, model):
        """Every process holds every weight whole inside (what a weight sync to vLLM reads; every process must
        enter it together), as plain tensors; whatever is done to them inside (peft's merge) is dropped on exit,
        the shards stay the source of truth. FSDP2: each DTensor parameter is replaced by a full copy for the
        duration (read them with named_parameters: FSDP2's state_dict hook swaps its own shards back in; and
        peft's merge on DTensors is wrong by up to 0.17 and leaves the shards changed, measured); ZeRO-3: all
        parameters gathered."""
        if self.fsdp:
            from torch.distributed.tensor import DTensor

            swapped = [(module, name, param) for module in model.modules()
                       for name, param in module._parameters.items() if isinstance(param, DTensor)]
            for module, name, param in swapped:
                module._parameters[name] = torch.nn.Parameter(param.full_tensor(), requires_grad=False)
            try:
                yield
            finally:
                for module, name, param in swapped:
                    module._parameters[name] = param
        elif self.zero_stage == 3:
            import deepspeed

            with deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=None):
                yield
        else:
            yield

    # ---- one optimiser step ---------------------------------------------------------------------
    def micro_batch(self, model, last: bool):
        """Context for one accumulation micro-batch: DDP and FSDP2 skip the gradient sync but on the last one;
        DeepSpeed's unmanaged accumulation reduces per micro-batch and steps once."""
        if self.deepspeed or last:
            return contextlib.nullcontext()
        return self.accelerator.no_sync(model)

    def backward(self, model, loss: torch.Tensor) -> None:
        if self.deepspeed:  # not accelerator.backward: that runs engine.step() after every micro-batch
            model.backward(loss, scale_wrt_gas=False)
        else:
            self.accelerator.backward(loss)

    def clip(self, model, max_grad_norm: float | None) -> float | None:
        """The gradient norm before clipping; None under DeepSpeed, which clips inside its step."""
        if self.deepspeed:
            return None
        return float(self.accelerator.clip_grad_norm_(model.parameters(), max_grad_norm))

    def step(self, model, optimizer) -> tuple[bool, float | None]:
        """(was the step applied, gradient norm). DeepSpeed skips a step whose gradient norm is not finite."""
        if not self.deepspeed:
            optimizer.step()
            return True, None
        model.step()
        from rlft.train.engine_io import relink_optimizer_state

        relink_optimizer_state(model.optimizer)
        norm = model.get_global_grad_norm()
        return bool(model.was_step_applied()), None if norm is None else float(norm)

    def zero_grad(self, model, optimizer) -> None:
        optimizer.zero_grad(set_to_none=True)
        if self.deepspeed:
            model.zero_grad()

    def watch_grads(self, model) -> None:
        """Before the backward passes the flow check reads: DeepSpeed keeps gradients in its own buffers (and
        reduces them inside its step), so hooks note each trainable parameter's gradient as autograd makes it."""
        if not self.deepspeed:
            return
        from functools import partial

        from rlft.models import trainable_parameters

        self._seen: dict[str, float] = {}
        self._hooks = [p.register_hook(partial(self._note, name))
                       for name, p in trainable_parameters(self.accelerator.unwrap_model(model))]

    def _note(self, name: str, grad: torch.Tensor) -> None:
        self._seen[name] = self._seen.get(name, 0.0) + float(grad.detach().float().pow(2).sum())

    def grads(self, model) -> list[tuple[str, torch.Tensor | None]]:
        """Every trainable parameter's gradient after the backward passes, the same on every process (FSDP2's
        sharded gradients reduce when their norm is taken; DeepSpeed's hooked squares are summed over processes).
        None for a parameter that got no gradient at all."""
        from rlft.models import trainable_parameters

        named = trainable_parameters(self.accelerator.unwrap_model(model))
        if not self.deepspeed:
            return [(name, p.grad) for name, p in named]
        for hook in self._hooks:
            hook.remove()
        squares = torch.tensor([self._seen.get(name, -1.0) for name, _ in named], dtype=torch.float64,
                               device=self.accelerator.device)
        squares = self.accelerator.reduce(squares, "sum")  # a missing gradient is missing on every process
        return [(name, None if value < 0 else value.sqrt().reshape(1)) for (name, _), value in zip(named, squares)]
