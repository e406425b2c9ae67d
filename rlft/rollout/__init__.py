"""Rollout engines behind one protocol: `engine(model, prompt_ids, num_generations, greedy=False) -> Rollout`.

`make_generator(args, tokenizer)` builds the engine a config asks for; the trainer never knows
which one runs: transformers' `generate` (`hf.py`, the default) or vLLM (`vllm.py`, `use_vllm=True`).
"""

from __future__ import annotations

from rlft.rollout.hf import HFGenerator, Rollout

__all__ = ["HFGenerator", "Rollout", "make_generator"]


def make_generator(args, tokenizer, model=None, source=None, synced: bool = False):
    """The rollout engine for a GRPOConfig (`model`: the policy, `source`: where it was loaded from; `synced`:
    the weights are sharded over the processes (FSDP2, ZeRO-3), so every process runs every forward pass)."""
    if args.use_vllm:
        if synced:
            from rlft.config import ConfigError

            raise ConfigError("use_vllm with FSDP2 or ZeRO-3: syncing sharded weights into vLLM is not built; use the "
                              "generate engine (use_vllm: false) or DDP / ZeRO-2")
        if args.vllm_mode == "server":
            from rlft.rollout.vllm_server import VLLMServer

            return VLLMServer(args, tokenizer, model)
        from rlft.rollout.vllm import VLLMColocate

        return VLLMColocate(args, tokenizer, model, source)
    return HFGenerator(tokenizer, max_new_tokens=args.max_completion_length, temperature=args.temperature,
                       top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                       repetition_penalty=args.repetition_penalty, cache_implementation=args.cache_implementation,
                       shared_prompt_prefill=args.shared_prompt_prefill, generation_kwargs=args.generation_kwargs,
                       synced=synced)
