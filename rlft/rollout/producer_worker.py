"""The rollout producer's own process (`python -m rlft.rollout.producer_worker FOLDER`), started by
`ProcessProducer` (rlft/rollout/producer.py).

It builds the policy from FOLDER (the model as the trainer held it at start, LoRA adapters
included), an engine from the trainer's config (transformers' generate, vLLM in this process, or a
vLLM server) and then serves its standard input in order, one JSON object per line:

  {"type": "weights", "version": v, "path": file}
      load the trainable tensors of version v, delete the file (path null: the weights did not
      change, only the version)
  {"type": "generate", "key": k, "prompt_ids": [...], "num_generations": G, "greedy": b, "seed": s}
      partial rollouts add "ahead": [{"key", "prompt_ids"}] and "carry" (rlft/rollout/partial.py);
      with tools, "rows": {"prefixes", "budgets", "must", "names"} instead of prompt_ids (the trainer
      holds the pool: rlft/train/sources/agent_pool.py), answered with "finished" per row
  {"type": "mark", "key": k}                        the trainer now waits for request k (no work)
  {"type": "stop"}

and answers on its standard output (anything else this process prints goes to standard error):

  {"type": "ready"}, {"type": "heartbeat"} every second, {"type": "begin"/"done", "key": k} around a
  request, {"type": "result", "key": k, "version": v, "tokens": [[...]], "logprobs": [[...]],
   "kept": [[[...]]] or null, "routes": file or null (a MoE policy's experts), "seconds": ...,
   "step_versions": [...] (in-flight weight updates: the version that sampled each token);
   partial rollouts: "row_versions" [[...]] per row and the pool after the window, "carry"},
  {"type": "error", "message": traceback}

No pickle crosses the pipe. Each rollout is sampled after `torch.manual_seed(seed)`: the same
weights, prompts and seed give the same completions. The process ends when its standard input closes
or its parent dies.
"""

from __future__ import annotations

import ctypes
import json
import os
import queue
import sys
import threading
import time
import traceback
import types
from pathlib import Path

SPEC_FILE = "producer.json"


class Channel:
    """JSON lines on the original standard output, one writer at a time."""

    def __init__(self, stream):
        self.stream, self.lock = stream, threading.Lock()

    def send(self, message: dict) -> None:
        line = json.dumps(message)
        with self.lock:
            self.stream.write(line + "\n")
            self.stream.flush()


