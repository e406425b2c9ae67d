"""Model FLOPs of a decoder-only transformer, for model FLOPs utilisation (MFU).

Counting follows Kaplan et al. 2020 ("Scaling Laws for Neural Language Models", arXiv:2001.08361,
sec. 2.1) and PaLM's MFU (Chowdhery et al. 2022, arXiv:2204.02311, appendix B): a matmul with a
weight of n parameters costs 2n FLOPs per token forward; backward costs twice the forward, so
training costs 3x forward. Model FLOPs count the work the model needs, not what the hardware does:
recomputation (gradient checkpointing) and padding are not counted, so they show up as lower
utilisation.

Per token, forward, with hidden size h, L layers, q heads and k key/value heads of size d, MLP width
m:
    attention projections   2 (h q d + 2 h k d + q d h)
    attention scores        4 q d t   for a token attending to t positions (Q K^T and attn V);
                            causal: the token at position t (1-based) attends to t positions
    MLP (gated, 3 matrices) 2 * 3 h m; a mixture of experts: 2 * 3 h m_e per active expert
                            + 2 h E (router), + 2 * 3 h m_s + 2 h for a shared expert (every
                            layer counted as a MoE layer)
    LM head                 2 h V, only at positions whose logits are computed (rlft's fused
                            scoring projects completion positions only; generation projects one
                            position per new token)
Embedding lookups cost nothing.
"""

from __future__ import annotations

from collections.abc import Sequence


def _text_config(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def layer_flops_per_token(config) -> float:
    """Forward FLOPs of all layers' matmuls for one token, attention scores excluded."""
    c = _text_config(config)
    h, q = c.hidden_size, c.num_attention_heads
    k = getattr(c, "num_key_value_heads", None) or q
    d = getattr(c, "head_dim", None) or h // q
    attention = 2 * (h * q * d + 2 * h * k * d + q * d * h)
    active = getattr(c, "num_experts_per_tok", None)
    if active:
        experts = getattr(c, "num_local_experts", None) or getattr(c, "num_experts", None) or active
        width = getattr(c, "moe_intermediate_size", None) or c.intermediate_size
        mlp = active * 2 * 3 * h * width + 2 * h * experts
        shared = getattr(c, "shared_expert_intermediate_size", None)
        if shared:  # Qwen2-MoE's always-on expert and its sigmoid gate
            mlp += 2 * 3 * h * shared + 2 * h
    else:
        mlp = 2 * 3 * h * c.intermediate_size
    return float(c.num_hidden_layers * (attention + mlp))


def attention_score_flops(config, start: int, end: int) -> float:
    """Forward attention-score FLOPs of the tokens at positions start+1 .. end of one causal
    sequence (each attends to every position up to its own): 4 q d L * sum_{t=start+1}^{end} t."""
    c = _text_config(config)
    q = c.num_attention_heads
    d = getattr(c, "head_dim", None) or c.hidden_size // q
    positions = (end * (end + 1) - start * (start + 1)) / 2
    return 4.0 * q * d * c.num_hidden_layers * positions


def lm_head_flops(config, positions: int) -> float:
    c = _text_config(config)
    return 2.0 * c.hidden_size * c.vocab_size * positions


def scoring_flops(config, prompt_lengths: Sequence[int], completion_lengths: Sequence[int]) -> float:
    """Forward FLOPs of scoring completions: every prompt + completion token through the layers, the
    LM head at the completion positions only. Training (forward + backward) is 3x this."""
    per_token = layer_flops_per_token(config)
    total = 0.0
    for p, c in zip(prompt_lengths, completion_lengths, strict=True):
        total += (p + c) * per_token + attention_score_flops(config, 0, p + c) + lm_head_flops(config, c)
    return total


def generation_flops(config, prompt_lengths: Sequence[int], completion_lengths: Sequence[int],
                     group: int = 1) -> float:
    """Forward FLOPs of sampling: each prompt prefilled once per group of `group` consecutive rows
    (its completions share it; the LM head at its last position), then every new token through the
    layers and the LM head."""
    per_token = layer_flops_per_token(config)
    total = 0.0
    for row, (p, c) in enumerate(zip(prompt_lengths, completion_lengths, strict=True)):
        if row % group == 0:
            total += p * per_token + attention_score_flops(config, 0, p) + lm_head_flops(config, 1)
        total += c * per_token + attention_score_flops(config, p, p + c) + lm_head_flops(config, c)
    return total


def mfu(flops: float, seconds: float, peak_flops_per_second: float) -> float:
    """Model FLOPs utilisation in percent: achieved model FLOP/s over the device's peak."""
    if seconds <= 0 or peak_flops_per_second <= 0:
        return float("nan")
    return 100.0 * flops / (seconds * peak_flops_per_second)
