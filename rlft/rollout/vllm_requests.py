"""Interruptible requests to a vLLM server (`vllm_mode: server`), for the rollout producer's in-flight
weight updates and partial rollouts (docs/async.md).

A server runs each completion as one HTTP request, and a request cannot change weights half-way in a way
the client could see: the server does not say which of its steps sampled which token. So a request is
interrupted instead (AReaL's interruptible generation): when newer weights wait in the producer's inbox
(`switch.ready()`), or a partial-rollout window has what it needs, this process aborts its own requests
by id (the server's `POST /abort_requests`, a development route of `rlft vllm-serve`); each answers at
once with the tokens it had, their processed log-probs and finish reason "abort". Only once every request
of the round has answered are the newer weights loaded and pushed, so every token a request returned was
sampled by the weights it started under: its recorded version and log-prob are exact. The unfinished rows
then go on as new requests (prompt and tokens so far, what is left of the budget, a new seed) under the
newer weights. The server's prefix cache serves the tokens a request already has while the weights are
the same (a salt per weight version keeps blocks of older weights out); after a push they are prefilled
again, so each token after a switch reads keys and values its own weights computed -- unlike a kept
request on a colocated engine (rlft/rollout/vllm_steps.py), which goes on over older ones.

A request that reaches the server after its round's abort (the abort found nothing to stop) runs to its
end under the weights it started with: the push waits for it, so its tokens are labelled correctly too.

A MoE policy under routing replay: each round's requests hand over the experts the server chose for their
tokens (rlft/rollout/vllm_routes.py), and a position keeps the first round's read of it.
"""

from __future__ import annotations

import threading
import uuid
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait

from rlft.rollout import vllm_routes
from rlft.rollout.partial import Stepped
from rlft.rollout.truncation import kept_of

# how often a round looks at the producer's inbox for newer weights while its requests run
POLL_SECONDS = 0.05
# concurrent HTTP requests (one thread each): every row at once, up to this many, for the server to batch
WORKERS = 512


def choice_fields(choice: dict, replayed: bool) -> tuple[list[int], list[float | None], list | None]:
    """One completion choice of the server's answer: its token ids, each one's processed log-prob and
    (`replayed`) the ids the sampler kept at each token."""
    logprobs = choice.get("logprobs") or {}
    tokens = list(choice.get("token_ids") or [])
    kept = [kept_of({int(key.rpartition(":")[2]): value for key, value in (top or {}).items()})
            for top in logprobs.get("top_logprobs") or []] if replayed else None
    return tokens, list(logprobs.get("token_logprobs") or [])[:len(tokens)], kept


class _Round:
    """The requests of one round, each abortable by its id; a request not yet sent when the round stops
    is not sent at all."""

    def __init__(self, engine, mark: str = "rlft-"):
        self.engine, self.mark, self.stopped, self.lock = engine, mark, False, threading.Lock()
        self.ids: dict[int, str] = {}

    def run(self, row: int, ids: list[int], seed: int, budget: int, salt: str) -> dict:
        with self.lock:
            if self.stopped:
                return {"token_ids": [], "finish_reason": "abort"}
            self.ids[row] = f"{self.mark}{uuid.uuid4().hex}"  # (unique across the producers sharing a server)
        return self.engine.complete(ids, seed, budget, self.ids[row], salt)

    def stop(self, rows) -> None:
        with self.lock:
            self.stopped = True
            ids = [self.ids[row] for row in rows if row in self.ids]
        if ids:
            self.engine.abort(ids)


