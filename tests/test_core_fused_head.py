"""Fused LM-head scoring: per-token log-probs and entropy from hidden states, tile by tile, never [N, V].

The reference is written from the definition (log-softmax of the scaled, softcapped, tempered logits) in float64;
gradients are checked against autograd of that reference and with torch.autograd.gradcheck.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from rlft.core.fused_head import fused_token_logprobs, tile_positions


def reference(hidden, weight, bias, targets, temperature, scale, softcap):
    z = (hidden @ weight.T + (0 if bias is None else bias)) * scale  # [N, V]
    if softcap:
        z = softcap * torch.tanh(z / softcap)
    log_probs = torch.log_softmax(z / temperature, dim=-1)
    picked = log_probs.gather(-1, targets[:, None]).squeeze(-1)
    return picked, -(log_probs.exp() * log_probs).sum(-1)


def inputs(n=9, h=6, v=13, seed=0, bias=True):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(v, h, generator=g, dtype=torch.float64, requires_grad=True)
    b = torch.randn(v, generator=g, dtype=torch.float64, requires_grad=True) if bias else None
    return hidden, weight, b, torch.randint(0, v, (n,), generator=g)


@pytest.mark.parametrize("temperature,scale,softcap,tile", [(1.0, 1.0, None, 4), (0.7, 1.0, None, 1),
                                                            (1.3, 0.5, 2.5, 3), (1.0, 2.0, 30.0, 100)])
def test_values_and_gradients_equal_the_float64_definition(temperature, scale, softcap, tile):
    hidden, weight, bias, targets = inputs()
    logps, entropy = fused_token_logprobs(hidden, weight, targets, bias, temperature, scale, softcap, True, tile)
    want_logps, want_entropy = reference(hidden, weight, bias, targets, temperature, scale, softcap)
    torch.testing.assert_close(logps, want_logps, rtol=0, atol=1e-12)
    torch.testing.assert_close(entropy, want_entropy, rtol=0, atol=1e-12)
    up, ue = torch.randn(len(targets), dtype=torch.float64), torch.randn(len(targets), dtype=torch.float64)
    got = torch.autograd.grad((logps * up).sum() + (entropy * ue).sum(), (hidden, weight, bias))
    want = torch.autograd.grad((want_logps * up).sum() + (want_entropy * ue).sum(), (hidden, weight, bias))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10)


def test_gradcheck_with_and_without_bias_and_entropy():
    for bias in (True, False):
        hidden, weight, b, targets = inputs(n=5, h=4, v=7, bias=bias)
        args = (hidden, weight) + ((b,) if bias else ())

        def both(h, w, *rest, targets=targets):
            return fused_token_logprobs(h, w, targets, rest[0] if rest else None, 0.8, 1.2, 3.0, True, 2)

        assert torch.autograd.gradcheck(both, args)
        assert torch.autograd.gradcheck(lambda h, w, *r: both(h, w, *r)[0], args)  # log-probs alone


def test_an_empty_batch_gives_empty_results_connected_to_the_graph():
    hidden, weight, _, _ = inputs(n=0)
    logps, entropy = fused_token_logprobs(hidden, weight, torch.zeros(0, dtype=torch.long), entropy=True)
    assert logps.shape == (0,) and entropy.shape == (0,)
    logps.sum().backward()
    assert hidden.grad is not None


def test_low_precision_weights_score_in_float32():
    hidden, weight, bias, targets = inputs(n=8, h=16, v=50)
    logps, _ = fused_token_logprobs(hidden.detach().bfloat16(), weight.detach().bfloat16(), targets,
                                    bias.detach().bfloat16(), tile=3)
    assert logps.dtype == torch.float32
    h, w, b = hidden.bfloat16().double(), weight.bfloat16().double(), bias.bfloat16().double()
    want, _ = reference(h, w, b, targets, 1.0, 1.0, None)
    # A bf16 matmul (float32 accumulation) rounds each logit to bf16: off by at most half its unit in the last
    # place, 2^-8 |z|; log p = z_t - logsumexp(z) then carries at most that of z_t plus the largest: 2^-7 max|z|
    # (+ float32's own rounding). Seen: 0.023 for max|z| ~ 6.
    bound = 2.0 ** -7 * (h @ w.T + b).abs().max().item() + 1e-5
    torch.testing.assert_close(logps.double(), want, rtol=0, atol=bound)


class LargestTensor(TorchDispatchMode):
    """Records the largest tensor any operation produces (with `vocab`: among those with a vocabulary-sized
    dimension, i.e. logits and their gradients)."""

    def __init__(self, vocab: int | None = None):
        super().__init__()
        self.vocab, self.largest = vocab, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for value in out if isinstance(out, tuple | list) else [out]:
            if isinstance(value, torch.Tensor) and (self.vocab is None or self.vocab in value.shape):
                self.largest = max(self.largest, value.numel())
        return out


def test_no_tensor_of_positions_times_vocabulary_is_built_forward_or_backward():
    n, h, v, tile = 64, 8, 500, 8
    hidden = torch.randn(n, h, requires_grad=True)
    weight = torch.randn(v, h, requires_grad=True)
    targets = torch.randint(0, v, (n,))
    with LargestTensor() as watch:
        logps, entropy = fused_token_logprobs(hidden, weight, targets, entropy=True, tile=tile)
        (logps.sum() + entropy.sum()).backward()
    assert watch.largest <= max(tile * v, v * h)  # one tile of logits, or the head's own gradient; never n * v
    assert watch.largest < n * v


def test_tiles_are_sized_to_the_vocabulary():
    assert tile_positions(151_936) == (1 << 24) // 151_936
    assert tile_positions(10) == (1 << 24) // 10 and tile_positions(1 << 30) == 1
    assert tile_positions(151_936, device="cuda") == (1 << 26) // 151_936  # larger tiles fill a GPU


def kept_reference(hidden, weight, bias, targets, kept, temperature, scale, softcap):
    """log p_K(y): the log-softmax over each row's kept ids where its target is among them, else the full one."""
    z = (hidden @ weight.T + (0 if bias is None else bias)) * scale
    if softcap:
        z = softcap * torch.tanh(z / softcap)
    z = z / temperature
    full = torch.log_softmax(z, dim=-1).gather(-1, targets[:, None]).squeeze(-1)
    inside = (kept >= 0) & (kept == targets[:, None]).any(-1, keepdim=True)  # [N, K]
    renormalised = z.gather(-1, targets[:, None]).squeeze(-1) - torch.logsumexp(
        z.gather(-1, kept.clamp(min=0)).masked_fill(~inside, float("-inf")), dim=-1)
    return torch.where(inside.any(-1), renormalised, full)


