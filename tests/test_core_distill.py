"""The distillation divergence (rlft/core/distill.py) against a float64 reference written from its definition
(arXiv:2306.13649's generalized JSD with TRL's beta): values and gradients, tiled = untiled."""

from __future__ import annotations

import pytest
import torch

from rlft.core.distill import Head, tiled_divergence


def reference(h_s, w_s, b_s, h_t, w_t, beta: float, temperature: float, scale_s=1.0, scale_t=1.0):
    """Explicit distributions: p = softmax(c (h W^T + b) / T); D from the probabilities themselves."""
    p_s = torch.softmax(scale_s * (h_s @ w_s.T + b_s) / temperature, dim=-1)
    p_t = torch.softmax(scale_t * (h_t @ w_t.T) / temperature, dim=-1)
    if beta == 0.0:
        return (p_t * torch.log(p_t / p_s)).sum(-1)
    if beta == 1.0:
        return (p_s * torch.log(p_s / p_t)).sum(-1)
    m = (1 - beta) * p_s + beta * p_t
    return beta * (p_t * torch.log(p_t / m)).sum(-1) + (1 - beta) * (p_s * torch.log(p_s / m)).sum(-1)


def inputs(seed: int = 0, n: int = 7, v: int = 50, h_s: int = 6, h_t: int = 9):
    g = torch.Generator().manual_seed(seed)
    make = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64)  # noqa: E731
    return make(n, h_s), make(v, h_s), make(v) * 0.1, make(n, h_t), make(v, h_t)


@pytest.mark.parametrize("beta", [0.0, 0.1, 0.5, 0.9, 1.0])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_divergence_and_its_gradients_are_the_definitions(beta, temperature):
    h_s, w_s, b_s, h_t, w_t = inputs()
    weights = [t.clone().requires_grad_() for t in (h_s, w_s, b_s)]
    want = reference(*weights, h_t, w_t, beta, temperature, scale_s=0.8, scale_t=1.3)
    g = torch.linspace(0.5, 1.5, h_s.shape[0], dtype=torch.float64)  # a weighted sum: per-row gradients
    want_grads = torch.autograd.grad((want * g).sum(), weights)
    mine = [t.clone().requires_grad_() for t in (h_s, w_s, b_s)]
    d, entropy, teacher_entropy = tiled_divergence(mine[0], h_t, Head(mine[1], mine[2], scale=0.8),
                                                   Head(w_t, scale=1.3), beta, temperature, tile=3)  # 3 tiles, 7 rows
    assert torch.allclose(d, want, atol=1e-12, rtol=0)
    p_s = torch.softmax(0.8 * (h_s @ w_s.T + b_s) / temperature, dim=-1)
    p_t = torch.softmax(1.3 * (h_t @ w_t.T) / temperature, dim=-1)
    assert torch.allclose(entropy, -(p_s * p_s.log()).sum(-1), atol=1e-12)
    assert torch.allclose(teacher_entropy, -(p_t * p_t.log()).sum(-1), atol=1e-12)
    for got, ref in zip(torch.autograd.grad((d * g).sum(), mine), want_grads):
        assert torch.allclose(got, ref, atol=1e-10, rtol=0)


def test_the_two_kls_and_the_mixture_behave_as_divergences():
    h_s, w_s, b_s, h_t, _ = inputs(1)
    same = Head(w_s, b_s)
    for beta in (0.0, 0.5, 1.0):  # a student equal to its teacher has nothing to learn
        d = tiled_divergence(h_s, h_s, same, same, beta).value
        assert d.abs().max() < 1e-12
    other = Head(torch.randn_like(w_s))
    d = {beta: tiled_divergence(h_s, h_s, same, other, beta)[0] for beta in (0.0, 0.5, 1.0)}
    assert all((x > 0).all() for x in d.values())
    assert (d[0.5] <= torch.log(torch.tensor(2.0, dtype=torch.float64))).all()  # JSD(1/2) <= log 2


