"""Several teachers (multi-teacher distillation): each row is distilled from the teacher its dataset
row names in a `teacher_id` column (TRL's column and message, from its experimental async
distillation), each teacher local or served. `TeacherSet` is what the scorer holds in place of one
teacher: it routes the rows of a rollout (`route`: the rollout carries each row's teacher as
`teacher_index`, in checkpoints too), and sums per teacher what the step's divergences were
(`teacher_jsd/<id>`, `teacher_entropy/<id>`, `teacher_token_frac/<id>`).

Teachers come from `teacher_model=` as a dict (id -> a hub id, a folder, a loaded model or a server
URL), or from the config: `teacher_models` (id -> hub id or folder) and `teacher_server_urls` (TRL's
name: id -> URL of `rlft vllm-serve`). With one teacher the column is not needed (and not read).
"""

from __future__ import annotations

from typing import Any

import torch

from rlft.errors import ConfigError

COLUMN = "teacher_id"


def teacher_dict(teacher_model, args) -> dict[str, Any] | None:
    """id -> what each teacher loads from (a URL for a served one), or None for a run of one
    teacher."""
    local = dict(getattr(args, "teacher_models", None) or {})
    served = dict(getattr(args, "teacher_server_urls", None) or {})
    if isinstance(teacher_model, dict):
        local.update(teacher_model)
    elif teacher_model is not None and (local or served):
        raise ConfigError("teacher_model is one teacher, but teacher_models / teacher_server_urls "
                          "name several: pass teacher_model={id: model, ...} or leave it out")
    if not local and not served:
        return None
    clash = sorted(set(local) & set(served))
    if clash:
        raise ConfigError(f"teacher ids {clash} are both local (teacher_models / teacher_model) "
                          "and served (teacher_server_urls): give each id one teacher")
    if args.teacher_model_name_or_path or args.teacher_model_server_url:
        raise ConfigError("teacher_model_name_or_path / teacher_model_server_url name one teacher, "
                          "and teacher_models / teacher_server_urls / teacher_model={...} several: "
                          "keep one form")
    return {str(k): v for k, v in {**local, **served}.items()}


def is_url(value) -> bool:
    return isinstance(value, str) and value.startswith(("http://", "https://"))


class TeacherSet:
    """The run's teachers by id (module docstring)."""

    def __init__(self, teachers: dict[str, Any]):
        self.ids = list(teachers)
        self.teachers = teachers
        for k, teacher in enumerate(teachers.values()):
            # a served one asks its server for its own rows only
            if hasattr(teacher, "route_index"):
                teacher.route_index = k
        self.reset()

    def __len__(self) -> int:
        return len(self.ids)

    def items(self):
        return self.teachers.items()

    def prepared(self, prepare) -> TeacherSet:
        """The set with every local teacher passed through `prepare` (the training engine's, for a
        frozen model)."""
        return TeacherSet({k: prepare(t) if isinstance(t, torch.nn.Module) else t for k, t in self.items()})

    def record(self) -> dict:
        """For the run record: each teacher's (a served one's own; a local one's class, size and
        weights)."""
        from rlft.train.run.runs import model_record

        return {k: t.record() if hasattr(t, "record") else model_record(getattr(t, "module", t), weights=True)
                for k, t in self.items()}

    # ---- routing ----------------------------------------------------------------------------------
    def route(self, rollout) -> None:
        """rollout.teacher_index [N] from the rows' `teacher_id` (rollout.extra); one teacher: all
        0."""
        if rollout.teacher_index is not None:
            return
        rows = rollout.completion_ids.shape[0]
        if len(self.ids) == 1:
            index = [0] * rows
        else:
            named = rollout.extra.get(COLUMN)
            if named is None:
                raise ConfigError(f"{len(self.ids)} teachers ({self.ids}) but the dataset has no "
                                  f"'{COLUMN}' "
                                  "column: give each row the id of the teacher it is distilled "
                                  "from")
            index = [self._index(value) for value in named]
        rollout.teacher_index = torch.tensor(index, dtype=torch.long, device=rollout.completion_ids.device)

    def _index(self, value) -> int:
        if value not in self.teachers:
            raise ConfigError(f"Example has `{COLUMN}={value!r}`, which is not among the teachers "
                              "passed to `teacher_server_urls` / `teacher_models`. Expected one "
                              f"of: {self.ids}.")
        return self.ids.index(value)

    # ---- what the step's divergences were, per teacher -----------------------------------------
    def reset(self) -> None:
        self.sums = torch.zeros(len(self.ids), 3, dtype=torch.float64)  # D, teacher entropy, tokens

    def observe(self, k: int, divergence: torch.Tensor, teacher_entropy: torch.Tensor,
                mask: torch.Tensor) -> None:
        mask = mask.to(divergence.dtype)
        self.sums[k] += torch.stack([(divergence.detach() * mask).sum(), (teacher_entropy * mask).sum(),
                                     mask.sum()]).double().cpu()

    def metrics(self, accelerator) -> dict[str, float]:
        """Per teacher, over the step on every process: the token-mean divergence and teacher
        entropy, and the teacher's share of the trained tokens."""
        sums = self.sums.to(accelerator.device)
        if accelerator.num_processes > 1:
            sums = accelerator.reduce(sums, "sum")
        total = float(sums[:, 2].sum()) or 1.0
        out = {}
        for k, name in enumerate(self.ids):
            tokens = float(sums[k, 2])
            out[f"teacher_token_frac/{name}"] = tokens / total
            if tokens:
                out[f"teacher_jsd/{name}"] = float(sums[k, 0]) / tokens
                out[f"teacher_entropy/{name}"] = float(sums[k, 1]) / tokens
        self.reset()
        return out
