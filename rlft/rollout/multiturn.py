"""The tool-calling loop around a rollout engine: generate a turn, run its tool calls, append the
tool messages as tokens, generate the next turn, until no row calls a tool,
`max_tool_calling_iterations` rounds of tools have run, or the completion budget
(`max_completion_length`, tool output included) is spent. Same protocol as the engines, plus per-row
tool sets (an environment's methods are its own row's tools).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

import torch

from rlft.data.prompts import right_pad
from rlft.model.routing import extend_first_reads
from rlft.rollout.base import Rollout, engine_metrics, holds_own_weights, weights_changed
from rlft.rollout.tools import ToolCall, ToolRunner, parse_turn, tool_suffix_ids
from rlft.rollout.truncation import kept_tensor


@dataclass
class Toolset:
    functions: dict  # name -> callable
    # what the prompt was rendered with (and what parse_response casts arguments by)
    schemas: list[dict]


@dataclass
class _Row:
    prompt: list[int]
    toolset: Toolset
    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)  # 1: sampled by the policy
    logps: list[float] = field(default_factory=list)
    # per token: the ids the sampler kept
    kept: list[list[int] | None] = field(default_factory=list)
    messages: list[dict] = field(default_factory=list)
    pending: list[ToolCall] = field(default_factory=list)  # calls of the last turn not yet answered
    ended: bool = False  # the last turn ended with EOS
    calls: int = 0
    failures: int = 0
    turns: int = 0
    # a MoE policy's routes [layers, k] per completion token, from the forward that first read it (None:
    # not read yet: a turn's last token, tool output, until the next turn's prompt reads them)
    routes: list[torch.Tensor | None] = field(default_factory=list)
    # in-flight weight updates (an async producer's turns): each token's weights version; a tool's output
    # takes the version of the token before it (it is not sampled, and not trained)
    versions: list[int] = field(default_factory=list)
    turn_start: int = 0  # where in `ids` the turn being sampled began (a partial-rollout window may cut it)
    rounds: int = 0  # rounds of tool calls answered
    # partial rollouts' pool (rlft/train/sources/agent_pool.py): "generate" (a turn to sample, or to go on
    # with), "tools" (calls to answer) or "done"; and the prompt's routes, read by the row's first window
    status: str = "generate"
    prompt_routes: torch.Tensor | None = None
    # [name, arguments, answer] of each call that ran (partial rollouts replay them on the row's environment
    # after a resume)
    ran: list = field(default_factory=list)


class ToolLoop:
    """`loop(model, prompt_ids, num_generations, greedy, toolsets=None) -> Rollout` with
    `tool_mask`, `completions` (each row as assistant / tool messages) and per-row `stats`."""

    def __init__(self, engine, tokenizer, toolset: Toolset, max_completion_length: int,
                 max_iterations: int | None = None, timeout: float = 30.0,
                 template_kwargs: dict | None = None):
        self.engine, self.tokenizer, self.toolset = engine, tokenizer, toolset
        self.max_length = max_completion_length
        self.max_iterations = sys.maxsize if max_iterations is None else max_iterations
        self.runner = ToolRunner(timeout)
        self.template_kwargs = template_kwargs

    @property
    def holds_own_weights(self) -> bool:
        return holds_own_weights(self.engine)

    def on_weights_changed(self) -> None:
        weights_changed(self.engine)

    def metrics(self) -> dict[str, float]:
        return engine_metrics(self.engine)

    def close(self) -> None:
        if hasattr(self.engine, "close"):
            self.engine.close()

    def __call__(self, model, prompt_ids: list[list[int]], num_generations: int, greedy: bool = False,
                 toolsets: list[Toolset] | None = None) -> Rollout:
        prompts = [ids for ids in prompt_ids for _ in range(num_generations)]
        rows = [_Row(p, t) for p, t in zip(prompts, toolsets or [self.toolset] * len(prompts), strict=True)]
        first = self.engine(model, prompt_ids, num_generations, greedy)
        self._absorb(rows, first)
        active, rounds = [r for r in rows if r.pending], 0
        while active and rounds < self.max_iterations:
            active = self.answer(active)  # rows whose tool results fit in the budget
            if not active:
                break
            room = max(self.max_length - len(r.ids) for r in active)
            self._absorb(active, self.engine(model, [r.prompt + r.ids for r in active], 1, greedy,
                                             max_new_tokens=room))
            active, rounds = [r for r in active if r.pending], rounds + 1
        return self.assemble(rows, first)

    def _absorb(self, rows: list[_Row], out: Rollout) -> None:
        """Append each row's newly generated turn (cut to what is left of the budget) and parse its
        tool calls."""
        for i, row in enumerate(rows):
            self.absorb_row(row, out, i)

    def absorb_row(self, row: _Row, out: Rollout, i: int, cut: bool = False) -> None:
        """Append what row `i` of `out` sampled for `row`; the turn ends here (its tool calls parsed)
        unless `cut` (a partial-rollout window ended before it did: the next window goes on with it)."""
        ids = out.completion_ids[i][out.completion_mask[i].bool()].tolist()
        room = self.max_length - len(row.ids)
        ended = len(ids) <= room and not bool(out.truncated[i])
        ids = ids[:room]
        if out.completion_routes is not None:
            self._take_routes(row, out, i, len(row.prompt) + len(row.ids), len(ids))
        row.ids += ids
        row.mask += [1] * len(ids)
        if out.sampling_logps is not None:
            row.logps += out.sampling_logps[i][:len(ids)].tolist()
        if out.sampling_kept is not None:
            row.kept += [[k for k in step if k >= 0] for step in out.sampling_kept[i][:len(ids)].tolist()]
        if out.token_versions is not None:
            row.versions += out.token_versions[i][:len(ids)].tolist()
        if cut:
            return
        row.ended, row.turns = ended, row.turns + 1
        turn, context = row.ids[row.turn_start:], row.prompt + row.ids[:row.turn_start]
        if row.ended:  # a cut turn's calls are incomplete: not run
            content, row.pending = parse_turn(self.tokenizer, turn, context, row.toolset.schemas)
        else:
            content, row.pending = self.tokenizer.decode(turn, skip_special_tokens=True), []
        message = {"role": "assistant", "content": content}
        valid = [{"type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                 for c in row.pending if c.error is None]
        row.messages.append({**message, "tool_calls": valid} if valid else message)

    @staticmethod
    def _take_routes(row: _Row, out: Rollout, i: int, context: int, count: int) -> None:
        """A turn's routes for row `row` (the turn's row `i`): its prompt read every earlier token of
        the row, so the ones no forward had read (the last token of the previous turn, tool output) take
        their routes from it; the turn's own tokens take theirs from its decoding."""
        read = out.prompt_routes[i, out.prompt_routes.shape[1] - context:]  # [context, layers, k]
        if row.prompt_routes is None:
            row.prompt_routes = read[:len(row.prompt)].clone()
        extend_first_reads(row.routes, read[len(row.prompt):], out.completion_routes[i, :count])

    def answer(self, rows: list[_Row]) -> list[_Row]:
        """Run every pending call of every row at once; append the tool messages as tokens (mask 0).
        A row whose tool results would leave no room for another token stops here, its calls counted
        but unanswered."""
        jobs = [(call, row.toolset.functions) for row in rows for call in row.pending]
        results, going, start = self.runner.run(jobs), [], 0
        for row in rows:
            answered, start = results[start:start + len(row.pending)], start + len(row.pending)
            row.ran += [[call.name, call.arguments, text] for call, (_, text, _) in zip(row.pending, answered)
                        if call.error is None and call.name in row.toolset.functions]
            row.calls += len(answered)
            row.failures += sum(failed for _, _, failed in answered)
            messages = [{"role": "tool", "name": name, "content": text} for name, text, _ in answered]
            suffix = tool_suffix_ids(self.tokenizer, messages, self.template_kwargs)
            if len(row.ids) + len(suffix) >= self.max_length:
                continue  # stays pending: counted as hitting the limit
            row.pending, row.rounds = [], row.rounds + 1
            row.ids += suffix
            row.mask += [0] * len(suffix)
            row.logps += [0.0] * len(suffix)
            row.kept += [None] * len(suffix)
            row.routes += [None] * len(suffix)
            row.versions += row.versions[-1:] * len(suffix)
            row.messages += messages
            row.turn_start = len(row.ids)
            going.append(row)
        return going

    def assemble(self, rows: list[_Row], first: Rollout) -> Rollout:
        device = first.completion_ids.device
        ids, mask = right_pad([r.ids for r in rows], self.tokenizer.pad_token_id)
        tool_mask = right_pad([r.mask for r in rows], 0)[0]
        logps = (right_pad([r.logps for r in rows], 0.0, torch.float32)[0]
                 if first.sampling_logps is not None else None)
        stats = {name: torch.tensor([float(value(r)) for r in rows]) for name, value in (
            ("tool_calls", lambda r: r.calls), ("tool_failures", lambda r: r.failures),
            ("turns", lambda r: r.turns), ("hit_limit", lambda r: bool(r.pending)))}
        truncated = torch.tensor([not r.ended for r in rows], device=device)
        kept = None if first.sampling_kept is None else kept_tensor([r.kept for r in rows], ids.shape[1])
        rollout = Rollout(first.prompt_ids, first.prompt_mask, ids.to(device), mask.to(device), truncated,
                          None if logps is None else logps.to(device), tool_mask.to(device),
                          completions=[r.messages for r in rows], stats=stats,
                          sampling_kept=None if kept is None else kept.to(device))
        if first.completion_routes is not None:  # (-1: never read, route freely)
            routes = first.completion_routes.new_full((len(rows), ids.shape[1],
                                                       *first.completion_routes.shape[2:]), -1)
            for r, row in enumerate(rows):
                for j, route in enumerate(row.routes):
                    if route is not None:
                        routes[r, j] = route
            rollout.prompt_routes, rollout.completion_routes = first.prompt_routes, routes
        if first.token_versions is not None:
            versions = right_pad([r.versions for r in rows], -1, torch.int32)[0].to(device)
            rollout.token_versions = versions.masked_fill(rollout.completion_mask == 0, -1)
        return rollout
