"""The training engine a launch asks for, and the engine classes: DDP (or one process), FSDP2,
ZeRO-2/3.

The accelerate config (`accelerate launch --config_file`, which sets ACCELERATE_USE_FSDP /
ACCELERATE_USE_DEEPSPEED and the plugin's settings) chooses the engine. accelerate drops both
plugins when the Accelerator runs with cpu=True, which is how a gloo group forms on a machine
without CUDA; there rlft switches the state to the engine asked for (what accelerate does itself on
GPUs), so the engine that runs is the one asked for on CPUs as on GPUs, and a mismatch is an error.

`make_engine(accelerator)` picks the engine class once, from what accelerate will run; the loops
then call a `TrainingEngine` (base.py) for the few things that differ: accumulation, backward,
clipping and the optimiser step, gradients for the flow check, full (gathered) weights, and the
engine state a checkpoint holds. No code outside this package asks which engine runs.
"""

from __future__ import annotations

import os

from rlft.errors import ConfigError
from rlft.train.engines.ddp import DDPEngine
from rlft.train.engines.deepspeed import DeepSpeedEngine
from rlft.train.engines.engine_base import TrainingEngine
from rlft.train.engines.fsdp2 import FSDP2Engine

__all__ = ["DDPEngine", "DeepSpeedEngine", "Engine", "FSDP2Engine", "TrainingEngine", "asked_engine",
           "check_engine", "engine_plugins", "force_engine", "make_engine"]

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
            raise ConfigError(f"the accelerate config asks for FSDP version {plugin.fsdp_version}; "
                              "rlft runs FSDP2 only: set fsdp_version: 2 "
                              "(examples/accelerate/fsdp2.yaml)")
        return {"fsdp_plugin": plugin}
    if engine == "deepspeed":
        from accelerate.utils import DeepSpeedPlugin, is_deepspeed_available

        if not is_deepspeed_available():
            raise ConfigError("the accelerate config asks for DeepSpeed, which is not installed: "
                              "pip install 'rlft[deepspeed]'")
        plugin = DeepSpeedPlugin()
        if plugin.zero_stage not in (2, 3):
            raise ConfigError(f"the DeepSpeed config asks for ZeRO stage {plugin.zero_stage}; rlft "
                              "runs stages 2 and 3 (use DDP for no sharding: "
                              "examples/accelerate/ddp.yaml)")
        return {"deepspeed_plugin": plugin}
    return {}


def force_engine(accelerator, engine: str, plugins: dict) -> None:
    """On a machine without CUDA, accelerate (cpu=True) set up a gloo group and dropped the plugin:
    switch its state to the engine asked for, as AcceleratorState does on GPUs. FSDP2 runs on gloo
    as is; DeepSpeed's communication layer is initialised over the same gloo group."""
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
        # rlft sets the dtype itself (bf16 below when the weights are bf16)
        plugin.set_mixed_precision("no")
        plugin.select(_from_accelerator_state=True)
        state.deepspeed_plugins = plugin
        state.distributed_type = DistributedType.DEEPSPEED
    PartialState._shared_state["distributed_type"] = state.distributed_type


def _running(accelerator) -> str:
    """The engine accelerate will run, named as asked_engine names it: distributed_type is read only
    here."""
    from accelerate.utils import DistributedType

    return {DistributedType.FSDP: "fsdp", DistributedType.DEEPSPEED: "deepspeed"}.get(
        accelerator.distributed_type, "ddp")


def check_engine(accelerator, engine: str) -> None:
    """The engine that will run is the one asked for, or a ConfigError naming both."""
    running = _running(accelerator)
    if running != engine:
        raise ConfigError(f"the launch asks for {NAMES[engine]} but accelerate would run "
                          f"{NAMES[running]} ({accelerator.distributed_type}); check the "
                          "accelerate config and the launcher")


CLASSES: dict[str, type[TrainingEngine]] = {"ddp": DDPEngine, "fsdp": FSDP2Engine,
                                            "deepspeed": DeepSpeedEngine}


def make_engine(accelerator) -> TrainingEngine:
    """The engine for what accelerate will run, chosen once: the only place the classes are told
    apart."""
    return CLASSES[_running(accelerator)](accelerator)


Engine = make_engine  # the name the trainers called before the engines were classes
