"""Preference pairs for reward models: load, check, render, tokenize, truncate (and say so).

Accepted rows: implicit prompt (`chosen`, `rejected` full texts), explicit prompt (`prompt`,
`chosen`, `rejected`), conversational (lists of chat messages, rendered with the chat
template), each with an optional numeric `margin`. Nothing is dropped silently: over-long
pairs follow the `truncation` policy and are counted; pairs that are identical (as given,
or after truncation) carry no signal, are left out, counted and reported.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch

from rlft.data.prompts import DatasetError, is_conversational

# TRL's pre-tokenized preference columns (1.x), and the older names TRL still reads
TOKENIZED_NAMES = (("chosen_ids", "rejected_ids"), ("chosen_input_ids", "rejected_input_ids"))


@dataclass
class PairReport:
    total: int = 0
    truncated: int = 0
    identical: int = 0
    identical_after_truncation: int = 0
    first_rows: dict[str, int] = field(default_factory=dict)

    def lines(self, max_length: int | None, policy: str) -> list[str]:
        out = []
        if self.truncated:
            out.append(f"{self.truncated} of {self.total} pairs exceed max_length={max_length} "
                       f"tokens and were truncated with truncation={policy!r} "
                       f"(first: row {self.first_rows['truncated']})")
        if self.identical:
            out.append(f"{self.identical} pairs have chosen identical to rejected and were left "
                       f"out (first: row {self.first_rows['identical']})")
        if self.identical_after_truncation:
            out.append(f"{self.identical_after_truncation} pairs became identical after truncation "
                       "and were left out; raise max_length or use truncation='keep_end' (first: "
                       f"row {self.first_rows['identical_after_truncation']})")
        return out

    def note(self, kind: str, row: int) -> None:
        setattr(self, kind, getattr(self, kind) + 1)
        self.first_rows.setdefault(kind, row)


def _render(value: Any, prompt: Any, tokenizer, row: int, column: str,
            template_kwargs: dict | None = None) -> str:
    if value is None or (isinstance(value, str | list) and len(value) == 0):
        raise DatasetError(f"row {row}: '{column}' is empty; "
                           "every pair needs non-empty chosen and rejected responses")
    if is_conversational(value) or is_conversational(prompt):
        if not getattr(tokenizer, "chat_template", None):
            raise DatasetError(f"row {row}: '{column}' is a list of chat messages but the "
                               "tokenizer has no chat template (BERT-style encoders have none); "
                               "give plain-text pairs or set tokenizer.chat_template")
        messages = (prompt or []) + (value if isinstance(value, list)
                                     else [{"role": "assistant", "content": value}])
        return tokenizer.apply_chat_template(messages, tokenize=False, **(template_kwargs or {}))
    if not isinstance(value, str):
        raise DatasetError(f"row {row}: '{column}' must be a string or a list of chat messages, "
                           f"got {type(value).__name__}")
    return (prompt or "") + value


def _truncate(ids: list[int], max_length: int | None, policy: str, row: int) -> tuple[list[int], bool]:
    if max_length is None or len(ids) <= max_length:
        return ids, False
    if policy == "error":
        raise DatasetError(f"row {row}: {len(ids)} tokens exceed max_length={max_length}; "
                           "raise max_length or choose truncation='keep_start' / 'keep_end'")
    return (ids[:max_length] if policy == "keep_start" else ids[-max_length:]), True


class DataCollatorForPreference:
    """TRL's preference collator: examples with `chosen_ids`, `rejected_ids` (and optionally
    `margin`) -> a batch of the chosen rows then the rejected rows, right-padded with `pad_token_id`
    (to a multiple of `pad_to_multiple_of`): `input_ids`, `attention_mask` [2B, L] and `margin`
    [B]."""

    def __init__(self, pad_token_id: int, pad_to_multiple_of: int | None = None, return_tensors: str = "pt"):
        if return_tensors != "pt":
            raise ValueError(f"return_tensors={return_tensors!r}: only 'pt' (torch tensors) is "
                             "supported")
        self.pad_token_id, self.pad_to_multiple_of = pad_token_id, pad_to_multiple_of

    def __call__(self, examples: list[dict]) -> dict[str, torch.Tensor]:
        sequences = [list(e["chosen_ids"]) for e in examples] + [list(e["rejected_ids"]) for e in examples]
        width = max(len(s) for s in sequences)
        if self.pad_to_multiple_of:
            width = -(-width // self.pad_to_multiple_of) * self.pad_to_multiple_of
        ids = torch.full((len(sequences), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, seq in enumerate(sequences):
            ids[row, :len(seq)] = torch.tensor(seq, dtype=torch.long)
            mask[row, :len(seq)] = 1
        out = {"input_ids": ids, "attention_mask": mask}
        if examples and "margin" in examples[0]:
            out["margin"] = torch.tensor([float(e["margin"]) for e in examples])
        return out


class PreferencePairs:
    """Tokenized chosen/rejected pairs (+ margins), checked up front."""

    def __init__(self, dataset, tokenizer, max_length: int | None, truncation: str):
        self.tokenized = next((names for names in TOKENIZED_NAMES
                               if all(c in dataset.column_names for c in names)), None)
        if self.tokenized == TOKENIZED_NAMES[1]:
            warnings.warn("the columns chosen_input_ids / rejected_input_ids are TRL's older "
                          "names, which TRL says will not be supported in v1: rename them "
                          "chosen_ids / rejected_ids",
                          FutureWarning, stacklevel=3)
        missing = [c for c in ("chosen", "rejected") if c not in dataset.column_names]
        if missing and not self.tokenized:
            raise DatasetError(f"preference dataset lacks column(s) {missing}; "
                               f"columns found: {dataset.column_names}. "
                               "A pair needs 'chosen' and 'rejected' (and optionally 'prompt', "
                               f"'margin'), or pre-tokenized {list(TOKENIZED_NAMES[0])}")
        self.chosen: list[list[int]] = []
        self.rejected: list[list[int]] = []
        self.margins: list[float] | None = [] if "margin" in dataset.column_names else None
        self.report = PairReport(total=len(dataset))
        for row, example in enumerate(dataset):
            self._add(example, row, tokenizer, max_length, truncation)
        if not self.chosen:
            raise DatasetError(f"no usable preference pairs in {len(dataset)} rows: "
                               + ("; ".join(self.report.lines(max_length, truncation))
                                  or "the dataset is empty"))

    def _token_ids(self, example: dict, row: int, tokenizer) -> list[list[int]] | None:
        if self.tokenized:
            ids = [example[c] for c in self.tokenized]
            for column, value in zip(self.tokenized, ids):
                if not value or not all(isinstance(t, int) for t in value):
                    raise DatasetError(f"row {row}: '{column}' must be a non-empty list of token "
                                       "ids")
            return None if ids[0] == ids[1] else ids
        prompt = example.get("prompt")
        kwargs = example.get("chat_template_kwargs") or {}  # TRL's per-row template arguments
        texts = [_render(example[c], prompt, tokenizer, row, c, kwargs) for c in ("chosen", "rejected")]
        if texts[0] == texts[1]:
            return None
        return [tokenizer(t, add_special_tokens=True)["input_ids"] for t in texts]

    def _add(self, example: dict, row: int, tokenizer, max_length, truncation) -> None:
        ids = self._token_ids(example, row, tokenizer)
        if ids is None:
            self.report.note("identical", row)
            return
        (chosen, cut_c), (rejected, cut_r) = (_truncate(i, max_length, truncation, row) for i in ids)
        if cut_c or cut_r:
            self.report.note("truncated", row)
        if chosen == rejected:
            self.report.note("identical_after_truncation", row)
            return
        if self.margins is not None:
            margin = example["margin"]
            if not isinstance(margin, int | float) or isinstance(margin, bool) or not math.isfinite(margin):
                raise DatasetError(f"row {row}: 'margin' must be a finite number, got {margin!r}")
            self.margins.append(float(margin))
        self.chosen.append(chosen)
        self.rejected.append(rejected)

    def __len__(self) -> int:
        return len(self.chosen)

    def examples(self, indices: list[int]) -> list[dict]:
        """TRL's processed rows: chosen_ids, rejected_ids (and margin)."""
        return [{"chosen_ids": self.chosen[i], "rejected_ids": self.rejected[i],
                 **({"margin": self.margins[i]} if self.margins is not None else {})} for i in indices]

    def as_dataset(self):
        """Every usable pair as a datasets.Dataset of TRL's processed columns (what TRL's
        trainer.train_dataset holds after tokenization)."""
        import datasets

        return datasets.Dataset.from_list(self.examples(list(range(len(self)))))

    def batch(self, indices: list[int], pad_id: int, pad_to_multiple_of: int | None = None,
              collator=None) -> dict[str, torch.Tensor]:
        """Chosen rows then rejected rows, right-padded: input_ids/attention_mask [2B, L], margin
        [B]; a TRL-style data collator given to the trainer builds the batch instead."""
        collator = collator or DataCollatorForPreference(pad_id, pad_to_multiple_of)
        return collator(self.examples(indices))
