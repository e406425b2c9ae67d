"""Saving what a trainer writes, whatever the engine: `save_pretrained` of the full weights and the
LoRA-merged copy, plus the checkpoint's engine/ folder, which each engine writes and reads itself
(`save_state` / `load_state` in rlft/train/engines/: FSDP2 through torch.distributed.checkpoint, DeepSpeed
through its safe_get/set_full_* helpers; the files' format is in rlft/train/engines/base.py).

Every process calls these (gathering is a collective); the main process writes. Files are written without
pickle.
"""

from __future__ import annotations

from pathlib import Path

from rlft.train.engines.deepspeed import relink_optimizer_state
from rlft.train.safe_files import check_finite

__all__ = ["load_engine_state", "merged_copy", "relink_optimizer_state", "save_engine_state",
           "save_pretrained"]


def save_pretrained(accelerator, engine, model, folder: Path, tokenizer=None) -> dict | None:
    """`save_pretrained` of the full weights, gathered on every process (FSDP2, ZeRO-3), written by the main
    one. Returns the gathered state dict (the main process's; None when nothing had to be gathered)."""

    unwrapped = accelerator.unwrap_model(model)
    state_dict = accelerator.get_state_dict(model) if engine.sharded else None
    if accelerator.is_main_process:
        check_finite(unwrapped if state_dict is None else state_dict)
        unwrapped.save_pretrained(folder, **({} if state_dict is None else
                                              {"state_dict": _without_tied(unwrapped, state_dict)}))
        if tokenizer is not None:
            tokenizer.save_pretrained(folder)
    accelerator.wait_for_everyone()
    return state_dict


def _without_tied(model, state_dict: dict) -> dict:
    """A gathered state dict holds tied weights (lm_head = embeddings) as separate tensors, so save_pretrained
    cannot see the tie and would save both: keep the first name of each shared parameter only."""
    seen, tied = set(), set()
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in seen:
            tied.add(name)
        seen.add(id(param))
    return {k: v for k, v in state_dict.items() if k not in tied}


def merged_copy(peft_model, state_dict=None):
    """A LoRA model with its adapters merged into a new plain model; from `state_dict` (gathered full weights)
    when the model's own are in pieces. Built with the model class itself; under ZeRO-3 call it inside
    `TrainingEngine.unpartitioned()` (or transformers partitions the new model too)."""
    import copy

    if state_dict is None:
        return copy.deepcopy(peft_model).merge_and_unload()
    from peft import get_peft_model

    base = peft_model.get_base_model()
    fresh = get_peft_model(type(base)(base.config), copy.deepcopy(peft_model.peft_config["default"]))
    fresh.to(next(iter(state_dict.values())).dtype).load_state_dict(state_dict, strict=True)
    return fresh.merge_and_unload()


def save_engine_state(accelerator, engine, model, optimizer, folder: Path,
                      gathered: dict | None = None) -> None:
    """Write engine/ (its format: rlft/train/engines/base.py); every process calls this. The engine gathers
    its own state; `gathered`: the full state dict save_pretrained just gathered, which FSDP2 takes its
    weights from rather than gather them again (`accelerator`: the engine's own, kept for the callers)."""
    engine.save_state(model, optimizer, folder, gathered)


def load_engine_state(accelerator, engine, model, optimizer, folder: Path) -> None:
    """Read engine/ back into the sharded model and optimizer, split the engine's way (every process)."""
    engine.load_state(model, optimizer, folder)
