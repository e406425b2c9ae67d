"""Padded vs packed vs shared-prompt scoring at a real Qwen2.5 shape on one GPU (issue 42's three shapes), and
the peak memory per 1,000 completion tokens.

One forward + backward of `rlft.scoring.score_rows` (the per-token log-probs GRPO's update computes, full
fine-tuning, gradient checkpointing on, bfloat16, sdpa) over fixed rollouts, in three ways:

  padded    the micro-batch padded to its longest prompt and completion (padding_free=False)
  rows      the rows packed into one sequence without padding, each row whole (packing "rows")
  prompts   packed, a prompt shared by a group held once (packing "prompts", rlft's default)

Workloads (prompt tokens x completion lengths): skewed 64 x (one 2,048 + fifteen 96); shared 3,072 x eight
64; long 64 x two 8,192. Each variant runs `--repeats` times after one untimed warm-up, the order of the
variants flipping from one repeat to the next; the median is reported, with the peak of
torch.cuda.max_memory_allocated (reset before each call; the weights are in it). The sweep scores two
completions of each `--sweep` length behind a 64-token prompt (packed, shared prompt) and fits the peak's
growth per 1,000 completion tokens. Checks: the packed log-probs against the padded ones (max |difference|
over real tokens; bfloat16 rounding) and the embedding gradient's norm.

    python benchmarks/gpu/packing.py --out benchmarks/gpu/packing-h200.md
    python benchmarks/gpu/packing.py --device cpu --shape tiny --scale 16 --sweep 64 128   # CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.gpu.bench import COMMON, FIELDS, SHAPES, VOCAB  # noqa: E402

WORKLOADS = {"skewed": (64, [2048] + [96] * 15), "shared": (3072, [64] * 8), "long": (64, [8192] * 2)}
# name: (packing, attention kernel); "sdpa" hides torch's varlen flash attention from rlft (one SDPA call per
# block, what a CPU runs), "auto" lets rlft choose (varlen flash on a GPU where torch has it)
VARIANTS = {"padded": (None, "auto"), "rows": ("rows", "auto"), "prompts": ("prompts", "auto"),
            "rows-sdpa": ("rows", "sdpa"), "prompts-sdpa": ("prompts", "sdpa")}


def build_model(args, longest: int):
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    from rlft.scoring import install_scoring

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=args.vocab, max_position_embeddings=longest + 8, use_cache=False,
                         **dict(zip(FIELDS, SHAPES[args.shape])), **COMMON)
    dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    with torch.device(args.device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    model.train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    install_scoring(model)
    return model


def rollout(args, prompt: int, lengths: list[int]):
    """One group: a shared prompt, completions of `lengths` tokens right-padded to the longest."""
    import torch

    from rlft.rollout.base import Rollout

    g = torch.Generator().manual_seed(1)
    n, width = len(lengths), max(lengths)
    prompt_ids = torch.randint(3, args.vocab, (1, prompt), generator=g).expand(n, prompt).clone()
    mask = (torch.arange(width)[None] < torch.tensor(lengths)[:, None]).long()
    ids = torch.randint(3, args.vocab, (n, width), generator=g) * mask
    return Rollout(prompt_ids.to(args.device), torch.ones_like(prompt_ids).to(args.device),
                   ids.to(args.device), mask.to(args.device), torch.zeros(n, dtype=torch.bool,
                                                                           device=args.device))


def call(args, model, batch, packing, kernel: str = "auto"):
    """One forward + backward: (seconds, peak GiB, log-probs, embedding-gradient norm, computed tokens,
    the attention kernel packed scoring ran)."""

    import rlft.core.segments as segments

    varlen, segments.LAST_KERNEL = segments.varlen_attn, None
    if kernel == "sdpa":
        segments.varlen_attn = None
    try:
        return _call(args, model, batch, packing) + (segments.LAST_KERNEL,)
    finally:
        segments.varlen_attn = varlen


def _call(args, model, batch, packing):
    import torch

    from rlft.scoring import score_rows

    cuda = args.device.startswith("cuda")
    model.zero_grad(set_to_none=True)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    scored = score_rows(model, batch, slice(None), packing=packing)
    (scored.logps * batch.completion_mask[:, :scored.logps.shape[1]]).sum().backward()
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan")
    grad = model.get_input_embeddings().weight.grad
    return seconds, peak, scored.logps.detach().float(), float(grad.double().norm()), scored.tokens


def workload(args, model, name: str) -> list[dict]:
    prompt, lengths = WORKLOADS[name]
    if args.scale > 1:
        prompt, lengths = max(prompt // args.scale, 2), [max(n // args.scale, 2) for n in lengths]
    batch = rollout(args, prompt, lengths)
    rows, times, results = {}, {v: [] for v in VARIANTS}, {}
    for turn in range(args.repeats + 1):
        for variant in (list(VARIANTS) if turn % 2 == 0 else list(VARIANTS)[::-1]):
            seconds, peak, logps, norm, tokens, kernel = call(args, model, batch, *VARIANTS[variant])
            times[variant] += [seconds] if turn else []
            results[variant] = (peak, logps, norm, tokens, kernel)
    padded = results["padded"][1]
    real = batch.completion_mask.bool()
    for variant, (peak, logps, norm, tokens, kernel) in results.items():
        rows[variant] = {"workload": name, "variant": variant, "kernel": kernel, "prompt": prompt,
                         "lengths": lengths,
                         "computed_tokens": tokens, "real_tokens": prompt * len(lengths) + sum(lengths),
                         "seconds": round(statistics.median(times[variant]), 4), "peak_gb": round(peak, 3),
                         "max_logp_diff_vs_padded": float((logps - padded).abs()[real].max()),
                         "grad_norm": norm}
    return list(rows.values())


def sweep(args, model) -> list[dict]:
    out = []
    for length in args.sweep:
        batch = rollout(args, 64 // args.scale if args.scale > 1 else 64, [length, length])
        call(args, model, batch, "prompts")  # warm-up
        seconds, peak, _, _, tokens, kernel = call(args, model, batch, "prompts")
        out.append({"sweep_length": length, "rows": 2, "peak_gb": round(peak, 3), "seconds": round(seconds, 4),
                    "computed_tokens": tokens, "kernel": kernel})
    return out


def slope(points: list[dict]) -> float:
    """Least-squares growth of the peak (GiB) per 1,000 completion tokens (both rows counted)."""
    xs = [2 * p["sweep_length"] / 1000 for p in points]
    ys = [p["peak_gb"] for p in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def report(args, device: str, rows: list[dict], points: list[dict]) -> str:
    import torch
    import transformers

    lines = [f"# Padded vs packed scoring on {device}", "", f"Command: `{shlex.join(['python', *sys.argv])}`",
             "", f"Versions: python {sys.version.split()[0]}, torch {torch.__version__}, transformers "
             f"{transformers.__version__}. Model: Qwen2.5-{args.shape} shape, random weights, full fine-tuning, "
             "gradient checkpointing, sdpa; median of "
             f"{args.repeats} forward + backward passes after a warm-up.", "",
             "| workload | variant | attention | computed tokens | real tokens | peak GiB | seconds "
             "| vs padded (memory, time) | max abs log-prob diff vs padded |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        base = next(b for b in rows if b["workload"] == r["workload"] and b["variant"] == "padded")
        ratio = f"{r['peak_gb'] / base['peak_gb']:.2f}x, {r['seconds'] / base['seconds']:.2f}x"
        lines.append(f"| {r['workload']} | {r['variant']} | {r['kernel'] or 'model (sdpa)'} | "
                     f"{r['computed_tokens']:,} | {r['real_tokens']:,} | "
                     f"{r['peak_gb']:.2f} | {r['seconds']:.3f} | {ratio} | {r['max_logp_diff_vs_padded']:.3g} |")
    if len(points) > 1:
        lines += ["", "Peak memory, two completions behind a 64-token prompt (packed, shared prompt):", "",
                  "| completion tokens per row | peak GiB | seconds |", "| --- | --- | --- |"]
        lines += [f"| {p['sweep_length']:,} | {p['peak_gb']:.2f} | {p['seconds']:.3f} |" for p in points]
        lines += ["", f"Growth: {slope(points):.3f} GiB per 1,000 completion tokens (least squares)."]
    return "\n".join(lines + ["", "```jsonl", *(json.dumps(r) for r in rows + points), "```", ""])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="0.5b")
    parser.add_argument("--workloads", nargs="+", choices=sorted(WORKLOADS), default=list(WORKLOADS))
    parser.add_argument("--sweep", nargs="*", type=int, default=[2048, 4096, 8192, 16384])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--scale", type=int, default=1, help="divide every length by this (CPU smoke run)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--vocab", type=int, default=VOCAB)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    import torch

    longest = max([p + max(n) for p, n in WORKLOADS.values()] + [64 + s for s in args.sweep])
    model = build_model(args, longest)
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else "CPU"
    rows = []
    for name in args.workloads:
        rows += workload(args, model, name)
        print("\n".join(json.dumps(r) for r in rows[-len(VARIANTS):]), flush=True)
    points = sweep(args, model)
    text = report(args, device, rows, points)
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