def run_requests(engine, model, prefixes: list[list[int]], budgets: list[int], must: list[bool] | None = None,
                 limit: int | None = None, switch=None, version: int = 0) -> Stepped:
    """Continue each prefix (prompt + tokens so far) by up to its budget of tokens on the server until
    every row finished, or (`must`) every row flagged True did, or (`limit`) each row drew that many
    tokens in this call; the others are cut where they are. `switch` (rlft/rollout/hf.py: WeightSwitch):
    in-flight weight updates, taken between rounds (module docstring); `version` without one."""
    from rlft.rollout.vllm import request_seeds

    count = len(prefixes)
    out = Stepped([[] for _ in prefixes], [[] for _ in prefixes],
                  [[] for _ in prefixes] if engine.replay_mask else None, [[] for _ in prefixes],
                  [budget <= 0 for budget in budgets], 0)
    must = must or [True] * count
    cap = [budget if limit is None else min(budget, limit) for budget in budgets]
    reads = [{} for _ in prefixes] if engine.record_routes(model) else None  # (a MoE policy's routes)
    with ThreadPoolExecutor(max_workers=min(WORKERS, max(count, 1))) as pool:
        while True:
            todo = [r for r in range(count) if not out.finished[r] and len(out.tokens[r]) < cap[r]]
            if not todo or all(out.finished[r] or not needed for r, needed in enumerate(must)):
                break
            if switch is not None and switch.ready():
                switch.load()
            if engine.stale:  # no request of this process runs: each token keeps its version
                engine.sync(model)
            _round(engine, pool, out, todo, prefixes, cap, request_seeds(len(todo), False),
                   switch.version if switch is not None else version, must, switch, budgets, reads)
    out.steps = max((len(tokens) for tokens in out.tokens), default=0)
    if reads is not None:
        out.routes = vllm_routes.assemble(reads, prefixes, [len(tokens) for tokens in out.tokens])
    return out


def _round(engine, pool, out: Stepped, todo: list[int], prefixes, cap, seeds, version: int, must, switch,
           budgets, reads: list[dict] | None) -> None:
    """One request per row of `todo` until they all answered; the unanswered ones stopped as soon as
    newer weights wait or every `must` row finished. `reads`: each row's routes by position, to which
    this round's add (a MoE policy's, rlft/rollout/vllm_routes.py)."""
    requests = _Round(engine, "rlft-" if reads is None else vllm_routes.MARK)
    salt = f"rlft-weights-{engine.syncs}"
    futures = {pool.submit(requests.run, r, prefixes[r] + out.tokens[r], seed, cap[r] - len(out.tokens[r]),
                           salt): r for r, seed in zip(todo, seeds)}
    pending, stopped = set(futures), False
    while pending:
        done, pending = wait(pending, timeout=POLL_SECONDS, return_when=FIRST_COMPLETED)
        for future in done:
            _take(out, futures[future], future.result(), version, engine, budgets)
        if not stopped and pending and (
                all(out.finished[r] or not needed for r, needed in enumerate(must))
                or (switch is not None and switch.ready())):
            requests.stop(futures[future] for future in pending)
            stopped = True
    if reads is not None:  # (a request's prompt is its row's prefix and tokens so far: the row's positions)
        rows = [row for row in todo if row in requests.ids]
        vllm_routes.merge(reads, rows, engine.take_routes([requests.ids[row] for row in rows]),
                          [len(prefixes[row]) + len(out.tokens[row]) for row in rows])


def _take(out: Stepped, row: int, choice: dict, version: int, engine, budgets) -> None:
    tokens, logprobs, kept = choice_fields(choice, engine.replay_mask)
    out.tokens[row] += tokens
    out.logprobs[row] += [float("nan") if value is None else float(value) for value in logprobs]
    out.logprobs[row] += [float("nan")] * (len(tokens) - len(logprobs))
    if out.kept is not None:
        out.kept[row] += (kept or [])[:len(tokens)] + [None] * (len(tokens) - len(kept or []))
    out.versions[row] += [version] * len(tokens)
    # EOS; or the row's whole budget drawn ("length" at a window's `limit` is not an end)
    out.finished[row] = bool(out.tokens[row]) and out.tokens[row][-1] in engine.eos_ids \
        or len(out.tokens[row]) >= budgets[row]
