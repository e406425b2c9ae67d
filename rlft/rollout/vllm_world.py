"""A colocated vLLM engine inside the trainer's torch.distributed world (torchrun): its shutdown must
leave the trainer's groups alone (rlft/rollout/vllm.py starts the engine)."""

from __future__ import annotations

import weakref


def keep_the_trainers_process_group(llm) -> None:
    """Under torchrun, an in-process engine builds its groups inside the trainer's torch.distributed
    world, and its shutdown destroys that world's default group too, at interpreter exit, after rlft
    has already destroyed it (a traceback per rank). Shut the engine down without touching groups it
    does not own."""
    client = getattr(llm.llm_engine, "engine_core", None)
    finalizer, core = getattr(client, "_finalizer", None), getattr(client, "engine_core", None)
    if not (finalizer and core):  # another vLLM version: leave its shutdown as it is
        return
    finalizer.detach()
    weakref.finalize(client, _shutdown_in_shared_world, core)


def _shutdown_in_shared_world(core) -> None:
    import torch.distributed as dist
    from vllm.distributed import parallel_state

    for part in (core.model_executor, core.scheduler):
        if part is not None:
            part.shutdown()
    if dist.is_initialized():  # rlft's group still lives: destroy only vLLM's own groups
        parallel_state.destroy_model_parallel()
        if parallel_state._WORLD:
            parallel_state._WORLD.destroy()
    parallel_state._WORLD = None
