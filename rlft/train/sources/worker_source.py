"""A rollout worker's samples (TRL 1.16's `AsyncGRPOTrainer(rollout_worker=..., weight_transfer=...)`;
docs/async.md, "Your own rollout worker").

The worker is the user's: it samples, scores and computes each completion's advantage wherever it
likes (its own GPUs, a vLLM fleet, an agent harness) and puts `RolloutSample`s on its
`rollout_buffer` queue; the trainer takes a rollout's worth of them when the step comes and trains
on them with the advantage given. The weights reach the worker's engine through `weight_transfer`
(`pause`, `send_weights((name, tensor), ...)`, `resume`: LoRA merged in, in the model's checkpoint
names), every `weight_sync_steps` steps and once before the worker starts; each sync counts a
version (`update_model_version(v)` tells the worker), and a sample `s` syncs older than the
trainer's is `s x weight_sync_steps` optimiser steps stale: above `max_staleness` it is dropped and
counted (`sample/dropped_stale_total`), as TRL does.

What the samples mean (TRL's `RolloutSample`): `input_ids` is prompt + completion, `completion_mask`
1 on the tokens the policy sampled and is trained on (a multi-turn sample's tool output is 0 inside
the completion), `old_log_probs` the sampler's log-prob of each token (per token of `input_ids`),
`advantage` one number per sample, `model_version` the version that sampled it, `metrics` the
worker's per-sample numbers (its rewards), averaged per step under their own names.

Only the main process talks to the worker: it takes every process's rows and hands each its slice.
A checkpoint keeps the version count and the drop count; the samples still in the worker's queue are
the worker's (a resume asks it for more). The reward functions given to the trainer are not called.
"""

from __future__ import annotations

import math
import queue
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from rlft.errors import ConfigError
from rlft.rollout.base import Rollout
from rlft.train.run.checkpoint import PartState
from rlft.train.sources.rollout_source import SourceBase, SourceParts
from rlft.train.update.rollout_batch import ScoredRollout

POLL_SECONDS = 1.0  # between health checks while the queue is empty
SAY_EVERY = 60.0  # seconds between "still waiting" lines


@dataclass
class RolloutSample:
    """One scored completion (TRL 1.16's `RolloutSample`, the same fields): module docstring."""

    prompt: Any
    completion: Any
    input_ids: Any
    completion_mask: Any
    old_log_probs: Any
    advantage: float
    model_version: int
    group_id: int
    metrics: dict[str, float] = field(default_factory=dict)
    enqueued_at: float | None = None


class RolloutWorkerProtocol(Protocol):
    """TRL 1.16's: `rollout_buffer` (a queue of RolloutSample), `start()`, `stop()`,
    `update_model_version(v)`, `check_health(stale_after_s)`; `metrics_queue` is optional."""

    rollout_buffer: Any

    def start(self) -> None: ...

    def stop(self) -> None: ...

    def update_model_version(self, model_version: int) -> None: ...

    def check_health(self, stale_after_s: float) -> None: ...


class WeightTransferProtocol(Protocol):
    """TRL 1.16's: `init_weight_transfer()`, `pause()`, `send_weights(iterator)`, `resume()`,
    `destroy()`."""

    def init_weight_transfer(self) -> None: ...

    def pause(self) -> None: ...

    def send_weights(self, iterator) -> None: ...

    def resume(self) -> None: ...

    def destroy(self) -> None: ...


@dataclass
class WorkerParts:
    """What AsyncGRPOTrainer was given (either may be None: no sync, or no worker)."""

    rollout_worker: Any
    weight_transfer: Any


def check_worker(worker, transfer) -> None:
    """Each object has the methods TRL's protocols name, or a ConfigError naming what is missing."""
    for given, name, needs in ((worker, "rollout_worker", ("rollout_buffer", "start", "stop",
                                                           "update_model_version", "check_health")),
                               (transfer, "weight_transfer", ("init_weight_transfer", "pause",
                                                              "send_weights", "resume", "destroy"))):
        missing = [n for n in needs if given is not None and not hasattr(given, n)]
        protocol = "RolloutWorkerProtocol" if name == "rollout_worker" else "WeightTransferProtocol"
        if missing:
            raise ConfigError(f"{name}={type(given).__name__} has no {', '.join(missing)}: it must "
                              f"implement TRL's {protocol} (docs/async.md, 'Your own rollout worker')")


