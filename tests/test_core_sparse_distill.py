"""The top-k (served-teacher) divergence of rlft/core/sparse_distill.py against its definition in float64:
both distributions coarse-grained to the teacher's support plus one tail bucket, the generalized JSD between
them, its gradients; the data-processing bound D(k) <= D(k') <= D(full vocabulary)."""


import pytest
import torch

from rlft.core.distill import Head, divergence_from_logprobs
from rlft.core.sparse_distill import sparse_divergence

V, H, N = 40, 12, 9


def problem(seed: int = 0, temperature: float = 1.0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=g, dtype=torch.float64)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64) * 0.7
    bias = torch.randn(V, generator=g, dtype=torch.float64) * 0.3
    teacher = torch.log_softmax(torch.randn(N, V, generator=g, dtype=torch.float64) * 2.0, dim=-1)
    sampled = torch.randint(0, V, (N,), generator=g)
    return hidden, weight, bias, teacher, sampled


def support(teacher: torch.Tensor, sampled: torch.Tensor, k: int):
    """What the server answers: the teacher's top k and the sampled token (-1 padding), their log-probs."""
    top = teacher.topk(k, dim=-1).indices
    ids = torch.full((teacher.shape[0], k + 1), -1, dtype=torch.long)
    for i in range(teacher.shape[0]):
        row = top[i].tolist() + ([] if int(sampled[i]) in top[i].tolist() else [int(sampled[i])])
        ids[i, :len(row)] = torch.tensor(row)
    return ids, teacher.gather(-1, ids.clamp(min=0)).masked_fill(ids < 0, 0.0)


def reference(hidden, weight, bias, ids, teacher_full, beta, temperature, tail=True):
    """D per position from the definition: buckets S_1..S_m (and the rest), both sides' masses summed."""
    z = (hidden @ weight.T + bias) / temperature
    ps = torch.softmax(z, dim=-1)
    out = []
    for i in range(hidden.shape[0]):
        chosen = [int(t) for t in ids[i] if t >= 0]
        pt = teacher_full[i].exp()
        s = [ps[i, j] for j in chosen]
        t = [float(pt[j]) for j in chosen]
        if tail:
            s.append(1 - sum(s))
            t.append(1 - sum(t))
        else:
            s = [x / sum(s) for x in s]
            t = [x / sum(t) for x in t]
        out.append(gkd(s, t, beta))
    return torch.stack(out)


def gkd(s: list, t: list[float], beta: float) -> torch.Tensor:
    """The paper's divergence between two discrete distributions, written out: the student's masses `s` as
    tensors (so autograd gives the definition's gradient), the teacher's `t` as numbers."""
    def kl(p, q):
        return sum(a * (torch.log(a) - torch.log(b)) for a, b in zip(p, q) if bool(a.detach() > 0))
    ts = [torch.tensor(x, dtype=torch.float64) for x in t]
    if beta == 0:
        return kl(ts, s)
    if beta == 1:
        return kl(s, ts)
    m = [(1 - beta) * a + beta * b for a, b in zip(s, ts)]
    return beta * kl(ts, m) + (1 - beta) * kl(s, m)


@pytest.mark.parametrize("beta", [0.0, 0.3, 0.5, 1.0])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_value_and_gradients_equal_the_definition(beta, temperature):
    hidden, weight, bias, teacher, sampled = problem()
    ids, logps = support(teacher, sampled, k=4)
    leaves = [x.clone().requires_grad_(True) for x in (hidden, weight, bias)]
    got = sparse_divergence(leaves[0], Head(leaves[1], leaves[2]), ids, logps, beta, temperature, tile=4)
    refs = [x.clone().requires_grad_(True) for x in (hidden, weight, bias)]
    want = reference(*refs, ids, teacher, beta, temperature)
    torch.testing.assert_close(got.value, want, rtol=1e-10, atol=1e-12)
    w = torch.rand(N, dtype=torch.float64)
    grads = torch.autograd.grad((got.value * w).sum(), leaves)
    wants = torch.autograd.grad((want * w).sum(), refs)
    for a, b in zip(grads, wants):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)
    ps = torch.log_softmax((hidden @ weight.T + bias) / temperature, dim=-1)
    torch.testing.assert_close(got.entropy, -(ps.exp() * ps).sum(-1))


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_renormalised_without_tail(beta):
    hidden, weight, bias, teacher, sampled = problem(1)
    ids, logps = support(teacher, sampled, k=3)
    got = sparse_divergence(hidden, Head(weight, bias), ids, logps, beta, tail=False)
    torch.testing.assert_close(got.value, reference(hidden, weight, bias, ids, teacher, beta, 1.0, tail=False))


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_a_lower_bound_that_tightens_with_k_and_is_exact_on_the_whole_vocabulary(beta):
    hidden, weight, bias, teacher, sampled = problem(2)
    head = Head(weight, bias)
    values = [sparse_divergence(hidden, head, *support(teacher, sampled, k), beta).value for k in (1, 3, 10, 30)]
    student = torch.log_softmax(hidden @ weight.T + bias, dim=-1)
    exact = divergence_from_logprobs(student, teacher, beta)
    for low, high in zip(values, [*values[1:], exact]):
        assert bool((low <= high + 1e-12).all())
    everything = torch.arange(V).expand(N, V)
    whole = sparse_divergence(hidden, head, everything, teacher.gather(-1, everything), beta).value
    torch.testing.assert_close(whole, exact)


def test_float32_model_tiles_and_bad_support():
    hidden, weight, bias, teacher, sampled = problem(3)
    ids, logps = support(teacher, sampled, k=5)
    head = Head(weight.float(), bias.float())
    one = sparse_divergence(hidden.float(), head, ids, logps.float(), 0.5, tile=2).value
    whole = sparse_divergence(hidden.float(), head, ids, logps.float(), 0.5).value
    assert one.dtype == torch.float32
    torch.testing.assert_close(one, whole)
    torch.testing.assert_close(one.double(), sparse_divergence(hidden, Head(weight, bias), ids, logps, 0.5).value,
                               rtol=1e-4, atol=1e-6)
    unplaced = ids.clone()
    unplaced[0, 0] = -1  # padding in column 0: no answer at that position
    with pytest.raises(ValueError, match="no teacher token"):
        sparse_divergence(hidden, Head(weight, bias), unplaced, logps)
    with pytest.raises(ValueError, match="vocabulary has 40 tokens"):
        sparse_divergence(hidden, Head(weight, bias), ids + V, logps)
    with pytest.raises(ValueError, match="must agree"):
        sparse_divergence(hidden, Head(weight, bias), ids[:, :2], logps)
