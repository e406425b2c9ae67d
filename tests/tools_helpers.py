"""A scripted policy for tool-loop tests: a generator stand-in that writes fixed turns."""

from __future__ import annotations

import time

import torch

from rlft.data.prompts import left_pad
from rlft.rollout.hf import Rollout


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first number.
        b: The second number.
    """
    return a + b


def explode(x: int) -> int:
    """Always fails.

    Args:
        x: Anything.
    """
    raise RuntimeError(f"boom {x}")


def slow(x: int) -> int:
    """Sleeps.

    Args:
        x: Anything.
    """
    time.sleep(2.0)
    return x


def call(name: str, **arguments) -> str:
    import json

    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


class Scripted:
    """`script(context_text, turn) -> text`: each generated turn is that text plus EOS (turn counts from 0 by the
    assistant headers in the context). `cut` turns end without EOS (truncated)."""

    def __init__(self, tokenizer, script, cut: bool = False):
        self.tokenizer, self.script, self.cut, self.calls, self.budgets = tokenizer, script, cut, [], []

    def __call__(self, model, prompt_ids, num_generations, greedy=False, max_new_tokens=None):
        self.calls.append([list(p) for p in prompt_ids])
        self.budgets.append(max_new_tokens)
        rows = [p for p in prompt_ids for _ in range(num_generations)]
        turns = []
        for ids in rows:
            context = self.tokenizer.decode(ids, skip_special_tokens=False)
            turn = context.count("<|im_start|>assistant") - 1
            text = self.script(context, turn)
            out = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            turns.append(out if self.cut else out + [self.tokenizer.eos_token_id])
        ids, mask = left_pad(rows, self.tokenizer.pad_token_id)
        width = max(len(t) for t in turns)
        completion = torch.full((len(turns), width), self.tokenizer.pad_token_id)
        completion_mask = torch.zeros_like(completion)
        for i, t in enumerate(turns):
            completion[i, :len(t)] = torch.tensor(t)
            completion_mask[i, :len(t)] = 1
        truncated = torch.tensor([self.cut] * len(turns))
        return Rollout(ids, mask, completion, completion_mask, truncated)
