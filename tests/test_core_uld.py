"""The Universal Logit Distillation loss (rlft/core/uld.py) against float64 constructions written from
the paper (Boizard et al. 2024, arXiv:2402.12030: the sorted probability vectors' L1 distance, the
closed form of the Wasserstein-1 distance under a uniform cost) and from the chain rule for merged
token groups."""

from __future__ import annotations

import pytest
import torch

from rlft.core.distill import Head
from rlft.core.uld import (
    Hybrid,
    align_by_byte_ends,
    build_pairs,
    matched_vocabulary,
    positional_groups,
    sorted_l1,
    spread,
    uld_distance,
)


def paper_uld(p: list[float], q: list[float]) -> float:
    """sum_i |p_(i) - q_(i)| over both vectors sorted in decreasing order, the shorter padded with 0."""
    a, b = sorted(p, reverse=True), sorted(q, reverse=True)
    size = max(len(a), len(b))
    a, b = a + [0.0] * (size - len(a)), b + [0.0] * (size - len(b))
    return sum(abs(x - y) for x, y in zip(a, b))


def test_sorted_l1_is_the_papers_distance_and_blind_to_relabelling():
    gen = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(5, 7, generator=gen, dtype=torch.float64), -1)
    q = torch.softmax(torch.randn(5, 11, generator=gen, dtype=torch.float64), -1)
    got = sorted_l1(p, q)
    for i in range(5):
        assert got[i].item() == pytest.approx(paper_uld(p[i].tolist(), q[i].tolist()), abs=1e-14)
    shuffled = q[:, torch.randperm(11, generator=gen)]
    assert torch.allclose(sorted_l1(p, shuffled), got, atol=1e-15)
    assert torch.allclose(sorted_l1(p, p), torch.zeros(5, dtype=torch.float64))
    assert torch.allclose(sorted_l1(q, p), got)  # symmetric


def test_byte_alignment_groups_runs_that_end_on_the_same_byte():
    # "hello world": student "hel|lo| wor|ld", teacher "hello| w|orld"
    s_ends, t_ends = [3, 5, 9, 11], [5, 7, 11]
    assert align_by_byte_ends(s_ends, t_ends) == ([[0, 1], [2, 3]], [[0], [1, 2]])
    # identical cuts: one group per token; a zero-width EOS at the end pairs with the other's
    assert align_by_byte_ends([2, 4, 4], [2, 4, 4]) == ([[0], [1], [2]], [[0], [1], [2]])
    # texts that disagree (a replaced byte): what is left is one last group
    assert align_by_byte_ends([1, 2, 3], [1, 4]) == ([[0], [1, 2]], [[0], [1]])
    assert align_by_byte_ends([1], []) == ([[0]], [[]])
    assert positional_groups(3, 2) == ([[0], [1]], [[0], [1]])


def chain_rule_groups(logp: torch.Tensor, tokens: list[int], groups: list[list[int]], strategy: str):
    """Merged group distributions from their definition: the varying token's distribution times the
    probabilities of the others' actual tokens (each clamped at 1e-8)."""
    out = []
    for group in groups:
        varying = group[0] if strategy == "observed" else group[-1]
        factor = torch.ones((), dtype=logp.dtype)
        for j in group:
            if j != varying:
                factor = factor * logp[j, tokens[j]].exp().clamp_min(1e-8)
        out.append(logp[varying].exp() * factor)
    return torch.stack(out)


