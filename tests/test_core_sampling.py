"""Inversion sampling (rlft/core/sampling.py) against its definition in float64: the draw for uniform U is the
smallest i with F(i) > U * F(V - 1), F the cumulative mass; zero-mass tokens are never drawn; the draws'
frequencies are the distribution's."""

from __future__ import annotations

import pytest
import torch

from rlft.core.sampling import inverse_cdf_sample


def reference(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    cdf = probs.double().cumsum(-1)
    return torch.searchsorted(cdf, (uniforms.double() * cdf[:, -1])[:, None], right=True).squeeze(1)


def dyadic_probs(rows: int, vocab: int, seed: int) -> torch.Tensor:
    """Masses k / 4096 with many zeros: every partial sum is exact in float32, so the definition has one answer."""
    g = torch.Generator().manual_seed(seed)
    counts = torch.randint(0, 8, (rows, vocab), generator=g) * (torch.rand(rows, vocab, generator=g) < 0.4)
    counts[:, 0] += 1  # at least one token of mass per row
    return counts.float() / 4096


@pytest.mark.parametrize("vocab,block", [(37, 8), (64, 8), (1000, 1024), (5000, 128)])
def test_the_draw_is_the_definitions_for_every_uniform(vocab, block):
    probs = dyadic_probs(6, vocab, seed=vocab)
    for seed in range(20):
        uniforms = torch.rand(6, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
        assert torch.equal(inverse_cdf_sample(probs, uniforms, block=block), reference(probs, uniforms))


def test_no_zero_mass_token_at_the_ends_of_the_unit_interval():
    """Zero mass before the first token of mass, between blocks, in the partial last block and after the
    last token of mass; U = 0 and the largest double below 1."""
    vocab, block = 45, 8
    probs = torch.zeros(3, vocab)
    probs[0, 5], probs[0, 30] = 0.25, 0.75  # zero blocks between, zero tail block
    probs[1, 41] = 2.0  # mass only in the partial last block, unnormalised
    probs[2, [0, 8, 16]] = 1e-30  # tiny masses
    low = torch.zeros(3, dtype=torch.float64)
    high = torch.full((3,), 1.0 - 2.0 ** -53, dtype=torch.float64)  # the largest double below 1
    assert inverse_cdf_sample(probs, low, block=block).tolist() == [5, 41, 0]
    assert inverse_cdf_sample(probs, high, block=block).tolist() == [30, 41, 16]
    uniforms = torch.rand(3, 2000, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    for row in range(3):
        drawn = inverse_cdf_sample(probs[row].expand(2000, vocab), uniforms[row], block=block)
        assert bool((probs[row][drawn] > 0).all())


def test_frequencies_are_the_distributions():
    """200,000 draws from ten tokens (two of mass zero): every frequency within 5 standard errors of its mass."""
    probs = torch.tensor([0.3, 0.0, 0.05, 0.15, 0.001, 0.2, 0.0, 0.099, 0.1, 0.1])
    n = 200_000
    torch.manual_seed(0)
    drawn = inverse_cdf_sample(probs.expand(n, 10), torch.rand(n, dtype=torch.float64), block=4)
    freq = torch.bincount(drawn, minlength=10).double() / n
    p = probs.double()
    assert freq[p == 0].sum() == 0
    assert bool(((freq - p).abs() <= 5 * (p * (1 - p) / n).sqrt() + 1e-12).all()), (freq, p)


@pytest.mark.parametrize("bad", [0.0, float("nan")])
def test_a_row_without_finite_mass_is_an_error_naming_it(bad):
    probs = torch.full((3, 20), 0.05)
    probs[2] = 0.0
    probs[2, 4] = bad
    with pytest.raises(ValueError, match="row 2 has no finite positive mass"):
        inverse_cdf_sample(probs, torch.rand(3, dtype=torch.float64))
