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
- partial rollouts: a window stops as soon as every completion that must finish (rollout k's) has,
  and the engine's other requests are aborted; what they sampled is carried by the pool and prefilled
  again in the next window (rlft/rollout/partial.py: Pool). With the same weights, vLLM's prefix cache
  serves that prefill from the blocks it already holds.

Each request has its own seed (drawn from rlft's RNG), so what a request samples does not depend on
which other requests share its steps.
"""

from __future__ import annotations

import itertools

from rlft.rollout.partial import Stepped
from rlft.rollout.truncation import kept_of

_IDS = itertools.count()


def run_steps(engine, model, prompts: list[list[int]], params: list, switch=None,
              must: list[bool] | None = None, limit: int | None = None, version: int = 0) -> Stepped:
    """Run `prompts` (token ids, one request each, with vLLM SamplingParams `params`) on the colocated
    engine `engine` (rlft/rollout/vllm.py: VLLMColocate) step by step until every request finished,
    or (`must`) every request flagged True did, or (`limit`) that many steps were taken; unfinished
    requests are aborted. `switch`: in-flight weight updates, between steps; `version`: the weights'
    version without one."""
    from vllm.sampling_params import RequestOutputKind

    llm = engine.llm.llm_engine
    ids = [f"rlft-{next(_IDS)}" for _ in prompts]
    index = {request: i for i, request in enumerate(ids)}
    for request, prompt, param in zip(ids, prompts, params):
        param.output_kind = RequestOutputKind.DELTA
        llm.add_request(request, {"prompt_token_ids": prompt}, param, lora_request=engine.lora_request)
    replayed = engine.replay_mask
    out = Stepped([[] for _ in prompts], [[] for _ in prompts], [[] for _ in prompts] if replayed else None,
                  [[] for _ in prompts], [False] * len(prompts), 0)
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
        unfinished = [request for request, done in zip(ids, out.finished) if not done]
        if unfinished:
            llm.abort_request(unfinished)
        engine.after_requests()
    return out


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
