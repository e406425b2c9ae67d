"""Routing-replay checks shared by the engine tests (tests/test_routing.py, test_partial.py, test_vllm_routes.py)."""

from __future__ import annotations

import copy

import torch

from rlft.model.scoring import score_rows


def log_ratios(trainer, rollout, replayed: bool, packing=None) -> torch.Tensor:
    """log pi_trainer - log pi_sampler over the completion tokens, from a forward that could train
    (route agreement is counted there)."""
    if not replayed:
        rollout = copy.copy(rollout)
        rollout.prompt_routes = rollout.completion_routes = None
    logps = score_rows(trainer, rollout, slice(None), packing=packing).logps.detach()
    mask = rollout.completion_mask[:, :logps.shape[1]].bool()
    return (logps.double() - rollout.sampling_logps[:, :logps.shape[1]].double())[mask]


def read_positions(rollout) -> torch.Tensor:
    """Each completion token a forward read: all but each completion's last."""
    read = rollout.completion_mask.clone()
    read[torch.arange(read.shape[0]), read.sum(1) - 1] = 0
    return read.bool()


def assert_replayed_exactly(model, state, rollout, only_read: bool = True) -> None:
    """Every prompt token and every read completion token has its route, and (`only_read`) none other has;
    replayed, a float32 trainer agrees with every choice and scores the sampler's log-probs within 1e-5.
    (transformers' generate feeds a row's last token when other rows go on, so there it may have one.)"""
    assert bool((rollout.prompt_routes[rollout.prompt_mask.bool()] >= 0).all())
    read = read_positions(rollout)
    assert bool((rollout.completion_routes[read] >= 0).all())
    assert not only_read or bool((rollout.completion_routes[~read] < 0).all())
    ratio = log_ratios(model, rollout, True).exp()
    assert state.take_agreement() == 1.0
    assert (ratio - 1).abs().max() < 1e-5


def windows(model, engine, prompts, tokens: int = 3, budget: int = 24):
    """Partial rollouts' pool on `engine` (routes recorded): rollouts r0 and r1 (`prompts` x 2, r1's reversed),
    `tokens` tokens of every row drawn first (an idle advance), then r0's window and r1's. Returns the rows
    carried by the advance, and per window its Rollout (with its routes) and the pool's window stats."""
    from rlft.rollout.hf import eos_token_ids
    from rlft.rollout.partial import Pool, window_routes
    from rlft.rollout.vllm import engine_rollout

    pool = Pool(budget)
    order = {"r0": prompts, "r1": prompts[::-1]}
    for key, listed in order.items():
        pool.add(key, listed, 2, getattr(engine, "replay_mask", False), True)
    torch.manual_seed(0)
    pool.advance(model, engine, tokens, 0)
    carried = sum(not row.done for cohort in pool.cohorts.values() for row in cohort["rows"])
    out = []
    for key, listed in order.items():
        rows = pool.window(model, engine, key, 0)
        rollout = engine_rollout([p for p in listed for _ in range(2)], [row.tokens for row in rows],
                                 [row.logprobs for row in rows], engine.tokenizer.pad_token_id,
                                 eos_token_ids(model, engine.tokenizer), torch.device("cpu"), False, None)
        prompt_routes, completion_routes = window_routes(rows)
        rollout.prompt_routes = prompt_routes
        rollout.completion_routes = completion_routes[:, :rollout.completion_ids.shape[1]]
        out.append((rollout, dict(pool.stats)))
    return carried, out
