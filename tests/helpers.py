"""Small builders shared by trainer tests."""

from __future__ import annotations

from rlft import GRPOConfig
from rlft.data.addition import rows, split_problems


def addition_rows(count: int = 64, heldout: bool = False) -> list[dict]:
    train, held = split_problems()
    return rows((held if heldout else train)[:count])


def tiny_grpo_config(tmp_path, **overrides) -> GRPOConfig:
    values = dict(output_dir=str(tmp_path / "run"), learning_rate=1e-3, max_steps=2, num_generations=4,
                  per_device_train_batch_size=8, max_completion_length=8, logging_steps=1, save_steps=1000,
                  report_to=["none"], disable_tqdm=True, seed=0)
    values.update(overrides)
    return GRPOConfig(**values)


def correct_answer(completions, answer, **kwargs):
    """A TRL-style reward: keyword arguments, one float per completion."""
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [1.0 if f"<answer>{a}</answer>" in t else 0.0 for t, a in zip(texts, answer)]


def has_answer_tags(completions, **kwargs):
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [0.5 if "<answer>" in t and "</answer>" in t else 0.0 for t in texts]
