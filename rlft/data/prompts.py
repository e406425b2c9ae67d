"""Prompt datasets for GRPO: load, check, render chat prompts, tokenize, and order by epoch.

A dataset has a `prompt` column (a string, or a list of chat messages rendered with the
tokenizer's chat template and `add_generation_prompt=True`); every other column travels with
its prompt and reaches reward functions as a keyword argument.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

FILE_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


class DatasetError(ValueError):
    """Unusable dataset rows or columns; the message names the row/column and the fix."""


def load_dataset_any(source: Any):
    """A `datasets.Dataset`, a list of dicts, or a local jsonl/json/parquet/csv file."""
    import datasets

    if source is None:
        raise DatasetError("no training dataset: pass train_dataset= (a datasets.Dataset or a file path)")
    if isinstance(source, datasets.Dataset):
        return source
    if isinstance(source, datasets.DatasetDict):
        if "train" not in source:
            raise DatasetError(f"DatasetDict has splits {list(source)}; pass one split, e.g. dataset['train']")
        return source["train"]
    if isinstance(source, list):
        return datasets.Dataset.from_list(source)
    path = Path(str(source))
    if not path.exists():
        raise DatasetError(f"dataset file {path} does not exist")
    fmt = FILE_FORMATS.get(path.suffix)
    if fmt is None:
        raise DatasetError(f"dataset file {path}: unknown format {path.suffix!r}; use one of {sorted(FILE_FORMATS)}")
    return datasets.load_dataset(fmt, data_files=str(path), split="train")


def is_conversational(prompt: Any) -> bool:
    return isinstance(prompt, list) and all(isinstance(m, dict) and "role" in m for m in prompt)


def render_prompt(prompt: Any, tokenizer, row: int) -> str:
    if isinstance(prompt, str):
        if not prompt:
            raise DatasetError(f"row {row}: empty prompt")
        return prompt
    if is_conversational(prompt):
        if not getattr(tokenizer, "chat_template", None):
            raise DatasetError(f"row {row}: the prompt is a list of chat messages but the tokenizer has no chat "
                               "template; set tokenizer.chat_template or give prompts as plain strings")
        return tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    raise DatasetError(f"row {row}: prompt must be a string or a list of {{'role', 'content'}} messages, "
                       f"got {type(prompt).__name__}")


class PromptSet:
    """Rendered, tokenized prompts plus their extra columns, checked once up front."""

    def __init__(self, dataset, tokenizer, max_prompt_length: int | None, max_completion_length: int,
                 context_length: int | None):
        if "prompt" not in dataset.column_names:
            raise DatasetError(f"dataset has no 'prompt' column; columns found: {dataset.column_names}. "
                               "Rename the column holding prompts to 'prompt'")
        if len(dataset) == 0:
            raise DatasetError("dataset is empty")
        self.rows = dataset.to_list()
        self.extra_columns = [c for c in dataset.column_names if c != "prompt"]
        self.texts = [render_prompt(r["prompt"], tokenizer, i) for i, r in enumerate(self.rows)]
        encoded = tokenizer(self.texts, add_special_tokens=False)["input_ids"]
        self.token_ids: list[list[int]] = encoded
        self._check_lengths(max_prompt_length, max_completion_length, context_length)

    def _check_lengths(self, max_prompt_length, max_completion_length, context_length) -> None:
        lengths = [len(ids) for ids in self.token_ids]
        longest = max(range(len(lengths)), key=lengths.__getitem__)
        if max_prompt_length is not None and lengths[longest] > max_prompt_length:
            over = sum(n > max_prompt_length for n in lengths)
            raise DatasetError(f"{over} prompt(s) exceed max_prompt_length={max_prompt_length} tokens (row {longest} "
                               f"has {lengths[longest]}); raise max_prompt_length or shorten/filter those rows")
        if context_length is not None and lengths[longest] + max_completion_length > context_length:
            raise DatasetError(f"row {longest}: prompt of {lengths[longest]} tokens + max_completion_length="
                               f"{max_completion_length} exceeds the model's context of {context_length} tokens; "
                               "lower max_completion_length or shorten the prompt")

    def __len__(self) -> int:
        return len(self.rows)

    def batch(self, indices: list[int]) -> dict[str, Any]:
        """Prompts (original form), token ids and every extra column for `indices`."""
        out: dict[str, Any] = {
            "prompts": [self.rows[i]["prompt"] for i in indices],
            "prompt_ids": [self.token_ids[i] for i in indices],
        }
        for column in self.extra_columns:
            out[column] = [self.rows[i][column] for i in indices]
        return out


def epoch_order(num_rows: int, seed: int, epoch: int) -> list[int]:
    """A deterministic shuffle per epoch, so a resumed run sees the same prompts in the same order."""
    generator = torch.Generator().manual_seed(seed * 100_003 + epoch)
    return torch.randperm(num_rows, generator=generator).tolist()


def left_pad(sequences: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[[ids]] -> (ids [B, P] left-padded, mask [B, P])."""
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, seq in enumerate(sequences):
        if seq:
            ids[row, width - len(seq):] = torch.tensor(seq)
            mask[row, width - len(seq):] = 1
    return ids, mask
