"""Rollout engines behind one protocol (`RolloutEngine`, rlft/rollout/base.py): `engine(model,
prompt_ids, num_generations, greedy=False) -> Rollout`, `on_weights_changed()`, `close()`.

`make_generator(args, tokenizer)` builds the engine a config asks for from a small table; the
trainer never knows which one runs: transformers' `generate` (`hf.py`, the default) or vLLM
(`vllm.py`, `use_vllm=True`).
"""

from __future__ import annotations

from rlft.config.rules import replay_plan
from rlft.rollout.base import Rollout, RolloutEngine
from rlft.rollout.hf import HFGenerator

__all__ = ["HFGenerator", "Rollout", "RolloutEngine", "make_generator"]


def _hf(args, tokenizer, model, source, synced, full_weights) -> HFGenerator:
    return HFGenerator(tokenizer, max_new_tokens=args.max_completion_length, temperature=args.temperature,
                       top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                       repetition_penalty=args.repetition_penalty,
                       cache_implementation=args.cache_implementation,
                       shared_prompt_prefill=args.shared_prompt_prefill,
                       generation_kwargs=args.generation_kwargs, synced=synced,
                       replay_mask=replay_plan(args)[0])


def _vllm_colocate(args, tokenizer, model, source, synced, full_weights):
    from rlft.rollout.vllm import VLLMColocate

    return VLLMColocate(args, tokenizer, model, source, full_weights)


def _vllm_server(args, tokenizer, model, source, synced, full_weights):
    from rlft.rollout.vllm_server import VLLMServer

    return VLLMServer(args, tokenizer, model, full_weights)


# (use_vllm, vllm_mode) -> builder; vLLM is imported only when asked for
ENGINES = {(False, None): _hf, (True, "colocate"): _vllm_colocate, (True, "server"): _vllm_server}


def make_generator(args, tokenizer, model=None, source=None, synced: bool = False,
                   full_weights=None) -> RolloutEngine:
    """The rollout engine for a GRPOConfig (`model`: the policy, `source`: where it was loaded from;
    `synced`: the weights are sharded over the processes (FSDP2, ZeRO-3), so every process runs
    every forward pass; `full_weights(model)`: a context inside which every process holds the
    weights whole, entered by all processes together; a vLLM engine reads its weight sync there)."""
    build = ENGINES[(True, args.vllm_mode) if args.use_vllm else (False, None)]
    return build(args, tokenizer, model, source, synced, full_weights)
