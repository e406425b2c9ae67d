"""Writes the small data files the CPU example configs use (examples/data/), from the demo's addition task.

    python examples/make_data.py

- addition_train.jsonl / addition_heldout.jsonl: conversational prompts "What is a+b?" with an `answer`
  column, from the demo's fixed split (held-out problems are never trained on);
- addition_preferences.jsonl: chosen/rejected answers to training problems for a reward model: chosen is
  the correct sum in <answer> tags, rejected a sum off by 1-10, or the right sum without the tags.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from rlft.data.addition import prompt_messages, rows, split_problems

OUT = Path(__file__).resolve().parent / "data"


def preference_pairs(problems: list[tuple[int, int]], seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    pairs = []
    for a, b in problems:
        wrong = a + b + rng.choice([d for d in range(-10, 11) if d])
        rejected = f"<answer>{wrong}</answer>" if rng.random() < 0.75 else f"{a + b}"
        pairs.append({"prompt": prompt_messages(a, b), "chosen": [{"role": "assistant", "content": f"<answer>{a + b}</answer>"}],
                      "rejected": [{"role": "assistant", "content": rejected}]})
    return pairs


def write(name: str, records: list[dict]) -> None:
    (OUT / name).write_text("".join(json.dumps(r) + "\n" for r in records))
    print(f"{OUT / name}: {len(records)} rows")


if __name__ == "__main__":
    OUT.mkdir(exist_ok=True)
    train, heldout = split_problems()
    write("addition_train.jsonl", rows(train[:1024]))
    write("addition_heldout.jsonl", rows(heldout))
    write("addition_preferences.jsonl", preference_pairs(train[1024:2048]))
