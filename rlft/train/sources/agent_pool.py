"""Partial rollouts with tools and environments (AsyncGRPOTrainer, `partial_rollouts: N` with `tools=` or
`environment_factory=`; docs/async.md).

Without tools, the producer holds partial rollouts' pool (rlft/rollout/partial.py). A tool loop runs in
the trainer's process (rlft/train/sources/agent_driver.py), so here the driver thread holds the pool:
the tool-loop rows of rollout k and of the next N rollouts, each row a completion in progress (its
tokens, tool output included, each sampled token's log-prob and version) with its own tools or
environment instance. Driving rollout k is a sequence of *windows*, each one producer request:

1. every row whose turn ended with tool calls has them run (all rows' calls at once), its tool
   messages appended as tokens (masked from the loss), and it starts its next turn;
2. every row with a turn to sample or to go on with, of any rollout in the pool, is continued in one
   generate call, which ends as soon as every such row of rollout k has ended its turn (EOS or its
   budget); the other rows' turns are cut there and go on in a later window (continued, not restarted:
   their tokens so far are the next window's prefix);

until no row of rollout k has a turn to sample. Rollout k is then scored and trained at its step, with the
same prompts as without look-ahead; its rows' tokens may come from up to N rollouts' older weights,
each corrected per token by its recorded version and log-prob (max_staleness bounds it). So a rollout's
long multi-turn tail no longer sets the step time: the rows of later rollouts advance in its windows.

Windows are decided by the schedule alone (which rows rollout k has, not timing), and each samples
after a seed that is a function of (seed, k, window): with tools and environments that answer the same,
one seed gives one run. A checkpoint saves the pool (tokens, messages, counters; no user objects). On
resume each carried row's environment is reset with its dataset row again and the row's recorded tool
calls are replayed on it in order, rebuilding its state; an environment that answers a replayed call
differently from the recorded answer is warned about (the resumed run then differs from the straight
one). Pool rollouts take their environment instances from lanes 1..N+1 (rollout r: lane 1 + r mod
(N + 1)), so evaluation (lane 0) and rollouts in flight never share an instance.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass

import torch

from rlft.data.prompts import left_pad
from rlft.rollout.base import Rollout
from rlft.rollout.multiturn import ToolLoop, _Row
from rlft.rollout.tools import ToolCall

_ROW_FIELDS = ("ids", "mask", "logps", "kept", "messages", "ended", "calls", "failures", "turns", "versions",
               "turn_start", "rounds", "status", "ran")


@dataclass
class Cohort:
    """One rollout's rows in the pool and (environments) their instances."""

    rows: list[_Row]
    envs: list | None = None


