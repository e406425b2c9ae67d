"""TRL's `trl.models.unwrap_model_for_generation` for a script's own generation with a trainer's
model (TRL 1.16's signature): the model as transformers built it, its weights whole for the duration
(a ZeRO-3 model gathered when `gather_deepspeed3_params`, an FSDP2 model unsharded), reshard on
exit. Every process must enter it together when the weights are sharded.
"""

from __future__ import annotations

import contextlib


@contextlib.contextmanager
def unwrap_model_for_generation(model, accelerator, gather_deepspeed3_params: bool = True, **kwargs):
    unwrapped = accelerator.unwrap_model(model)
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    if plugin is not None and plugin.zero_stage == 3 and gather_deepspeed3_params:
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=None):
            yield unwrapped
        return
    from torch.distributed.fsdp import FSDPModule

    sharded = [m for m in unwrapped.modules() if isinstance(m, FSDPModule)]
    for module in sharded:
        module.unshard()
    try:
        yield unwrapped
    finally:
        for module in sharded:
            module.reshard()
