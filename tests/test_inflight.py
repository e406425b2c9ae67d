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


def test_a_weight_switch_mid_sequence_records_each_tokens_version_and_its_exact_behaviour_log_prob(tokenizer):
    """Weights change after the 5th token: tokens 0-4 come from version 0, the rest from version 1 reading the
    keys and values version 0 left in the cache. Each recorded log-prob equals a forward pass of that
    construction: version 0 over the prefix, version 1 over the rest on version 0's cache (a float64 model;
    the sampler records float32 log-probs, hence 2e-6)."""
    model, newer = two_versions(tokenizer)
    older = {name: p.detach().clone() for name, p in model.named_parameters()}
    engine = HFGenerator(tokenizer, max_new_tokens=12)
    engine.return_logps = True

    def pending():
        if len(switch.versions) == 5:  # after the logits of token 4
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
    load(model, older)
    cache = DynamicCache(config=model.config)
    before = logps_of(model, ids, mask, 0, prompt + 4, cache)[:, prompt - 1:]  # tokens 0-4
    load(model, newer)
    after = logps_of(model, ids, mask, prompt + 4, prompt + width - 1, cache)  # tokens 5.. on that cache
    want = torch.cat([before, after], dim=1)
    scored = rollout.completion_mask.bool()
    torch.testing.assert_close(rollout.sampling_logps[scored].double(), want[scored], atol=2e-6, rtol=0)
    # and not what either version alone gives
    for weights, part in ((newer, slice(0, 5)), (older, slice(5, None))):
        load(model, weights)
        alone = logps_of(model, ids, mask, 0, prompt + width - 1)[:, prompt - 1:]
        assert (alone[:, part][scored[:, part]] - want[:, part][scored[:, part]]).abs().max() > 1e-3
