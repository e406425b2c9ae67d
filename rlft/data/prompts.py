"""Prompt datasets for GRPO: load, check, render chat prompts, tokenize, and order by epoch.

A dataset has a `prompt` column (a string, or a list of chat messages rendered with the
tokenizer's chat template and `add_generation_prompt=True`); every other column travels with
its prompt and reaches reward functions as a keyword argument.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch

from rlft.errors import RlftError

CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")
# Keyword arguments rlft passes to every reward function; a dataset column must not shadow one.
REWARD_ARGUMENTS = ("prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric",
                    "environments")
FILE_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


class DatasetError(RlftError, ValueError):
    """Unusable dataset rows or columns; the message names the row/column and the fix."""


def _load_named(source: str):
    """A local file, a local dataset folder, or a hub dataset id ('name' or 'name:config', split
    'train').

    Local files and folders go through `datasets.load_dataset` exactly as a hub id does, with the
    network off for them (datasets would otherwise make a request even for a local file)."""
    import datasets

    path = Path(source)
    if path.is_file():
        fmt = FILE_FORMATS.get(path.suffix)
        if fmt is None:
            raise DatasetError(f"dataset file {path}: unknown format {path.suffix!r}; "
                               f"use one of {sorted(FILE_FORMATS)}")
        data = path.read_bytes()
        if not data.strip():
            raise DatasetError(f"dataset file {path} is empty; it needs one row per line (jsonl) "
                               "or a table")
        if fmt != "parquet":
            _check_utf8(path, data)
        try:
            with offline_datasets():
                return datasets.load_dataset(fmt, data_files=str(path), split="train")
        except Exception as err:
            # datasets wraps the parser's error in DatasetGenerationError, without the file
            raise DatasetError(f"dataset file {path}: "
                               f"{_first_bad_line(path) or f'{type(err).__name__}: {err}'}") from err
    if path.is_dir():
        with offline_datasets():
            loaded = datasets.load_from_disk(str(path)) if (path / "dataset_info.json").exists() or \
                (path / "dataset_dict.json").exists() else datasets.load_dataset(str(path))
        return loaded
    name, _, config = source.partition(":")
    if path.suffix in FILE_FORMATS or "/" not in name:
        raise DatasetError(f"dataset {source!r} is neither an existing file or folder nor a hub "
                           "dataset id ('org/name', or 'org/name:config'); check the path")
    try:
        return datasets.load_dataset(name, config or None)
    except Exception as err:  # offline, private, misspelled: datasets' own message says which
        raise DatasetError(f"dataset {source!r} could not be loaded from the hub: "
                           f"{type(err).__name__}: {err}") from err


def _check_utf8(path: Path, data: bytes) -> None:
    """A text dataset file must be UTF-8: pyarrow reads other bytes without a word and fails later,
    on the first access to the row, naming neither file nor line."""
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        column = err.start - (data.rfind(b"\n", 0, err.start) + 1) + 1
        byte = data[err.start]
        raise DatasetError(f"dataset file {path}: line {line} is not valid UTF-8 (byte "
                           f"0x{byte:02x} at column {column}); save the file as UTF-8 or fix that "
                           "line") from None


def _first_bad_line(path: Path) -> str | None:
    """For a JSON-lines file: 'line N: <why>' for the first line that is not one JSON object."""
    import json

    if path.suffix not in (".jsonl", ".json"):
        return None
    lines = path.read_text(errors="replace").splitlines()
    if path.suffix == ".json" and lines and lines[0].lstrip().startswith("["):
        return None  # one JSON array, not JSON lines
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except ValueError as err:
            return (f"line {number} is not valid JSON ({err.msg} at column {err.colno}); "
                    "fix or remove that line")
        if not isinstance(value, dict):
            return f"line {number} is a JSON {type(value).__name__}, not an object with one field per column"
    return None


@contextlib.contextmanager
def offline_datasets():
    """datasets' offline flag on for one local load: datasets reads `datasets.config.HF_HUB_OFFLINE`
    at call time, and without it counts a download (a network request) even for a local file."""
    import datasets.config

    saved = datasets.config.HF_HUB_OFFLINE
    datasets.config.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE = saved


def load_dataset_any(source: Any, split: str = "train"):
    """A `datasets.Dataset` / `IterableDataset`, a `DatasetDict` (its `split`), a list of dicts, or
    a name (`_load_named`). Anything else is an error naming the type."""
    import datasets

    if source is None:
        raise DatasetError("`train_dataset` is required: pass train_dataset= (a datasets.Dataset, "
                           "a file, a folder or a hub dataset id)")
    if isinstance(source, str | Path):
        source = _load_named(str(source))
    if isinstance(source, datasets.Dataset | datasets.IterableDataset):
        return source
    if isinstance(source, datasets.DatasetDict | datasets.IterableDatasetDict):
        if split not in source:
            raise DatasetError(f"the DatasetDict has splits {list(source)} and no {split!r}; "
                               f"pass one split, e.g. dataset[{next(iter(source), 'train')!r}]")
        return source[split]
    if isinstance(source, list):
        if not source:
            raise DatasetError("the dataset is an empty list")
        if not all(isinstance(row, dict) for row in source):
            bad = next(i for i, row in enumerate(source) if not isinstance(row, dict))
            raise DatasetError(f"row {bad} of the dataset list is a {type(source[bad]).__name__}, "
                               "not a dict")
        return datasets.Dataset.from_list(source)
    raise DatasetError(f"unsupported dataset type {type(source).__name__}: pass a "
                       "datasets.Dataset, IterableDataset, DatasetDict, a list of dicts, a file "
                       "path, a dataset folder or a hub dataset id")


def load_named_dataset(name: str, config: str | None = None, streaming: bool = False):
    """`datasets.load_dataset(name, config, streaming=...)`: a hub dataset id, or a local folder
    laid out like a hub dataset repository (data files named by split, or a README with `configs`)
    through the same call, offline for the local folder. Returns the DatasetDict (or
    IterableDatasetDict) of every split."""
    import datasets

    local = Path(name).exists()
    try:
        with offline_datasets() if local else contextlib.nullcontext():
            return datasets.load_dataset(name, config, streaming=streaming)
    # missing, private, offline, bad config: datasets' own message says which
    except Exception as err:
        where = "local folder" if local else "hub dataset"
        raise DatasetError(f"dataset_name {name!r}" + (f" (dataset_config {config!r})" if config else "") +
                           f" could not be loaded as a {where}: {type(err).__name__}: {err}") from err


def pick_split(loaded, split: str, field_name: str, hint: str = ""):
    """One split of a loaded DatasetDict, or an error naming the splits there are and the field to
    set."""
    if split not in loaded:
        raise DatasetError(f"the dataset has the splits {list(loaded)} and no {split!r}: "
                           f"set {field_name} to one of them{hint}")
    return loaded[split]


def load_eval_datasets(source: Any) -> dict[str | None, Any]:
    """None -> {}; a dict of datasets or a DatasetDict -> {name: dataset}, several named eval sets
    (metrics `eval_<name>_*`, as TRL and transformers name them); else {None: dataset}. A file or
    hub id is one set (its 'test' split when it has several)."""
    if source is None:
        return {}
    if isinstance(source, dict):  # DatasetDict and IterableDatasetDict are dicts too
        return {str(name): load_dataset_any(value, split="test") for name, value in source.items()}
    return {None: load_dataset_any(source, split="test")}


def materialize(dataset, rows_needed: int | None, whole: bool = False):
    """An IterableDataset (streaming) is read only as far as the run needs, which requires max_steps
    (an eval set, `whole`, is read to its end); returns (Dataset, streamed?)."""
    import itertools

    import datasets

    if not isinstance(dataset, datasets.IterableDataset):
        return dataset, False
    if whole:
        rows = list(dataset)
        if not rows:
            raise DatasetError("the eval IterableDataset yielded no rows")
        return datasets.Dataset.from_list(rows), True
    if rows_needed is None:
        raise DatasetError("an IterableDataset (streaming) has no length: set max_steps so rlft "
                           "knows how many rows to read")
    rows = list(itertools.islice(iter(dataset), rows_needed))
    if not rows:
        raise DatasetError("the IterableDataset yielded no rows")
    return datasets.Dataset.from_list(rows), True


def is_conversational(prompt: Any) -> bool:
    return isinstance(prompt, list) and all(isinstance(m, dict) and "role" in m for m in prompt)


def render_prompt(prompt: Any, tokenizer, row: int, chat_template_kwargs: dict | None = None,
                  filled_later: bool = False) -> str:
    """The prompt as the policy reads it (a chat template for messages). `filled_later`: an
    environment's reset() adds to every prompt, so chat messages may all be empty."""
    if isinstance(prompt, str):
        if not prompt:
            raise DatasetError(f"row {row}: empty prompt")
        return prompt
    if is_conversational(prompt):
        if not getattr(tokenizer, "chat_template", None):
            raise DatasetError(f"row {row}: the prompt is a list of chat messages but the "
                               "tokenizer has no chat template; set tokenizer.chat_template or "
                               "give prompts as plain strings")
        for index, message in enumerate(prompt):
            if message.get("role") not in CHAT_ROLES:
                raise DatasetError(f"row {row}: message {index} has role {message.get('role')!r}; "
                                   f"use one of {CHAT_ROLES}")
            if message.get("content") is None and not message.get("tool_calls"):
                raise DatasetError(f"row {row}: message {index} ({message['role']}) has no "
                                   "'content'")
        if not filled_later and not any(_said(message) for message in prompt):
            raise DatasetError(f"row {row}: every message of the prompt is empty (the policy would "
                               "answer the chat template alone); fill its content or drop the row")
        return tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True,
                                             **(chat_template_kwargs or {}))
    raise DatasetError(f"row {row}: prompt must be a string or a list of {{'role', 'content'}} "
                       f"messages, got {type(prompt).__name__}")


