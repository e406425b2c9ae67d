"""Rollout engines behind one protocol: `engine(model, prompt_ids, num_generations, greedy=False) -> Rollout`.

`make_generator(args, tokenizer)` builds the engine a config asks for; the trainer never knows
which one runs: transformers' `generate` (`hf.py`, the default) or vLLM (`vllm.py`, `use_vllm=True`).
"""

from __future__ import annotations

from rlft.rollout.hf import HFGenerator, Rollout

__all__ = ["HFGenerator", "Rollout", "make_generator"]


def make_generator(args, tokenizer, model=None, source=None, synced: bool = False, full_weights=None):
    """The rollout engine for a GRPOConfig (`model`: the policy, `source`: where it was loaded from; `synced`:
    the weights are sharded over the processes (FSDP2, ZeRO-3), so every process runs every forward pass;
    `full_weights(model)`: a context inside which every process holds the weights whole, entered by all
    processes together; a vLLM engine reads its weight sync there)."""
    if args.use_vllm:
        if args.vllm_mode == "server":
            from rlft.rollout.vllm_server import VLLMServer

            return VLLMServer(args, tokenizer, model, full_weights)
        from rlft.rollout.vllm import VLLMColocate

        return VLLMColocate(args, tokenizer, model, source, full_weights)
    return HFGenerator(tokenizer, max_new_tokens=args.max_completion_length, temperature=args.temperature,
                       top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                       repetition_penalty=args.repetition_penalty, cache_implementation=args.cache_implementation,
                       shared_prompt_prefill=args.shared_prompt_prefill, generation_kwargs=args.generation_kwargs,
                       synced=synced)