def test_tiles_change_nothing_in_float32():
    h_s, w_s, b_s, h_t, w_t = (t.float() for t in inputs(2, n=33, v=300))
    runs = []
    for tile in (1, 8, 33):
        h = h_s.clone().requires_grad_()
        w = w_s.clone().requires_grad_()
        d = tiled_divergence(h, h_t, Head(w, b_s), Head(w_t), 0.5, 1.0, tile=tile).value
        d.sum().backward()
        runs.append((d.detach(), h.grad, w.grad))
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            assert torch.allclose(a, b, atol=1e-5, rtol=1e-5)


def test_bad_inputs_are_named():
    h_s, w_s, b_s, h_t, w_t = inputs()
    with pytest.raises(ValueError, match="vocabulary .* differ"):
        tiled_divergence(h_s, h_t, Head(w_s), Head(w_t[:-1]))
    with pytest.raises(ValueError, match=r"beta must be in \[0, 1\]"):
        tiled_divergence(h_s, h_t, Head(w_s), Head(w_t), beta=1.5)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_scoring_a_rollout_against_a_teacher_is_the_divergence_of_the_two_models_logits(beta):
    """score_rows(student, rollout, rows, teacher=...) reads both models' hidden states at the completion
    positions: the same divergence and student gradients as the two models' own [B, T, V] logits give."""
    from rlft.model.scoring import install_scoring, score_rows
    from rlft.tiny import build_causal_lm, build_tokenizer
    from tests.test_packing import rollout

    tokenizer = build_tokenizer(0, vocab_size=384)
    student = build_causal_lm(tokenizer, "qwen2", hidden_size=64, seed=0)
    teacher = build_causal_lm(tokenizer, "llama", hidden_size=96, seed=1)  # another architecture and width
    install_scoring(student)
    r = rollout(student.config.vocab_size, lengths=(6, 2, 1, 4, 5))
    scored = score_rows(student, r, slice(None), 0.8, teacher=teacher, beta=beta)
    mask = r.completion_mask.bool()
    cut = scored.divergence.shape[1]  # the batch's longest completion: padding columns are not scored
    assert cut == 6 and not mask[:, cut:].any()
    g = torch.linspace(0.5, 1.5, cut)
    (scored.divergence * g).sum().backward()
    got = {n: p.grad.clone() for n, p in student.named_parameters()}
    student.zero_grad()
    ids = torch.cat([r.prompt_ids, r.completion_ids], 1)
    attention = torch.cat([r.prompt_mask, r.completion_mask], 1)
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    width = r.completion_ids.shape[1]
    logits = [m(input_ids=ids, attention_mask=attention, position_ids=positions).logits[:, -(width + 1):-1]
              for m in (student, teacher)]  # [b, c, V]
    log_ps, log_pt = (torch.log_softmax(z.double() / 0.8, -1) for z in logits)
    want = torch.zeros(mask.shape, dtype=torch.float64)
    want[mask] = reference_from_logprobs(log_ps[mask], log_pt[mask].detach(), beta)
    want = want[:, :cut]
    assert torch.allclose(scored.divergence.double(), want, atol=1e-5)
    assert (scored.divergence[~mask[:, :cut]] == 0).all() and (want[mask[:, :cut]] > 0).all()
    (want * g).sum().backward()
    for name, param in student.named_parameters():
        assert torch.allclose(got[name], param.grad, atol=1e-5, rtol=1e-4), name


def reference_from_logprobs(log_ps, log_pt, beta: float):
    p_s, p_t = log_ps.exp(), log_pt.exp()
    if beta == 0.0:
        return (p_t * (log_pt - log_ps)).sum(-1)
    if beta == 1.0:
        return (p_s * (log_ps - log_pt)).sum(-1)
    m = (1 - beta) * p_s + beta * p_t
    return beta * (p_t * (log_pt - m.log())).sum(-1) + (1 - beta) * (p_s * (log_ps - m.log())).sum(-1)