def _said(message: dict) -> bool:
    """The message carries something: text (or content parts), or tool calls."""
    content = message.get("content")
    text = content.strip() if isinstance(content, str) else content
    return bool(text) or bool(message.get("tool_calls"))


class PromptSet:
    """Rendered, tokenized prompts plus their extra columns, checked once up front."""

    def __init__(self, dataset, tokenizer, max_prompt_length: int | None, max_completion_length: int,
                 context_length: int | None, chat_template_kwargs: dict | None = None,
                 filled_later: bool = False):
        if "prompt" not in dataset.column_names:
            raise DatasetError("dataset has no 'prompt' column; columns found: "
                               f"{dataset.column_names}. "
                               "Rename the column holding prompts to 'prompt'")
        if len(dataset) == 0:
            raise DatasetError("dataset is empty")
        clash = [c for c in dataset.column_names if c in REWARD_ARGUMENTS]
        if clash:
            raise DatasetError(f"dataset column(s) {clash} have the names of arguments rlft passes "
                               f"to reward functions ({', '.join(REWARD_ARGUMENTS)}); rename them")
        self.rows = dataset.to_list()
        self.extra_columns = [c for c in dataset.column_names if c != "prompt"]
        self.texts = [render_prompt(r["prompt"], tokenizer, i, {**(chat_template_kwargs or {}),
                                                                **(r.get("chat_template_kwargs") or {})},
                                    filled_later)
                      # a row's own chat_template_kwargs win (TRL's column)
                      for i, r in enumerate(self.rows)]
        encoded = tokenizer(self.texts, add_special_tokens=False)["input_ids"]
        self.token_ids: list[list[int]] = encoded
        self._check_lengths(max_prompt_length, max_completion_length, context_length)

    def _check_lengths(self, max_prompt_length, max_completion_length, context_length) -> None:
        lengths = [len(ids) for ids in self.token_ids]
        longest = max(range(len(lengths)), key=lengths.__getitem__)
        if max_prompt_length is not None and lengths[longest] > max_prompt_length:
            over = sum(n > max_prompt_length for n in lengths)
            raise DatasetError(f"{over} prompt(s) exceed max_prompt_length={max_prompt_length} "
                               f"tokens (row {longest} has {lengths[longest]}); raise "
                               "max_prompt_length or shorten/filter those rows")
        if context_length is not None and lengths[longest] + max_completion_length > context_length:
            raise DatasetError(f"row {longest}: prompt of {lengths[longest]} tokens + "
                               f"max_completion_length={max_completion_length} exceeds the model's "
                               f"context of {context_length} "
                               "tokens; lower max_completion_length or shorten the prompt")

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
    """A deterministic shuffle per epoch, so a resumed run sees the same prompts in the same
    order."""
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


def right_pad(rows: list[list], fill, dtype=torch.long) -> tuple[torch.Tensor, torch.Tensor]:
    """[[values]] -> (values [B, W] right-padded with `fill`, mask [B, W]): completions, tool masks,
    log-probs."""
    width = max(len(r) for r in rows)
    values = torch.full((len(rows), width), fill, dtype=dtype)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        if len(row):
            values[i, :len(row)] = torch.tensor(row, dtype=dtype)
            mask[i, :len(row)] = 1
    return values, mask
