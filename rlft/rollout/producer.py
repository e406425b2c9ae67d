"""A rollout producer in its own process: generation overlapped with training (AsyncGRPOTrainer,
docs/async.md).

`ProcessProducer` starts `python -m rlft.rollout.producer_worker` with a copy of the policy and the
engine the config asks for (transformers' generate, vLLM in that process, or a vLLM server it talks
to), then sends it, in order, weight pushes (the trainable tensors as a safetensors file) and
rollout requests; it answers each request with the completions' token ids and the sampler's
per-token log-probs, tagged with the version of the weights that sampled them. Because the producer
serves its requests strictly in order, which weights sample which rollout is decided by the trainer
alone: the schedule is reproducible.

Faults are errors, never hangs: a producer that exits, stops signalling for
`heartbeat_stale_after_s`, spends longer than `request_timeout` on one rollout, or raises, stops the
trainer with a message naming it. The producer exits when the trainer closes it or dies
(rlft/rollout/producer_worker.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from rlft.errors import RlftError
from rlft.model.routing import route_state
from rlft.rollout import vllm_routes
from rlft.rollout.base import Rollout
from rlft.rollout.hf import eos_token_ids
from rlft.rollout.producer_worker import SPEC_FILE
from rlft.rollout.weight_sync import bucket_bytes_of, save_engine_folder, whole_tensors

# torchrun / accelerate's variables: the producer must not take itself for one of the trainer's
# processes
LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
                      "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "ACCELERATE_USE_FSDP",
                      "ACCELERATE_USE_DEEPSPEED")


class ProducerError(RlftError, RuntimeError):
    """The rollout producer died, stopped answering, timed out or failed; the message names it."""


@dataclass
class Produced:
    """One answered request: completions (token ids up to and including EOS), the sampler's
    log-probs, the version of the weights that sampled them, and the producer's timings."""

    key: str
    version: int
    tokens: list[list[int]]
    logprobs: list[list[float]] | None
    seconds: float = 0.0  # generating
    arrived: float = field(default_factory=time.monotonic)
    timings: dict[str, float] = field(default_factory=dict)
    # per row, per token: the ids a truncating sampler kept
    kept: list[list[list[int]]] | None = None
    # a MoE policy's recorded experts: "prompt" [N, P, L, k], "completion" [N, C, L, k] (int16)
    routes: dict[str, torch.Tensor] | None = None
    # in-flight weight updates: the version of the weights that sampled each token position
    step_versions: list[int] | None = None
    # partial rollouts: each row's tokens' versions, and the producer's pool after this window
    row_versions: list[list[int]] | None = None
    carry: list[dict] | None = None
    # a window of rows the trainer holds (partial rollouts with tools): each row finished its turn, or was cut
    finished: list[bool] | None = None


def _spec_args(args) -> dict:
    """The config's fields the producer's engine reads, as JSON values."""
    out = {}
    for name, value in vars(args).items():
        try:
            json.dumps(value)
        except TypeError:
            continue
        out[name] = value
    return out


def _peft_spec(model) -> dict | None:
    config = getattr(model, "peft_config", {}).get("default")
    if config is None:
        return None
    spec = config.to_dict()
    return {k: sorted(v) if isinstance(v, set) else v for k, v in spec.items()}


def trainable_tensors(model) -> list[tuple[str, torch.Tensor]]:
    """What a weight push sends: the parameters that train (LoRA: the adapters; full fine-tuning:
    all)."""
    return [(name, p) for name, p in model.named_parameters() if p.requires_grad]


