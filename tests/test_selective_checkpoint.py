"""recompute_attention: false (rlft/model/memory/selective_checkpoint.py): with gradient checkpointing, each layer's
attention output is kept from the forward and the backward's recomputation skips the attention kernel; the
log-probs and gradients are full recomputation's (padded and packed, Qwen2 and Llama, LoRA and full, with the
MLP in chunks), a model without a fused attention kernel is told, and bad combinations are named."""

from __future__ import annotations

import logging

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from rlft import GRPOConfig
from rlft.errors import ConfigError
from rlft.model.loading import enable_checkpointing
from rlft.model.memory.chunked_mlp import chunk_mlps
from rlft.model.memory.selective_checkpoint import AttentionKeeper, checkpointing_kwargs
from rlft.model.scoring import install_scoring
from rlft.tiny import build_causal_lm, build_tokenizer
from tests.helpers import assert_same_step, one_step_each
from tests.test_packing import rollout, scores_and_grads


class AttentionCalls(TorchDispatchMode):
    """Counts calls of the fused attention kernels (forward), whoever makes them."""

    def __init__(self, keeper: AttentionKeeper):
        super().__init__()
        self.kernels, self.calls = keeper.kernels, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += func in self.kernels
        return func(*args, **(kwargs or {}))


def counted(model, r, packing, keeper: AttentionKeeper) -> int:
    """Fused attention kernel calls of one forward + backward, counted from the backbone's forward on (the
    packing before it makes tensor subclasses, which a dispatch mode does not allow)."""
    calls = AttentionCalls(keeper)
    backbone = (model.get_base_model() if hasattr(model, "get_base_model") else model).model
    handle = backbone.register_forward_pre_hook(lambda *args: calls.__enter__() and None)
    try:
        scores_and_grads(model, r, packing)
    finally:
        handle.remove()
        calls.__exit__(None, None, None)
    return calls.calls


def model_with(arch: str, lora: bool, keeper: AttentionKeeper | None, attn: str = "sdpa"):
    torch.manual_seed(0)
    model = build_causal_lm(build_tokenizer(0, vocab_size=384), arch=arch, hidden_size=64)
    model.config._attn_implementation = attn
    model.train()
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    args = GRPOConfig(output_dir="unused", gradient_checkpointing=True, recompute_attention=keeper is None)
    enable_checkpointing(model, checkpointing_kwargs(args, keeper))
    install_scoring(model)
    return model


@pytest.mark.parametrize("arch,lora,chunk", [("qwen2", False, None), ("llama", True, None), ("qwen2", True, 3)])
@pytest.mark.parametrize("packing", [None, "prompts"])
def test_kept_attention_gives_full_recomputations_values_without_running_attention_again(arch, lora, chunk, packing):
    r = rollout(384)
    full = model_with(arch, lora, None)
    keeper = AttentionKeeper()
    kept = model_with(arch, lora, keeper)
    if chunk:
        chunk_mlps(full, chunk)
        chunk_mlps(kept, chunk)
    logps, entropy, grads = scores_and_grads(full, r, packing)
    kept_logps, kept_entropy, kept_grads = scores_and_grads(kept, r, packing)
    assert keeper.kept > 0
    calls_full, calls_kept = counted(full, r, packing, keeper), counted(kept, r, packing, keeper)
    layers = full.config.num_hidden_layers
    assert calls_full == 2 * calls_kept and calls_kept % layers == 0  # no attention re-run in the backward
    assert keeper.kept == 2 * calls_kept
    torch.testing.assert_close(kept_logps, logps, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(kept_entropy, entropy, atol=1e-6, rtol=1e-6)
    assert grads.keys() == kept_grads.keys() and grads
    for name, grad in grads.items():
        torch.testing.assert_close(kept_grads[name], grad, atol=1e-6, rtol=1e-5, msg=name)


def test_a_model_without_a_fused_attention_kernel_is_told_once(caplog):
    told = []
    keeper = AttentionKeeper(told.append)
    model = model_with("qwen2", False, keeper, attn="eager")
    r = rollout(384)
    scores_and_grads(model, r, None)
    scores_and_grads(model, r, None)
    assert keeper.kept == 0 and len(told) == 1 and "kept no attention output" in told[0]


def test_an_attention_kernel_with_dropout_is_recomputed_not_kept():
    """Kept, a kernel that draws dropout would leave the recomputation's RNG behind, and the layer's later
    random ops would draw other masks: it is recomputed (and said) and the gradients stay the full ones."""
    grads, told = [], []
    for keeper in (None, AttentionKeeper(told.append)):
        model = model_with("qwen2", False, keeper)
        for layer in model.model.layers:
            layer.self_attn.attention_dropout = 0.2
        torch.manual_seed(5)
        grads.append(scores_and_grads(model, rollout(384), None)[2])
    assert keeper.kept == 0 and len(told) == 1
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, atol=1e-6, rtol=1e-5, msg=name)


def test_bad_combinations_are_named(tmp_path):
    with pytest.raises(ConfigError, match="recompute_attention=False keeps attention outputs through gradient"):
        GRPOConfig(output_dir=str(tmp_path), recompute_attention=False, gradient_checkpointing=False)
    with pytest.raises(ConfigError, match="needs non-reentrant checkpointing"):
        GRPOConfig(output_dir=str(tmp_path), recompute_attention=False, gradient_checkpointing=True,
                   gradient_checkpointing_kwargs={"use_reentrant": True})
    with pytest.raises(ConfigError, match="through gradient"):  # transformers 5's names count the same
        GRPOConfig(output_dir=str(tmp_path), recompute_attention=False, activation_checkpointing=False)
    with pytest.raises(ConfigError, match="needs non-reentrant checkpointing"):
        GRPOConfig(output_dir=str(tmp_path), recompute_attention=False,
                   activation_checkpointing_kwargs={"use_reentrant": True})


def test_a_grpo_step_keeping_attention_is_the_same_step(tmp_path, tiny_causal_dir, caplog):
    with caplog.at_level(logging.WARNING, logger="rlft"):
        full, kept = one_step_each(tmp_path, tiny_causal_dir, "recompute_attention", (True, False))
    assert "kept no attention output" not in caplog.text
    assert_same_step(full, kept)
