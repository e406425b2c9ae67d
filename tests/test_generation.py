"""HFGenerator: the prompt prefilled once per group gives the tokens of a full prefill."""

from __future__ import annotations

import pytest
import torch

from rlft import GRPOConfig
from tests.helpers import addition_rows


def test_prompt_prefilled_once_per_group_generates_the_same_tokens(shipped_policy_dir):
    """Greedy decoding from the shared prompt cache equals a full prefill, prompts of different lengths."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlft.rollout.hf import HFGenerator

    model = AutoModelForCausalLM.from_pretrained(shipped_policy_dir)
    tokenizer = AutoTokenizer.from_pretrained(shipped_policy_dir)
    prompts = [tokenizer(tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False))
               ["input_ids"] for r in addition_rows(6)]
    prompts[1] = prompts[1][3:]  # a shorter prompt: left padding inside the shared cache
    shared = HFGenerator(tokenizer, 12)(model, prompts, 3, greedy=True)
    full = HFGenerator(tokenizer, 12, shared_prompt_prefill=False)(model, prompts, 3, greedy=True)
    assert torch.equal(shared.completion_ids, full.completion_ids)
    assert torch.equal(shared.completion_mask, full.completion_mask)
    torch.manual_seed(0)
    sampled = HFGenerator(tokenizer, 12)(model, prompts, 3)
    torch.manual_seed(0)
    assert torch.equal(sampled.completion_ids, HFGenerator(tokenizer, 12, shared_prompt_prefill=False)(
        model, prompts, 3).completion_ids)


def test_cache_implementation_is_checked_and_static_skips_sharing():
    from rlft.config import ConfigError
    from rlft.rollout.hf import HFGenerator

    with pytest.raises(ConfigError, match="cache_implementation='statik' is not allowed; choose one of None"):
        GRPOConfig(output_dir="x", cache_implementation="statik")
    assert not HFGenerator(None, 8, cache_implementation="static").shared_prompt_prefill
