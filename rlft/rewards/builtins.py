"""Built-in reward functions, with TRL's calling convention (keyword arguments, list out).

Each takes `completions` (strings or message lists) plus dataset columns by keyword and
returns one float, or None for "not applicable", per completion.
"""

from __future__ import annotations

import re
from collections.abc import Callable

ANSWER_TAG_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
NUMBER_RE = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
# Exactly one answer block (optionally after one think block), nothing after it. A lazy `.*?` is
# not enough: "<answer>1</answer></answer></answer>" would match, and a policy learns to do that.
DEFAULT_FORMAT = r"^\s*(?:<think>(?:(?!</?think>).)*</think>\s*)?<answer>(?:(?!</?answer>).)*</answer>\s*$"


def completion_text(completion) -> str:
    """A completion as text: strings pass through, message lists give the last message's content."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list) and completion and isinstance(completion[-1], dict):
        return str(completion[-1].get("content", ""))
    return str(completion)


def extract_final_answer(text: str) -> str | None:
    """The text inside the last <answer>...</answer>, else the last number in the text."""
    tagged = ANSWER_TAG_RE.findall(text)
    if tagged:
        return tagged[-1].strip()
    numbers = NUMBER_RE.findall(text)
    return numbers[-1] if numbers else None


def normalize_answer(answer: str) -> str:
    text = answer.strip().lower().replace(",", "").rstrip(".")
    text = re.sub(r"\s+", " ", text)
    try:
        number = float(text)
        return str(int(number)) if number.is_integer() else str(number)
    except ValueError:
        return text


def exact_match_reward(completions, answer, **kwargs) -> list[float | None]:
    """1.0 when the completion's final answer equals `answer` after normalisation, else 0.0.

    Normalisation: case, surrounding spaces, thousands separators, trailing '.', and numeric
    equality ("42.0" == "42"). A row whose `answer` is None is not applicable (None).
    """
    out: list[float | None] = []
    for completion, gold in zip(completions, answer):
        if gold is None:
            out.append(None)
            continue
        predicted = extract_final_answer(completion_text(completion))
        out.append(float(predicted is not None and normalize_answer(predicted) == normalize_answer(str(gold))))
    return out


def _math_verify_timeouts() -> dict:
    """math-verify's timeouts use signals, which only work in the main thread."""
    import threading

    main = threading.current_thread() is threading.main_thread()
    return {"parsing_timeout": 10 if main else None}, {"timeout_seconds": 5 if main else None}


def accuracy_reward(completions, solution, log_extra=None, **kwargs) -> list[float | None]:
    """TRL's `accuracy_reward`: math-verify equivalence of the completion with the `solution` column.

    The gold solution is parsed as LaTeX/expressions; when it does not parse the row is not applicable
    (None). The completion must state its answer in LaTeX (a `\\boxed{}` answer is tried first). With
    `log_extra` (passed by the trainer) the parsed gold and answer go to the completions log.
    """
    from math_verify import LatexExtractionConfig, parse, verify
    from math_verify.parser import NormalizationConfig

    parse_kw, verify_kw = _math_verify_timeouts()
    extraction = [LatexExtractionConfig(normalization_config=NormalizationConfig(units=True), boxed_match_priority=0,
                                        try_extract_without_anchor=False)]
    out: list[float | None] = []
    golds, answers = [], []
    for completion, gold in zip(completions, solution, strict=True):
        gold_parsed = parse(str(gold), **parse_kw)
        if not gold_parsed:
            out.append(None)
            golds.append("[unparseable]")
            answers.append("[skipped]")
            continue
        answer = parse(completion_text(completion), extraction_config=extraction, extraction_mode="first_match",
                       **parse_kw)
        out.append(float(verify(gold_parsed, answer, **verify_kw)))
        golds.append(str(gold_parsed))
        answers.append(str(answer) if answer else "[unparseable]")
    if log_extra is not None:
        log_extra("solution", [str(s) for s in solution])
        log_extra("gold_parsed", golds)
        log_extra("answer_parsed", answers)
    return out


def math_verify_reward(completions, solution=None, answer=None, **kwargs) -> list[float | None]:
    """Mathematical equivalence via math-verify (LaTeX/expressions), safe in threads.

    The gold comes from `solution` (or `answer`); a gold that does not parse gives None (not
    applicable) rather than a misleading 0. math-verify's timeouts use signals, which fail
    outside the main thread, so they are disabled here.
    """
    from math_verify import parse, verify

    golds = solution if solution is not None else answer
    if golds is None:
        raise ValueError("math_verify_reward needs a 'solution' or 'answer' column in the dataset")
    out: list[float | None] = []
    for completion, gold in zip(completions, golds):
        gold_parsed = parse(str(gold), parsing_timeout=None)
        if not gold_parsed:
            out.append(None)
            continue
        text = completion_text(completion)
        tagged = ANSWER_TAG_RE.findall(text)  # text inside <answer> tags parses to nothing: extract first
        candidate = tagged[-1] if tagged else text
        predicted = parse(candidate, parsing_timeout=None)
        out.append(float(bool(predicted) and verify(gold_parsed, predicted, timeout_seconds=None)))
    return out


def format_reward(completions, pattern: str = DEFAULT_FORMAT, **kwargs) -> list[float]:
    """1.0 when the whole completion matches `pattern` (default: optional <think>, then <answer>)."""
    regex = re.compile(pattern, re.DOTALL)
    return [float(regex.match(completion_text(c)) is not None) for c in completions]


def get_soft_overlong_punishment(max_completion_len: int, soft_punish_cache: int) -> Callable:
    """DAPO's soft overlong punishment (arXiv:2503.14476, eq. 13), on completion token counts L:

        0                                    if L <= L_max - L_cache
        ((L_max - L_cache) - L) / L_cache    if L_max - L_cache < L <= L_max
        -1                                   if L > L_max
    """
    if not 0 < soft_punish_cache <= max_completion_len:
        raise ValueError(f"soft_punish_cache={soft_punish_cache} must be in (0, max_completion_len]")

    def soft_overlong_punishment(completion_ids, **kwargs) -> list[float]:
        out = []
        for ids in completion_ids:
            length = len(ids)
            if length <= max_completion_len - soft_punish_cache:
                out.append(0.0)
            elif length <= max_completion_len:
                out.append((max_completion_len - soft_punish_cache - length) / soft_punish_cache)
            else:
                out.append(-1.0)
        return out

    return soft_overlong_punishment


BUILTIN_REWARDS: dict[str, Callable] = {
    "accuracy": accuracy_reward,  # TRL's: math-verify against the `solution` column
    "accuracy_reward": accuracy_reward,
    "exact_match": exact_match_reward,  # rlft's: normalised exact match against the `answer` column
    "math_verify": math_verify_reward,
    "format": format_reward,
}
