"""The one protocol every rollout engine meets: transformers' generate (`hf.py`), vLLM colocated
(`vllm.py`) or as a server (`vllm_server.py`), and the tool loop around any of them
(`multiturn.py`); and `Rollout`, what every engine returns: a carrier whose row operations are
written once, over its declared fields.

The trainer calls the engine for completions and tells it when the policy's weights changed (after
each applied optimiser step and after a resume); an engine holding its own copy of the weights
(vLLM) syncs before its next generation, one reading the live model (generate) has nothing to do.

Row carriers (`Rows`): each field says in its metadata what it holds per row (`rows(kind, ...)`),
and `select(rows)`, `split(size)`, `cat(parts)`, `to(device)`, `tensors()` / `from_tensors()` follow
from that, so no caller rebuilds a carrier field by field and no field is dropped on the way:
    left     [N, T] tensor, left-padded (prompts): `cat` pads on the left to the widest part
    right    [N, T] (or [N]) tensor, right-padded (completions, per-token values)
    row      [N, ...] tensor, nothing to pad
    list     one Python value per row
    columns  dict of per-row lists (values reward functions receive by name)
    tensors  dict of per-row tensors (counts per row)
    rows     a nested carrier (its saved tensors are flattened into the parent's)
    whole    one value for all rows (kept by select and split; `cat` keeps the first part's)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

KINDS = ("left", "right", "row", "list", "columns", "tensors", "rows", "whole")
PAD_TOKEN = "pad_token"  # a `pad` that stands for the pad token id given to `cat`


def rows(kind: str, *, pad: float | str = 0, saved: bool = False, stored: torch.dtype | None = None,
         default: Any = dataclasses.MISSING, default_factory: Any = dataclasses.MISSING) -> Any:
    """A carrier field: what it holds per row (`kind`, module docstring), the value `cat` pads with
    (a number, or PAD_TOKEN), whether `tensors()` saves it (checkpoints), and `stored`: the dtype a
    bool flag is saved as (read back as bool)."""
    if kind not in KINDS:
        raise ValueError(f"row kind {kind!r}: choose one of {KINDS}")
    meta = {"rows": kind, "pad": pad, "saved": saved, "stored": stored}
    return dataclasses.field(default=default, default_factory=default_factory, metadata=meta)


def _index(rows, device) -> Any:
    return rows if isinstance(rows, slice) else torch.as_tensor(rows, dtype=torch.long, device=device)


def _pick(value, rows):
    if isinstance(rows, slice):
        return value[rows]
    return [value[i] for i in (rows.tolist() if torch.is_tensor(rows) else rows)]


def _pad_cat(tensors: list[torch.Tensor], value, left: bool) -> torch.Tensor:
    """Rows of several [n, T, ...] tensors as one, each padded with `value` to the widest T (on the
    left with `left`) and the widest of every later dimension (on the right); [n] ones: cat."""
    device = tensors[0].device
    tensors = [t.to(device) for t in tensors]
    if tensors[0].ndim < 2:
        return torch.cat(tensors)
    shape = [max(t.shape[d] for t in tensors) for d in range(1, tensors[0].ndim)]
    padded = []
    for t in tensors:
        out = t.new_full((t.shape[0], *shape), value)
        start = shape[0] - t.shape[1] if left else 0
        out[(slice(None), slice(start, start + t.shape[1]), *(slice(0, n) for n in t.shape[2:]))] = t
        padded.append(out)
    return torch.cat(padded)


class Rows:
    """Row operations over a dataclass's `rows(...)` fields (module docstring)."""

    @classmethod
    def _fields(cls) -> list[tuple[str, dict]]:
        return [(f.name, f.metadata) for f in dataclasses.fields(cls) if "rows" in f.metadata]

    def row_count(self) -> int:
        """N, the number of rows."""
        for name, meta in self._fields():
            value = getattr(self, name)
            if value is not None and meta["rows"] in ("left", "right", "row", "list", "rows"):
                return len(value)
        raise ValueError(f"{type(self).__name__} has no per-row field set")

    def select(self, rows) -> Rows:
        """The carrier's rows `rows` (a slice, or row numbers in the order wanted) in every per-row
        field."""
        out = {}
        for name, meta in self._fields():
            value, kind = getattr(self, name), meta["rows"]
            if value is None or kind == "whole":
                out[name] = value
            elif kind in ("left", "right", "row"):
                out[name] = value[_index(rows, value.device)]
            elif kind == "list":
                out[name] = _pick(value, rows)
            elif kind == "columns":
                out[name] = {k: _pick(v, rows) for k, v in value.items()}
            elif kind == "tensors":
                out[name] = {k: v[_index(rows, v.device)] for k, v in value.items()}
            else:
                out[name] = value.select(rows)
        return dataclasses.replace(self, **out)

    def split(self, size: int) -> list[Rows]:
        """Consecutive parts of `size` rows (the last may be shorter)."""
        return [self.select(slice(start, start + size)) for start in range(0, self.row_count(), size)]

    @classmethod
    def cat(cls, parts: list[Rows], pad_token_id: int = 0) -> Rows:
        """The rows of several carriers as one, in order; padded fields padded to the widest
        part."""
        if len(parts) == 1:
            return parts[0]
        out = {}
        for name, meta in cls._fields():
            values, kind = [getattr(p, name) for p in parts], meta["rows"]
            if all(v is None for v in values) or kind == "whole":
                out[name] = values[0]
                continue
            if any(v is None for v in values):
                raise ValueError(f"{cls.__name__}.cat: {name} is set in some parts and not in "
                                 "others")
            pad = pad_token_id if meta["pad"] == PAD_TOKEN else meta["pad"]
            if kind in ("left", "right", "row"):
                out[name] = _pad_cat(values, pad, left=kind == "left")
            elif kind == "list":
                out[name] = [v for value in values for v in value]
            elif kind == "columns":  # the columns every part has
                out[name] = {k: [v for value in values for v in value[k]] for k in values[0]
                             if all(k in value for value in values)}
            elif kind == "tensors":
                out[name] = {k: _pad_cat([value[k] for value in values], 0, False) for k in values[0]}
            else:
                out[name] = type(values[0]).cat(values, pad_token_id)
        return cls(**out)

    def to(self, device) -> Rows:
        """Every tensor (nested ones and those in dicts too) on `device`."""
        out = {}
        for name, meta in self._fields():
            value, kind = getattr(self, name), meta["rows"]
            if value is None or kind in ("list", "columns", "whole"):
                out[name] = value
            elif kind == "tensors":
                out[name] = {k: v.to(device) for k, v in value.items()}
            else:
                out[name] = value.to(device)
        return dataclasses.replace(self, **out)

    def tensors(self) -> dict[str, torch.Tensor]:
        """The saved fields (`rows(saved=True)`) by name, nested carriers' flattened in, for a
        checkpoint."""
        out = {}
        for name, meta in self._fields():
            value = getattr(self, name)
            if meta["rows"] == "rows":
                out.update(value.tensors())
            elif meta["saved"] and value is not None:
                out[name] = value if meta["stored"] is None else value.to(meta["stored"])
        return out

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], device=None, **others) -> Rows:
        """The carrier `tensors()` saved, on `device`; fields that are not saved come from
        `others`."""
        out = dict(others)
        for name, meta in cls._fields():
            if name in out:
                continue
            if meta["rows"] == "rows":
                out[name] = _nested_type(cls, name).from_tensors(tensors, device)
            elif meta["saved"] and name in tensors:
                value = tensors[name] if device is None else tensors[name].to(device)
                out[name] = value.bool() if meta["stored"] is not None else value
        return cls(**out)


