"""The Triton tile kernels (rlft.core.tile_softmax.py), run by Triton's interpreter on the CPU
(TRITON_INTERPRET=1), against the float64 definitions: log-prob of the target, entropy, and the gradient of
any mix of the two; the torch path where Triton cannot run.

Triton reads TRITON_INTERPRET when it is imported, so the interpreted tests run in a pytest process of their
own, started by test_the_kernels_under_the_interpreter with the variable set."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rlft.core.logprobs import entropy_from_logits, selective_log_softmax

pytest.importorskip("triton")

from rlft.core import tile_softmax  # noqa: E402
from rlft.core.tile_softmax import tile_stats, tile_stats_grad, triton_runs  # noqa: E402

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
interpreted = pytest.mark.skipif(not INTERPRETED, reason="run by test_the_kernels_under_the_interpreter")


def test_the_kernels_under_the_interpreter():
    if INTERPRETED:
        pytest.skip("this is that process")
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k",
                             "not under_the_interpreter and not cannot_run"],
                            env={**os.environ, "TRITON_INTERPRET": "1"}, cwd=Path(__file__).resolve().parents[1],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0 and " passed" in result.stdout and "skipped" not in result.stdout, \
        result.stdout[-3000:]


def definition(z64: torch.Tensor, targets: torch.Tensor, temperature: float):
    """float64, straight from the formulas: s = z / T, logp_y = s_y - logsumexp(s), H = -sum p log p."""
    s = z64 / temperature
    logp_all = torch.log_softmax(s, dim=-1)
    logp = torch.where(targets >= 0, logp_all.gather(1, targets.clamp(min=0)[:, None])[:, 0], 0.0)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


def tile(dtype, rows=7, vocab=2500, seed=0):
    generator = torch.Generator().manual_seed(seed)
    z = (torch.randn(rows, vocab, generator=generator, dtype=torch.float64) * 3).to(dtype)
    targets = torch.randint(0, vocab, (rows,), generator=generator)
    targets[2] = -1  # a padded row
    return z, targets


@pytest.mark.parametrize("dtype, bound", [(torch.float64, 1e-12), (torch.float32, 2e-5), (torch.bfloat16, 2e-5)])
@interpreted
def test_the_kernels_forward_equals_the_float64_definition(dtype, bound):
    """Vocabulary 2,500: three blocks of 1,024, the last partial; bfloat16 tiles accumulate in float32, so they
    meet the definition on their own (rounded) values to float32 rounding."""
    z, targets = tile(dtype)
    assert triton_runs(z)
    logp, entropy, lse, mean_s = tile_stats(z, targets, temperature=0.7)
    want_logp, want_entropy = definition(z.double(), targets, 0.7)
    assert logp.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert (logp.double() - want_logp).abs().max() < bound and logp[2] == 0
    assert (entropy.double() - want_entropy).abs().max() < bound
    assert (lse.double() - torch.logsumexp(z.double() / 0.7, -1)).abs().max() < bound


@pytest.mark.parametrize("dtype, bound", [(torch.float64, 1e-12), (torch.float32, 1e-6)])
@interpreted
def test_the_kernels_gradient_equals_autograd_on_the_definition(dtype, bound):
    """d(sum a_r logp_r + b_r H_r)/dz from the forward's lse and E_p[s], one pass, against float64 autograd
    of the definition (a padded row's target gets no gradient; its entropy's does)."""
    z, targets = tile(dtype, seed=1)
    generator = torch.Generator().manual_seed(2)
    a, b = torch.randn(7, generator=generator, dtype=torch.float64), torch.randn(7, generator=generator,
                                                                                  dtype=torch.float64)
    z64 = z.double().requires_grad_(True)
    logp, entropy = definition(z64, targets, 1.3)
    (want,) = torch.autograd.grad((a * logp + b * entropy).sum(), z64)
    _, _, lse, mean_s = tile_stats(z, targets, temperature=1.3)
    got = tile_stats_grad(z, targets, lse, mean_s, a, b, temperature=1.3)
    assert got.dtype == dtype and (got.double() - want).abs().max() < bound


@pytest.mark.skipif(INTERPRETED, reason="a CPU tensor runs the kernels here")
def test_where_triton_cannot_run_the_torch_path_gives_the_same_numbers(monkeypatch):
    """No interpreter on a CPU tensor, or no triton at all: the torch formulas, equal to rlft's chunked
    log-probs and entropy (rlft/core/logprobs.py)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    z, targets = tile(torch.float32)
    assert not triton_runs(z)
    logp, entropy, lse, mean_s = tile_stats(z, targets, 0.7)
    safe = targets.clamp(min=0)
    reference = selective_log_softmax(z[None], safe[None], 0.7)[0]
    assert torch.allclose(logp[targets >= 0], reference[targets >= 0], atol=1e-6)
    assert torch.allclose(entropy, entropy_from_logits(z[None], 0.7)[0], atol=1e-5)
    monkeypatch.setattr(tile_softmax, "_triton", lambda: None)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not triton_runs(z)
    again = tile_stats(z, targets, 0.7)
    assert all(torch.equal(x, y) for x, y in zip(again, (logp, entropy, lse, mean_s)))
    with pytest.raises(ValueError, match=r"must be \[rows, vocab\]"):
        tile_stats(z[None], targets)


