"""Token-budget micro-batches: rows grouped by their token counts instead of a fixed number of rows.

Long rows go alone, short rows together, so every micro-batch costs about the same memory. The
step's loss is a sum over rows with global normalisers (rlft/core/losses.py), so how rows are
grouped changes nothing but memory and speed.
"""

from __future__ import annotations

import torch


def budget_bins(tokens: torch.Tensor, budget: int) -> list[list[int]]:
    """Rows in groups of at most `budget` tokens each: longest first, first fit (a row longer than
    the budget goes alone). tokens: [N] prompt + completion tokens per row -> groups of row indices,
    each longest first."""
    bins: list[list[int]] = []
    loads: list[int] = []
    for row in torch.argsort(tokens, descending=True, stable=True).tolist():
        length = int(tokens[row])
        for index, used in enumerate(loads):
            if used + length <= budget:
                bins[index].append(row)
                loads[index] += length
                break
        else:
            bins.append([row])
            loads.append(length)
    return bins


def budget_count(tokens: torch.Tensor, budget: int) -> int:
    return len(budget_bins(tokens, budget))


def split_to(bins: list[list[int]], tokens: torch.Tensor, count: int) -> list[list[int]]:
    """The same rows in `count` groups (at most the number of rows): the heaviest splittable group
    is halved until there are enough (another process needs more micro-batches, and every process
    runs as many)."""
    bins = [list(b) for b in bins]
    while len(bins) < count:
        splittable = [b for b in bins if len(b) > 1]
        if not splittable:
            break
        heaviest = max(splittable, key=lambda b: sum(int(tokens[r]) for r in b))
        bins.remove(heaviest)
        bins += [heaviest[: len(heaviest) // 2], heaviest[len(heaviest) // 2:]]
    return bins


def balanced_bins(tokens: torch.Tensor, count: int, budget: int | None = None) -> list[torch.Tensor]:
    """Row indices in `count` micro-batches within the token budget; each group longest first."""
    bins = split_to(budget_bins(tokens, budget if budget is not None else int(tokens.sum())), tokens, count)
    return [torch.tensor(b, dtype=torch.long) for b in bins]
