"""The tool demo task: the addition problems of `rlft.data.addition`, with an `add` tool the policy
may call.

A correct episode: the policy calls `<tool_call>{"name": "add", "arguments": {"a": A, "b":
B}}</tool_call>`, reads the tool's result and answers `<answer>N</answer>`; it may also answer
directly (and, being tiny, is then often wrong). Used by `examples/build_tiny_tool_policy.py` (the
shipped tiny-calculator) and `rlft demo --task calculator`.
"""

from __future__ import annotations

from rlft.data.addition import extract_answer, prompt_messages
from rlft.data.addition import rows as addition_rows


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first number.
        b: The second number.
    """
    return int(a) + int(b)


TOOLS = [add]
rows = addition_rows  # the same prompts and `answer` column


class CalculatorEnv:
    """The same task as an environment (`environment_factory=CalculatorEnv`): its `add` method is the
    tool, and it counts the calls of its episode (`calls`, reset per row)."""

    def reset(self, **row) -> None:
        self.calls = 0

    def add(self, a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: The first number.
            b: The second number.
        """
        self.calls += 1
        return int(a) + int(b)


def episode(a: int, b: int, use_tool: bool) -> list[dict]:
    """The messages of a correct episode, with or without the tool (what the warm-start
    imitates)."""
    answer = {"role": "assistant", "content": f"<answer>{a + b}</answer>"}
    if not use_tool:
        return [*prompt_messages(a, b), answer]
    call = {"type": "function", "function": {"name": "add", "arguments": {"a": a, "b": b}}}
    return [*prompt_messages(a, b), {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "name": "add", "content": str(a + b)}, answer]


def _final_answer(completion) -> str | None:
    text = completion[-1]["content"] if isinstance(completion, list) else completion
    return extract_answer(text or "")


def answer_reward(completions, answer, **kwargs) -> list[float]:
    """1 when the last assistant message answers `<answer>a+b</answer>`."""
    return [float(_final_answer(c) == str(a)) for c, a in zip(completions, answer)]


def tool_use_reward(completions, **kwargs) -> list[float]:
    """1 when the completion holds a tool result that is not an error (the tool was called and
    worked)."""
    return [float(any(m["role"] == "tool" and '"error"' not in m["content"] for m in c)) for c in completions]
