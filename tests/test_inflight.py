"""In-flight weight updates (issue 58): weights that change between two decode steps of a rollout, and
each token's recorded version and behaviour log-prob."""

from __future__ import annotations

import queue
import types

import pytest
import torch
from transformers import DynamicCache

from rlft.rollout.hf import HFGenerator, WeightSwitch, cache_keyword
from rlft.tiny import build_causal_lm, build_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(0)


def two_versions(tokenizer):
    """A float64 policy and a second set of its weights (version 1)."""
    model = build_causal_lm(tokenizer, hidden_size=64).double().eval()
    generator = torch.Generator().manual_seed(3)
    newer = {name: p.detach() + 0.05 * torch.randn(p.shape, generator=generator, dtype=p.dtype)
             for name, p in model.named_parameters()}
    return model, newer


def load(model, weights) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(weights[name])


def logps_of(model, ids, mask, start: int, stop: int, cache=None) -> torch.Tensor:
    """log p of ids[:, start + 1 : stop + 1] from a forward over ids[:, start:stop] (on `cache`)."""
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        out = model(input_ids=ids[:, start:stop], attention_mask=mask[:, :stop],
                    position_ids=positions[:, start:stop], use_cache=cache is not None,
                    **({cache_keyword(model): cache} if cache is not None else {}))
    logps = torch.log_softmax(out.logits.double(), dim=-1)
    return logps.gather(-1, ids[:, start + 1:stop + 1, None]).squeeze(-1)


def switched_logps(model, ids, mask, prompt: int, switch: int, older, newer) -> torch.Tensor:
    """log p of every completion token (ids[:, prompt:]) when the weights change from `older` to `newer` after
    the `switch`-th token: `older`'s forward over the prompt and the first tokens, `newer`'s over the rest on the
    keys and values `older` left in the cache (what a sampler switched mid-sequence computes)."""
    load(model, older)
    cache = DynamicCache(config=model.config)
    before = logps_of(model, ids, mask, 0, prompt + switch - 1, cache)[:, prompt - 1:]
    load(model, newer)
    return torch.cat([before, logps_of(model, ids, mask, prompt + switch - 1, ids.shape[1] - 1, cache)], dim=1)


def assert_neither_version_alone(model, ids, mask, prompt: int, switch: int, older, newer, want, scored) -> None:
    """Neither set of weights alone gives `want`: newer over the first `switch` tokens, older over the rest."""
    for weights, part in ((newer, slice(0, switch)), (older, slice(switch, None))):
        load(model, weights)
        alone = logps_of(model, ids, mask, 0, ids.shape[1] - 1)[:, prompt - 1:]
        assert (alone[:, part][scored[:, part]] - want[:, part][scored[:, part]]).abs().max() > 1e-3


def test_a_weight_switch_mid_sequence_records_each_tokens_version_and_its_exact_behaviour_log_prob(tokenizer):
    """Weights change after the 5th token: tokens 0-4 come from version 0, the rest from version 1 reading the
    keys and values version 0 left in the cache. Each recorded log-prob equals a forward pass of that
    construction: version 0 over the prefix, version 1 over the rest on version 0's cache (a float64 model;
    the sampler records float32 log-probs, hence 2e-6)."""
    model, newer = two_versions(tokenizer)
    older = {name: p.detach().clone() for name, p in model.named_parameters()}
    engine = HFGenerator(tokenizer, max_new_tokens=12)
    engine.return_logps = True

    def pending(tokens):
        if tokens == 5:  # after the logits of token 4
            load(model, newer)
            return 1
        return None

    switch = WeightSwitch(0, pending)
    engine.weight_switch = switch
    prompts = [tokenizer("1 + 2 =")["input_ids"], tokenizer("hello world 3 4 5")["input_ids"]]
    torch.manual_seed(0)
    rollout = engine(model, prompts, 2)
    width = rollout.completion_ids.shape[1]
    assert width > 6 and switch.versions[:width] == [0] * 5 + [1] * (width - 5)

    ids = torch.cat([rollout.prompt_ids, rollout.completion_ids], dim=1)
    mask = torch.cat([rollout.prompt_mask, rollout.completion_mask], dim=1)
    prompt = rollout.prompt_ids.shape[1]
    want = switched_logps(model, ids, mask, prompt, 5, older, newer)  # tokens 5.. on version 0's cache
    scored = rollout.completion_mask.bool()
    torch.testing.assert_close(rollout.sampling_logps[scored].double(), want[scored], atol=2e-6, rtol=0)
    assert_neither_version_alone(model, ids, mask, prompt, 5, older, newer, want, scored)


