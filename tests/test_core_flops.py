"""Model FLOPs (rlft/core/flops.py) against torch's own FLOP counter on real architectures, the causal attention
sum, generation vs scoring, and the MFU a GRPO step logs."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen2MoeConfig

from rlft.core.flops import (
    attention_score_flops,
    generation_flops,
    layer_flops_per_token,
    lm_head_flops,
    mfu,
    scoring_flops,
)

SHAPE = dict(vocab_size=1000, hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2)


@pytest.mark.parametrize("config", [Qwen2Config(**SHAPE), LlamaConfig(**SHAPE, head_dim=8)],
                         ids=["qwen2", "llama-head_dim"])
def test_layer_and_head_flops_equal_torchs_count_of_a_forward(config):
    """Eager attention computes the full S x S scores, so torch counts 4 q d L S^2 for them (not causal)."""
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    length = 10
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(torch.randint(0, 1000, (1, length)), logits_to_keep=length)
    head_dim = getattr(config, "head_dim", None) or 16
    full_scores = 4 * config.num_attention_heads * head_dim * config.num_hidden_layers * length**2
    assert counter.get_total_flops() == length * layer_flops_per_token(config) + full_scores + \
        lm_head_flops(config, length)


def test_moe_flops_count_active_and_shared_experts_and_the_router():
    config = Qwen2MoeConfig(**SHAPE, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                            shared_expert_intermediate_size=48)
    attention = 2 * (64 * 4 * 16 + 2 * 64 * 2 * 16 + 4 * 16 * 64)
    mlp = 2 * (2 * 3 * 64 * 32) + 2 * 64 * 8 + 2 * 3 * 64 * 48 + 2 * 64
    assert layer_flops_per_token(config) == 2 * (attention + mlp)


def test_causal_attention_scores_sum_over_positions():
    config = Qwen2Config(**SHAPE)
    per_position = 4 * 4 * 16 * 2
    assert attention_score_flops(config, 0, 7) == per_position * sum(range(1, 8))
    assert attention_score_flops(config, 3, 7) == per_position * sum(range(4, 8))


def test_generation_projects_one_more_position_and_shares_a_groups_prefill():
    config = Qwen2Config(**SHAPE)
    prompts, completions = [5, 5, 7, 7], [3, 4, 2, 6]
    scored = scoring_flops(config, prompts, completions)
    assert generation_flops(config, prompts, completions) == pytest.approx(scored + 4 * lm_head_flops(config, 1))
    shared = generation_flops(config, prompts, completions, group=2)
    prefill = lambda p: p * layer_flops_per_token(config) + attention_score_flops(config, 0, p) + \
        lm_head_flops(config, 1)  # noqa: E731
    assert generation_flops(config, prompts, completions) - shared == pytest.approx(prefill(5) + prefill(7))


def test_mfu_is_achieved_over_peak_in_percent():
    assert mfu(50e9, 2.0, 50e9) == 50.0
    assert math.isnan(mfu(1.0, 0.0, 1e9))


def test_a_grpo_step_logs_the_utilisation_of_each_phase(tmp_path, shipped_policy_dir):
    from rlft import GRPOTrainer
    from rlft.telemetry.perf import matmul_peak
    from tests.helpers import addition_rows, correct_answer, tiny_grpo_config

    trainer = GRPOTrainer(str(shipped_policy_dir), [correct_answer], tiny_grpo_config(tmp_path, max_steps=1),
                          addition_rows(16))
    trainer.train()
    row = next(r for r in trainer.state.log_history if "perf/mfu_fwd_bwd" in r)
    assert 0 < row["perf/mfu_fwd_bwd"] < 100 and 0 < row["perf/mfu_generation"] < 100
    assert row["perf/forwarded_tok_s_fwd_bwd"] > 0 and row["perf/generated_tok_s"] > 0
    assert trainer.throughput.peak == matmul_peak("cpu", torch.float32) > 1e9  # any CPU does a GFLOP/s