def head_inputs(dtype, n=10, h=8, v=1100, seed=3):
    """A head over two vocabulary blocks (1,024 + 76), with a bias and a kept set on every other row (the
    target among them on some, not on others: the full distribution there)."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g, dtype=torch.float64).to(dtype)
    weight = torch.randn(v, h, generator=g, dtype=torch.float64).to(dtype)
    bias = torch.randn(v, generator=g, dtype=torch.float64).to(dtype)
    targets = torch.randint(0, v, (n,), generator=g)
    kept = torch.stack([torch.randperm(v, generator=g)[:5] for _ in range(n)])
    kept[::2, 0] = targets[::2]
    kept[1::4] = -1
    return hidden, weight, bias, targets, kept, torch.randn(n, generator=g, dtype=torch.float64), \
        torch.randn(n, generator=g, dtype=torch.float64)


def with_and_without_kernels(monkeypatch, module, run, bound: float = 1e-10, off=()) -> int:
    """`run()` (a list of outputs) with `module`'s kernels, counting their launches, then on the torch path
    (Triton said not to run in `module` and the modules in `off`): each output equal to the other, in dtype
    and to `bound` times its largest value. Returns the launches of the kernel run."""
    launches = []
    kernels = module._kernels()
    monkeypatch.setattr(module, "_kernels", lambda: launches.append(1) or kernels)
    got = run()
    count = len(launches)
    for other in (module, *off):
        monkeypatch.setattr(other, "triton_runs", lambda z: False)
    want = run()
    assert len(got) == len(want)
    for have, expected in zip(got, want):
        assert have.dtype == expected.dtype
        torch.testing.assert_close(have, expected, rtol=0, atol=bound * max(1.0, float(expected.abs().max())))
    return count


def fused_head_run(case, dtype, a, b, hidden, weight, bias, targets, kept):
    """(log-probs, entropy, log kept mass, gradients) of one fused-head forward + backward: a frozen head
    (dL/dh in the forward), a trainable head whose loss reads the entropy (recomputing backward), or a
    trainable head given dL/dlog p (its gradients in the forward)."""
    from rlft.core.fused_head import fused_kept_logprobs

    trains = case != "frozen"
    h = hidden.clone().requires_grad_()
    w, c = weight.clone().requires_grad_(trains), bias.clone().requires_grad_(trains)
    predict = None
    if case == "predicted":
        def predict(logps, rows):
            return a[rows].to(logps.dtype)
    logps, entropy, logmass = fused_kept_logprobs(
        h, w, targets, kept, c, temperature=0.7, logit_scale=0.5, softcap=None if case == "frozen" else 3.0,
        entropy=True, tile=3, entropy_grad=case == "entropy", predict=predict)
    loss = (a.to(logps.dtype) * logps).sum()
    if case == "entropy":
        loss = loss + (b.to(entropy.dtype) * entropy).sum()
    grads = torch.autograd.grad(loss, (h, w, c) if trains else (h,))
    return [logps.detach(), entropy.detach(), logmass] + list(grads)


@pytest.mark.parametrize("case", ["frozen", "entropy", "predicted"])
@pytest.mark.parametrize("dtype, bound", [(torch.float64, 1e-10), (torch.float32, 2e-5)])
@interpreted
def test_the_fused_head_takes_the_kernels_and_equals_its_torch_path(monkeypatch, case, dtype, bound):
    """rlft/core/fused_head.py with the Triton kernels (what a GPU runs) against the same head on its torch
    path: log-probs renormalised over kept ids, entropy, kept mass, and dL/dh, dL/dW, dL/db for the three ways
    the head forms its gradients; the kernels ran (counted)."""
    *inputs, a, b = head_inputs(dtype)
    launches = with_and_without_kernels(monkeypatch, tile_softmax, lambda: fused_head_run(case, dtype, a, b, *inputs),
                                        bound)
    assert launches >= 8  # 4 tiles: their statistics, and their gradients (forward or backward)


@interpreted
def test_a_kernel_that_fails_to_launch_leaves_the_torch_path_with_one_warning(monkeypatch):
    """A device the kernels do not compile for: warned once, the same values from the torch path, and the
    kernels skipped from then on."""
    monkeypatch.setattr(tile_softmax, "_FAILED", [])

    def broken():
        raise RuntimeError("no such device")
    monkeypatch.setattr(tile_softmax, "_kernels", broken)
    z, targets = tile(torch.float32)
    with pytest.warns(RuntimeWarning, match="no such device"):
        got = tile_stats(z, targets, 0.7)
    assert not triton_runs(z)
    want = tile_softmax._stats_torch(z, targets, 0.7)
    assert all(torch.equal(x, y) for x, y in zip(got, want))


@interpreted
def test_rlft_triton_0_switches_the_kernels_off(monkeypatch):
    z, _ = tile(torch.float32)
    assert triton_runs(z)
    monkeypatch.setenv("RLFT_TRITON", "0")
    assert not triton_runs(z)


def divergence_definition(z_s64, z_t64, beta):
    """float64 GKD divergence from its formulas (rlft/core/distill.py: divergence_from_logprobs)."""
    from rlft.core.distill import divergence_from_logprobs

    log_ps, log_pt = torch.log_softmax(z_s64, -1), torch.log_softmax(z_t64, -1)
    return divergence_from_logprobs(log_ps, log_pt, beta), -(log_ps.exp() * log_ps).sum(-1), \
        -(log_pt.exp() * log_pt).sum(-1)


def divergence_tile(dtype, seed=4, rows=6, vocab=2100):
    """A student tile and a teacher tile 40 columns wider (a padded teacher head: only the first V are read)."""
    g = torch.Generator().manual_seed(seed)
    z_s = (torch.randn(rows, vocab, generator=g, dtype=torch.float64) * 2).to(dtype)
    wide = (torch.randn(rows, vocab + 40, generator=g, dtype=torch.float64) * 2).to(dtype)
    return z_s, wide[:, :vocab]


@pytest.mark.parametrize("beta", [0.0, 0.3, 1.0])
@pytest.mark.parametrize("dtype, bound", [(torch.float64, 1e-12), (torch.float32, 2e-5), (torch.bfloat16, 2e-5)])
@interpreted
def test_the_divergence_kernels_equal_the_float64_definition(beta, dtype, bound):
    """GKD's D at beta 0 (forward KL), 0.3 (the mixture: a second pass) and 1 (reverse KL), both entropies,
    and D's gradient in the student's logits against float64 autograd of the definition (rows weighted by
    an upstream gradient)."""
    from rlft.core.tile_divergence import divergence_grad, divergence_stats

    z_s, z_t = divergence_tile(dtype)
    assert triton_runs(z_s) and z_t.stride(0) == 2140
    z_s64 = z_s.double().requires_grad_()
    want_d, want_hs, want_ht = divergence_definition(z_s64, z_t.double(), beta)
    d, h_s, h_t, lse_s, lse_t, kl_sm = divergence_stats(z_s, z_t, beta)
    for got, want in ((d, want_d), (h_s, want_hs), (h_t, want_ht)):
        assert (got.double() - want.detach()).abs().max() < bound
    upstream = torch.linspace(-1, 2, z_s.shape[0], dtype=torch.float64)
    (want_grad,) = torch.autograd.grad((want_d * upstream).sum(), z_s64)
    grad = divergence_grad(z_s, z_t, lse_s, lse_t, d, kl_sm, upstream, beta)
    assert grad.dtype == dtype
    grad_bound = bound if dtype != torch.bfloat16 else 1e-2  # written back in bfloat16
    assert (grad.double() - want_grad).abs().max() < grad_bound * max(1.0, float(want_grad.abs().max()))


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
@interpreted
def test_the_tiled_divergence_takes_the_kernels_and_equals_its_torch_path(monkeypatch, beta):
    """rlft/core/distill.py's tiled divergence (a student and a teacher head, softcapping and a logit scale on
    the student, a teacher head padded past the vocabulary) with the kernels against its torch path: D, both
    entropies, and the student's dL/dh, dL/dW, dL/db."""
    from rlft.core import tile_divergence
    from rlft.core.distill import Head, tiled_divergence

    g = torch.Generator().manual_seed(9)
    n, h_s, h_t, vocab = 7, 6, 5, 1100
    hidden_s = torch.randn(n, h_s, generator=g, dtype=torch.float64)
    hidden_t = torch.randn(n, h_t, generator=g, dtype=torch.float64)
    weight_s, bias_s = torch.randn(vocab, h_s, generator=g, dtype=torch.float64), torch.randn(vocab, generator=g,
                                                                                             dtype=torch.float64)
    teacher = Head(torch.randn(vocab + 30, h_t, generator=g, dtype=torch.float64), vocab=vocab)
    upstream = torch.randn(n, generator=g, dtype=torch.float64)

    def run():
        params = [hidden_s.clone().requires_grad_(), weight_s.clone().requires_grad_(),
                  bias_s.clone().requires_grad_()]
        student = Head(params[1], params[2], scale=0.8, softcap=4.0)
        out = tiled_divergence(params[0], hidden_t, student, teacher, beta, temperature=0.9, tile=3)
        grads = torch.autograd.grad((out.value * upstream).sum(), params)
        return [out.value.detach(), out.entropy, out.teacher_entropy, *grads]

    assert with_and_without_kernels(monkeypatch, tile_divergence, run) == 6  # 3 tiles, forward and backward


