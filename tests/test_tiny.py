"""Tiny models and tokenizers behave like hub artefacts across save/load round trips."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from rlft.tiny import build_causal_lm, build_sequence_classifier, build_tokenizer, save_tiny

TEXTS = [
    "<|im_start|>user\nWhat is 12+34?<|im_end|>\n<|im_start|>assistant\n<answer>46</answer><|im_end|>",
    "The answer is 1234567890, naïve café — ok?",
    "  spaces\n\nand\ttabs 's 're",
]


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_tokenizer_round_trip_gives_identical_ids_and_padding_side(tmp_path, arch):
    tokenizer = build_tokenizer(seed=0)
    model = build_causal_lm(tokenizer, arch=arch, hidden_size=64)
    save_tiny(model, tokenizer, tmp_path)
    reloaded = AutoTokenizer.from_pretrained(tmp_path)
    for text in TEXTS:
        assert reloaded(text)["input_ids"] == tokenizer(text)["input_ids"]
        assert reloaded.decode(reloaded(text)["input_ids"]) == text
    assert reloaded.padding_side == "left"
    assert reloaded.pad_token == "<|endoftext|>" and reloaded.eos_token == "<|im_end|>"


def test_digits_and_answer_tags_are_single_tokens():
    tokenizer = build_tokenizer(seed=0)
    ids = tokenizer("<answer>907</answer>", add_special_tokens=False)["input_ids"]
    assert tokenizer.convert_ids_to_tokens(ids) == ["<answer>", "9", "0", "7", "</answer>"]


def test_chat_template_renders_chatml_with_generation_prompt(tmp_path):
    tokenizer = build_tokenizer(seed=0)
    save_tiny(build_causal_lm(tokenizer, hidden_size=64), tokenizer, tmp_path)
    reloaded = AutoTokenizer.from_pretrained(tmp_path)
    text = reloaded.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                        add_generation_prompt=True)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_causal_lm_round_trip_gives_identical_logits(tmp_path, arch):
    tokenizer = build_tokenizer(seed=0)
    model = build_causal_lm(tokenizer, arch=arch, hidden_size=64).eval()
    save_tiny(model, tokenizer, tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert reloaded.config.model_type == arch
    ids = tokenizer(TEXTS[:2], return_tensors="pt", padding=True)
    with torch.no_grad():
        assert torch.equal(model(**ids).logits, reloaded(**ids).logits)


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_sequence_classifier_round_trip_gives_identical_scores(tmp_path, arch):
    tokenizer = build_tokenizer(seed=0)
    model = build_sequence_classifier(tokenizer, arch=arch).eval()
    save_tiny(model, tokenizer, tmp_path)
    reloaded = AutoModelForSequenceClassification.from_pretrained(tmp_path).eval()
    assert reloaded.config.num_labels == 1
    ids = tokenizer(TEXTS[:2], return_tensors="pt", padding=True)
    with torch.no_grad():
        scores = model(**ids).logits
        assert scores.shape == (2, 1)
        assert torch.equal(scores, reloaded(**ids).logits)


def test_shipped_policy_loads_and_is_small(shipped_policy_dir):
    model = AutoModelForCausalLM.from_pretrained(shipped_policy_dir)
    assert sum(p.numel() for p in model.parameters()) < 1_000_000
    size_bytes = sum(f.stat().st_size for f in shipped_policy_dir.iterdir())
    assert size_bytes < 4 * 2**20


def test_shipped_policy_heldout_accuracy_is_in_the_warm_start_band(shipped_policy_dir):
    from rlft.data.addition import greedy_accuracy, split_problems

    model = AutoModelForCausalLM.from_pretrained(shipped_policy_dir)
    tokenizer = AutoTokenizer.from_pretrained(shipped_policy_dir)
    accuracy = greedy_accuracy(model, tokenizer, split_problems()[1])
    assert 0.2 <= accuracy <= 0.5


def test_a_dense_policy_upcycled_without_noise_is_the_same_function_as_a_mixture_of_experts():
    """Sparse upcycling: every expert a copy of the dense MLP, the top-k weights renormalised to 1, the shared
    expert off, so the MoE computes what the dense model does whatever the router picks; with noise the
    experts differ (and routing matters) while staying close."""
    from rlft.model.loading import shipped_policy_path
    from rlft.model.routing import moe_routers
    from rlft.tiny import upcycle_to_moe

    dense = AutoModelForCausalLM.from_pretrained(shipped_policy_path())
    ids = torch.randint(3, 300, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = dense(ids).logits
        exact = upcycle_to_moe(dense, noise=0.0)
        noisy = upcycle_to_moe(dense, noise=0.05)
        assert type(exact).__name__ == "Qwen2MoeForCausalLM" and len(moe_routers(exact)) == 2
        torch.testing.assert_close(exact(ids).logits, want, atol=1e-4, rtol=0)
        gap = (noisy(ids).logits - want).abs().max().item()
    assert 1e-4 < gap < 1.0