class Tiles:
    """Counts the tiles of logits formed (rlft.core.fused_head._logits) and the tiles whose dL/dh a forward
    forms (HeadGrads.add)."""

    def __init__(self, monkeypatch):
        from rlft.core import fused_head

        self.logits = self.bases = 0
        logits, add = fused_head._logits, fused_head.HeadGrads.add

        def counted_logits(*args, **kwargs):
            self.logits += 1
            return logits(*args, **kwargs)

        def counted_add(grads, *args, **kwargs):
            self.bases += 1
            return add(grads, *args, **kwargs)

        monkeypatch.setattr(fused_head, "_logits", counted_logits)
        monkeypatch.setattr(fused_head.HeadGrads, "add", counted_add)


@pytest.mark.parametrize("temperature,scale,softcap,tile,bias,truncated", [
    (1.0, 1.0, None, 4, False, False), (0.7, 1.0, None, 1, True, True), (1.3, 0.5, 2.5, 3, True, False),
    (0.9, 2.0, 30.0, 100, False, True)])
def test_a_frozen_head_forms_dh_in_the_forward_and_its_backward_recomputes_no_logits(
        monkeypatch, temperature, scale, softcap, tile, bias, truncated):
    """LoRA's case: W and b take no gradient, so dL/dh = g ([j = y] - p) W dz/du is formed per unit g in the
    forward; the backward only scales it. Exact against the float64 definition, logged entropy unused."""
    from rlft.core.fused_head import fused_kept_logprobs

    hidden, weight, b, targets = inputs(n=9, h=6, v=13, bias=bias)
    weight, b = weight.detach(), None if b is None else b.detach()
    g = torch.Generator().manual_seed(3)
    kept = None
    if truncated:  # 4 kept ids per row (-1 padding in some), the target among them in most rows
        kept = torch.stack([torch.randperm(13, generator=g)[:4] for _ in targets])
        kept[::2, 0] = targets[::2]
        kept[1::3, 3] = -1
    tiles = Tiles(monkeypatch)
    logps, entropy, _ = fused_kept_logprobs(hidden, weight, targets, kept, b, temperature, scale, softcap,
                                            True, tile)
    n_tiles = -(-len(targets) // tile)
    assert tiles.logits == n_tiles and tiles.bases == n_tiles  # each tile formed once, its dL/dh with it
    up = torch.randn(len(targets), dtype=torch.float64, generator=g)
    (got,) = torch.autograd.grad((logps * up).sum() + 0 * entropy.detach().sum(), hidden)
    assert tiles.logits == n_tiles  # the backward formed no logits
    want_logps = kept_reference(hidden, weight, b, targets, kept if truncated else torch.full_like(
        targets[:, None], -1), temperature, scale, softcap)
    torch.testing.assert_close(logps, want_logps, rtol=0, atol=1e-12)
    (want,) = torch.autograd.grad((want_logps * up).sum(), hidden)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-10)


