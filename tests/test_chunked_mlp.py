"""`mlp_chunk_size` (rlft/train/chunked_mlp.py): each decoder layer's MLP over a few positions at a time in
training forwards; log-probs and gradients are the unchunked ones (padded and packed, LoRA and full, with
and without gradient checkpointing), a GRPO step is the same step, a MoE block is refused by name."""

from __future__ import annotations

import pytest
import torch

from rlft.errors import ConfigError
from rlft.scoring import score_rows
from rlft.tiny import build_causal_lm, build_tokenizer
from rlft.train.chunked_mlp import chunk_mlps
from tests.helpers import assert_same_step, one_step_each, tiny_grpo_config
from tests.test_packing import rollout, scores_and_grads, tiny


@pytest.mark.parametrize("arch,lora,checkpointing", [("qwen2", False, True), ("llama", True, False),
                                                     ("llama", False, True), ("qwen2", True, False)])
@pytest.mark.parametrize("packing", [None, "prompts"])
def test_chunked_scores_and_gradients_are_the_whole_ones(arch, lora, checkpointing, packing):
    model = tiny(arch, lora, checkpointing)
    r = rollout(384)
    logps, entropy, grads = scores_and_grads(model, r, packing)
    seen = []
    layer = model.get_base_model() if lora else model
    mlp = layer.model.layers[0].mlp
    hook = mlp.down_proj.register_forward_hook(lambda m, i, o: seen.append(i[0].shape[-2]))
    assert chunk_mlps(model, 3) == len(layer.model.layers)
    chunked_logps, chunked_entropy, chunked_grads = scores_and_grads(model, r, packing)
    hook.remove()
    assert max(seen) == 3 and len(seen) > 2  # the MLP saw at most 3 positions at a time
    torch.testing.assert_close(chunked_logps, logps, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(chunked_entropy, entropy, atol=1e-5, rtol=1e-5)
    assert grads.keys() == chunked_grads.keys() and grads
    for name, grad in grads.items():
        torch.testing.assert_close(chunked_grads[name], grad, atol=1e-5, rtol=1e-4, msg=name)
    with torch.no_grad():  # a forward without gradient runs whole
        seen.clear()
        hook = mlp.down_proj.register_forward_hook(lambda m, i, o: seen.append(i[0].shape[-2]))
        score_rows(model, r, torch.arange(5))
        hook.remove()
        assert max(seen) > 3


def test_a_grpo_step_with_chunked_mlps_is_the_same_step(tmp_path, tiny_causal_dir):
    assert_same_step(*one_step_each(tmp_path, tiny_causal_dir, "mlp_chunk_size", (None, 4)))


def test_a_deep_copy_such_as_a_reference_runs_its_own_weights():
    import copy

    model = build_causal_lm(build_tokenizer(0, vocab_size=384), arch="qwen2", hidden_size=64)
    chunk_mlps(model, 2)
    copied = copy.deepcopy(model)
    with torch.no_grad():
        for p in copied.model.layers[0].mlp.parameters():
            p.zero_()
    hidden = torch.randn(1, 5, 64, requires_grad=True)
    assert not torch.allclose(copied.model.layers[0].mlp(hidden), model.model.layers[0].mlp(hidden))
    assert torch.count_nonzero(copied.model.layers[0].mlp(hidden)) == 0


def test_a_moe_block_and_a_bad_size_are_refused_by_name(tmp_path):
    moe = build_causal_lm(build_tokenizer(0, vocab_size=384), arch="qwen2_moe", hidden_size=64)
    with pytest.raises(ConfigError, match="Mixture-of-Experts"):
        chunk_mlps(moe, 16)
    with pytest.raises(ConfigError, match="mlp_chunk_size=0"):
        tiny_grpo_config(tmp_path, mlp_chunk_size=0)
