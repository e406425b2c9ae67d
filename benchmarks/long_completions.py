"""Peak memory and time of a long-completion scoring step against completion length, gradient checkpointing
on: each decoder layer's MLP whole or in chunks (`mlp_chunk_size`), the attention recomputed in the backward
or its output kept from the forward (`recompute_attention: false`), and TRL 1.16's scoring of the same batch
(its fused LM head, `add_fused_lm_head`, as its GRPO update forwards it; needs trl).

One scoring forward + backward (the policy's per-token log-probs through rlft's fused LM head, the loss
GRPO's clipped token mean on-policy with advantages +1 and -1, `grpo_loss`; before 2026-11-27 the loss was
the log-probs' sum, which costs the same) of 2 completions of L tokens behind a 64-token prompt, padded (both rows full length), on a
Qwen2-shaped model with Qwen2.5-0.5B's proportions at a CPU's size: hidden 512, intermediate 2,816 (5.5x), 4
layers, 8 heads, 2 kv heads, vocabulary 32k, random weights, float32, full fine-tuning. Each (L, setting) in
its own process; memory is the peak resident set above the process's resident set once the model is
built; time is the step's wall time. `--rlft-mmap-threshold N` starts rlft's workers with
MALLOC_MMAP_THRESHOLD_=N (glibc's threshold fixed; docs/troubleshooting.md), TRL's with glibc's defaults;
`--rlft-trim` gives rlft's workers `trim_host_memory`, as its trainers install it by default
(rlft/model/memory/host_memory.py: freed heap memory back to the system between decoder layers). A "fused loss"
setting gives rlft's head the loss's gradient as a function of the log-probs, as its GRPO trainer does for a
token-separable loss (rlft/core/fused_head.py: the trainable head's gradients formed in the forward).

    python benchmarks/long_completions.py                    # L = 2k, 4k, 8k, 16k; ~10 minutes on 2 cores
    python benchmarks/long_completions.py --lengths 512 1024 --out /tmp/long.json    # quick
    .venv-bench/bin/python benchmarks/long_completions.py --lengths 8192 \
        --settings whole "attention kept" trl --out benchmarks/results-long-attention.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# name: (mlp_chunk_size, keep attention outputs, library, the loss's gradient given to the head)
SETTINGS = {"whole": (None, False, "rlft", False), "chunked 1024": (1024, False, "rlft", False),
            "attention kept": (None, True, "rlft", False), "kept + chunked 1024": (1024, True, "rlft", False),
            "kept + chunked 4096": (4096, True, "rlft", False),
            "fused loss": (None, False, "rlft", True), "kept + fused loss": (None, True, "rlft", True),
            "kept + chunked 4096 + fused loss": (4096, True, "rlft", True),
            "kept + chunked 2048 + fused loss": (2048, True, "rlft", True),
            "kept + chunked 1024 + fused loss": (1024, True, "rlft", True),
            "trl": (None, False, "trl", False)}
DEFAULT = ("whole", "chunked 1024")


def grpo_loss(logps, advantages, epsilon: float = 0.2):
    """GRPO's clipped surrogate, token mean, on-policy (old = the log-probs themselves: ratio 1): logps [2, L],
    advantages [2, 1]. The same function for both libraries."""
    import torch

    ratio = torch.exp(logps - logps.detach())
    per_token = -torch.minimum(ratio * advantages, ratio.clamp(1 - epsilon, 1 + epsilon) * advantages)
    return per_token.mean()


def loss_gradient(advantages, epsilon: float = 0.2):
    """dL/dlog p of `grpo_loss` in closed form, a Score.loss_grad (what rlft's trainer gives the head for
    such a loss, rlft/core/loss_grads.py): the clipped token mean over every token of [2, width]."""
    import torch

    from rlft.core.loss_grads import ClosedFormGrad, token_loss_grad
    from rlft.core.losses import LossOptions

    options = LossOptions(epsilon_low=epsilon)

    def build(width: int):
        mask = torch.ones(advantages.shape[0], width, device=advantages.device)
        return token_loss_grad(None, advantages, mask, loss_type="dapo", options=options)
    return ClosedFormGrad(build)


def autograd_loss_gradient(advantages):
    """log-probs -> dL/dlog p of `grpo_loss` by autograd on the loss's own code (what the trainer gives for a
    token-separable loss without a closed form)."""
    import torch

    def gradient(logps):
        with torch.enable_grad():
            x = logps.detach().requires_grad_()
            return torch.autograd.grad(grpo_loss(x, advantages), x)[0]
    return gradient


def worker(length: int, setting: str) -> dict:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from rlft.model.memory.chunked_mlp import chunk_mlps
    from rlft.model.memory.selective_checkpoint import AttentionKeeper
    from rlft.model.scoring import install_scoring, score_rows
    from rlft.rollout.base import Rollout

    chunk, keep, lib, fused = SETTINGS[setting]

    torch.set_num_threads(2)
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=32000, hidden_size=512, intermediate_size=2816, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=length + 128,
                         attn_implementation="sdpa")
    model = Qwen2ForCausalLM(config)
    keeper = AttentionKeeper() if keep else None
    kwargs = {"use_reentrant": False, **({"context_fn": keeper.context_fn} if keeper else {})}
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    model.train()
    if lib == "trl":
        from trl.trainer.utils import add_fused_lm_head

        add_fused_lm_head(model)
    else:
        install_scoring(model)
    if chunk:
        chunk_mlps(model, chunk)
    if lib == "rlft" and os.environ.get("RLFT_BENCH_TRIM"):
        from rlft.model.memory.host_memory import trim_between_layers

        trim_between_layers(model, "cpu")
    rows, prompt = 2, 64
    g = torch.Generator().manual_seed(1)
    rollout = Rollout(prompt_ids=torch.randint(16, 32000, (rows, prompt), generator=g),
                      prompt_mask=torch.ones(rows, prompt, dtype=torch.long),
                      completion_ids=torch.randint(16, 32000, (rows, length), generator=g),
                      completion_mask=torch.ones(rows, length, dtype=torch.long),
                      truncated=torch.zeros(rows, dtype=torch.bool))
    advantages = torch.tensor([[1.0], [-1.0]])
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    started = time.perf_counter()
    if lib == "trl":
        ids = torch.cat([rollout.prompt_ids, rollout.completion_ids], 1)
        labels = ids.clone()
        labels[:, :prompt] = -100  # the completion only, as GRPO scores
        logps = model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=labels,
                      fused_lm_head=True).log_probs[:, prompt - 1:]
    else:
        logps = score_rows(model, rollout, torch.arange(rows),
                           loss_grad=loss_gradient(advantages) if fused else None).logps
    grpo_loss(logps, advantages).backward()
    seconds = time.perf_counter() - started
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"length": length, "chunk": chunk, "keep_attention": keep, "fused_loss": fused, "library": lib,
            "seconds": seconds,
            "step_peak_mb": (peak - before) / 1024, "logp_sum": float(logps.detach().sum()),
            "kept_attention_outputs": keeper.kept if keeper else 0}


def _median(runs: list[dict]) -> dict:
    return {key: statistics.median(r[key] for r in runs) for key in ("step_peak_mb", "seconds")}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    parser.add_argument("--settings", nargs="+", choices=list(SETTINGS), default=list(DEFAULT))
    parser.add_argument("--repeats", type=int, default=1, help="runs of each (length, setting), alternating; "
                        "the table shows medians")
    parser.add_argument("--rlft-mmap-threshold", type=int, default=None)
    parser.add_argument("--rlft-trim", action="store_true", help="trim_host_memory in rlft's workers")
    parser.add_argument("--worker", nargs=2)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results-long-completions.json"))
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(int(args.worker[0]), args.worker[1])))
        return
    results = {"date": str(date.today()), "machine": f"{platform.machine()}, 2 CPU threads", "runs": []}
    names = args.settings
    for length in args.lengths:
        for repeat in range(args.repeats):
            for name in names:
                env = dict(os.environ)
                if args.rlft_mmap_threshold and SETTINGS[name][2] == "rlft":
                    env["MALLOC_MMAP_THRESHOLD_"] = str(args.rlft_mmap_threshold)
                if args.rlft_trim and SETTINGS[name][2] == "rlft":
                    env["RLFT_BENCH_TRIM"] = "1"
                out = subprocess.run([sys.executable, __file__, "--worker", str(length), name],
                                     capture_output=True, text=True, cwd=ROOT, env=env)
                if out.returncode:
                    raise SystemExit(out.stderr[-3000:])
                run = {"setting": name, "repeat": repeat, **json.loads(out.stdout.strip().splitlines()[-1])}
                results["runs"].append(run)
                print(json.dumps(run), flush=True)
    Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    print("| completion tokens (2 rows) | " + " | ".join(f"{n}: step peak MB / s" for n in names) + " |")
    print("| --- |" + " --- |" * len(names))
    for length in args.lengths:
        cells = [_median([r for r in results["runs"] if r["length"] == length and r["setting"] == n])
                 for n in names]
        print(f"| 2 x {length:,} | " + " | ".join(f"{c['step_peak_mb']:,.0f} / {c['seconds']:.1f}" for c in cells)
              + " |")
    for name in names if len(args.lengths) > 1 else []:
        runs = [r for r in results["runs"] if r["setting"] == name]
        slope = (runs[-1]["step_peak_mb"] - runs[0]["step_peak_mb"]) / (2 * (runs[-1]["length"] - runs[0]["length"]))
        print(f"{name}: {1000 * slope:.1f} MB per 1,000 completion tokens")


if __name__ == "__main__":
    main()
