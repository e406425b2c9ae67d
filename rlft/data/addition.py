"""The demo task: two-digit addition asked in chat, answered as `<answer>N</answer>`.

It has a checkable answer, so GRPO can learn it from a correctness reward alone. The
problem space (a, b in 10..99) is split once, deterministically, into training problems
and held-out problems that no training run ever sees.
"""

from __future__ import annotations

import random
import re

import torch

ANSWER_RE = re.compile(r"<answer>\s*(-?\d+)\s*</answer>")
HELDOUT_SEED = 1234
HELDOUT_SIZE = 200


def all_problems() -> list[tuple[int, int]]:
    return [(a, b) for a in range(10, 100) for b in range(10, 100)]


def split_problems() -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """(train, heldout): a fixed split of the 8,100 problems; heldout has 200."""
    problems = all_problems()
    random.Random(HELDOUT_SEED).shuffle(problems)
    return problems[HELDOUT_SIZE:], problems[:HELDOUT_SIZE]


def prompt_messages(a: int, b: int) -> list[dict]:
    return [{"role": "user", "content": f"What is {a}+{b}?"}]


def target_text(a: int, b: int) -> str:
    return f"<answer>{a + b}</answer>"


def rows(problems: list[tuple[int, int]]) -> list[dict]:
    """Dataset rows: a conversational `prompt` and the `answer` column rewards receive."""
    return [{"prompt": prompt_messages(a, b), "answer": str(a + b)} for a, b in problems]


def extract_answer(text: str) -> str | None:
    match = ANSWER_RE.search(text)
    return match.group(1) if match else None


@torch.no_grad()
def greedy_accuracy(model, tokenizer, problems: list[tuple[int, int]], batch_size: int = 100,
                    max_new_tokens: int = 8) -> float:
    """Exact-match accuracy of greedy decoding on `problems` (fraction in [0, 1])."""
    was_training = model.training
    model.eval()
    correct = 0
    device = next(model.parameters()).device
    for start in range(0, len(problems), batch_size):
        chunk = problems[start:start + batch_size]
        texts = [tokenizer.apply_chat_template(prompt_messages(a, b), tokenize=False,
                                               add_generation_prompt=True) for a, b in chunk]
        enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
        out = model.generate(**enc, do_sample=False, max_new_tokens=max_new_tokens,
                             pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
        completions = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=False)
        correct += sum(extract_answer(c) == str(a + b) for c, (a, b) in zip(completions, chunk))
    model.train(was_training)
    return correct / len(problems)
