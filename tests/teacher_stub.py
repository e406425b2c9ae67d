"""A stand-in for a teacher behind `rlft vllm-serve`, for tests without vLLM: the routes a served teacher is
asked (/health, /v1/models, /server_info, /tokenize, /v1/completions with prompt_logprobs) answered as vLLM
0.32's OpenAI server answers them, from a local model's full-vocabulary log-probs at temperature 1."""

from __future__ import annotations

import contextlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch


@torch.no_grad()
def prompt_logprobs(model, ids: list[int], k: int) -> list:
    """vLLM's `prompt_logprobs` answer: None at position 0; then, per position, the top k tokens and the
    token that is there, {token id: {"logprob", "rank", "decoded_token"}} (rank 1 = most likely)."""
    logits = model(input_ids=torch.tensor([ids])).logits[0, :-1].float()
    logps = torch.log_softmax(logits, dim=-1)
    order = logps.argsort(dim=-1, descending=True)
    answer: list = [None]
    for place, token in enumerate(ids[1:]):
        ranks = {int(t): r + 1 for r, t in enumerate(order[place].tolist())}
        chosen = order[place, :k].tolist() + [token]
        answer.append({str(t): {"logprob": float(logps[place, t]), "rank": ranks[int(t)], "decoded_token": ""}
                       for t in chosen})
    return answer


@contextlib.contextmanager
def serve_teacher(model, tokenizer, max_logprobs: int = 1024, shift_tokens: int = 0):
    """A served teacher at the yielded URL; `shift_tokens` makes its tokenizer disagree with the student's.
    Yields (url, requests): the /v1/completions bodies it answered."""
    requests: list[dict] = []
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def _send(self, payload) -> None:
            data = json.dumps(payload).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path == "/health":
                return self._send(None)
            if self.path == "/v1/models":
                return self._send({"data": [{"id": "teacher"}]})
            if self.path.startswith("/server_info"):
                return self._send({"vllm_config": {"model_config": {"max_logprobs": max_logprobs}}})
            self.send_error(404)

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if self.path == "/tokenize":
                ids = tokenizer(body["prompt"], add_special_tokens=False)["input_ids"]
                return self._send({"tokens": [t + shift_tokens for t in ids]})
            if self.path == "/v1/completions":
                with lock:
                    requests.append(body)
                    answer = prompt_logprobs(model, body["prompt"], body["prompt_logprobs"])
                return self._send({"choices": [{"text": "", "prompt_logprobs": answer}]})
            self.send_error(404)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", requests
    finally:
        server.shutdown()
        server.server_close()