class ProcessProducer:
    """The rollout producer process and the trainer's end of its pipe. `full_weights`: the training
    engine's gather when it shards the weights (FSDP2, ZeRO-3), else None; `device`: the trainer's
    (where transformers' engine generates and rollouts are built; default: the model's)."""

    holds_own_weights = True

    def __init__(self, args, tokenizer, model, full_weights=None, device=None):
        self.args, self.tokenizer, self.full_weights = args, tokenizer, full_weights
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        self.eos_ids = eos_token_ids(model, tokenizer)
        self.folder = Path(tempfile.mkdtemp(prefix="rlft-producer-"))
        weakref.finalize(self, shutil.rmtree, str(self.folder), True)
        self.proc: subprocess.Popen | None = None
        self.results: dict[str, Produced] = {}
        self.cond, self.sending = threading.Condition(), threading.Lock()
        self.error: str | None = None
        self.beat = time.monotonic()
        self.begun: dict[str, float] = {}
        self.dirty, self.label, self.pushes = True, None, 0
        self.pending_metrics: dict[str, float] = {}
        self.ready, self.submitted = False, set()

    @property
    def name(self) -> str:
        pid = self.proc.pid if self.proc is not None else "not started"
        return f"the rollout producer (process {pid})"

    # ---- start, stop -----------------------------------------------------------------------------
    def start(self, model, version: int) -> None:
        """Save the policy as it is now (weights of `version`) for the producer to load, start it
        and wait until its engine is ready."""
        from rlft.rollout.vllm import engine_weights

        # close() removes it; a restart starts here again
        self.folder.mkdir(parents=True, exist_ok=True)
        weights = whole_tensors(model, engine_weights, self.full_weights, bucket_bytes_of(self.args))
        save_engine_folder(model, self.folder / "model", weights)
        self.tokenizer.save_pretrained(self.folder / "model")
        spec = {"args": _spec_args(self.args), "dtype": str(next(model.parameters()).dtype).split(".")[-1],
                "peft": _peft_spec(model), "parent": os.getpid(), "cpus": self.args.producer_cpus,
                "threads": self.args.producer_threads, "version": version,
                # the trainer replays a MoE policy's routes: the producer records them
                "routes": route_state(model) is not None,
                # transformers' engine generates on the trainer's device
                "device": str(self.device),
                # (each training process starts a producer: several may share one vLLM server)
                "processes": dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1}
        (self.folder / SPEC_FILE).write_text(json.dumps(spec))
        self.ready, self.error, self.beat, self.results, self.begun = False, None, time.monotonic(), {}, {}
        self.submitted = set()
        env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}
        self.proc = subprocess.Popen([sys.executable, "-m", "rlft.rollout.producer_worker", str(self.folder)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1,
                                     env=env)
        weakref.finalize(self, _stop, self.proc)
        threading.Thread(target=self._read, daemon=True).start()
        self._wait_for("ready", self.args.vllm_server_timeout)
        # LoRA: the adapters are not in the folder
        self.dirty, self.label = spec["peft"] is not None, version
        if self.dirty:
            self.push(model, version)

    def close(self) -> None:
        if self.proc is not None:
            _stop(self.proc)
            self.proc = None
        shutil.rmtree(self.folder, ignore_errors=True)

    # ---- requests ----------------------------------------------------------------------------------
    def on_weights_changed(self) -> None:
        self.dirty = True

    @torch.no_grad()
    def push(self, model, version: int) -> None:
        """The producer's next requests are sampled from the weights `model` has now (labelled
        `version`): the trainable tensors as a file, queued behind the requests already sent."""
        from safetensors.torch import save_file

        if not self.dirty:  # e.g. a skipped step: the same weights, under the new version
            if version != self.label:
                self._send({"type": "weights", "version": version, "path": None})
                self.label = version
            return
        started = time.perf_counter()
        # the names are read outside the gather: FSDP2's whole copies inside it do not train
        names = {name for name, _ in trainable_tensors(model)}
        chosen = lambda m: [(n, p) for n, p in m.named_parameters() if n in names]  # noqa: E731
        # save_file copies to the CPU
        tensors = {name: t.detach().contiguous() for name, t in whole_tensors(
            model, chosen, self.full_weights, bucket_bytes_of(self.args)).items()}
        path = self.folder / f"weights-{self.pushes}.safetensors"
        save_file(tensors, str(path))
        self._send({"type": "weights", "version": version, "path": str(path)})
        self.dirty, self.label, self.pushes = False, version, self.pushes + 1
        metrics = self.pending_metrics
        metrics["perf/weight_sync_s"] = metrics.get("perf/weight_sync_s", 0.0) + time.perf_counter() - started
        metrics["perf/weight_sync_bytes"] = metrics.get("perf/weight_sync_bytes", 0.0) + float(
            sum(t.numel() * t.element_size() for t in tensors.values()))

    def submit(self, key: str, prompt_ids: list[list[int]], num_generations: int, seed: int,
               greedy: bool = False, partial: dict | None = None, max_new_tokens: int | None = None) -> int:
        """Queue a request; returns the version of the weights that will sample it. `partial`:
        partial rollouts' "ahead" and "carry" (rlft/rollout/partial.py); `max_new_tokens`: a tool
        loop's later turn (what is left of the completion's budget)."""
        self.submitted.add(key)
        limit = {} if max_new_tokens is None else {"max_new_tokens": max_new_tokens}
        self._send({"type": "generate", "key": key, "prompt_ids": prompt_ids,
                    "num_generations": num_generations, "greedy": greedy, "seed": seed, **limit,
                    **(partial or {})})
        return self.label

    def submit_rows(self, key: str, rows: dict, seed: int) -> int:
        """Queue a window of rows the trainer holds (partial rollouts with tools; rlft/rollout/partial.py:
        serve_rows): `rows` has "prefixes", "budgets", "must" and "names"."""
        self.submitted.add(key)
        self._send({"type": "generate", "key": key, "rows": rows, "greedy": False, "seed": seed})
        return self.label

    def take(self, key: str) -> Produced:
        """The answer to request `key`, waiting for it; a producer that fails, dies or stops
        answering is an error within heartbeat_stale_after_s (or request_timeout for one slow
        rollout)."""
        if key not in self.submitted:
            raise KeyError(f"no request {key!r} was sent to {self.name}")
        if getattr(self.args, "inflight_switch_tokens", None) is not None:
            # reproducible in-flight updates: a rollout waiting at its switch point reads the
            # trainer's next message; this one is sent before every wait, whether or not the rollout
            # is done, so the order of messages is the schedule's alone (producer_worker.InFlight)
            self._send({"type": "mark", "key": key})
        with self.cond:
            while key not in self.results:
                self._check()
                self.cond.wait(0.2)
            self.submitted.discard(key)
            return self.results.pop(key)

    def waiting_rows(self) -> int:
        """Completions answered and not yet taken."""
        with self.cond:
            return sum(len(p.tokens) for p in self.results.values())

    def metrics(self) -> dict[str, float]:
        pending, self.pending_metrics = self.pending_metrics, {}
        return pending

    def to_rollout(self, produced: Produced, prompt_ids: list[list[int]], num_generations: int, device,
                   greedy: bool = False) -> Rollout:
        from rlft.rollout.vllm import engine_rollout

        repeated = [ids for ids in prompt_ids for _ in range(num_generations)]
        rollout = engine_rollout(repeated, produced.tokens, produced.logprobs or [None] * len(repeated),
                                 self.tokenizer.pad_token_id, self.eos_ids, device, greedy, produced.kept)
        width = rollout.completion_ids.shape[1]
        if produced.row_versions is not None:  # partial rollouts: per row
            versions = torch.full((len(produced.row_versions), width), -1, dtype=torch.int32)
            for r, row_versions in enumerate(produced.row_versions):
                versions[r, :len(row_versions)] = torch.tensor(row_versions[:width], dtype=torch.int32)
            rollout.token_versions = versions.to(device).masked_fill(rollout.completion_mask == 0, -1)
        elif produced.step_versions is not None:  # in-flight weight updates
            versions = torch.tensor(produced.step_versions, dtype=torch.int32)
            row = torch.full((width,), -1, dtype=torch.int32)
            row[:min(width, len(versions))] = versions[:width]
            rollout.token_versions = row.expand(rollout.completion_ids.shape[0], -1).to(device).masked_fill(
                rollout.completion_mask == 0, -1)
        if produced.routes is not None:
            vllm_routes.attach(rollout, (produced.routes["prompt"], produced.routes["completion"]))
        return rollout

    def __call__(self, model, prompt_ids: list[list[int]], num_generations: int, greedy: bool = False,
                 seed: int = 0, version: int = -1) -> Rollout:
        """The RolloutEngine protocol (evaluation): the current weights, pushed if they changed,
        then one request, waited for."""
        self.push(model, version)
        key = f"call-{time.monotonic_ns()}"
        self.submit(key, prompt_ids, num_generations, seed, greedy)
        return self.to_rollout(self.take(key), prompt_ids, num_generations, self.device, greedy)

    # ---- the pipe ------------------------------------------------------------------------------------
    def _send(self, message: dict) -> None:
        try:
            with self.sending:  # the trainer's thread and a tool loop's driver thread both send
                self.proc.stdin.write(json.dumps(message) + "\n")
                self.proc.stdin.flush()
        except (BrokenPipeError, OSError, ValueError) as err:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=5)  # the pipe breaks as the process dies: say how it ended
            with self.cond:
                self._check()
            raise ProducerError(f"{self.name} does not take requests: {err}") from err

    def _read(self) -> None:
        stream = self.proc.stdout
        for line in stream:
            try:
                message = json.loads(line)
            # something a library printed before the producer took over its output
            except ValueError:
                sys.stderr.write(line)
                continue
            with self.cond:
                self.beat = time.monotonic()
                kind = message.pop("type")
                if kind == "result":
                    timings = {k: message.pop(k) for k in list(message) if k not in (
                        "key", "version", "tokens", "logprobs", "seconds", "kept", "routes",
                        "step_versions", "row_versions", "carry", "finished")}
                    self.results[message["key"]] = Produced(message["key"], message["version"],
                                                            message["tokens"], message["logprobs"],
                                                            message["seconds"], timings=timings,
                                                            kept=message.get("kept"),
                                                            routes=_routes(message.get("routes")),
                                                            step_versions=message.get("step_versions"),
                                                            row_versions=message.get("row_versions"),
                                                            carry=message.get("carry"),
                                                            finished=message.get("finished"))
                    self.begun.pop(message["key"], None)
                elif kind == "begin":
                    self.begun[message["key"]] = time.monotonic()
                elif kind == "done":
                    self.begun.pop(message["key"], None)
                elif kind == "error":
                    self.error = message["message"]
                self.ready = self.ready or kind == "ready"
                self.cond.notify_all()

    def _wait_for(self, what: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        with self.cond:
            while not getattr(self, what, False):
                self._check(startup=True)
                if time.monotonic() > deadline:
                    self.close()
                    raise ProducerError(f"{self.name} did not start within "
                                        f"vllm_server_timeout={timeout} s")
                self.cond.wait(0.2)

    def _check(self, startup: bool = False) -> None:
        """Raise if the producer failed, exited, stopped signalling, or spends too long on one
        request (a rollout or a weight load). Called with `cond` held."""
        code = self.proc.poll()
        if code is not None and self.error is None:
            self.cond.wait(1.0)  # let the reader take in a last message (the traceback) first
        if self.error is not None:
            raise ProducerError(f"{self.name} failed:\n{self.error}")
        if code is not None:
            raise ProducerError(f"{self.name} exited with code {code}")
        now = time.monotonic()
        if not startup and now - self.beat > self.args.heartbeat_stale_after_s:
            self.proc.kill()  # a stopped process cannot read a request to stop
            raise ProducerError(f"{self.name} has not signalled for {now - self.beat:.0f} s "
                                f"(heartbeat_stale_after_s={self.args.heartbeat_stale_after_s}): "
                                "stopped or hung; it was stopped")
        begun = min(self.begun.values(), default=None)
        if begun is not None and now - begun > self.args.request_timeout:
            self.proc.kill()
            raise ProducerError(f"{self.name} spent over "
                                f"request_timeout={self.args.request_timeout} s on "
                                "one request; it was stopped")


def _routes(path: str | None) -> dict[str, torch.Tensor] | None:
    """The routes file a result names, read and deleted (None: none recorded)."""
    if path is None:
        return None
    from safetensors.torch import load_file

    routes = load_file(path)
    os.remove(path)
    return routes


def _stop(proc: subprocess.Popen) -> None:
    """Ask the producer to stop, then make sure it has."""
    if proc.poll() is not None:
        return
    try:
        proc.stdin.write(json.dumps({"type": "stop"}) + "\n")
        proc.stdin.flush()
        proc.stdin.close()
    except (BrokenPipeError, OSError, ValueError):
        pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)
