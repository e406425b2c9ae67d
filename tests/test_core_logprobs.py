"""selective_log_softmax / entropy: exact against log_softmax().gather, bounded memory."""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from rlft.core.logprobs import default_chunk_size, entropy_from_logits, selective_log_softmax


def reference(logits, ids, temperature=1.0):
    return torch.log_softmax(logits.float() / temperature, dim=-1).gather(-1, ids[..., None]).squeeze(-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("chunk_size", [1, 4, 5, 64])  # 4 divides 3*4=12 rows, 5 does not
def test_matches_log_softmax_gather(dtype, chunk_size):
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(3, 4, 50, generator=g) * 3).to(dtype)
    ids = torch.randint(0, 50, (3, 4), generator=g)
    out = selective_log_softmax(logits, ids, temperature=0.7, chunk_size=chunk_size)
    assert out.dtype == torch.float32
    assert torch.allclose(out, reference(logits, ids, 0.7), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("chunk_size", [3, 100])
def test_gradient_matches_autograd_of_reference(chunk_size):
    logits = torch.randn(2, 5, 30, requires_grad=True)
    ids = torch.randint(0, 30, (2, 5))
    weights = torch.randn(2, 5)
    (selective_log_softmax(logits, ids, 1.3, chunk_size) * weights).sum().backward()
    mine = logits.grad.clone()
    logits.grad = None
    (reference(logits, ids, 1.3) * weights).sum().backward()
    assert torch.allclose(mine, logits.grad, atol=1e-6)


def test_gradcheck_float64():
    logits = torch.randn(2, 3, 7, dtype=torch.float64, requires_grad=True)
    ids = torch.randint(0, 7, (2, 3))
    assert torch.autograd.gradcheck(lambda x: selective_log_softmax(x, ids, 0.9, 4), (logits,))


def test_bf16_gradient_comes_back_in_input_dtype():
    logits = torch.randn(2, 3, 11).bfloat16().requires_grad_()
    selective_log_softmax(logits, torch.zeros(2, 3, dtype=torch.long)).sum().backward()
    assert logits.grad.dtype == torch.bfloat16


def test_large_vocab_never_allocates_the_full_float32_tensor():
    """Bound: the largest single allocation is the gradient w.r.t. the logits, in their own dtype
    (bf16: half the float32 size); float32 work buffers are one chunk (chunk_size x vocab)."""
    batch, seq, vocab, chunk = 4, 64, 32000, 32
    logits = torch.randn(batch, seq, vocab).bfloat16().requires_grad_()
    ids = torch.randint(0, vocab, (batch, seq))
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        selective_log_softmax(logits, ids, chunk_size=chunk).sum().backward()
    largest = max(e.cpu_memory_usage for e in prof.events())
    full_float32 = batch * seq * vocab * 4
    assert largest <= logits.numel() * logits.element_size() == full_float32 // 2


def test_entropy_matches_definition_and_bounds():
    logits = torch.randn(2, 6, 40).bfloat16()
    probs = torch.softmax(logits.float(), -1)
    expected = -(probs * torch.log(probs)).sum(-1)
    assert torch.allclose(entropy_from_logits(logits, chunk_size=5), expected, atol=1e-5)
    uniform = entropy_from_logits(torch.zeros(1, 1, 40))
    assert uniform.item() == pytest.approx(torch.log(torch.tensor(40.0)).item(), rel=1e-6)


def test_shape_mismatch_is_an_error():
    with pytest.raises(ValueError, match="disagree"):
        selective_log_softmax(torch.randn(2, 3, 5), torch.zeros(2, 4, dtype=torch.long))


def test_sliced_logits_view_is_not_copied_whole():
    """The trainer passes logits[:, :-1] (a non-contiguous view): no [B, T, V] copy may be made."""
    batch, seq, vocab, chunk = 4, 64, 32000, 32
    full = torch.randn(batch, seq + 1, vocab).bfloat16()
    view = full[:, :-1]
    ids = torch.randint(0, vocab, (batch, seq))
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = selective_log_softmax(view, ids, chunk_size=chunk)
        entropy_from_logits(view, chunk_size=chunk)
    largest = max(e.cpu_memory_usage for e in prof.events())
    assert largest <= chunk * vocab * 4 * 2 < view.numel() * view.element_size()
    assert torch.allclose(out, reference(view, ids), atol=1e-6, rtol=1e-6)


def test_default_block_on_a_cpu_holds_about_a_million_elements_and_changes_no_value():
    """logprob_chunk_size: null sizes blocks to the device; the values do not depend on the block size."""
    torch.manual_seed(3)
    large = torch.randn(2, 3, 32000)
    assert default_chunk_size(large) == (1 << 20) // 32000 == 32
    assert default_chunk_size(torch.randn(1, 1, 3_000_000)) == 1  # never 0, however large the vocabulary
    small = torch.randn(2, 40, 50, dtype=torch.float64)
    ids = torch.randint(0, 50, (2, 40))
    assert default_chunk_size(small) == (1 << 20) // 50
    auto = selective_log_softmax(small, ids, 0.8, default_chunk_size(small))
    assert torch.equal(auto, selective_log_softmax(small, ids, 0.8, 7))
    assert torch.equal(entropy_from_logits(small, 0.8, default_chunk_size(small)), entropy_from_logits(small, 0.8, 7))