def test_a_frozen_heads_entropy_gradient_is_exact_announced_or_not(monkeypatch):
    hidden, weight, b, targets = inputs(n=7, h=5, v=11)
    weight, b = weight.detach(), b.detach()
    want_logps, want_entropy = reference(hidden, weight, b, targets, 0.8, 1.0, None)
    up, ue = torch.linspace(-1, 1, 7, dtype=torch.float64), torch.linspace(2, 0.5, 7, dtype=torch.float64)
    (want,) = torch.autograd.grad((want_logps * up).sum() + (want_entropy * ue).sum(), hidden)
    for announced in (True, False):
        tiles = Tiles(monkeypatch)
        logps, entropy = fused_token_logprobs(hidden, weight, targets, b, 0.8, entropy=True, tile=3,
                                              entropy_grad=announced)
        assert tiles.bases == (0 if announced else 3)  # announced: no dL/dh basis formed in the forward
        (got,) = torch.autograd.grad((logps * up).sum() + (entropy * ue).sum(), hidden)
        assert tiles.logits == 6  # the backward recomputed each tile for the entropy's term
        torch.testing.assert_close(got, want, rtol=0, atol=1e-10)


def test_no_basis_without_gradient_or_when_the_head_trains(monkeypatch):
    hidden, weight, _, targets = inputs()
    tiles = Tiles(monkeypatch)
    with torch.no_grad():  # old-policy and reference scoring
        fused_token_logprobs(hidden, weight.detach(), targets, tile=4)
    logps, _ = fused_token_logprobs(hidden, weight, targets, tile=4)  # full fine-tuning: W's gradient too
    assert tiles.bases == 0
    logps.sum().backward()
    assert tiles.bases == 3 and weight.grad is not None  # the backward's tiles, as before


def clipped_token_loss(logps, old, advantages, weights, epsilon=0.2):
    """A GRPO-style loss whose gradient at each token depends on that token's log-prob alone: the clipped
    surrogate -min(r A, clip(r) A) with constant per-token weights (a normaliser)."""
    ratio = torch.exp(logps - old)
    return -(torch.minimum(ratio * advantages, ratio.clamp(1 - epsilon, 1 + epsilon) * advantages)
             * weights).sum()


def predictor(loss_of):
    def predict(logps, rows):  # the loss's dL/dlog p at these log-probs, read at a tile's rows
        with torch.enable_grad():
            x = logps.detach().requires_grad_()
            return torch.autograd.grad(loss_of(x), x)[0][rows]
    return predict


@pytest.mark.parametrize("temperature,scale,softcap,tile,bias,truncated,c", [
    (1.0, 1.0, None, 4, True, False, 1.0), (0.7, 1.0, None, 1, False, True, 2.0),
    (1.3, 0.5, 2.5, 3, True, True, 0.25), (0.9, 2.0, 30.0, 100, True, False, 3.0)])
