"""Rollout engines behind one protocol: `engine(model, prompt_ids, num_generations, greedy=False) -> Rollout`.

`make_generator(args, tokenizer)` builds the engine a config asks for; the trainer never knows
which one runs. Today: transformers' `generate` (`hf.py`).
"""

from __future__ import annotations

from rlft.rollout.hf import HFGenerator, Rollout

__all__ = ["HFGenerator", "Rollout", "make_generator"]


def make_generator(args, tokenizer) -> HFGenerator:
    """The rollout engine for a GRPOConfig."""
    return HFGenerator(tokenizer, max_new_tokens=args.max_completion_length, temperature=args.temperature,
                       top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                       repetition_penalty=args.repetition_penalty, cache_implementation=args.cache_implementation,
                       shared_prompt_prefill=args.shared_prompt_prefill, generation_kwargs=args.generation_kwargs)
