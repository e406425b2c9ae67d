"""Log-probs under truncated sampling, in float64: the distribution top-k / top-p / min-p sample from, built
explicitly from their definitions (top-k: the k likeliest tokens; top-p: the smallest set of likeliest tokens
holding mass p; min-p: tokens at least min_p times as likely as the likeliest), in either engine's order,
renormalised over what it keeps; the library's renormalised log-prob (dense and fused, with gradients) must be
that distribution's."""

from __future__ import annotations

import pytest
import torch

from rlft.core.fused_head import fused_kept_logprobs
from rlft.core.logprobs import finite_ids, kept_log_softmax

V = 40


def top_k_set(probs: torch.Tensor, k: int) -> torch.Tensor:
    order = probs.argsort(descending=True)
    keep = torch.zeros_like(probs, dtype=torch.bool)
    keep[order[:k]] = True
    return keep


def top_p_set(probs: torch.Tensor, p: float) -> torch.Tensor:
    order = probs.argsort(descending=True)
    before = torch.cumsum(probs[order], 0) - probs[order]  # mass of the likelier tokens
    keep = torch.zeros_like(probs, dtype=torch.bool)
    keep[order[before < p]] = True  # each token whose likelier ones hold less than p is needed
    return keep


def min_p_set(probs: torch.Tensor, min_p: float) -> torch.Tensor:
    return probs >= min_p * probs.max()


def truncated(z: torch.Tensor, steps: list[tuple[str, float]]) -> torch.Tensor:
    """The sampling distribution of one position: softmax(z) cut by each step in turn, each step on the
    distribution renormalised over what the steps before it kept."""
    keep = torch.ones_like(z, dtype=torch.bool)
    for name, value in steps:
        probs = torch.softmax(z.masked_fill(~keep, float("-inf")), 0)
        cut = {"top_k": top_k_set, "top_p": top_p_set, "min_p": min_p_set}[name](probs, value)
        keep = keep & cut
    return torch.softmax(z.masked_fill(~keep, float("-inf")), 0)


# transformers applies top-k, top-p, min-p; vLLM min-p, top-k, top-p (after temperature in both)
CASES = {"top_k": [("top_k", 5)], "top_p": [("top_p", 0.8)], "min_p": [("min_p", 0.1)],
         "transformers_order": [("top_k", 20), ("top_p", 0.8), ("min_p", 0.05)],
         "vllm_order": [("min_p", 0.05), ("top_k", 20), ("top_p", 0.8)]}


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_renormalised_log_prob_is_the_truncated_distributions(case):
    g = torch.Generator().manual_seed(0)
    temperature = 0.7
    logits = torch.randn(12, V, dtype=torch.float64, generator=g) * 2.5
    dists = torch.stack([truncated(row / temperature, CASES[case]) for row in logits])  # [12, V]
    targets = torch.multinomial(dists, 1, generator=g).squeeze(-1)
    kept = finite_ids(torch.log(dists))  # the sampler's kept ids, -1 padded
    expected = torch.log(dists.gather(-1, targets[:, None]).squeeze(-1))
    dense = kept_log_softmax(logits, targets, kept, temperature)
    assert torch.allclose(dense, expected, rtol=0, atol=1e-12)
    weight = torch.eye(V, dtype=torch.float64)  # hidden @ W^T = the logits themselves
    fused, _, logmass = fused_kept_logprobs(logits, weight, targets, kept, temperature=temperature, tile=5)
    assert torch.allclose(fused, expected, rtol=0, atol=1e-12)
    full = torch.softmax(logits / temperature, -1)
    assert torch.allclose(logmass.exp(), (full * (dists > 0)).sum(-1), rtol=0, atol=1e-12)
    assert (kept >= 0).sum(-1).tolist() == (dists > 0).sum(-1).tolist()


def test_a_position_without_kept_ids_or_whose_token_was_not_kept_scores_the_full_vocabulary():
    logits = torch.randn(3, V, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    targets = torch.tensor([4, 7, 9])
    kept = torch.tensor([[-1, -1], [1, 2], [9, 3]])  # none; 7 not kept; 9 kept
    full = torch.log_softmax(logits, -1).gather(-1, targets[:, None]).squeeze(-1)
    out = kept_log_softmax(logits, targets, kept)
    assert torch.allclose(out[:2], full[:2], atol=1e-12)
    assert out[2].item() == pytest.approx((logits[2, 9] - torch.logsumexp(logits[2, [9, 3]], 0)).item(), abs=1e-12)


@pytest.mark.parametrize("entropy", [False, True])
def test_the_fused_kept_path_equals_the_dense_one_with_gradients(entropy):
    g = torch.Generator().manual_seed(2)
    n, h = 9, 6
    hidden = torch.randn(n, h, dtype=torch.float64, generator=g, requires_grad=True)
    weight = torch.randn(V, h, dtype=torch.float64, generator=g, requires_grad=True)
    bias = torch.randn(V, dtype=torch.float64, generator=g, requires_grad=True)
    targets = torch.randint(0, V, (n,), generator=g)
    kept = torch.stack([torch.cat([targets[i:i + 1], torch.randperm(V, generator=g)[:4]]) for i in range(n)])
    kept[kept == kept[:, :1]] = -1  # no duplicates of the target
    kept[:, 0] = targets
    kept[2] = -1  # one position with no kept set: the full vocabulary
    upstream = torch.randn(n, dtype=torch.float64, generator=g)
    fused, ent, _ = fused_kept_logprobs(hidden, weight, targets, kept, bias, 0.9, 1.3, 4.0, entropy, 4)
    loss = (fused * upstream).sum() + (ent.sum() * 0.3 if entropy else 0)
    grads = torch.autograd.grad(loss, (hidden, weight, bias))
    z = 4.0 * torch.tanh((hidden @ weight.t() + bias) * 1.3 / 4.0)
    dense = kept_log_softmax(z, targets, kept, 0.9)
    reference = (dense * upstream).sum()
    if entropy:
        p = torch.softmax(z / 0.9, -1)
        reference = reference + 0.3 * -(p * torch.log(p)).sum()
    expected = torch.autograd.grad(reference, (hidden, weight, bias))
    assert torch.allclose(fused, dense, atol=1e-12)
    for got, want in zip(grads, expected):
        assert torch.allclose(got, want, atol=1e-10)