def test_a_trainable_heads_gradients_come_from_the_forward_with_a_predicted_loss_gradient(
        monkeypatch, temperature, scale, softcap, tile, bias, truncated, c):
    """Full fine-tuning with a token-separable loss: the forward forms dL/dh, dL/dW, dL/db from the loss's
    predicted g; the backward recomputes no logits and scales them by c (here the loss times c, as gradient
    accumulation or a process count scales it). Exact against the float64 definition."""
    from rlft.core.fused_head import fused_kept_logprobs

    hidden, weight, b, targets = inputs(n=9, h=6, v=13, bias=bias)
    g = torch.Generator().manual_seed(5)
    kept = None
    if truncated:
        kept = torch.stack([torch.randperm(13, generator=g)[:4] for _ in targets])
        kept[::2, 0] = targets[::2]
    old = kept_reference(hidden, weight, b, targets, kept if truncated else torch.full_like(targets[:, None], -1),
                         temperature, scale, softcap).detach() + 0.3 * torch.randn(9, dtype=torch.float64,
                                                                                   generator=g)
    advantages = torch.randn(9, dtype=torch.float64, generator=g)
    weights = torch.rand(9, dtype=torch.float64, generator=g)

    def loss_of(x):
        return clipped_token_loss(x, old, advantages, weights)

    tiles = Tiles(monkeypatch)
    logps, _, _ = fused_kept_logprobs(hidden, weight, targets, kept, b, temperature, scale, softcap, True, tile,
                                      predict=predictor(loss_of))
    n_tiles = -(-len(targets) // tile)
    assert tiles.logits == n_tiles and tiles.bases == n_tiles
    params = (hidden, weight) + ((b,) if bias else ())
    got = torch.autograd.grad(c * loss_of(logps), params)
    assert tiles.logits == n_tiles  # the backward formed no logits
    want_logps = kept_reference(hidden, weight, b, targets, kept if truncated else torch.full_like(
        targets[:, None], -1), temperature, scale, softcap)
    torch.testing.assert_close(logps, want_logps, rtol=0, atol=1e-12)
    want = torch.autograd.grad(c * loss_of(want_logps), params)
    for a, w in zip(got, want):
        torch.testing.assert_close(a, w, rtol=0, atol=1e-10)


def test_a_loss_gradient_other_than_the_predicted_one_is_recomputed_exactly(monkeypatch):
    """A loss that is not token-separable (a sequence-level ratio: each token's gradient reads the others'
    log-probs) predicts the wrong g in the forward; the backward sees it, says so, and recomputes."""
    hidden, weight, b, targets = inputs(n=8, h=5, v=11)
    old = torch.zeros(8, dtype=torch.float64)

    def sequence_loss(x):  # GSPO-like: one ratio from the mean log-ratio of all tokens
        return -torch.exp((x - old).mean()) * 1.5

    tiles = Tiles(monkeypatch)
    logps, _ = fused_token_logprobs(hidden, weight, targets, b, tile=3, predict=predictor(sequence_loss))
    with pytest.warns(UserWarning, match="not token-separable"):
        got = torch.autograd.grad(sequence_loss(logps), (hidden, weight, b))
    assert tiles.logits == 6  # the forward's 3 tiles, then the backward's 3
    want_logps, _ = reference(hidden, weight, b, targets, 1.0, 1.0, None)
    want = torch.autograd.grad(sequence_loss(want_logps), (hidden, weight, b))
    for a, w in zip(got, want):
        torch.testing.assert_close(a, w, rtol=0, atol=1e-10)


def test_a_predicted_loss_is_unused_for_a_frozen_head_or_without_gradient(monkeypatch):
    hidden, weight, _, targets = inputs()
    calls = []

    def predict(logps, rows):
        calls.append(1)
        return torch.ones_like(logps[rows])

    with torch.no_grad():
        fused_token_logprobs(hidden, weight, targets, tile=4, predict=predict)
    logps, _ = fused_token_logprobs(hidden, weight.detach(), targets, tile=4, predict=predict)
    logps.sum().backward()
    assert not calls and hidden.grad is not None  # the frozen head's basis instead
