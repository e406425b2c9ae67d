"""Partial rollouts (AsyncGRPOConfig `partial_rollouts: N`; docs/async.md): the rollout producer's
look-ahead, so that a rollout's long tail no longer sets the time of its step.

While the producer samples rollout k it also samples the completions of the next N rollouts. Its
generate call (a *window*) ends as soon as every completion of rollout k is done (EOS or its length
limit), however far the others are. A completion of a later rollout that is not done is carried
over: in the next window it continues from its tokens so far (prompt and tokens prefilled again
under the weights the producer holds then: continued, not restarted), and every token keeps the
log-prob of the distribution it was drawn from and the version of the weights that drew it. A long
completion of rollout k was therefore started up to N windows before rollout k's own, and a window
lasts about (longest completion) / (N + 1) decode steps instead of the longest completion.

Rollout k is still trained at step k, with the same prompts as without look-ahead: only its tokens
are older (by up to N rollouts; max_staleness bounds it) and, like every async token, corrected per
token by pi_old / pi_sampler. What is carried (the pool) is a function of the earlier windows, and
each window samples after `torch.manual_seed(seed of rollout k)`: the same seed gives the same run,
and the pool travels with every result so that a checkpoint holds it (`Pool.state` / `Pool.load`).

Re-prefilling carried completions costs one forward over their tokens per window (the price of
continuing under new weights without a KV cache that the new weights did not compute). In the throughput
mode a colocated vLLM engine keeps their requests, and caches, between windows instead
(rlft/rollout/vllm_steps.py), and transformers' engine keeps each cut row's slice of the window's cache
(rlft/rollout/kv_carry.py).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch
from transformers import StoppingCriteria, StoppingCriteriaList

from rlft.data.prompts import left_pad
from rlft.model.routing import extend_first_reads, route_state
from rlft.rollout.hf import cache_keyword, eos_token_ids, sampling_forwards
from rlft.rollout.kv_carry import carried_routes

# The throughput mode (in-flight weight updates whenever weights arrive): between two requests the
# producer moves the pool on by this many decode steps at a time, then looks at its inbox again
ADVANCE_TOKENS = 16


@dataclass
class Row:
    """One completion in the pool: its tokens so far, each one's sampler log-prob, kept ids (a
    truncating sampler's, else None) and weights version; done once it emitted EOS or reached its
    length limit."""

    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    kept: list[list[int]] | None = None
    versions: list[int] = field(default_factory=list)
    done: bool = False
    # a MoE policy's routes (routing replay): each token's [layers][k] from the forward that first read it
    # (None: not read yet, the window's last token), and its prompt's from the first window
    routes: list | None = None
    prompt_routes: list | None = None


class WindowStop(StoppingCriteria):
    """Ends each row at EOS or at its own token budget, and the whole window once every row that
    must finish (rollout k's) is done (`must` None: only max_new_tokens ends it); `ended[i]`: the
    tokens row i generated in this window (-1: cut by the window's end, it generated all of them)."""

    def __init__(self, start: int, budgets: torch.Tensor, must: torch.Tensor | None, eos_ids: list[int]):
        self.start, self.budgets, self.must = start, budgets, must
        self.eos = torch.tensor(eos_ids, device=budgets.device)
        self.done = torch.zeros(budgets.shape, dtype=torch.bool, device=budgets.device)
        self.ended = torch.full_like(budgets, -1)

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        step = input_ids.shape[1] - self.start
        newly = ~self.done & (torch.isin(input_ids[:, -1], self.eos) | (step >= self.budgets))
        self.ended[newly] = step
        self.done |= newly
        if self.must is not None and bool((self.done | ~self.must).all()):
            return torch.ones_like(self.done)
        return self.done.clone()


class Pool:
    """The producer's rollouts in progress, in request order: key -> (prompts, rows; row
    i*G + j is prompt i's j-th completion)."""

    def __init__(self, max_tokens: int):
        self.max_tokens = max_tokens
        self.cohorts: dict[str, dict] = {}
        self.stats: dict[str, float] = {}
        # decode steps taken while idle since the last result, and the tokens they prefilled again
        self.between = {"partial/advance_steps": 0.0, "partial/advance_reprefill_tokens": 0.0}

    def add(self, key: str, prompt_ids: list[list[int]], num_generations: int, replay_mask: bool,
            routes: bool = False) -> None:
        if key in self.cohorts:
            return
        rows = [Row(kept=[] if replay_mask else None, routes=[] if routes else None)
                for _ in range(len(prompt_ids) * num_generations)]
        self.cohorts[key] = {"prompts": [list(p) for p in prompt_ids], "num_generations": num_generations,
                             "rows": rows}

    def unfinished(self) -> bool:
        return any(not row.done for cohort in self.cohorts.values() for row in cohort["rows"])

    # ---- a window ---------------------------------------------------------------------------------
    @torch.no_grad()
    def window(self, model, generator, key: str, version: int, switch=None) -> list[Row]:
        """Generate until rollout `key` is done, advancing every other row as far; returns `key`'s
        rows and drops them from the pool."""
        active = [(k, i, row) for k, cohort in self.cohorts.items() for i, row in enumerate(cohort["rows"])
                  if not row.done]
        rows = self.cohorts[key]["rows"]
        before = sum(len(row.tokens) for row in rows)
        if any(k == key for k, _, _ in active):
            self.stats = self._generate(model, generator, key, version, switch, active)
        else:  # done in earlier windows
            self.stats = {"partial/window_rows": 0.0, "partial/window_steps": 0.0,
                          "partial/reprefill_tokens": 0.0}
        # the share of rollout `key`'s tokens drawn before its own window (earlier windows, or while idle)
        self.stats["partial/carried_share"] = before / max(1, sum(len(row.tokens) for row in rows))
        self.stats.update(self.between)
        self.between = {"partial/advance_steps": 0.0, "partial/advance_reprefill_tokens": 0.0}
        return self.cohorts.pop(key)["rows"]

    @torch.no_grad()
    def advance(self, model, generator, tokens: int, version: int, switch=None) -> None:
        """Up to `tokens` more tokens for every unfinished row (the producer's idle time in the
        throughput mode, between two requests); nothing is returned, the pool moves on."""
        active = [(k, i, row) for k, cohort in self.cohorts.items() for i, row in enumerate(cohort["rows"])
                  if not row.done]
        if active:
            stats = self._generate(model, generator, None, version, switch, active, tokens)
            self.between["partial/advance_steps"] += stats["partial/window_steps"]
            self.between["partial/advance_reprefill_tokens"] += stats["partial/reprefill_tokens"]

    def _generate(self, model, generator, key, version, switch, active, limit: int | None = None) -> dict:
        prefixes = [self.cohorts[k]["prompts"][i // self.cohorts[k]["num_generations"]] + row.tokens
                    for k, i, row in active]
        budgets = [self.max_tokens - len(row.tokens) for _, _, row in active]
        must = None if key is None else [k == key for k, _, _ in active]
        out = step_rows(model, generator, prefixes, budgets, must, limit, version, switch,
                        [(k, i) for k, i, _ in active])
        if out.routes is not None:
            _take_routes(active, prefixes, [len(t) for t in out.tokens], *out.routes)
        for r, (_, _, row) in enumerate(active):
            row.tokens += out.tokens[r]
            row.logprobs += out.logprobs[r]
            if row.kept is not None and out.kept is not None:
                row.kept += out.kept[r]
            row.versions += out.versions[r]
            row.done = out.finished[r]
        carried = sum(len(row.tokens) - len(out.tokens[r]) for r, (_, _, row) in enumerate(active)
                      if not (out.continued and out.continued[r]))
        return {"partial/window_rows": float(len(active)), "partial/window_steps": float(out.steps),
                "partial/reprefill_tokens": float(carried)}

    # ---- what a checkpoint keeps ------------------------------------------------------------------
    def state(self) -> list[dict]:
        """The pool as JSON values (every rollout in progress, its rows' tokens, log-probs, kept ids,
        versions)."""
        return [{"key": key, "prompts": c["prompts"], "num_generations": c["num_generations"],
                 "rows": [copy.deepcopy(vars(row)) for row in c["rows"]]} for key, c in self.cohorts.items()]

    def load(self, state: list[dict]) -> None:
        self.cohorts = {e["key"]: {"prompts": e["prompts"], "num_generations": e["num_generations"],
                                   "rows": [Row(**copy.deepcopy(row)) for row in e["rows"]]} for e in state}


@dataclass
class Stepped:
    """A window's new tokens per row: each one's log-prob, kept ids (None where not replayed) and
    weights version, and whether the row finished (EOS or its budget) rather than being cut."""

    tokens: list[list[int]]
    logprobs: list[list[float]]
    kept: list[list[list[int] | None]] | None
    versions: list[list[int]]
    finished: list[bool]
    steps: int
    # per row: it went on in the engine's own cache (a kept vLLM request), nothing prefilled again
    continued: list[bool] | None = None
    # a MoE policy's routes (transformers' generate): (read [N, P, L, k] over the left-padded prefixes,
    # decoded [N, steps, L, k])
    routes: tuple | None = None


def step_rows(model, generator, prefixes: list[list[int]], budgets: list[int], must: list[bool] | None,
              limit: int | None, version: int, switch, names: list) -> Stepped:
    """One window: each prefix continued by up to its budget of tokens, until every `must` row finished
    (or `limit` decode steps); `names`: each row's hashable name (a colocated vLLM engine in the
    throughput mode keeps a cut row's request for the next window naming it)."""
    if hasattr(generator, "continue_rows"):  # a vLLM engine, stepped (rollout/vllm_steps.py) or a server
        return generator.continue_rows(model, prefixes, budgets, must, limit, switch, version, rows=names)
    return _hf_window(model, generator, prefixes, budgets, must, limit, version, switch, names)


def _hf_window(model, generator, prefixes, budgets, must, limit, version, switch, names=None) -> Stepped:
    """One window with transformers' generate: the prefixes left-padded, each row stopped at EOS or
    its budget, the window at `must`'s rows' end (or `limit` decode steps). With `generator.kv_carry`
    (the throughput mode; rlft/rollout/kv_carry.py) a row cut by the previous window goes on from its
    cache instead of being prefilled again."""
    tokenizer = generator.tokenizer
    device = next(model.parameters()).device
    ids, mask = (t.to(device) for t in left_pad(prefixes, tokenizer.pad_token_id))
    budgets = torch.tensor(budgets, device=device)
    must = None if must is None else torch.tensor(must, device=device)
    eos_ids = eos_token_ids(model, tokenizer)
    stop = WindowStop(ids.shape[1], budgets, must, eos_ids)
    routes = route_state(model)
    carry = getattr(generator, "kv_carry", None) if names is not None else None
    continued = None
    with sampling_forwards(model, routes):  # (a MoE policy under routing replay: this window's routes)
        sampling, recorder = generator._settings(model, False, device)
        if recorder is None or not recorder.record_logps:
            raise RuntimeError("partial rollouts need the sampler's log-probs recorded while "
                               "generate samples (an rlft bug: the config allows only that case)")
        most = int(budgets.max()) if limit is None else min(limit, int(budgets.max()))
        sampling.update(max_new_tokens=most, stopping_criteria=StoppingCriteriaList([stop]))
        if carry is not None:
            keyword = cache_keyword(model)
            cache, continued = carry.cache_for(model, prefixes, names, tokenizer.pad_token_id, keyword,
                                               device)
            sampling.update({keyword: cache} if cache is not None else {}, return_dict_in_generate=True)
        out = model.generate(input_ids=ids, attention_mask=mask, pad_token_id=tokenizer.pad_token_id,
                             eos_token_id=eos_ids, use_cache=True, **sampling)
    sequences = out if carry is None else out.sequences
    new = sequences[:, ids.shape[1]:]
    steps = new.shape[1]
    counts = torch.where(stop.ended >= 0, stop.ended, steps).clamp(max=steps).tolist()
    if carry is not None:
        cache = out.cache if "cache" in out else out.past_key_values  # (the name from transformers 5.24)
        carry.keep(cache, names, prefixes, counts, (stop.ended >= 0).tolist())
    if routes is None:
        read = None
    elif continued is not None and any(continued):  # (from kept caches: it read only what it computed)
        read = carried_routes(routes.take_calls(), prefixes, continued, steps)
    else:
        read = routes.assemble(len(prefixes), ids.shape[1], steps)
    lengths = torch.tensor(counts, device=device)[:, None]
    logps, kept = recorder.finish(new, (torch.arange(steps, device=device)[None, :] < lengths).long())
    versions = switch.versions if switch is not None else [version] * steps
    return Stepped(
        [new[r, :n].tolist() for r, n in enumerate(counts)],
        [logps[r, :n].tolist() for r, n in enumerate(counts)],
        None if kept is None else [[[k for k in step if k >= 0] for step in kept[r, :n].tolist()]
                                   for r, n in enumerate(counts)],
        [versions[:n] for n in counts], (stop.ended >= 0).tolist(), steps, continued, routes=read)


def _take_routes(active, prefixes: list[list[int]], counts: list[int], read: torch.Tensor,
                 decoded: torch.Tensor) -> None:
    """A window's routes into its rows (before their tokens are appended): the prefill read each row's
    prompt (kept from the first window) and its carried tokens (filling those no forward had read: the
    last token of its previous window); decoding read the new tokens (all but a cut row's last)."""
    for r, (_, _, row) in enumerate(active):
        if row.routes is None:  # (a pool kept by a run without routes)
            continue
        prefix = read[r, read.shape[1] - len(prefixes[r]):]  # [prompt + carried, L, k]
        prompt = len(prefixes[r]) - len(row.tokens)
        if row.prompt_routes is None:
            row.prompt_routes = prefix[:prompt].tolist()
        extend_first_reads(row.routes, prefix[prompt:], decoded[r, :counts[r]], torch.Tensor.tolist)


def window_routes(rows: list[Row]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A finished rollout's routes as (prompt [N, P, L, k] left-padded, completion [N, C, L, k]), int16,
    -1 where no forward read a position; None: none recorded."""
    if not rows or rows[0].routes is None or rows[0].prompt_routes is None:
        return None
    shape = torch.tensor(rows[0].prompt_routes[0] if rows[0].prompt_routes else rows[0].routes[0]).shape
    width = max(len(row.prompt_routes) for row in rows)
    length = max(max(len(row.routes) for row in rows), 1)
    prompt = torch.full((len(rows), width, *shape), -1, dtype=torch.int16)
    completion = torch.full((len(rows), length, *shape), -1, dtype=torch.int16)
    for r, row in enumerate(rows):
        if row.prompt_routes:
            prompt[r, width - len(row.prompt_routes):] = torch.tensor(row.prompt_routes, dtype=torch.int16)
        for j, step in enumerate(row.routes):
            if step is not None:
                completion[r, j] = torch.tensor(step, dtype=torch.int16)
    return prompt, completion


def serve_window(pool: Pool, model, engine, message: dict, version: int, switch=None) -> dict:
    """The producer's answer to a partial-rollout request: `message` names rollout k ("key",
    "prompt_ids"), the rollouts to look ahead to ("ahead": [{"key", "prompt_ids"}]) and, after the
    producer (re)started, the pool a checkpoint kept ("carry"); the result holds rollout k's
    completions, each token's version ("row_versions") and the pool after this window ("carry")."""
    import time

    started = time.perf_counter()
    if message.get("carry") is not None:
        pool.load(message["carry"])
    routes = route_state(model) is not None
    for entry in ({"key": message["key"], "prompt_ids": message["prompt_ids"]}, *message["ahead"]):
        pool.add(entry["key"], entry["prompt_ids"], message["num_generations"], engine.replay_mask, routes)
    torch.manual_seed(message["seed"])
    rows = pool.window(model, engine, message["key"], version, switch)
    return {"type": "result", "key": message["key"], "version": version,
            "tokens": [row.tokens for row in rows], "logprobs": [row.logprobs for row in rows],
            "kept": [row.kept for row in rows] if engine.replay_mask else None,
            "row_versions": [row.versions for row in rows], "routes": window_routes(rows),
            "seconds": time.perf_counter() - started, "carry": pool.state(), **pool.stats,
            "score_seconds": 0.0}


def serve_rows(model, engine, message: dict, version: int, switch=None) -> dict:
    """The producer's answer to a window of rows the trainer holds (partial rollouts with tools or
    environments, rlft/train/sources/agent_pool.py): `message["rows"]` gives each row's prefix (prompt
    and tokens so far, tool output included), budget, whether the window waits for it ("must") and its
    name; the result holds each row's new tokens, their log-probs, kept ids, versions, routes and
    whether the row finished its turn ("finished": EOS or its budget) rather than being cut."""
    import time

    started = time.perf_counter()
    torch.manual_seed(message["seed"])
    rows = message["rows"]
    out = step_rows(model, engine, rows["prefixes"], rows["budgets"], rows["must"], None, version, switch,
                    [tuple(name) for name in rows["names"]])
    continued = out.continued or [False] * len(out.tokens)  # (went on from a kept request or cache)
    prefilled = sum(len(p) for p, going in zip(rows["prefixes"], continued) if not going)
    return {"type": "result", "key": message["key"], "version": version, "tokens": out.tokens,
            "logprobs": out.logprobs, "kept": out.kept if engine.replay_mask else None,
            "row_versions": out.versions, "finished": out.finished, "routes": out.routes,
            "seconds": time.perf_counter() - started, "score_seconds": 0.0,
            "partial/window_rows": float(len(out.tokens)), "partial/window_steps": float(out.steps),
            "partial/prefill_tokens": float(prefilled), "partial/continued_rows": float(sum(continued))}
