"""Partial rollouts (issue 58): the producer looks ahead to later rollouts, ends each generate window when the
current rollout is done, and carries the others' unfinished completions over, continued under the weights it
holds then, each token keeping its version and behaviour log-prob."""

from __future__ import annotations

import json
import queue
import types

import pytest
import torch

from rlft.errors import ConfigError
from rlft.rollout.hf import HFGenerator
from rlft.rollout.partial import Pool, Row
from rlft.tiny import build_causal_lm, build_tokenizer
from tests.test_inflight import Sent, load, logps_of, two_versions


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(0)


def engine_for(tokenizer, max_tokens=12):
    engine = HFGenerator(tokenizer, max_new_tokens=max_tokens)
    engine.return_logps = True
    return engine


def seeded_pool(tokenizer, prompts, done_tokens: int, max_tokens: int = 12) -> Pool:
    """Rollout "a" with `done_tokens` tokens already drawn (so its window ends within max_tokens -
    done_tokens steps) and rollout "b" fresh."""
    pool = Pool(max_tokens)
    pool.add("a", prompts, 2, False)
    for row in pool.cohorts["a"]["rows"]:
        row.tokens, row.logprobs, row.versions = [5] * done_tokens, [-1.0] * done_tokens, [0] * done_tokens
    pool.add("b", prompts, 2, False)
    return pool