@pytest.mark.parametrize("dtype, bound", [(torch.float64, 1e-12), (torch.float32, 2e-5), (torch.bfloat16, 2e-5)])
@interpreted
def test_the_support_kernels_equal_the_float64_definition(dtype, bound):
    """rlft/core/tile_buckets.py: lse, entropy and the tail's logsumexp outside a support of 6 ids per row
    (one row's support the whole of a small vocabulary: no tail), and c p_v + [v not in S] g exp(z_v - lse_out)."""
    from rlft.core.tile_buckets import support_grad, support_stats

    for vocab, rows in ((2100, 5), (6, 2)):
        g = torch.Generator().manual_seed(6)
        z = (torch.randn(rows, vocab, generator=g, dtype=torch.float64) * 3).to(dtype)
        ids = torch.stack([torch.randperm(vocab, generator=g)[:6] for _ in range(rows)])
        inside = torch.zeros(rows, vocab, dtype=torch.bool).scatter_(-1, ids, True)
        z64 = z.double()
        lse, entropy, lse_out = support_stats(z, inside)
        want_out = torch.logsumexp(z64.masked_fill(inside, float("-inf")), -1)
        assert (lse.double() - torch.logsumexp(z64, -1)).abs().max() < bound
        log_p = torch.log_softmax(z64, -1)
        assert (entropy.double() - -(log_p.exp() * log_p).sum(-1)).abs().max() < bound
        finite = torch.isfinite(want_out)
        assert torch.equal(torch.isfinite(lse_out), finite) and finite.any() == (vocab > 6)
        if finite.any():
            assert (lse_out.double()[finite] - want_out[finite]).abs().max() < bound
        c, g_tail = torch.randn(rows, generator=g, dtype=torch.float64), torch.randn(rows, generator=g,
                                                                                   dtype=torch.float64)
        g_tail = torch.where(finite, g_tail, 0.0)
        want = log_p.exp() * c[:, None] + torch.where(inside, 0.0, (z64 - want_out[:, None]).exp()) * g_tail[:, None]
        got = support_grad(z, inside, lse, lse_out, c, g_tail)
        assert got.dtype == dtype
        assert (got.double() - want).abs().max() < (bound if dtype != torch.bfloat16 else 1e-2)