@pytest.mark.parametrize("strategy", ["observed", "bayesian"])
@pytest.mark.parametrize("hybrid", [False, True])
def test_uld_distance_equals_the_float64_definition_value_and_gradient(strategy, hybrid):
    gen = torch.Generator().manual_seed(1)
    hs, ht, vs, vt = 6, 5, 9, 12
    w_s = torch.randn(vs, hs, generator=gen, dtype=torch.float64, requires_grad=True)
    w_t = torch.randn(vt, ht, generator=gen, dtype=torch.float64)
    # two rows: student 4 + 3 tokens, teacher 3 + 4 tokens
    h_s = torch.randn(7, hs, generator=gen, dtype=torch.float64, requires_grad=True)
    h_t = torch.randn(7, ht, generator=gen, dtype=torch.float64)
    tok_s, tok_t = [1, 4, 2, 8, 0, 3, 5], [7, 11, 2, 9, 0, 4, 6]
    rows = [align_by_byte_ends([2, 3, 6, 8], [3, 6, 8]), align_by_byte_ends([1, 4, 5], [1, 2, 4, 5])]
    temps = (0.8, 1.3)
    pairs = build_pairs(rows, [0, 4], [0, 3], 7, strategy)
    matched = Hybrid(torch.tensor([0, 3, 5]), torch.tensor([2, 7, 10]), 0.4, 0.9, 0.3) if hybrid else None

    lp_s = torch.log_softmax(h_s @ w_s.t() / temps[0], -1)
    lp_t = torch.log_softmax(h_t @ w_t.t() / temps[1], -1)
    want = []
    for (s_groups, t_groups), s0, t0 in zip(rows, [0, 4], [0, 3]):
        p = chain_rule_groups(lp_s, tok_s, [[s0 + i for i in g] for g in s_groups], strategy)
        q = chain_rule_groups(lp_t, tok_t, [[t0 + i for i in g] for g in t_groups], strategy)
        for i in range(p.shape[0]):
            if not hybrid:
                want.append(sorted_l1(p[i:i + 1], q[i:i + 1])[0])
                continue
            a, b = p[i, [0, 3, 5]].clamp_min(1e-8), q[i, [2, 7, 10]].clamp_min(1e-8)
            m = 0.7 * a + 0.3 * b  # the generalized JSD at beta 0.3
            jsd = 0.3 * (b * (b / m).log()).sum() + 0.7 * (a * (a / m).log()).sum()
            rest_s = [j for j in range(vs) if j not in (0, 3, 5)]
            rest_t = [j for j in range(vt) if j not in (2, 7, 10)]
            unmatched = sorted_l1(p[i:i + 1, rest_s], q[i:i + 1, rest_t])[0]  # (its value: the paper's)
            assert unmatched.item() == pytest.approx(paper_uld(p[i, rest_s].tolist(), q[i, rest_t].tolist()))
            want.append(0.4 * jsd + 0.9 * unmatched)
    want = torch.stack(want)

    token_logps_s = lp_s.gather(1, torch.tensor(tok_s)[:, None])[:, 0]
    token_logps_t = lp_t.gather(1, torch.tensor(tok_t)[:, None])[:, 0]
    got = uld_distance(h_s, Head(w_s), token_logps_s, h_t, Head(w_t), token_logps_t, pairs, temps, matched, tile=2)
    assert got.shape == want.shape == (6,)
    assert torch.allclose(got, want, atol=1e-12)
    weights = torch.arange(1.0, 7.0, dtype=torch.float64)
    g_got = torch.autograd.grad((got * weights).sum(), (h_s, w_s), retain_graph=True)
    g_want = torch.autograd.grad((want * weights).sum(), (h_s, w_s))
    for a, b in zip(g_got, g_want):
        assert torch.allclose(a, b, atol=1e-11)


def test_spread_shares_each_group_among_its_student_tokens_and_skips_the_rest():
    rows = [([[0, 1], [2]], [[0], [1, 2]]), ([[0], []], [[0], [1]])]  # an empty side is left out
    pairs = build_pairs(rows, [0, 3], [0, 3], 5, "bayesian")
    assert len(pairs) == 3 and pairs.s_base.tolist() == [1, 2, 3] and pairs.t_base.tolist() == [0, 2, 3]
    share = spread(torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64), pairs)
    assert share.tolist() == [0.5, 0.5, 2.0, 3.0, 0.0]
    with pytest.raises(ValueError, match="uld_token_merge_strategy must be one of"):
        build_pairs(rows, [0, 3], [0, 3], 5, "mean")


def test_matched_vocabulary_pairs_the_strings_both_sides_hold():
    assert matched_vocabulary({"a": 0, "b": 1, "c": 2}, {"c": 0, "x": 1, "a": 2}) == ([2, 0], [0, 2])


def test_no_group_gives_an_empty_distance_still_in_the_graph():
    h = torch.randn(2, 3, requires_grad=True)
    pairs = build_pairs([([], [])], [0], [0], 2, "observed")
    got = uld_distance(h, Head(torch.randn(4, 3)), torch.zeros(2), torch.randn(1, 3), Head(torch.randn(5, 3)),
                       torch.zeros(1), pairs)
    assert got.shape == (0,) and got.sum().requires_grad