def _nested_type(cls: type, name: str) -> type:
    import typing

    hint = typing.get_type_hints(cls)[name]
    return next(a for a in (typing.get_args(hint) or (hint,)) if isinstance(a, type) and issubclass(a, Rows))


@dataclass
class Rollout(Rows):
    """What an engine returns for prompts x num_generations: rows in groups, each prompt's
    completions consecutive."""

    # [N, P] each prompt G times in a row
    prompt_ids: torch.Tensor = rows("left", pad=PAD_TOKEN, saved=True)
    prompt_mask: torch.Tensor = rows("left", saved=True)  # [N, P]
    completion_ids: torch.Tensor = rows("right", pad=PAD_TOKEN, saved=True)  # [N, C]
    # [N, C] 1 up to and including the first EOS
    completion_mask: torch.Tensor = rows("right", saved=True)
    # [N] bool: no EOS in the budget
    truncated: torch.Tensor = rows("row", saved=True, stored=torch.uint8)
    # [N, C] the engine's log-prob of each sampled token (vLLM, the async producer, rollout_func)
    sampling_logps: torch.Tensor | None = rows("right", pad=0.0, saved=True, default=None)
    # Multi-turn rollouts: 1 where the policy sampled the token, 0 for tool output and chat-template
    # glue, which the policy reads (attention: completion_mask) but is not trained on (loss:
    # loss_mask).
    tool_mask: torch.Tensor | None = rows("right", saved=True, default=None)  # [N, C]
    # per row, the completion as chat messages (what reward functions receive)
    completions: list | None = rows("list", default=None)
    # per-row values for reward functions
    extra: dict[str, list] = rows("columns", default_factory=dict)
    # per-row counts: tool calls,...
    stats: dict[str, torch.Tensor] = rows("tensors", default_factory=dict)
    # [N, C, K] int32: the token ids a truncating sampler (top-k / top-p / min-p) kept at each
    # position, -1 padding (a position without any: the full vocabulary); the trainer renormalises
    # over them
    sampling_kept: torch.Tensor | None = rows("right", pad=-1, saved=True, default=None)
    # [N] the teacher each row is distilled from, by its index in the run's teachers (several
    # teachers: rlft/train/update/teachers.py)
    teacher_index: torch.Tensor | None = rows("row", saved=True, default=None)
    # [N, P, L, k] and [N, C, L, k] int16: the experts the sampler routed each prompt and completion
    # token to in each of a Mixture-of-Experts policy's L layers, -1 where none was recorded; the
    # trainer replays them (routing_replay, rlft/model/routing.py)
    prompt_routes: torch.Tensor | None = rows("left", pad=-1, saved=True, default=None)
    completion_routes: torch.Tensor | None = rows("right", pad=-1, saved=True, default=None)
    # [N, C] int32: the version (optimiser step) of the weights that sampled each completion token
    # when weights change mid-rollout (in-flight weight updates), -1 past the completion
    token_versions: torch.Tensor | None = rows("right", pad=-1, saved=True, default=None)
    # [N, P'] the prompt the teacher reads before each completion where it differs from the
    # student's (self-distillation: the prompt with its privileged context; rlft/train/sdft.py)
    teacher_prompt_ids: torch.Tensor | None = rows("left", pad=PAD_TOKEN, saved=True, default=None)
    teacher_prompt_mask: torch.Tensor | None = rows("left", saved=True, default=None)  # [N, P']
    # [N] 1 where the teacher's prompt holds what the student's lacks (SDPO: a sibling's success or
    # feedback), 0 where it is the student's own; None: every row
    teacher_rows: torch.Tensor | None = rows("row", saved=True, default=None)

    @property
    def loss_mask(self) -> torch.Tensor:
        """The tokens the loss is over: the completion, less what the policy did not generate."""
        return self.completion_mask if self.tool_mask is None else self.completion_mask * self.tool_mask