class Sent:
    def __init__(self):
        self.messages = []

    def send(self, message):
        self.messages.append(message)


def test_the_producer_loads_weights_that_arrive_mid_rollout_between_decode_steps(tmp_path, tokenizer):
    """The producer's loop, driven by its inbox: weights queued behind the request being sampled are loaded at
    its next decode step (every later token records version 1), and the next request starts from them. Without
    inflight_weight_updates the same inbox samples the whole first rollout from version 0."""
    from safetensors.torch import save_file

    from rlft.model.scoring import install_scoring
    from rlft.rollout.producer_worker import serve

    prompts = [tokenizer("1 + 2 =")["input_ids"]]
    results = {}
    for in_flight in (True, False):
        model = build_causal_lm(tokenizer, hidden_size=64).eval()
        install_scoring(model)
        weights = tmp_path / f"weights-{in_flight}.safetensors"
        save_file({n: p.detach() + 0.05 for n, p in model.named_parameters()}, str(weights))
        engine = HFGenerator(tokenizer, max_new_tokens=8)
        engine.return_logps = True
        inbox: queue.Queue = queue.Queue()
        for message in ({"type": "generate", "key": "r0", "prompt_ids": prompts, "num_generations": 2,
                         "greedy": False, "seed": 0},
                        {"type": "weights", "version": 1, "path": str(weights)},
                        {"type": "generate", "key": "r1", "prompt_ids": prompts, "num_generations": 2,
                         "greedy": False, "seed": 1},
                        {"type": "stop"}):
            inbox.put(message)
        channel = Sent()
        args = types.SimpleNamespace(inflight_weight_updates=in_flight)
        serve(model, engine, args, channel, inbox, 0, tmp_path)
        results[in_flight] = {m["key"]: m for m in channel.messages if m["type"] == "result"}
    flying, whole = results[True], results[False]
    width = max(len(t) for t in flying["r0"]["tokens"])
    assert flying["r0"]["version"] == 0 and flying["r0"]["step_versions"][:width] == [0] + [1] * (width - 1)
    assert flying["r1"]["version"] == 1 and set(flying["r1"]["step_versions"]) == {1}
    assert "step_versions" not in whole["r0"] and whole["r0"]["version"] == 0 and whole["r1"]["version"] == 1
    assert flying["r0"]["tokens"][0][0] == whole["r0"]["tokens"][0][0]  # the first token: version 0 in both


def test_an_async_run_with_in_flight_updates_trains_and_reports_each_tokens_version(tmp_path):
    """AsyncGRPOTrainer with inflight_weight_updates: rollouts carry per-token versions; the step reports how
    many tokens newer weights sampled and the token-mean staleness (which of them did depends on timing)."""
    from tests.test_async_grpo import rows_of, trained

    trained(tmp_path, "run", max_steps=3, inflight_weight_updates=True)
    rows = [r for r in rows_of(tmp_path / "run") if "loss" in r]
    assert len(rows) == 3
    for row in rows:
        assert 0.0 <= row["sampling/tokens_from_newer_weights"] <= 1.0
        assert row["sampling/policy_version_spread"] >= 0.0
        assert row["sample/staleness_mean"] <= row["sample/staleness_max"]


def test_in_flight_updates_at_a_fixed_token_give_the_same_run_twice_and_resume_exactly(tmp_path):
    """inflight_switch_tokens: newer weights are loaded only after that many tokens of a rollout, where the
    producer waits for the trainer's next message; the trainer's messages follow its schedule, so one seed gives
    one run: a second run, stopped at a checkpoint and resumed, equals the first (rows, timings aside)."""
    from rlft import AsyncGRPOTrainer
    from rlft.model.loading import shipped_policy_path
    from tests.helpers import addition_rows, correct_answer, has_answer_tags, stop_after
    from tests.test_async_grpo import async_config, rows_of, trained

    settings = dict(max_steps=3, save_steps=2, inflight_weight_updates=True, inflight_switch_tokens=2)
    trained(tmp_path, "a", **settings)
    rows = rows_of(tmp_path / "a")
    assert any(r.get("sampling/tokens_from_newer_weights", 0) > 0 for r in rows)  # weights did switch mid-rollout
    AsyncGRPOTrainer(str(shipped_policy_path()), [correct_answer, has_answer_tags],
                     async_config(tmp_path, "split", **settings), addition_rows(32), callbacks=[stop_after(2)]).train()
    trained(tmp_path, "split", resume=True, **settings)
    assert rows_of(tmp_path / "split") == rows