@pytest.mark.parametrize("beta, tail", [(0.0, True), (0.5, True), (1.0, False)])
@interpreted
def test_the_sparse_divergence_takes_the_kernels_and_equals_its_torch_path(monkeypatch, beta, tail):
    """rlft/core/sparse_distill.py (a served teacher's top-k and sampled token; the tail bucket or the
    renormalised support) with the kernels against its torch path: D, both entropies, dL/dh, dL/dW, dL/db."""
    from rlft.core import tile_buckets
    from rlft.core.distill import Head
    from rlft.core.sparse_distill import sparse_divergence

    g = torch.Generator().manual_seed(11)
    n, h, vocab, k = 7, 6, 1100, 5
    hidden = torch.randn(n, h, generator=g, dtype=torch.float64)
    weight, bias = torch.randn(vocab, h, generator=g, dtype=torch.float64), torch.randn(vocab, generator=g,
                                                                                       dtype=torch.float64)
    teacher = torch.log_softmax(torch.randn(n, vocab, generator=g, dtype=torch.float64) * 2, -1)
    ids = torch.cat([teacher.topk(k, -1).indices, torch.full((n, 1), -1)], -1)
    ids[::2, k] = torch.randint(0, vocab, (n,), generator=g)[::2]  # a sampled token beyond the top k
    ids[::2, k] = torch.where((ids[::2, :k] == ids[::2, k:]).any(-1), -1, ids[::2, k])
    logps = teacher.gather(-1, ids.clamp(min=0)).masked_fill(ids < 0, 0.0)
    upstream = torch.randn(n, generator=g, dtype=torch.float64)

    def run():
        params = [hidden.clone().requires_grad_(), weight.clone().requires_grad_(), bias.clone().requires_grad_()]
        out = sparse_divergence(params[0], Head(params[1], params[2], scale=1.2), ids, logps, beta, 0.8, tail,
                                tile=3)
        return [out.value.detach(), out.entropy, out.teacher_entropy,
                *torch.autograd.grad((out.value * upstream).sum(), params)]

    assert with_and_without_kernels(monkeypatch, tile_buckets, run) == 6  # 3 tiles, forward and backward