@runtime_checkable
class RolloutEngine(Protocol):
    """`engine(model, prompt_ids, num_generations, greedy=False) -> Rollout` (groups of
    num_generations consecutive rows per prompt), `on_weights_changed()`, `close()`;
    `holds_own_weights` says whether the engine keeps a copy of the weights (so the trainer need not
    make its own whole for a rollout)."""

    holds_own_weights: bool

    def __call__(self, model, prompt_ids: list[list[int]], num_generations: int, greedy: bool = False,
                 **kwargs) -> Rollout: ...

    def on_weights_changed(self) -> None: ...

    def close(self) -> None: ...


def holds_own_weights(engine) -> bool:
    """The engine's `holds_own_weights`; a bare callable engine (a test stub, a user's own) reads
    the live model."""
    return bool(getattr(engine, "holds_own_weights", False))


def weights_changed(engine) -> None:
    """Tell the engine the policy's weights changed; a bare callable engine has nothing to sync."""
    notify = getattr(engine, "on_weights_changed", None)
    if notify is not None:
        notify()


def engine_metrics(engine) -> dict[str, float]:
    """What the engine measured since it was last asked (vLLM: weight-sync seconds and bytes); {}
    for engines that measure nothing."""
    metrics = getattr(engine, "metrics", None)
    return metrics() if metrics is not None else {}
