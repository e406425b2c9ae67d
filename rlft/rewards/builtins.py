"""Built-in reward functions, with TRL's calling convention (keyword arguments, list out).

Each takes `completions` (strings or message lists) plus dataset columns by keyword and
returns one float, or None for "not applicable", per completion.
"""

from __future__ import annotations

import math
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
        out.append(float(predicted is not None
                         and normalize_answer(predicted) == normalize_answer(str(gold))))
    return out


def _math_verify_timeouts() -> dict:
    """math-verify's timeouts use signals, which only work in the main thread."""
    import threading

    main = threading.current_thread() is threading.main_thread()
    return {"parsing_timeout": 10 if main else None}, {"timeout_seconds": 5 if main else None}


def _verify_latex(text: str, gold, parse_kw: dict, verify_kw: dict) -> tuple[float | None, str, str]:
    """(reward, gold as parsed, answer as parsed): math-verify equivalence of the LaTeX answer in
    `text` (a `\\boxed{}` answer tried first) with `gold`; None when the gold does not parse (not
    applicable)."""
    from math_verify import LatexExtractionConfig, parse, verify
    from math_verify.parser import NormalizationConfig

    gold_parsed = parse(str(gold), **parse_kw)
    if not gold_parsed:
        return None, "[unparseable]", "[skipped]"
    extraction = [LatexExtractionConfig(normalization_config=NormalizationConfig(units=True),
                                        boxed_match_priority=0, try_extract_without_anchor=False)]
    answer = parse(text, extraction_config=extraction, extraction_mode="first_match", **parse_kw)
    return (float(verify(gold_parsed, answer, **verify_kw)), str(gold_parsed),
            str(answer) if answer else "[unparseable]")


def _log_parsed(log_extra, solution, golds: list[str], answers: list[str]) -> None:
    if log_extra is not None:
        log_extra("solution", [str(s) for s in solution])
        log_extra("gold_parsed", golds)
        log_extra("answer_parsed", answers)


def accuracy_reward(completions, solution, log_extra=None, **kwargs) -> list[float | None]:
    """TRL's `accuracy_reward`: math-verify equivalence of the completion with the `solution`
    column.

    The gold solution is parsed as LaTeX/expressions; when it does not parse the row is not
    applicable (None). The completion must state its answer in LaTeX (a `\\boxed{}` answer is tried
    first). With `log_extra` (passed by the trainer) the parsed gold and answer go to the
    completions log.
    """
    parse_kw, verify_kw = _math_verify_timeouts()
    results = [_verify_latex(completion_text(c), gold, parse_kw, verify_kw)
               for c, gold in zip(completions, solution, strict=True)]
    _log_parsed(log_extra, solution, [r[1] for r in results], [r[2] for r in results])
    return [r[0] for r in results]


def reasoning_accuracy_reward(completions, solution, reasoning_delimiters: list[str] | None = None,
                              log_extra=None, **kwargs) -> list[float | None]:
    """TRL's `reasoning_accuracy_reward`: `accuracy_reward` on the text after the reasoning, i.e.
    after the first delimiter found (default `</think>`). A completion whose reasoning never ends
    scores 0.0 (not None: an unfinished reasoning is penalised); a gold that does not parse gives
    None."""
    delimiters = reasoning_delimiters or ["</think>"]
    parse_kw, verify_kw = _math_verify_timeouts()
    results = []
    for completion, gold in zip(completions, solution, strict=True):
        text = completion_text(completion)
        found = next((d for d in delimiters if d in text), None)
        if found is None:
            results.append((0.0, "[incomplete reasoning]", "[incomplete reasoning]"))
            continue
        results.append(_verify_latex(text.split(found)[-1], gold, parse_kw, verify_kw))
    _log_parsed(log_extra, solution, [r[1] for r in results], [r[2] for r in results])
    return [r[0] for r in results]


THINK_FORMAT = re.compile(r"^<think>(?!.*<think>)(.*?)</think>.*$", re.DOTALL | re.MULTILINE)


def think_format_reward(completions, **kwargs) -> list[float]:
    """TRL's `think_format_reward`: 1.0 when the completion opens with one `<think>...</think>`
    block (and no second `<think>`), else 0.0."""
    return [float(THINK_FORMAT.match(completion_text(c)) is not None) for c in completions]


class _RepetitionPenalty:
    """Picklable (a class, not a closure): reward functions travel to other processes."""

    __name__ = "repetition_penalty_reward"

    def __init__(self, ngram_size: int, max_penalty: float):
        self.ngram_size, self.max_penalty = ngram_size, max_penalty

    def __call__(self, completion_ids, **kwargs) -> list[float]:
        out = []
        for ids in completion_ids:
            grams = list(zip(*[ids[i:] for i in range(self.ngram_size)]))
            repeated = 1 - len(set(grams)) / len(grams) if grams else 0.0
            out.append(repeated * self.max_penalty if repeated else 0.0)
        return out