def worker_parts(args, rollout_worker, weight_transfer, eval_dataset) -> WorkerParts | None:
    """AsyncGRPOTrainer's rollout_worker= / weight_transfer=, checked (None: rlft's own producer)."""
    if rollout_worker is None:
        if weight_transfer is not None:
            raise ConfigError("weight_transfer without a rollout_worker: rlft's own producer takes its "
                              "weights from the trainer directly; pass weight_transfer with the "
                              "rollout_worker it feeds")
        return None
    check_worker(rollout_worker, weight_transfer)
    if args.rollout_source not in (None, "worker"):
        raise ConfigError(f"rollout_source={args.rollout_source!r} with a rollout_worker: the "
                          "worker is where the rollouts come from; leave rollout_source unset")
    if eval_dataset is not None:
        raise ConfigError("eval_dataset with a rollout_worker: the worker owns generation, so rlft "
                          "has no engine to complete evaluation prompts; evaluate in the worker")
    return WorkerParts(rollout_worker, weight_transfer)


def sample_row(sample, index: int) -> dict:
    """A sample's prompt / completion split by its completion mask, checked (errors name the sample
    by its group_id and position in the step)."""
    where = f"rollout worker sample {index} (group_id {getattr(sample, 'group_id', '?')})"
    ids = [int(t) for t in sample.input_ids]
    mask = [int(m) for m in sample.completion_mask]
    logps = [float(v) for v in sample.old_log_probs]
    if not (len(ids) == len(mask) == len(logps)):
        raise ConfigError(f"{where}: input_ids ({len(ids)}), completion_mask ({len(mask)}) and "
                          f"old_log_probs ({len(logps)}) must each hold one value per token")
    if 1 not in mask:
        raise ConfigError(f"{where}: completion_mask has no 1, so there is nothing to train on")
    start = mask.index(1)
    if not math.isfinite(float(sample.advantage)):
        raise ConfigError(f"{where}: advantage is {sample.advantage}, not a finite number")
    return {"prompt_ids": ids[:start], "completion_ids": ids[start:], "trained": mask[start:],
            "logps": logps[start:], "advantage": float(sample.advantage),
            "version": int(sample.model_version), "prompt": sample.prompt, "completion": sample.completion,
            "metrics": dict(sample.metrics or {}),
            "queued": None if sample.enqueued_at is None else time.time() - sample.enqueued_at}


def rows_to_rollout(rows: list[dict], pad_id: int, eos_ids: set[int], device) -> Rollout:
    """The rows as a Rollout: the policy's tokens trained (tool_mask), the sampler's log-probs kept,
    truncated where the completion holds no EOS."""
    from rlft.data.prompts import left_pad, right_pad

    prompt_ids, prompt_mask = left_pad([r["prompt_ids"] for r in rows], pad_id)
    completion_ids, completion_mask = right_pad([r["completion_ids"] for r in rows], pad_id)
    trained, _ = right_pad([r["trained"] for r in rows], 0)
    logps, _ = right_pad([r["logps"] for r in rows], 0.0, dtype=torch.float32)
    # no EOS anywhere in it (a chat template may end a turn with a newline after its EOS)
    truncated = torch.tensor([not eos_ids.intersection(r["completion_ids"]) for r in rows])
    return Rollout(prompt_ids, prompt_mask, completion_ids, completion_mask, truncated, sampling_logps=logps,
                   tool_mask=trained, completions=[r["completion"] for r in rows]).to(device)


def mean_metrics(rows: list[dict]) -> dict[str, float]:
    """The worker's per-sample metrics, each averaged over the samples that carry it (NaN
    skipped)."""
    out = {}
    for key in dict.fromkeys(k for r in rows for k in r["metrics"]):
        values = [float(r["metrics"][key]) for r in rows if key in r["metrics"]]
        valid = [v for v in values if not math.isnan(v)]
        out[key] = sum(valid) / len(valid) if valid else float("nan")
    return out


