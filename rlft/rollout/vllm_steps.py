"""A colocated vLLM engine driven one scheduler step at a time (docs/async.md), for the rollout
producer's in-flight weight updates and partial rollouts.

`LLM.generate` runs its requests to the end under one set of weights. Here the requests are added
to the engine and `LLMEngine.step()` is called in a loop; each step returns the tokens it sampled
(each with its processed log-prob: the distribution it was drawn from), and between two steps:

- in-flight weight updates: `switch.step()` (rlft/rollout/hf.py: WeightSwitch) may load newer weights
  into the producer's model, and the engine takes them at once (`reload_weights`) while its
  requests keep their KV cache. Each token records the version of the weights whose forward
  produced its logits, and its log-prob is that distribution's: the per-token correction is exact.
  The prefix cache is reset once the requests are gone (its blocks hold the older weights' keys);
- partial rollouts: a window stops as soon as every completion that must finish (rollout k's) has;
  what the others sampled is carried by the pool (rlft/rollout/partial.py: Pool). In the reproducible
  modes their requests are aborted and prefilled again in the next window, under the weights then
  (vLLM's prefix cache serves that prefill where the weights are the same). In the throughput mode
  (in-flight updates whenever weights arrive) they stay in the engine with their KV cache and their
  seed and simply go on in the next window, as a request going on under in-flight updates does:
  nothing is prefilled again.

A MoE policy's routes are recorded as on a whole rollout (rlft/rollout/vllm_routes.py): each token's from
the step that read it, under the weights of that step.

Each request has its own seed (drawn from rlft's RNG), so what a request samples does not depend on
which other requests share its steps.
"""

from __future__ import annotations

import itertools

from rlft.model.routing import route_state
from rlft.rollout import vllm_routes
from rlft.rollout.partial import Stepped
from rlft.rollout.truncation import kept_of

_IDS = itertools.count()


def run_steps(engine, model, prompts: list[list[int]], params: list, switch=None,
              must: list[bool] | None = None, limit: int | None = None, version: int = 0,
              rows: list | None = None) -> Stepped:
    """Run `prompts` (token ids, one request each, with vLLM SamplingParams `params`) on the colocated
    engine `engine` (rlft/rollout/vllm.py: VLLMColocate) step by step until every request finished,
    or (`must`) every request flagged True did, or (`limit`) that many steps were taken. `switch`:
    in-flight weight updates, between steps; `version`: the weights' version without one.

    Unfinished requests are aborted, unless `rows` names each prompt's row (hashable): then they stay
    in the engine (`engine.kept`, row -> request), keeping their KV cache and their seed, and a later
    call naming the same row continues that request instead of adding its prompt again (its params
    are then not read, and its prompt is the tokens it holds); a kept request that a call does not
    name is aborted. A MoE policy under routing replay: `Stepped.routes` holds what each request read
    in this call (rlft/rollout/vllm_routes.py: assemble)."""
    llm = engine.llm.llm_engine
    names = rows if rows is not None else [None] * len(prompts)
    ids, continued = _add_requests(engine, names, prompts, params)
    index = {request: i for i, request in enumerate(ids)}
    replayed, routes = engine.replay_mask, route_state(model) is not None  # (a MoE policy's routes)
    if routes:
        vllm_routes.record(engine.llm)
    out = Stepped([[] for _ in prompts], [[] for _ in prompts], [[] for _ in prompts] if replayed else None,
                  [[] for _ in prompts], [False] * len(prompts), 0, continued)
    must = must or [True] * len(prompts)
    try:
        while llm.has_unfinished_requests():
            now = switch.version if switch is not None else version
            for output in llm.step():
                _take(out, index[output.request_id], output, now, replayed)
            out.steps += 1
            if all(done or not needed for done, needed in zip(out.finished, must)):
                break
            if limit is not None and out.steps >= limit:
                break
            if switch is not None:
                switch.step()
                if engine.stale:  # loaded between two steps: the running requests keep their cache
                    engine.sync(model, in_flight=True)
    finally:
        unfinished = [(name, request) for name, request, done in zip(names, ids, out.finished) if not done]
        if rows is None and unfinished:
            llm.abort_request([request for _, request in unfinished])
        engine.kept = {name: request for name, request in unfinished} if rows is not None else {}
        if not engine.kept:
            engine.after_requests()
    if routes:  # (a kept request's: what it read in this call, from its last carried token on)
        out.routes = vllm_routes.assemble(vllm_routes.take(engine.llm, ids), prompts,
                                          [len(tokens) for tokens in out.tokens])
    return out


def _add_requests(engine, names: list, prompts: list[list[int]], params: list) -> tuple[list, list[bool]]:
    """Each prompt's request: its row's kept one, else added; kept requests no name asks for aborted. The
    request ids, and whether each was kept."""
    from vllm.sampling_params import RequestOutputKind

    llm, kept, named = engine.llm.llm_engine, engine.kept, set(names)
    stale = [request for row, request in kept.items() if row not in named]  # (all of them without rows)
    if stale:
        llm.abort_request(stale)
    ids = []
    for name, prompt, param in zip(names, prompts, params):
        if name in kept:
            ids.append(kept[name])
            continue
        ids.append(f"rlft-{next(_IDS)}")
        param.output_kind = RequestOutputKind.DELTA
        # blocks of the prefix cache are reused only under the weights that computed them
        llm.add_request(ids[-1], {"prompt_token_ids": prompt, "cache_salt": f"rlft-weights-{engine.syncs}"},
                        param, lora_request=engine.lora_request)
    return ids, [name in kept for name in names]


def token_versions(versions: list[list[int]], completion_mask):
    """Per row, each token's version (`Stepped.versions`) as a [N, C] int32 tensor, -1 outside the
    completion."""
    import torch

    out = torch.full(completion_mask.shape, -1, dtype=torch.int32)
    for row, drawn in enumerate(versions):
        out[row, :len(drawn)] = torch.tensor(drawn[:completion_mask.shape[1]], dtype=torch.int32)
    return out.to(completion_mask.device).masked_fill(completion_mask == 0, -1)


def throughput_mode(args) -> bool:
    """In-flight updates whenever weights arrive (no fixed switch token): partial rollouts keep their
    requests between windows."""
    return bool(getattr(args, "inflight_weight_updates", False)) and getattr(
        args, "inflight_switch_tokens", None) is None


def _take(out: Stepped, row: int, output, version: int, replayed: bool) -> None:
    sample = output.outputs[0]
    tokens = list(sample.token_ids)
    steps = sample.logprobs or [{} for _ in tokens]
    out.tokens[row] += tokens
    out.logprobs[row] += [float(lp[t].logprob) if t in lp else float("nan") for t, lp in zip(tokens, steps)]
    if replayed:
        out.kept[row] += [kept_of({t: float(v.logprob) for t, v in lp.items()}) for lp in steps]
    out.versions[row] += [version] * len(tokens)
    out.finished[row] = out.finished[row] or bool(output.finished)