def get_repetition_penalty_reward(ngram_size: int, max_penalty: float) -> Callable:
    """TRL's repetition penalty (Demystifying Long CoT, arXiv:2502.03373): max_penalty times the
    share of repeated n-grams among a completion's token n-grams; 0 for completions shorter than one
    n-gram."""
    if max_penalty > 0:
        raise ValueError(f"max_penalty={max_penalty} must be <= 0 (it is a penalty)")
    return _RepetitionPenalty(ngram_size, max_penalty)


class _CosineScaled:
    __name__ = "cosine_scaled_reward"

    def __init__(self, max_len: int, wrong: tuple[float, float], correct: tuple[float, float]):
        self.max_len, self.wrong, self.correct = max_len, wrong, correct

    def __call__(self, completions, solution, completion_ids, **kwargs) -> list[float | None]:
        out: list[float | None] = []
        for correct, ids in zip(accuracy_reward(completions, solution), completion_ids, strict=True):
            if correct is None:
                out.append(None)
                continue
            low, high = self.correct if correct else self.wrong
            # past max_len the schedule stays at its end
            progress = min(len(ids) / self.max_len, 1.0)
            out.append(float(low + 0.5 * (high - low) * (1.0 + math.cos(progress * math.pi))))
        return out


def get_cosine_scaled_reward(max_len: int, min_value_wrong: float = -1.0, max_value_wrong: float = -0.5,
                             min_value_correct: float = 0.5, max_value_correct: float = 1.0) -> Callable:
    """TRL's cosine length-scaled correctness (arXiv:2502.03373, App. C.1): with p = min(len /
    max_len, 1), r = v_lo + (v_hi - v_lo)(1 + cos(p pi)) / 2; correct: (v_lo, v_hi) =
    (min_value_correct, max_value_correct), shorter is better; wrong: (max_value_wrong,
    min_value_wrong), shorter is penalised more. None where the gold does not parse
    (accuracy_reward's None)."""
    return _CosineScaled(max_len, (max_value_wrong, min_value_wrong), (min_value_correct, max_value_correct))

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
        # text inside <answer> tags parses to nothing: extract first
        tagged = ANSWER_TAG_RE.findall(text)
        candidate = tagged[-1] if tagged else text
        predicted = parse(candidate, parsing_timeout=None)
        out.append(float(bool(predicted) and verify(gold_parsed, predicted, timeout_seconds=None)))
    return out


def format_reward(completions, pattern: str = DEFAULT_FORMAT, **kwargs) -> list[float]:
    """1.0 when the whole completion matches `pattern` (default: optional <think>, then
    <answer>)."""
    regex = re.compile(pattern, re.DOTALL)
    return [float(regex.match(completion_text(c)) is not None) for c in completions]


class _SoftOverlong:
    __name__ = "soft_overlong_punishment"

    def __init__(self, max_completion_len: int, soft_punish_cache: int):
        self.max_len, self.cache = max_completion_len, soft_punish_cache

    def __call__(self, completion_ids, **kwargs) -> list[float]:
        out = []
        for ids in completion_ids:
            length = len(ids)
            if length <= self.max_len - self.cache:
                out.append(0.0)
            elif length <= self.max_len:
                out.append((self.max_len - self.cache - length) / self.cache)
            else:
                out.append(-1.0)
        return out


def get_soft_overlong_punishment(max_completion_len: int, soft_punish_cache: int) -> Callable:
    """DAPO's soft overlong punishment (arXiv:2503.14476, eq. 13), on completion token counts L:

        0                                    if L <= L_max - L_cache
        ((L_max - L_cache) - L) / L_cache    if L_max - L_cache < L <= L_max
        -1                                   if L > L_max
    """
    if not 0 < soft_punish_cache <= max_completion_len:
        raise ValueError(f"soft_punish_cache={soft_punish_cache} must be in (0, "
                         "max_completion_len]")
    return _SoftOverlong(max_completion_len, soft_punish_cache)


BUILTIN_REWARDS: dict[str, Callable] = {
    "accuracy": accuracy_reward,  # TRL's: math-verify against the `solution` column
    "accuracy_reward": accuracy_reward,
    "reasoning_accuracy_reward": reasoning_accuracy_reward,
    "think_format_reward": think_format_reward,
    "exact_match": exact_match_reward,  # rlft's: normalised exact match against the `answer` column
    "math_verify": math_verify_reward,
    "format": format_reward,
}