def test_a_window_ends_with_the_current_rollout_and_carries_the_next_ones_tokens_exactly(tokenizer):
    """Window 1 (version 0) ends when rollout a reaches its budget: rollout b's rows stop part-way and are
    carried. Window 2 (version 1) continues them: their tokens record [0]*n + [1]*rest, and every recorded
    log-prob equals a forward pass of the version that drew it over the whole sequence so far (a float64
    model; recorded in float32, hence 2e-6)."""
    model, newer = two_versions(tokenizer)
    older = {name: p.detach().clone() for name, p in model.named_parameters()}
    engine = engine_for(tokenizer)
    prompts = [tokenizer("1 + 2 =")["input_ids"], tokenizer("hello world 3 4 5")["input_ids"]]
    pool = seeded_pool(tokenizer, prompts, done_tokens=8)
    torch.manual_seed(0)
    finished = pool.window(model, engine, "a", 0)
    assert [len(r.tokens) for r in finished] == [12] * 4 and all(r.done for r in finished)
    assert list(pool.cohorts) == ["b"] and pool.stats["partial/window_steps"] == 4
    carried = pool.cohorts["b"]["rows"]
    first = [len(r.tokens) for r in carried]
    assert any(not r.done for r in carried) and max(first) <= 4  # stopped with rollout a, not finished

    load(model, newer)
    rows = pool.window(model, engine, "b", 1)
    assert not pool.cohorts and all(r.done for r in rows)
    for row, n in zip(rows, first):
        assert row.versions == [0] * n + [1] * (len(row.tokens) - n)
    for index, row in enumerate(rows):
        ids = torch.tensor([prompts[index // 2] + row.tokens])
        mask = torch.ones_like(ids)
        start = len(prompts[index // 2]) - 1
        want = []
        for weights in (older, newer):
            load(model, weights)
            want.append(logps_of(model, ids, mask, 0, ids.shape[1] - 1)[0, start:])
        n = first[index]
        expected = torch.cat([want[0][:n], want[1][n:]])
        torch.testing.assert_close(torch.tensor(row.logprobs, dtype=torch.float64), expected, atol=2e-6, rtol=0)


def test_in_the_throughput_mode_a_cut_row_goes_on_from_its_cache_under_newer_weights(tokenizer):
    """transformers' engine with kv_carry (the throughput mode): rollout b's rows, cut by rollout a's window under
    version 0, go on in the next window under version 1 from the keys and values version 0 left (nothing prefilled
    again), rollout c's new rows prefilled beside them. Each recorded log-prob equals that construction: version
    0's forward over the prompt and the first tokens, version 1's over the rest on version 0's cache (float64
    model, recorded in float32); neither version alone gives it."""
    from rlft.rollout.kv_carry import KVCarry
    from tests.test_inflight import assert_neither_version_alone, switched_logps

    model, newer = two_versions(tokenizer)
    older = {name: p.detach().clone() for name, p in model.named_parameters()}
    engine = engine_for(tokenizer, 24)
    engine.kv_carry = KVCarry()
    prompts = [tokenizer("1 + 2 =")["input_ids"], tokenizer("hello world 3 4 5")["input_ids"]]
    pool = seeded_pool(tokenizer, prompts, done_tokens=18, max_tokens=24)
    torch.manual_seed(0)
    pool.window(model, engine, "a", 0)
    first = [len(r.tokens) for r in pool.cohorts["b"]["rows"]]
    assert len(engine.kv_carry.rows) == 4 and all(0 < n < 24 for n in first)
    load(model, newer)
    pool.add("c", prompts, 2, False)
    rows = pool.window(model, engine, "b", 1)
    assert pool.stats["partial/reprefill_tokens"] == 0 and all(r.done for r in rows)
    for index, (row, n) in enumerate(zip(rows, first)):
        assert row.versions == [0] * n + [1] * (len(row.tokens) - n)
        prompt = prompts[index // 2]
        ids = torch.tensor([prompt + row.tokens])
        mask = torch.ones_like(ids)
        want = switched_logps(model, ids, mask, len(prompt), n, older, newer)
        got = torch.tensor([row.logprobs], dtype=torch.float64)
        torch.testing.assert_close(got, want, atol=2e-6, rtol=0)
        if len(row.tokens) > n + 1:
            scored = torch.ones_like(got, dtype=torch.bool)
            assert_neither_version_alone(model, ids, mask, len(prompt), n, older, newer, want, scored)
    assert len(engine.kv_carry.rows) == sum(not r.done for r in pool.cohorts["c"]["rows"])
    load(model, newer)  # rollout c's rows, new in that window: prefilled under version 1 beside the kept caches
    for index, row in enumerate(pool.cohorts["c"]["rows"]):
        ids = torch.tensor([prompts[index // 2] + row.tokens])
        want = logps_of(model, ids, torch.ones_like(ids), 0, ids.shape[1] - 1)[0, len(prompts[index // 2]) - 1:]
        torch.testing.assert_close(torch.tensor(row.logprobs, dtype=torch.float64), want, atol=2e-6, rtol=0)


def test_a_tool_pool_window_goes_on_from_the_cache_the_window_before_kept(tokenizer):
    """serve_rows (the tool pool's windows) with transformers' engine in the throughput mode: a row the first
    window cut, named again with its prefix one token longer, goes on from its kept cache (continued, nothing
    of it prefilled) and samples what the prefilling engine samples with the same seed."""
    from rlft.rollout.kv_carry import KVCarry
    from rlft.rollout.partial import serve_rows

    model = build_causal_lm(tokenizer, hidden_size=64).eval()
    prompts = [tokenizer("1 + 2 =")["input_ids"], tokenizer("hello world 3 4 5")["input_ids"]]
    first = {"key": "w0", "seed": 1, "rows": {"prefixes": prompts, "budgets": [2, 12], "must": [True, False],
                                              "names": [[0, 0, 0], [1, 0, 0]]}}
    answers = []
    for carry in (True, False):
        engine = engine_for(tokenizer)
        if carry:
            engine.kv_carry = KVCarry()
        out = serve_rows(model, engine, first, 0)
        assert not out["finished"][1] and len(out["tokens"][1]) == 2  # cut with the must row's budget
        prefix = prompts[1] + out["tokens"][1]
        second = {"key": "w1", "seed": 2, "rows": {"prefixes": [prefix], "budgets": [10], "must": [True],
                                                   "names": [[1, 0, 0]]}}
        answers.append(serve_rows(model, engine, second, 0))
    kept, prefilled = answers
    assert kept["partial/continued_rows"] == 1 and kept["partial/prefill_tokens"] == 0
    assert prefilled["partial/continued_rows"] == 0 and prefilled["partial/prefill_tokens"] == len(prompts[1]) + 2
    assert kept["tokens"] == prefilled["tokens"]
    torch.testing.assert_close(torch.tensor(kept["logprobs"]), torch.tensor(prefilled["logprobs"]), atol=1e-5, rtol=0)


def test_the_pool_survives_json_and_continues_as_if_never_stopped(tokenizer):
    """What a checkpoint keeps: the pool after a window, through JSON, then the next window with one seed gives
    the same completions as the pool that never left memory."""
    model = build_causal_lm(tokenizer, hidden_size=64).eval()
    engine = engine_for(tokenizer)
    prompts = [tokenizer("7 + 1 =")["input_ids"]]
    results = []
    for through_json in (False, True):
        pool = seeded_pool(tokenizer, prompts, done_tokens=9)
        torch.manual_seed(1)
        pool.window(model, engine, "a", 0)
        if through_json:
            saved = json.loads(json.dumps(pool.state()))
            pool = Pool(12)
            pool.load(saved)
        torch.manual_seed(2)
        results.append([vars(r) for r in pool.window(model, engine, "b", 1)])
    assert results[0] == results[1]
    assert isinstance(Row(**results[0][0]), Row)


def test_the_producer_serves_windows_and_hands_back_its_pool(tmp_path, tokenizer):
    """The producer's loop with partial rollouts: request r0 looks ahead to r1; the result carries rollout r0's
    completions with per-row versions and the pool (r1's carried rows); r1 then continues after a weight push,
    recording version 0 for carried tokens and 1 for the rest; a restarted producer given the carry answers r1
    as the first one did."""
    from safetensors.torch import save_file

    from rlft.rollout.producer_worker import serve

    prompts = [tokenizer("1 + 2 =")["input_ids"]]
    model = build_causal_lm(tokenizer, hidden_size=64).eval()
    base = {n: p.detach().clone() for n, p in model.named_parameters()}

    def run(messages):
        load(model, base)
        inbox: queue.Queue = queue.Queue()
        for message in (*messages, {"type": "stop"}):
            inbox.put(message)
        channel = Sent()
        args = types.SimpleNamespace(partial_rollouts=1, max_completion_length=12)
        serve(model, engine_for(tokenizer), args, channel, inbox, 0, tmp_path)
        return {m["key"]: m for m in channel.messages if m["type"] == "result"}

    def weights(name):
        path = tmp_path / f"{name}.safetensors"
        save_file({n: p + 0.05 for n, p in base.items()}, str(path))
        return {"type": "weights", "version": 1, "path": str(path)}

    # r0 arrives with 9 of its 12 tokens drawn: its window ends within 3 steps, r1's rows stop part-way
    begun = {"tokens": [5] * 9, "logprobs": [-1.0] * 9, "kept": None, "versions": [0] * 9, "done": False}
    r0 = {"type": "generate", "key": "r0", "prompt_ids": prompts, "num_generations": 4, "greedy": False,
          "seed": 0, "ahead": [{"key": "r1", "prompt_ids": prompts}],
          "carry": [{"key": "r0", "prompts": prompts, "num_generations": 4, "rows": [begun] * 4}]}
    r1 = {"type": "generate", "key": "r1", "prompt_ids": prompts, "num_generations": 4, "greedy": False,
          "seed": 1, "ahead": [], "carry": None}
    first = run([r0, weights("w0"), r1])
    assert set(first["r0"]["row_versions"][0]) == {0} and first["r0"]["carry"][0]["key"] == "r1"
    carried = [len(row["tokens"]) for row in first["r0"]["carry"][0]["rows"]]
    assert max(carried) <= 3 and not all(row["done"] for row in first["r0"]["carry"][0]["rows"])
    for row, n in zip(first["r1"]["row_versions"], carried):
        assert row == [0] * n + [1] * (len(row) - n)
    assert first["r1"]["carry"] == []
    again = run([weights("w1"), {**r1, "carry": first["r0"]["carry"]}])
    assert again["r1"]["tokens"] == first["r1"]["tokens"] and again["r1"]["logprobs"] == first["r1"]["logprobs"]


def test_partial_rollouts_refuse_what_cannot_record_each_tokens_log_prob_and_count_in_the_staleness_bound():
    from rlft import AsyncGRPOConfig

    with pytest.raises(ConfigError, match="partial_rollouts=2 needs each token's log-prob recorded.*repetition"):
        AsyncGRPOConfig(output_dir="x", partial_rollouts=2, max_staleness=8, repetition_penalty=1.1)
    with pytest.raises(ConfigError, match="inflight_weight_updates needs each token's log-prob.*generation_kwargs"):
        AsyncGRPOConfig(output_dir="x", inflight_weight_updates=True, generation_kwargs={"no_repeat_ngram_size": 2})
    # a vLLM server takes both (its requests are interrupted), but not the fixed switch token
    AsyncGRPOConfig(output_dir="x", partial_rollouts=2, max_staleness=8, use_vllm=True, vllm_mode="server")
    AsyncGRPOConfig(output_dir="x", inflight_weight_updates=True, use_vllm=True, vllm_mode="server")
    with pytest.raises(ConfigError, match="inflight_switch_tokens=4 with vllm_mode: server: not built"):
        AsyncGRPOConfig(output_dir="x", inflight_weight_updates=True, inflight_switch_tokens=4, use_vllm=True,
                        vllm_mode="server")
    AsyncGRPOConfig(output_dir="x", partial_rollouts=2, max_staleness=8, use_vllm=True, inflight_weight_updates=True)
    with pytest.raises(ConfigError, match="rollout_lag=1 and partial_rollouts=4 with weight_sync_steps=1 "
                                          "samples rollouts up to 5 steps behind, above max_staleness=4"):
        AsyncGRPOConfig(output_dir="x", partial_rollouts=4)
    AsyncGRPOConfig(output_dir="x", partial_rollouts=3)


def test_an_async_run_with_partial_rollouts_repeats_and_resumes_exactly(tmp_path):
    """AsyncGRPOTrainer with partial_rollouts=2: carried tokens are trained (tokens_from_older_weights > 0 on
    some step); one seed gives one run: a second run, stopped at a checkpoint (the pool saved with it) and
    resumed, equals the first."""
    from rlft import AsyncGRPOTrainer
    from rlft.model.loading import shipped_policy_path
    from tests.helpers import addition_rows, correct_answer, has_answer_tags, stop_after
    from tests.test_async_grpo import async_config, rows_of, trained

    settings = dict(max_steps=4, save_steps=2, partial_rollouts=2, max_completion_length=16)
    trained(tmp_path, "a", **settings)
    rows = rows_of(tmp_path / "a")
    losses = [r for r in rows if "loss" in r]
    assert len(losses) == 4 and any(r["sampling/tokens_from_older_weights"] > 0 for r in losses)
    assert all(r["sample/staleness_mean"] <= r["sample/staleness_max"] <= 3 for r in losses)
    # the oldest token sets staleness_max: where tokens come from older weights, it is above the rollout's own
    older = [r for r in losses if r["sampling/tokens_from_older_weights"] > 0]
    assert all(r["sample/token_version_min"] < r["sample/version"] and r["partial/carried_share"] > 0
               for r in older)
    AsyncGRPOTrainer(str(shipped_policy_path()), [correct_answer, has_answer_tags],
                     async_config(tmp_path, "split", **settings), addition_rows(32),
                     callbacks=[stop_after(2)]).train()
    trained(tmp_path, "split", resume=True, **settings)
    assert rows_of(tmp_path / "split") == rows


def test_in_the_throughput_mode_the_producer_moves_the_pool_on_while_it_waits(tmp_path, tokenizer):
    """In-flight updates whenever weights arrive (no inflight_switch_tokens): between two requests the producer
    advances the carried completions (partial/advance_steps); the next request finds them further on (here: all
    done, so its window generates nothing), every token still recorded with its version."""
    import threading

    from rlft.rollout.producer_worker import serve

    prompts = [tokenizer("1 + 2 =")["input_ids"]]
    model = build_causal_lm(tokenizer, hidden_size=64).eval()
    begun = {"tokens": [5] * 10, "logprobs": [-1.0] * 10, "kept": None, "versions": [0] * 10, "done": False}
    inbox: queue.Queue = queue.Queue()
    inbox.put({"type": "generate", "key": "r0", "prompt_ids": prompts, "num_generations": 4, "greedy": False,
               "seed": 0, "ahead": [{"key": "r1", "prompt_ids": prompts}],
               "carry": [{"key": "r0", "prompts": prompts, "num_generations": 4, "rows": [begun] * 4}]})
    later = [{"type": "generate", "key": "r1", "prompt_ids": prompts, "num_generations": 4, "greedy": False,
              "seed": 1, "ahead": [], "carry": None}, {"type": "stop"}]
    timer = threading.Timer(1.0, lambda: [inbox.put(m) for m in later])
    timer.start()
    channel = Sent()
    args = types.SimpleNamespace(partial_rollouts=1, max_completion_length=12, inflight_weight_updates=True)
    serve(model, engine_for(tokenizer), args, channel, inbox, 0, tmp_path)
    timer.join()
    results = {m["key"]: m for m in channel.messages if m["type"] == "result"}
    assert results["r0"]["partial/advance_steps"] == 0 and max(
        len(row["tokens"]) for row in results["r0"]["carry"][0]["rows"]) <= 2
    assert results["r1"]["partial/advance_steps"] > 0 and results["r1"]["partial/window_steps"] == 0
    # every token of r1 was drawn before its own window; r0 had 10 of each row's tokens from the carry
    assert results["r1"]["partial/carried_share"] == 1.0 and 0 < results["r0"]["partial/carried_share"] < 1
    assert all(len(v) == len(t) and set(v) == {0} for v, t in zip(results["r1"]["row_versions"],
                                                                  results["r1"]["tokens"]))


@pytest.mark.parametrize("carry", [False, True])
def test_a_moe_policys_rows_going_on_from_kept_caches_carry_each_tokens_route(tokenizer, carry):
    """A Mixture-of-Experts policy under routing replay (near-tied routers, float32) on transformers' engine:
    every row advanced 3 tokens, then two rollouts' windows. With kv_carry (the throughput mode) the cut rows go
    on from their caches, nothing prefilled again: the window's first step reads each row's last carried token,
    and that route fills it. Either way every read token has its route and the trainer, replaying them, agrees
    with every choice and scores the sampler's log-probs (which it would not with a route one position off)."""
    from rlft.model import routing
    from rlft.model.scoring import install_scoring
    from rlft.rollout.kv_carry import KVCarry
    from rlft.tiny import build_near_tie_moe
    from tests.route_helpers import assert_replayed_exactly, windows

    model = build_near_tie_moe(tokenizer, "qwen3_moe", num_layers=2).float().eval()
    install_scoring(model)
    state = routing.install(model)
    engine = engine_for(tokenizer, max_tokens=16)
    engine.kv_carry = KVCarry() if carry else None
    prompts = [tokenizer(f"{a} + {b} = ")["input_ids"] for a in range(2) for b in range(2)]
    carried, rollouts = windows(model, engine, prompts, budget=16)
    assert carried >= 12
    # (r0's window carried every row on: the first after the advance)
    assert (rollouts[0][1]["partial/reprefill_tokens"] == 0) == carry
    for rollout, _ in rollouts:
        assert_replayed_exactly(model, state, rollout, only_read=False)
