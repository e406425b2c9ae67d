"""TRL's `trl.data_utils` helpers a script calls on its own data (`is_conversational`,
`apply_chat_template`, `maybe_apply_chat_template`), with TRL 1.16's signatures and results: an
example's `prompt` (and `completion` / `chosen` / `rejected`, or `messages`) rendered by the
tokenizer's chat template, the prompt with its generation prompt. The trainers render their own
datasets (rlft/data/prompts.py); these are for a script's own use of the same text.
"""

from __future__ import annotations

from typing import Any

_TURN_KEYS = ("completion", "chosen", "rejected")


def is_conversational(example: dict[str, Any]) -> bool:
    """The example's first known column is a list of {'role', 'content'} messages."""
    for key in ("prompt", "messages", *_TURN_KEYS):
        value = example.get(key)
        if isinstance(value, list) and value and isinstance(value[0], dict) and "role" in value[0]:
            return True
    return False


def apply_chat_template(example: dict[str, Any], tokenizer, tools: list | None = None,
                        **template_kwargs) -> dict[str, str]:
    """A conversational example as text: `messages` whole, `prompt` with the generation prompt, and
    each of completion / chosen / rejected as what the template adds after that prompt."""
    def render(messages, generation_prompt: bool) -> str:
        return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                             add_generation_prompt=generation_prompt, **template_kwargs)

    out: dict[str, str] = {}
    if "messages" in example:
        out["text"] = render(example["messages"], False)
    if "prompt" in example:
        prompt = render(example["prompt"], True)
        out["prompt"] = prompt
        for key in _TURN_KEYS:
            if key in example:
                whole = render(list(example["prompt"]) + list(example[key]), False)
                if not whole.startswith(prompt):
                    raise ValueError(f"the chat template renders prompt + {key} without the prompt's own "
                                     "rendering at its start; give them as plain text")
                out[key] = whole[len(prompt):]
    else:
        for key in _TURN_KEYS:
            if key in example:
                out[key] = render(example[key], False)
    return out


def maybe_apply_chat_template(example: dict[str, Any], tokenizer, tools: list | None = None,
                              **template_kwargs) -> dict[str, Any]:
    """`apply_chat_template` for a conversational example; a plain-text one unchanged."""
    if is_conversational(example):
        return apply_chat_template(example, tokenizer, tools, **template_kwargs)
    return example
