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


def _engine_and_prompts(shipped_policy_dir, count: int = 2):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(shipped_policy_dir)
    tokenizer = AutoTokenizer.from_pretrained(shipped_policy_dir)
    prompts = [tokenizer(tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False))
               ["input_ids"] for r in addition_rows(count)]
    return model, tokenizer, prompts


def test_rlfts_token_sampler_draws_from_the_distribution_generates_multinomial_does(shipped_policy_dir):
    """4,000 completions of 2 tokens at temperature 1.5 with top-k 6: the joint frequencies of the two tokens
    drawn by rlft's TokenSampler and by generate's torch.multinomial agree (a two-sample chi-square far below its
    0.1% quantile), every token inside what top-k keeps; the same seed draws the same tokens."""
    from rlft.rollout.hf import HFGenerator

    model, tokenizer, prompts = _engine_and_prompts(shipped_policy_dir, 1)
    counts = []
    for draw in (True, False):
        torch.manual_seed(0)
        engine = HFGenerator(tokenizer, 2, temperature=1.5, top_k=6, draw_tokens=draw)
        rollout = engine(model, prompts, 4000)
        pairs = rollout.completion_ids[:, 0] * 100_000 + rollout.completion_ids[:, 1]
        counts.append({int(k): int(v) for k, v in zip(*torch.unique(pairs, return_counts=True))})
    keys = sorted(set(counts[0]) | set(counts[1]))
    a, b = (torch.tensor([c.get(k, 0) for k in keys], dtype=torch.float64) for c in counts)
    used = (a + b) >= 10  # cells with enough draws for the statistic
    chi2 = float((((a - b) ** 2) / (a + b))[used].sum())
    dof = int(used.sum()) - 1
    assert 3 < dof < 36 and chi2 < dof + 4 * (2 * dof) ** 0.5 + 10, (chi2, dof)
    assert len({k // 100_000 for k in keys}) <= 6  # top-k 6 on the first token
    torch.manual_seed(5)
    first = HFGenerator(tokenizer, 6)(model, prompts, 8).completion_ids
    torch.manual_seed(5)
    assert torch.equal(first, HFGenerator(tokenizer, 6)(model, prompts, 8).completion_ids)


def test_generate_samples_itself_where_it_must_and_every_configured_warper_is_applied(shipped_policy_dir):
    """Beams, assisted decoding and a watermark keep generate's own sampling; the model's generation config
    (here typical_p and min_p, which rlft's config does not set) is applied in rlft's chain, in generate's
    order, before the sampler; greedy takes no chain."""
    from transformers.generation import logits_process as lp

    from rlft.rollout.hf import HFGenerator, TokenSampler, draws_itself

    assert draws_itself({"num_beams": 1}) and draws_itself({})
    for settings in ({"num_beams": 2}, {"assistant_model": object()}, {"watermarking_config": {"bias": 2.0}},
                     {"prompt_lookup_num_tokens": 3}):
        assert not draws_itself(settings)
    model, tokenizer, prompts = _engine_and_prompts(shipped_policy_dir)
    model.generation_config.typical_p, model.generation_config.min_p = 0.9, 0.05
    sampling, _ = HFGenerator(tokenizer, 4, temperature=0.8, top_p=0.9, draw_tokens=True)._settings(
        model, greedy=False, device=torch.device("cpu"))
    assert sampling["do_sample"] is False and sampling["typical_p"] is None
    assert [type(p) for p in sampling["logits_processor"]] == [
        lp.TemperatureLogitsWarper, lp.TopPLogitsWarper, lp.MinPLogitsWarper, lp.TypicalLogitsWarper, TokenSampler]
    beams, _ = HFGenerator(tokenizer, 4, generation_kwargs={"num_beams": 2}, draw_tokens=True)._settings(
        model, greedy=False, device=torch.device("cpu"))
    assert beams["do_sample"] is True and "logits_processor" not in beams
    greedy, _ = HFGenerator(tokenizer, 4)._settings(model, greedy=True, device=torch.device("cpu"))
    assert greedy["do_sample"] is False and "logits_processor" not in greedy
    rollout = HFGenerator(tokenizer, 4, temperature=0.8, top_p=0.9, draw_tokens=True)(model, prompts, 3)
    assert rollout.completion_ids.shape[0] == 6


def test_rlft_draws_tokens_itself_from_a_large_vocabulary_and_leaves_a_small_one_to_generate(shipped_policy_dir):
    """By default (draw_tokens None) the sampler is rlft's from DRAW_FROM_VOCABULARY entries on (the shipped
    policy's 386 are below: generate's own torch.multinomial, so a seed gives transformers' and TRL's samples)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from rlft.rollout.hf import DRAW_FROM_VOCABULARY, HFGenerator, TokenSampler, vocabulary_size

    model, tokenizer, prompts = _engine_and_prompts(shipped_policy_dir, 1)
    small, _ = HFGenerator(tokenizer, 4)._settings(model, greedy=False, device=torch.device("cpu"))
    assert small["do_sample"] is True and "logits_processor" not in small
    torch.manual_seed(1)
    ours = HFGenerator(tokenizer, 6)(model, prompts, 4).completion_ids
    torch.manual_seed(1)
    ids = torch.tensor(prompts * 4)
    theirs = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=True,
                            top_k=0, top_p=1.0, temperature=1.0, pad_token_id=tokenizer.pad_token_id)
    assert torch.equal(ours[:, :4], theirs[:, ids.shape[1]:][:, :4])
    large = Qwen2ForCausalLM(Qwen2Config(vocab_size=DRAW_FROM_VOCABULARY, hidden_size=16, intermediate_size=32,
                                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1))
    sampling, _ = HFGenerator(tokenizer, 4)._settings(large, greedy=False, device=torch.device("cpu"))
    assert sampling["do_sample"] is False and isinstance(sampling["logits_processor"][-1], TokenSampler)
    head = large.get_output_embeddings().weight  # as ZeRO-3 leaves it outside a gather: empty, shape aside
    head.data, head.ds_shape = torch.empty(0), head.shape
    assert vocabulary_size(large) == DRAW_FROM_VOCABULARY
