"""How much of a CPU run's peak memory is glibc's heap keeping freed memory: the scoring forward + backward
of workload d's shape (Qwen2, hidden 512, 4 layers, intermediate 1,536, vocabulary 151,936, LoRA r 16,
gradient checkpointing; 16 completions of 512 tokens behind a 40-token prompt), twice, by rlft and by TRL 1.16
(its fused LM head over the same batch, as its GRPO update forwards it), each in its own process, with
glibc's default allocator settings and with MALLOC_MMAP_THRESHOLD_=65536 (every allocation over 64 KiB its
own mapping, given back to the system when freed: glibc otherwise raises that threshold to up to 32 MiB as
the program frees large blocks, and serves them from a heap that a long-lived block above them keeps from
shrinking), and rlft once more with glibc's defaults and `trim_host_memory` (rlft/model/memory/host_memory.py:
malloc_trim between decoder layers; the trainers install it by default, this worker builds the model by
hand, so it installs it itself). Reports peak RSS above the built model, the seconds of the two passes,
and the log-prob sum (the same computation on both sides).

    .venv-bench/bin/python benchmarks/cpu_allocator.py      # needs trl==1.16.0; ~10 minutes on 2 cores
"""

from __future__ import annotations

import json
import os
import platform
import resource
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ALLOCATORS = {"glibc default": {}, "MALLOC_MMAP_THRESHOLD_=65536": {"MALLOC_MMAP_THRESHOLD_": "65536"},
              "glibc default, trim_host_memory": {"RLFT_BENCH_TRIM": "1"}}


def worker(lib: str) -> dict:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.set_num_threads(2)
    config = Qwen2Config(vocab_size=151936, hidden_size=512, num_hidden_layers=4, num_attention_heads=8,
                         num_key_value_heads=2, intermediate_size=1536, max_position_embeddings=640,
                         tie_word_embeddings=True, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear",
                                             task_type="CAUSAL_LM"))
    model.train()
    rows, prompt, length = 16, 40, 512
    g = torch.Generator().manual_seed(1)
    prompt_ids = torch.randint(5, 151000, (rows, prompt), generator=g)
    completion_ids = torch.randint(5, 151000, (rows, length), generator=g)
    if lib == "trl":
        from trl.trainer.utils import add_fused_lm_head

        add_fused_lm_head(model.base_model.model)
    else:
        from rlft.model.scoring import install_scoring, score_rows
        from rlft.rollout.base import Rollout

        install_scoring(model)
        if os.environ.get("RLFT_BENCH_TRIM"):
            from rlft.model.memory.host_memory import trim_between_layers

            trim_between_layers(model, "cpu")
        rollout = Rollout(prompt_ids, torch.ones_like(prompt_ids), completion_ids, torch.ones_like(completion_ids),
                          torch.zeros(rows, dtype=torch.bool))
    built = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    started = time.perf_counter()
    for _ in range(2):
        if lib == "trl":
            ids = torch.cat([prompt_ids, completion_ids], 1)
            labels = ids.clone()
            labels[:, :prompt] = -100
            logps = model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=labels,
                          fused_lm_head=True).log_probs[:, prompt - 1:]
        else:
            logps = score_rows(model, rollout, slice(None)).logps
        logps.sum().backward()
    return {"library": lib, "seconds": time.perf_counter() - started, "built_mb": built,
            "step_peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - built,
            "logp_sum": float(logps.detach().sum())}


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        print(json.dumps(worker(sys.argv[2])))
        return
    results = {"date": str(date.today()), "machine": f"{platform.machine()}, 2 CPU threads", "runs": []}
    for name, extra in ALLOCATORS.items():
        for lib in ("rlft",) if "RLFT_BENCH_TRIM" in extra else ("rlft", "trl"):
            env = {**os.environ, "PYTHONPATH": str(ROOT), **extra}
            out = subprocess.run([sys.executable, __file__, "--worker", lib], capture_output=True, text=True,
                                 cwd=ROOT, env=env)
            if out.returncode:
                raise SystemExit(out.stderr[-3000:])
            run = {"allocator": name, **json.loads(out.stdout.strip().splitlines()[-1])}
            results["runs"].append(run)
            print(json.dumps(run), flush=True)
    Path(ROOT / "benchmarks" / "results-cpu-allocator.json").write_text(json.dumps(results, indent=1) + "\n")
    print("| allocator | rlft: step peak MB / s | TRL: step peak MB / s | rlft vs TRL, whole process peak |")
    print("| --- | --- | --- | --- |")
    for name, extra in ALLOCATORS.items():
        against = "glibc default" if "RLFT_BENCH_TRIM" in extra else name  # TRL has no trimmer
        mine, theirs = (next(r for r in results["runs"] if r["allocator"] == key and r["library"] == lib)
                        for key, lib in ((name, "rlft"), (against, "trl")))
        ratio = (mine["built_mb"] + mine["step_peak_mb"]) / (theirs["built_mb"] + theirs["step_peak_mb"])
        print(f"| {name} | {mine['step_peak_mb']:,.0f} / {mine['seconds']:.1f} | "
              f"{theirs['step_peak_mb']:,.0f} / {theirs['seconds']:.1f} | {ratio:.2f}x |")


if __name__ == "__main__":
    main()