class WorkerSource(SourceBase):
    """Rollouts from the user's rollout worker (module docstring)."""

    scores_itself = True  # the worker's samples come with their advantages: no reward function is called

    @classmethod
    def check(cls, args, processes: int, tools: list, environment_factory, rollout_func) -> None:
        for given, what in ((tools or args.tools, "tools"), (environment_factory, "environment_factory"),
                            (rollout_func, "rollout_func")):
            if given:
                raise ConfigError(f"{what} with a rollout_worker: the worker samples the completions, "
                                  f"so it runs its own {what}; give them to the worker")
        if args.dynamic_sampling:
            raise ConfigError("dynamic_sampling with a rollout_worker: the worker chooses which groups "
                              "it sends; filter them there")

    def __init__(self, parts: SourceParts):
        given = parts.worker
        if given is None or given.rollout_worker is None:
            raise ConfigError("rollout_source 'worker' takes its samples from AsyncGRPOTrainer's "
                              "rollout_worker= argument; none was given")
        self.args, self.schedule, self.accelerator = parts.args, parts.schedule, parts.accelerator
        self.state, self.messages, self.model = parts.state, parts.messages, parts.model
        self.worker, self.transfer = given.rollout_worker, given.weight_transfer
        self.full_weights = parts.training_engine.full_weights if parts.training_engine.sharded else None
        self.pad_id = parts.tokenizer.pad_token_id
        from rlft.rollout.hf import eos_token_ids

        self.eos = set(eos_token_ids(parts.model, parts.tokenizer))
        self.rows = parts.schedule.per_process * parts.args.num_generations  # per process and rollout
        self.started = self.synced_at = None
        self.load_state_dict(None)

    @property
    def main(self) -> bool:
        return self.accelerator.is_main_process

    # ---- train()
    def open(self) -> None:
        """TRL's order: the transfer set up, the weights synced (a version counted), the worker
        started."""
        if self.started:
            return
        if self.main and self.transfer is not None:
            self.transfer.init_weight_transfer()
        if self.main and self.version:  # a resume: the worker hears the version it was at
            self.worker.update_model_version(self.version)
        self._sync()
        if self.main:
            self.worker.start()
        self.started = True

    def close(self) -> None:
        if self.started and self.main:
            self.worker.stop()
            if self.transfer is not None:
                self.transfer.destroy()
        self.started = False

    def _sync(self) -> None:
        """The current weights through the transfer (every process enters a sharded gather), then a
        new version for the worker."""
        from rlft.rollout.vllm import synced_weights

        started = time.perf_counter()
        if self.transfer is not None:
            dtype = next(self.model.parameters()).dtype
            if self.main:
                self.transfer.pause()
            with synced_weights(self.model, self.full_weights, dtype) as entries:
                if self.main:
                    self.transfer.send_weights(iter(entries))
            if self.main:
                self.transfer.resume()
        self.version += 1
        self.synced_at = self.state.global_step
        if self.main:
            self.worker.update_model_version(self.version)
        self.sync_seconds += time.perf_counter() - started

    # ---- a rollout
    def rollout(self, index: int) -> ScoredRollout:
        step = self.state.global_step
        if step - self.synced_at >= self.args.weight_sync_steps:
            self._sync()
        started = time.perf_counter()
        rows = self._take(self.rows * self.accelerator.num_processes) if self.main else None
        if self.accelerator.num_processes > 1:
            from accelerate.utils import broadcast_object_list

            rows = broadcast_object_list([rows], from_process=0)[0]
        waited = time.perf_counter() - started
        mine = rows[self.accelerator.process_index * self.rows:][:self.rows]
        rollout = rows_to_rollout(mine, self.pad_id, self.eos, self.accelerator.device)
        stale = [(self.version - r["version"]) * self.args.weight_sync_steps for r in rows]
        queued = [r["queued"] for r in rows if r["queued"] is not None]
        self.last = {"sample/staleness_mean": sum(stale) / len(stale),
                     "sample/staleness_max": float(max(stale)),
                     "perf/rollout_wait_s": waited, "sample/rollout_queue_size": float(self._queued()),
                     **({"sample/time_in_queue_s": sum(queued) / len(queued)} if queued else {})}
        advantages = torch.tensor([r["advantage"] for r in mine], dtype=torch.float32)
        tokens = float(rollout.prompt_mask.sum() + rollout.completion_mask.sum())
        return ScoredRollout(rollout, torch.zeros(len(mine), 0), [r["completion"] for r in mine],
                             [r["prompt"] for r in mine], timing={"time/generation_seconds": waited,
                                                                  "tokens": tokens},
                             metrics=mean_metrics(rows), advantages=advantages,
                             totals=torch.tensor([r["metrics"].get("reward", math.nan) for r in mine]))

    def _queued(self) -> int:
        try:
            return self.worker.rollout_buffer.qsize()
        except (NotImplementedError, AttributeError):  # macOS multiprocessing queues
            return -1

    def _take(self, count: int) -> list[dict]:
        """`count` fresh samples from the worker's queue, in its order; stale ones dropped and
        counted."""
        rows, waited_since, said = [], time.perf_counter(), 0.0
        while len(rows) < count:
            try:
                sample = self.worker.rollout_buffer.get(timeout=POLL_SECONDS)
            except queue.Empty:
                self.worker.check_health(self.args.heartbeat_stale_after_s)
                waited = time.perf_counter() - waited_since
                if waited > self.args.request_timeout:
                    raise ConfigError(
                        f"the rollout worker ({type(self.worker).__name__}) sent no sample for "
                        f"{waited:.0f} s (request_timeout={self.args.request_timeout}); it has "
                        f"{len(rows)} of the {count} this step needs. Check the worker, or raise "
                        "request_timeout") from None
                if waited - said >= SAY_EVERY:
                    said = waited
                    self.messages.warn(f"waiting for the rollout worker: {waited:.0f} s, {len(rows)} of "
                                       f"{count} samples")
                continue
            waited_since, said = time.perf_counter(), 0.0
            lag = (self.version - int(sample.model_version)) * self.args.weight_sync_steps
            if lag > self.args.max_staleness:
                self.dropped += 1
                continue
            rows.append(sample_row(sample, len(rows)))
        return rows

    def step_metrics(self, step: int) -> dict[str, float]:
        out = {**self.last, "sample/dropped_stale_total": float(self.dropped),
               "perf/weight_sync_s": self.sync_seconds, "sample/version": float(self.version)}
        self.sync_seconds = 0.0
        if self.main and hasattr(self.worker, "metrics_queue"):  # what the worker measured itself
            out.update(_drain_metrics(self.worker.metrics_queue))
        return out

    def round(self, index: int, round_index: int) -> ScoredRollout:
        raise ConfigError("dynamic_sampling with a rollout_worker (refused at construction; an rlft bug)")

    def generate(self, prompts: dict, count: int, greedy: bool = False):
        raise ConfigError("evaluation with a rollout_worker: the worker owns generation, so rlft has no "
                          "engine to complete the evaluation prompts; evaluate in the worker, or set "
                          "eval_strategy: no")

    # ---- checkpoints
    def state_dict(self) -> PartState:
        return PartState(extra={"worker": {"model_version": self.version, "dropped": self.dropped}})

    def load_state_dict(self, part: PartState | None) -> None:
        saved = {} if part is None else part.extra.get("worker", {})
        self.version, self.dropped = saved.get("model_version", 0), saved.get("dropped", 0)
        self.last, self.sync_seconds = {}, 0.0


def _drain_metrics(metrics_queue) -> dict[str, float]:
    """TRL's metrics_queue items: {key: value} gauges or {key: (numerator, denominator)} rates, the
    step's items combined (values averaged, rates summed then divided)."""
    values, rates = {}, {}
    while True:
        try:
            item = metrics_queue.get_nowait()
        except queue.Empty:
            break
        for key, value in item.items():
            if isinstance(value, tuple | list):
                num, den = rates.get(key, (0.0, 0.0))
                rates[key] = (num + float(value[0]), den + float(value[1]))
            else:
                values.setdefault(key, []).append(float(value))
    out = {key: sum(v) / len(v) for key, v in values.items()}
    out.update({key: num / den if den else math.nan for key, (num, den) in rates.items()})
    return out