class AgentPool:
    """The driver thread's pool of tool-loop rows (module docstring); `drive(r)` -> rollout r's Rollout
    (its rows done), the rollouts after it advanced as far."""

    def __init__(self, source, ahead: int):
        self.source, self.ahead = source, ahead
        args = source.args
        self.loop = ToolLoop(None, source.tokenizer, source.setup.toolset, args.max_completion_length,
                             args.max_tool_calling_iterations, args.tool_call_timeout,
                             args.chat_template_kwargs)
        self.cohorts: dict[int, Cohort] = {}
        self.kept = False  # a truncating sampler's kept ids are recorded
        self.stats: dict[str, float] = {}
        self.saved: tuple | None = None  # a checkpoint's pool, restored when the driver next drives

    # ---- rows ----------------------------------------------------------------------------------------
    def _add(self, rollout: int) -> None:
        if rollout in self.cohorts:
            return
        ids, envs, toolsets = self._prompts(rollout)
        self.cohorts[rollout] = Cohort([_Row(p, t) for p, t in zip(ids, toolsets, strict=True)], envs)

    def _prompts(self, rollout: int):
        """Rollout `rollout`'s rows: prompt ids, environment instances (None without), toolsets."""
        from rlft.train.sources.generation import environment_rows

        source, count = self.source, self.source.args.num_generations
        prompts = source.schedule.batch(rollout)
        if source.setup.environments is None:
            ids = [p for p in prompts["prompt_ids"] for _ in range(count)]
            return ids, None, [source.setup.toolset] * len(ids)
        return environment_rows(source.setup, source.tokenizer, prompts, count,
                                lane=1 + rollout % (self.ahead + 1))

    def _answer(self) -> None:
        """Run the pending tool calls of every row in the pool that may still call tools."""
        waiting = [row for c in self.cohorts.values() for row in c.rows if row.status == "tools"]
        if not waiting:
            return
        for row in waiting:
            if row.rounds >= self.loop.max_iterations:
                row.status = "done"  # its calls stay pending: counted as hitting the limit
        going = {id(row) for row in self.loop.answer([row for row in waiting if row.status == "tools"])}
        for row in waiting:
            row.status = "generate" if id(row) in going else "done"

    # ---- a rollout -------------------------------------------------------------------------------------
    def drive(self, rollout: int, last: int, version: int) -> Rollout:
        """Windows until every row of rollout `rollout` is done (the rollouts up to `last` in the pool
        too), each from the weights of `version` or (in-flight updates) newer; its rows assembled,
        dropped from the pool. Every pending call is answered before it returns."""
        if self.saved is not None:
            self._restore(*self.saved)
            self.saved = None
        for r in range(rollout, min(rollout + self.ahead, last) + 1):
            self._add(rollout=r)
        stats = {"partial/window_rows": 0.0, "partial/window_steps": 0.0, "partial/prefill_tokens": 0.0,
                 "partial/continued_rows": 0.0, "partial/windows": 0.0, "seconds": 0.0}
        mine = self.cohorts[rollout].rows
        before = sum(row.mask.count(1) for row in mine)
        while True:
            self._answer()
            going = [(r, i, row) for r, c in self.cohorts.items() for i, row in enumerate(c.rows)
                     if row.status == "generate"]
            if not any(r == rollout for r, _, _ in going):
                break
            produced = self._window(going, rollout, int(stats["partial/windows"]), version)
            stats["seconds"] += produced.seconds
            for key in ("partial/window_rows", "partial/window_steps", "partial/prefill_tokens",
                        "partial/continued_rows"):
                stats[key] += produced.timings.get(key, 0.0)
            stats["partial/windows"] += 1
        self._answer()
        sampled = sum(row.mask.count(1) for row in mine)
        stats["partial/carried_share"] = before / max(sampled, 1)
        self.stats = stats
        cohort = self.cohorts.pop(rollout)
        out = self.loop.assemble(cohort.rows, self._head(cohort.rows))
        if cohort.envs is not None:
            out.extra["environments"] = cohort.envs
        return out

    def _window(self, going: list[tuple[int, int, _Row]], rollout: int, window: int, version: int):
        """One producer request: every row in `going` ((rollout, index, row)) continued, until rollout
        `rollout`'s turns end."""
        source = self.source
        engine, key = source.engine, f"rollout-{rollout}-w{window}"
        prefixes = [row.prompt + row.ids for _, _, row in going]
        rows = {"prefixes": prefixes, "budgets": [self.loop.max_length - len(row.ids) for _, _, row in going],
                "must": [r == rollout for r, _, _ in going],
                # a turn cut by a window goes on under its name (a kept vLLM request in the throughput mode)
                "names": [[r, i, row.turns] for r, i, row in going]}
        engine.submit_rows(key, rows, source.turn_seed(rollout, window))
        produced = engine.take(key)
        newer_allowed = getattr(source.args, "inflight_weight_updates", False)
        if produced.version < version or (produced.version != version and not newer_allowed):
            raise RuntimeError(f"{key} was sampled from the weights of step {produced.version}, not "
                               f"{version} (an rlft bug: weights were pushed during its rollout's windows)")
        out = engine.to_rollout(produced, prefixes, 1, source.accelerator.device)
        self.kept = self.kept or out.sampling_kept is not None
        for i, (_, _, row) in enumerate(going):
            cut = not produced.finished[i]
            self.loop.absorb_row(row, out, i, cut)
            if not cut:
                row.status = "tools" if row.pending else "done"
        return produced

    def _head(self, rows: list[_Row]) -> Rollout:
        """What ToolLoop.assemble reads of a first turn: the prompts and which per-token records exist."""
        device = self.source.accelerator.device
        prompt_ids, prompt_mask = left_pad([row.prompt for row in rows], self.source.tokenizer.pad_token_id)
        n = len(rows)
        empty = torch.zeros((n, 1), dtype=torch.long, device=device)
        head = Rollout(prompt_ids.to(device), prompt_mask.to(device), empty, empty, empty[:, 0].bool(),
                       torch.zeros((n, 1), device=device),
                       sampling_kept=torch.full((n, 1, 1), -1, dtype=torch.int32, device=device)
                       if self.kept else None)
        head.token_versions = empty.int()
        if rows[0].prompt_routes is not None:  # a MoE policy's routes, each prompt's from its first window
            shape = rows[0].prompt_routes.shape[1:]
            routes = torch.full((n, prompt_ids.shape[1], *shape), -1, dtype=torch.int16)
            for r, row in enumerate(rows):
                routes[r, routes.shape[1] - len(row.prompt):] = row.prompt_routes
            head.prompt_routes = routes.to(device)
            head.completion_routes = torch.full((n, 1, *shape), -1, dtype=torch.int16, device=device)
        return head

    # ---- what a checkpoint keeps -----------------------------------------------------------------------
    def state(self) -> tuple[list[dict], dict[str, torch.Tensor]]:
        """(JSON, tensors) of every rollout in the pool: each row's progress (no environment: resumed by
        replaying the row's tool calls, `load`)."""
        if self.saved is not None:  # (restored from a checkpoint, not driven since)
            return self.saved
        saved, tensors = [], {}
        for rollout, cohort in self.cohorts.items():
            rows = []
            for index, row in enumerate(cohort.rows):
                rows.append({name: copy.deepcopy(getattr(row, name)) for name in _ROW_FIELDS}
                            | {"pending": [vars(call) for call in row.pending]})
                if row.prompt_routes is not None:
                    prefix = f"async.pool.{rollout}.{index}"
                    tensors[f"{prefix}.prompt_routes"] = row.prompt_routes.cpu().contiguous()
                    known = [j for j, route in enumerate(row.routes) if route is not None]
                    tensors[f"{prefix}.route_positions"] = torch.tensor(known, dtype=torch.long)
                    tensors[f"{prefix}.routes"] = (torch.stack([row.routes[j].cpu() for j in known]) if known
                                                   else row.prompt_routes[:0].cpu()).contiguous()
            saved.append({"rollout": rollout, "rows": rows})
        return saved, tensors

    def load(self, saved: list[dict], tensors: dict[str, torch.Tensor]) -> None:
        """The pool a checkpoint kept, restored when the driver next drives (the prompt schedule is
        restored by then)."""
        mine = {name: value for name, value in tensors.items() if name.startswith("async.pool.")}
        self.cohorts, self.saved = {}, ((saved, mine) if saved else None)

    def _restore(self, saved: list[dict], tensors: dict[str, torch.Tensor]) -> None:
        """Rows rebuilt from their prompts (the schedule's), progress restored, each environment reset
        and its row's recorded calls replayed on it."""
        for entry in saved:
            rollout = entry["rollout"]
            self._add(rollout)
            cohort = self.cohorts[rollout]
            for index, (row, values) in enumerate(zip(cohort.rows, entry["rows"], strict=True)):
                for name in _ROW_FIELDS:
                    setattr(row, name, values[name])
                row.pending = [ToolCall(**call) for call in values["pending"]]
                prefix, row.routes = f"async.pool.{rollout}.{index}", [None] * len(row.ids)
                if f"{prefix}.prompt_routes" in tensors:  # a MoE policy's routes
                    row.prompt_routes = tensors[f"{prefix}.prompt_routes"]
                    positions = tensors[f"{prefix}.route_positions"].tolist()
                    for j, route in zip(positions, tensors[f"{prefix}.routes"], strict=True):
                        row.routes[j] = route
                self.kept = self.kept or any(k is not None for k in row.kept)
            if cohort.envs is not None:
                for row, env in zip(cohort.rows, cohort.envs):
                    replay_calls(row, env)


def replay_calls(row: _Row, env) -> None:
    """Rebuild an environment's state: the tool calls that ran on it for its row, in order, run again
    (its reset was done); a different answer is warned about."""
    from rlft.rollout.tools import ToolRunner

    for name, arguments, answer in row.ran:
        method = getattr(env, name, None)
        if method is None:
            continue
        (_, text, _), = ToolRunner(timeout=60.0).run([(ToolCall(name, arguments), {name: method})])
        if text != answer:
            logging.getLogger("rlft").warning(
                f"{type(env).__name__}.{name} answered {text!r} when its call was replayed on resume, not "
                f"the recorded {answer!r}: the environment is not deterministic, so this run differs from "
                "an uninterrupted one from here")
