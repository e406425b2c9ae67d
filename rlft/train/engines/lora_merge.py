"""The LoRA-merged copy a reward model is saved as, whatever the engine (the full weights and the
checkpoint files each engine saves itself: `save_pretrained`, `save_checkpoint` in
rlft/train/engines/engine_base.py)."""

from __future__ import annotations

from rlft.train.engines.deepspeed import relink_optimizer_state

__all__ = ["merged_copy", "relink_optimizer_state"]


def merged_copy(peft_model, state_dict=None):
    """A LoRA model with its adapters merged into a new plain model; from `state_dict` (gathered
    full weights) when the model's own are in pieces. Built with the model class itself; under
    ZeRO-3 call it inside `TrainingEngine.unpartitioned()` (or transformers partitions the new model
    too)."""
    import copy

    if state_dict is None:
        return copy.deepcopy(peft_model).merge_and_unload()
    from peft import get_peft_model

    base = peft_model.get_base_model()
    fresh = get_peft_model(type(base)(base.config), copy.deepcopy(peft_model.peft_config["default"]))
    fresh.to(next(iter(state_dict.values())).dtype).load_state_dict(state_dict, strict=True)
    return fresh.merge_and_unload()
