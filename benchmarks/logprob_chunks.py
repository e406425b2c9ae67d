"""How large should a block of the chunked float32 log-softmax be? Times one selective_log_softmax
forward + backward plus the entropy (what one GRPO micro-batch costs after the model) for blocks of
256 KiB to 64 MiB of float32 logits, on a small (512), a Llama-2 (32000) and a Qwen (151936) vocabulary.
Best of 3 per row; compare rows of one run, not runs (timings on a shared CPU are noisy).

    python benchmarks/logprob_chunks.py
"""

from __future__ import annotations

import time

import torch

from rlft.core.logprobs import default_chunk_size, entropy_from_logits, selective_log_softmax

SHAPES = ((512, 16, 257), (32000, 8, 129), (151936, 2, 257))  # vocab, rows, positions + 1


def seconds(logits: torch.Tensor, ids: torch.Tensor, chunk: int) -> float:
    best = float("inf")
    for _ in range(3):
        leaf = logits.clone().requires_grad_()
        started = time.perf_counter()
        logps = selective_log_softmax(leaf[:, :-1], ids, 1.0, chunk)
        entropy_from_logits(leaf[:, :-1].detach(), 1.0, chunk)
        logps.sum().backward()
        best = min(best, time.perf_counter() - started)
    return best


if __name__ == "__main__":
    torch.manual_seed(0)
    for vocab, rows, positions in SHAPES:
        logits = torch.randn(rows, positions, vocab)
        ids = torch.randint(0, vocab, (rows, positions - 1))
        print(f"vocab {vocab}: default block {default_chunk_size(logits)} positions", flush=True)
        baseline = seconds(logits, ids, 1024)
        for kib in (256, 1024, 4096, 16384, 65536):
            chunk = max(kib * 1024 // (4 * vocab), 1)
            took = seconds(logits, ids, chunk)
            print(f"  {kib:>6} KiB = {chunk:>5} positions: {took:.3f} s ({baseline / took:.2f}x vs 1024 positions)",
                  flush=True)