def _die_with_parent(parent: int) -> None:
    """Linux: the kernel kills this process when the trainer dies (PR_SET_PDEATHSIG); elsewhere, and
    as a second guard, a thread exits when the parent process changes."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL
    except (OSError, AttributeError):
        pass

    def watch():
        while True:
            if os.getppid() != parent:
                os._exit(1)
            time.sleep(0.5)

    threading.Thread(target=watch, daemon=True).start()


def _inbox() -> queue.Queue:
    """Standard input read by a thread; its end (the trainer closed it or died) ends this
    process."""
    inbox: queue.Queue = queue.Queue()

    def read():
        for line in sys.stdin:
            if line.strip():
                inbox.put(json.loads(line))
        os._exit(0)

    threading.Thread(target=read, daemon=True).start()
    return inbox


def _build(folder: Path, spec: dict):
    """The policy (as the trainer built it, from the saved folder) and the engine the config asks
    for."""
    import torch
    from transformers import AutoTokenizer

    from rlft.model.loading import apply_lora, cast_lm_head_to_fp32, load_causal_lm
    from rlft.model.scoring import install_scoring
    from rlft.rollout import make_generator

    args = types.SimpleNamespace(**spec["args"])
    dtype = getattr(torch, spec["dtype"])
    model = load_causal_lm(str(folder / "model"), dtype, None, args.trust_remote_code)
    install_scoring(model)
    if args.cast_lm_head_to_fp32:
        cast_lm_head_to_fp32(model)
    if spec.get("routes"):  # the trainer replays a MoE policy's routes: generate records them
        from rlft.model.routing import install

        install(model)
    if spec.get("peft"):
        from peft import get_peft_config

        model = apply_lora(model, get_peft_config(spec["peft"]), "CAUSAL_LM")
    model.eval().requires_grad_(False)
    if not args.use_vllm:  # generate where the trainer trains (its GPU); vLLM places its own engine
        model.to(spec.get("device", "cpu"))
    tokenizer = AutoTokenizer.from_pretrained(str(folder / "model"))
    engine = make_generator(args, tokenizer, model, str(folder / "model"))
    if args.use_vllm and args.vllm_mode == "server":  # every training process's producer on one server
        engine.check_shared(spec.get("processes", 1))
    if hasattr(engine, "return_logps") and recorded_logps_match(args):
        engine.return_logps = True  # generate: each sampled token's log-prob, read while sampling
    return model, engine, args


def recorded_logps_match(args) -> bool:
    """Whether log-probs recorded inside generate are the trainer's softmax(logits / T): not when a
    processor that runs before the recorder changes the logits (repetition penalty,
    generation_kwargs such as no_repeat_ngram_size or bad_words_ids) or beams reorder the rows; then
    the producer scores its completions with a forward pass instead."""
    return args.repetition_penalty == 1.0 and not args.generation_kwargs


def _load_weights(model, path: str) -> None:
    from safetensors.torch import load_file

    tensors = load_file(path)
    os.remove(path)
    params = dict(model.named_parameters())
    missing = sorted(set(tensors) - set(params))
    if missing:
        raise KeyError(f"pushed tensors {missing[:5]} are not parameters of the producer's model")
    for name, tensor in tensors.items():
        params[name].data.copy_(tensor)


def _logprobs(model, rollout, args) -> list:
    """The sampler's log-prob of each token: the engine's own (vLLM), else the policy's scoring
    forward on the weights that sampled (teacher forcing, at the sampling temperature)."""
    import torch

    from rlft.model.scoring import score_rows

    if rollout.sampling_logps is not None:
        return rollout.sampling_logps.tolist()
    out = torch.zeros(rollout.completion_ids.shape)
    rows, size = rollout.completion_ids.shape[0], max(int(args.per_device_train_batch_size), 1)
    with torch.no_grad():
        for start in range(0, rows, size):
            part = slice(start, min(start + size, rows))
            logps = score_rows(model, rollout, part, args.temperature, tile=args.logprob_chunk_size).logps
            out[part, :logps.shape[1]] = logps.float()
    return out.tolist()


def _routes_file(rollout, lengths: list[int], folder: Path, key: str) -> str | None:
    """A MoE policy's recorded routes as a safetensors file beside the weights (the trainer reads
    and deletes it); None: none recorded."""
    if rollout.prompt_routes is None:
        return None
    return _save_routes(rollout.prompt_routes, rollout.completion_routes[:, :max(lengths, default=0)], folder,
                        key)


def _save_routes(prompt, completion, folder: Path, key: str) -> str:
    from safetensors.torch import save_file

    path = folder / f"routes-{key}.safetensors"
    save_file({"prompt": prompt.cpu().contiguous(), "completion": completion.cpu().contiguous()}, str(path))
    return str(path)


def _generate(model, engine, args, message: dict, version: int, folder: Path) -> dict:
    import torch

    started = time.perf_counter()
    torch.manual_seed(message["seed"])
    limit = {"max_new_tokens": message["max_new_tokens"]} if message.get("max_new_tokens") else {}
    rollout = engine(model, message["prompt_ids"], message["num_generations"], message["greedy"], **limit)
    generated = time.perf_counter()
    lengths = rollout.completion_mask.sum(dim=1).tolist()
    tokens = [row[:n] for row, n in zip(rollout.completion_ids.tolist(), lengths)]
    logprobs = None if message["greedy"] else [
        row[:n] for row, n in zip(_logprobs(model, rollout, args), lengths)]
    kept = None if rollout.sampling_kept is None else [
        [[k for k in step if k >= 0] for step in row[:n]]
        for row, n in zip(rollout.sampling_kept.tolist(), lengths)]
    # a stepped vLLM engine's in-flight updates: each row's own versions (its rows do not step together)
    stepped = {} if rollout.token_versions is None else {"row_versions": [
        row[:n] for row, n in zip(rollout.token_versions.tolist(), lengths)]}
    return {"type": "result", "key": message["key"], "version": version, "tokens": tokens,
            "logprobs": logprobs, "kept": kept, "seconds": generated - started, **stepped,
            "routes": _routes_file(rollout, lengths, folder, message["key"]),
            "width": rollout.completion_ids.shape[1],
            "score_seconds": time.perf_counter() - generated}


def _apply_weights(model, engine, channel: Channel, message: dict) -> float:
    """A weights message: load the file (None: the same weights under a new version, a skipped
    step); the seconds it took."""
    from rlft.rollout.base import weights_changed

    if message["path"] is None:
        return 0.0
    key, started = f"weights-{message['version']}", time.perf_counter()
    channel.send({"type": "begin", "key": key})
    _load_weights(model, message["path"])
    weights_changed(engine)  # vLLM engines push them on before their next generation
    channel.send({"type": "done", "key": key})
    return time.perf_counter() - started


class InFlight:
    """In-flight weight updates (`inflight_weight_updates`): between two decode steps of a rollout,
    weights at the head of the inbox are loaded, so the rest of the rollout samples from them
    (rlft/rollout/hf.py: WeightSwitch). A weights message behind a request waits for it, as without
    this mode: the trainer sends the weights a request needs before the request.

    `switch_at` None: whenever weights arrive (timing decides). An int: only after that many tokens,
    and there the producer waits for the trainer's next message: weights are loaded if it is a
    weights message, else the rollout goes on with the weights it has. The trainer's messages come
    in an order its schedule fixes, and it sends a "mark" naming the request before it waits for
    one (marks naming earlier requests are passed over), so the wait always ends and which tokens
    newer weights sample is reproducible."""

    def __init__(self, model, engine, channel: Channel, inbox: queue.Queue, switch_at: int | None = None):
        self.model, self.engine, self.channel, self.inbox = model, engine, channel, inbox
        self.switch_at, self.loaded, self.key = switch_at, 0.0, None

    def ready(self) -> bool:
        """Weights at the head of the inbox, to be loaded in flight (whenever weights arrive)."""
        with self.inbox.mutex:
            queued = self.inbox.queue
            return self.switch_at is None and bool(queued) and queued[0]["type"] == "weights"

    def pending(self, tokens: int) -> int | None:
        if self.switch_at is not None and tokens != self.switch_at:
            return None
        with self.inbox.not_empty:
            queued = self.inbox.queue
            while self.switch_at is not None:  # the trainer's next message, whenever it comes
                while queued and queued[0]["type"] == "mark" and queued[0]["key"] != self.key:
                    queued.popleft()  # it waited for an earlier rollout: not news for this one
                if queued:
                    break
                self.inbox.not_empty.wait()
            if not queued or queued[0]["type"] != "weights":
                return None
            message = queued.popleft()
        self.loaded += _apply_weights(self.model, self.engine, self.channel, message)
        return message["version"]


def serve(model, engine, args, channel: Channel, inbox: queue.Queue, version: int, folder: Path) -> None:
    from rlft.rollout.base import engine_metrics
    from rlft.rollout.hf import WeightSwitch
    from rlft.rollout.partial import ADVANCE_TOKENS, Pool, serve_rows, serve_window

    switch_at = getattr(args, "inflight_switch_tokens", None)
    idle, inflight = 0.0, InFlight(model, engine, channel, inbox, switch_at)
    pool = Pool(args.max_completion_length) if getattr(args, "partial_rollouts", 0) else None
    in_flight = bool(getattr(args, "inflight_weight_updates", False)) and hasattr(engine, "weight_switch")
    # partial rollouts in the throughput mode (in-flight updates whenever weights arrive): the
    # producer's idle time moves the pool on
    advancing = pool is not None and in_flight and switch_at is None
    # transformers' generate: rows a window cuts keep their cache (RLFT_KV_CARRY=0: prefilled again)
    if advancing and not hasattr(engine, "continue_rows") and os.environ.get("RLFT_KV_CARRY", "1") != "0":
        from rlft.rollout.kv_carry import KVCarry

        engine.kv_carry = KVCarry()
    while True:
        if advancing and inbox.empty() and pool.unfinished():
            switch = WeightSwitch(version, inflight.pending, inflight.ready)
            engine.weight_switch = switch
            pool.advance(model, engine, ADVANCE_TOKENS, version, switch)
            version = switch.version
            continue
        waiting = time.perf_counter()
        message = inbox.get()
        idle += time.perf_counter() - waiting
        if message["type"] == "stop":
            engine.close()
            return
        if message["type"] == "mark":  # the trainer waits for a rollout (InFlight)
            continue
        if message["type"] == "weights":
            inflight.loaded += _apply_weights(model, engine, channel, message)
            version = message["version"]
            continue
        channel.send({"type": "begin", "key": message["key"]})
        inflight.key = message["key"]
        switch = None if not in_flight or message["greedy"] else WeightSwitch(version, inflight.pending,
                                                                              inflight.ready)
        if in_flight:
            engine.weight_switch = switch
        if pool is not None and ("ahead" in message or "rows" in message):  # partial rollouts: a window
            result = (serve_window(pool, model, engine, message, version, switch) if "ahead" in message
                      else serve_rows(model, engine, message, version, switch))  # (rlft/rollout/partial.py)
            if result["routes"] is not None:  # (tensors: a file, as _generate's)
                result["routes"] = _save_routes(*result["routes"], folder, message["key"])
        else:
            result = _generate(model, engine, args, message, version, folder)
        width = result.pop("width", None)
        if switch is not None:  # each token's version; later requests start from the newest
            if "row_versions" not in result:
                result["step_versions"] = switch.versions[:width]
            version = switch.version
        channel.send({**result, "idle_seconds": idle, "load_seconds": inflight.loaded,
                      **engine_metrics(engine)})
        idle = inflight.loaded = 0.0


def main(argv: list[str]) -> int:
    folder = Path(argv[0])
    messages = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # whatever a library prints goes to standard error, not into the message stream
    channel = Channel(messages)
    spec = json.loads((folder / SPEC_FILE).read_text())
    _die_with_parent(spec["parent"])
    inbox = _inbox()
    if spec.get("cpus") and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, spec["cpus"])
    import torch

    torch.set_num_threads(spec.get("threads") or len(os.sched_getaffinity(0)))

    def beat():
        while True:
            channel.send({"type": "heartbeat"})
            time.sleep(1.0)

    try:
        model, engine, args = _build(folder, spec)
        threading.Thread(target=beat, daemon=True).start()
        channel.send({"type": "ready"})
        serve(model, engine, args, channel, inbox, spec["version"], folder)
    except BaseException:  # the trainer reports it, naming this process
        channel.send({"type": "error", "message": traceback.format_exc()})
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
