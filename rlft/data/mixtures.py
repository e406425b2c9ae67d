"""TRL's dataset mixtures (`datasets:` in a recipe, `DatasetMixtureConfig`): `get_dataset` loads
each entry (a local folder offline, as every local dataset rlft loads) and mixes them in their
fractions."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import TYPE_CHECKING

from rlft.data.prompts import offline_datasets
from rlft.errors import ConfigError

if TYPE_CHECKING:
    from rlft.config.script_args import DatasetMixtureConfig


def _mixture_shares(sizes: list[int], fractions: list[float]) -> list[int]:
    """Rows taken from each dataset: the largest mixture in which each dataset makes up its share of
    the whole (fractions normalised to sum to 1) without repeating a row; the first rows of each are
    kept."""
    weights = [f / sum(fractions) for f in fractions]
    total = min(size / w for size, w in zip(sizes, weights) if w > 0)
    return [round(w * total) for w in weights]


def get_dataset(mixture_config: DatasetMixtureConfig):
    """The mixture as a `DatasetDict`: 'train' (and 'test' with test_split_size)."""
    import datasets

    if not mixture_config.datasets:
        raise ConfigError("the dataset mixture is empty: give at least one entry under datasets:")
    loaded = []
    for entry in mixture_config.datasets:
        with offline_datasets() if Path(entry.path).exists() else contextlib.nullcontext():
            part = datasets.load_dataset(
                path=entry.path,
                name=entry.name,
                data_dir=entry.data_dir,
                data_files=entry.data_files,
                split=entry.split,
                streaming=mixture_config.streaming,
            )
        loaded.append(part.select_columns(entry.columns) if entry.columns is not None else part)
    fractions = [entry.fraction for entry in mixture_config.datasets]
    if any(f is not None for f in fractions):
        if any(f is None for f in fractions):
            raise ConfigError(
                "datasets: fraction is set for some datasets of the mixture and not others; set it "
                "for every one or none"
            )
        if mixture_config.streaming:
            raise ConfigError(
                "datasets: fraction needs the datasets' lengths, which streaming datasets do not "
                "have"
            )
        counts = _mixture_shares([len(d) for d in loaded], fractions)
        loaded = [d.select(range(n)) for d, n in zip(loaded, counts)]
    combined = datasets.concatenate_datasets(loaded)
    if mixture_config.test_split_size is not None:
        return combined.train_test_split(test_size=mixture_config.test_split_size)
    return (
        datasets.DatasetDict({"train": combined})
        if isinstance(combined, datasets.Dataset)
        else datasets.IterableDatasetDict({"train": combined})
    )