@pytest.mark.parametrize("tail", [True, False])
@interpreted
def test_the_self_distillation_top_k_takes_the_kernels_and_equals_its_torch_path(monkeypatch, tail):
    """rlft/core/self_distill.py's top-k divergence (the student's own top 4 at each position, the teacher's
    log-probs there) with the kernels against its torch path: D, both full entropies, the student's gradients."""
    from rlft.core import tile_buckets
    from rlft.core.distill import Head
    from rlft.core.self_distill import topk_divergence

    g = torch.Generator().manual_seed(13)
    n, h, vocab = 7, 6, 1100
    hidden_s, hidden_t = (torch.randn(n, h, generator=g, dtype=torch.float64) for _ in range(2))
    weight = torch.randn(vocab, h, generator=g, dtype=torch.float64)
    teacher = Head(weight + 0.3 * torch.randn(vocab, h, generator=g, dtype=torch.float64))
    upstream = torch.randn(n, generator=g, dtype=torch.float64)

    def run():
        params = [hidden_s.clone().requires_grad_(), weight.clone().requires_grad_()]
        out = topk_divergence(params[0], hidden_t, Head(params[1]), teacher, 4, 0.5, 0.9, tail, tile=3)
        return [out.value.detach(), out.entropy, out.teacher_entropy,
                *torch.autograd.grad((out.value * upstream).sum(), params)]

    # (the teacher's statistics by the softmax kernel: off too on the torch path)
    assert with_and_without_kernels(monkeypatch, tile_buckets, run, off=(tile_softmax,)) == 6  # 3 tiles, both ways
