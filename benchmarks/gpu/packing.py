"""Padded vs packed vs shared-prompt scoring at a real Qwen2.5 shape on one GPU (issue 42's three shapes), and
the peak memory per 1,000 completion tokens.

One forward + backward of `rlft.model.scoring.score_rows` (the per-token log-probs GRPO's update computes, full
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
import gc
import json
import shlex
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.gpu.bench import SHAPES, VOCAB, shape_fields  # noqa: E402

WORKLOADS = {"skewed": (64, [2048] + [96] * 15), "shared": (3072, [64] * 8), "long": (64, [8192] * 2)}
# name: (packing, attention kernel); "sdpa" hides torch's varlen flash attention from rlft (one SDPA call per
# block, what a CPU runs), "auto" lets rlft choose (varlen flash on a GPU where torch has it)
# the long-completion memory options: name -> (activation_offloading, mlp_chunk_size)
OFFLOAD = {"packed": (False, None), "offload": (True, None), "offload+mlp-chunks": (True, 4096)}
VARIANTS = {"padded": (None, "auto"), "rows": ("rows", "auto"), "prompts": ("prompts", "auto"),
            "rows-sdpa": ("rows", "sdpa"), "prompts-sdpa": ("prompts", "sdpa")}


def build_model(args, longest: int, head: str = "rlft"):
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    from rlft.model.scoring import install_scoring

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=args.vocab, max_position_embeddings=longest + 8, use_cache=False,
                         **shape_fields(args.shape))
    dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    with torch.device(args.device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    model.train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if head == "trl":  # TRL 1.16's GRPO forward: its fused LM head over the padded batch
        from trl.trainer.utils import add_fused_lm_head

        add_fused_lm_head(model)
    else:
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

    from rlft.model.scoring import score_rows

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


def shape_of(args, name: str) -> tuple[int, list[int]]:
    prompt, lengths = WORKLOADS[name]
    if args.scale > 1:
        prompt, lengths = max(prompt // args.scale, 2), [max(n // args.scale, 2) for n in lengths]
    return prompt, lengths


def workload(args, model, name: str) -> list[dict]:
    prompt, lengths = shape_of(args, name)
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


def trl_call(args, model, batch):
    """TRL 1.16's scoring of a padded micro-batch (what its GRPO update forwards): (seconds, peak GiB,
    completion log-probs, embedding-gradient norm, computed tokens)."""
    import torch

    cuda = args.device.startswith("cuda")
    ids = torch.cat([batch.prompt_ids, batch.completion_ids], 1)
    mask = torch.cat([batch.prompt_mask, batch.completion_mask], 1)
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :batch.prompt_ids.shape[1]] = -100  # the completion only, as GRPO scores
    model.zero_grad(set_to_none=True)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    logps = model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True).log_probs
    logps = logps[:, batch.prompt_ids.shape[1] - 1:]  # TRL's position t holds the log-prob of token t + 1
    (logps * batch.completion_mask).sum().backward()
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan")
    grad = model.get_input_embeddings().weight.grad
    return seconds, peak, logps.detach().float(), float(grad.double().norm()), ids.numel()


def trl_rows(args, model) -> list[dict]:
    """TRL on each workload and sweep length rlft ran (median of --repeats after a warm-up); its gradient norm
    is in each row to hold beside rlft's."""
    out = []
    shapes = [(name, *shape_of(args, name)) for name in args.workloads]
    shapes += [("sweep", max(64 // args.scale, 2), [n, n]) for n in offload_lengths(args)]
    for name, prompt, lengths in shapes:
        batch = rollout(args, prompt, lengths)
        try:
            runs = [trl_call(args, model, batch) for _ in range(args.repeats + 1)]
        except Exception as err:  # noqa: BLE001 - out of memory at a length: the row says so, the rest go on
            out.append({"workload": name, "lib": "trl", "lengths": lengths, "error": str(err)[:200]})
            continue
        seconds = statistics.median(r[0] for r in runs[1:])
        out.append({"workload": name, "lib": "trl", "prompt": prompt, "lengths": lengths,
                    "computed_tokens": runs[-1][4], "seconds": round(seconds, 4),
                    "peak_gb": round(max(r[1] for r in runs), 3), "grad_norm": runs[-1][3]})
        print(json.dumps(out[-1]), flush=True)
    return out


def memory_options(model, offload: bool, chunk: int | None) -> None:
    """Turn rlft's activation_offloading and mlp_chunk_size on or off on the built model."""
    from rlft.model.memory.chunked_mlp import _mlps, chunk_mlps
    from rlft.model.memory.offload import offload_activations

    backbone = model.model
    if offload:
        offload_activations(model)
    elif getattr(backbone, "_rlft_offload", False):
        del backbone.forward  # the class's forward again
        backbone._rlft_offload = False
    if chunk:
        chunk_mlps(model, chunk)
    for mlp in _mlps(model) if not chunk else []:
        if getattr(mlp, "_rlft_chunk", None) is not None:
            mlp._rlft_chunk = 1 << 62  # whole


def offload_lengths(args) -> list[int]:
    return [max(n // args.scale, 2) for n in args.offload_sweep]


def offload_sweep(args, model) -> list[dict]:
    """Two completions of each --offload-sweep length behind a 64-token prompt, packed: as GRPO scores them,
    with activation_offloading, and with it plus mlp_chunk_size. Peak, seconds (median of --repeats after a
    warm-up), and the bytes the last forward moved to host memory."""
    out = []
    for length in offload_lengths(args):
        batch = rollout(args, max(64 // args.scale, 2), [length, length])
        for name, (on, chunk) in OFFLOAD.items():
            memory_options(model, on, chunk and max(chunk // args.scale, 2))
            runs = [call(args, model, batch, "prompts") for _ in range(args.repeats + 1)]
            out.append({"offload_length": length, "variant": name, "rows": 2,
                        "peak_gb": round(max(r[1] for r in runs), 3),
                        "seconds": round(statistics.median(r[0] for r in runs[1:]), 4),
                        "moved_gb": round(getattr(model.model, "_rlft_offloaded_bytes", 0) / 2**30, 3)
                        if on else 0.0, "grad_norm": runs[-1][3], "kernel": runs[-1][5]})
    memory_options(model, False, None)
    return out


def slope(points: list[dict]) -> float:
    """Least-squares growth of the peak (GiB) per 1,000 completion tokens (both rows counted)."""
    xs = [2 * p["sweep_length"] / 1000 for p in points]
    ys = [p["peak_gb"] for p in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def report(args, device: str, rows: list[dict], points: list[dict], offloads: list[dict],
           trl: list[dict]) -> str:
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
    lines += offload_table(offloads) + trl_table(rows, offloads, trl)
    return "\n".join(lines + ["", "```jsonl", *(json.dumps(r) for r in rows + points + offloads + trl), "```",
                              ""])


def offload_table(offloads: list[dict]) -> list[str]:
    if not offloads:
        return []
    lines = ["", "Long completions: two completions behind a 64-token prompt, packed, gradient checkpointing; "
             f"then activation_offloading; then also mlp_chunk_size {OFFLOAD['offload+mlp-chunks'][1]}:", "",
             "| completion tokens per row | variant | peak GiB | seconds | moved to host GiB | vs packed "
             "(memory, time) |", "| --- | --- | --- | --- | --- | --- |"]
    for r in offloads:
        base = next(b for b in offloads if b["offload_length"] == r["offload_length"] and b["variant"] == "packed")
        lines.append(f"| {r['offload_length']:,} | {r['variant']} | {r['peak_gb']:.2f} | {r['seconds']:.3f} | "
                     f"{r['moved_gb']:.2f} | {r['peak_gb'] / base['peak_gb']:.2f}x, "
                     f"{r['seconds'] / base['seconds']:.2f}x |")
    return lines


def trl_table(rows: list[dict], offloads: list[dict], trl: list[dict]) -> list[str]:
    """rlft's default (packed, shared prompt; for the long sweep also its memory options) against TRL's
    padded scoring of the same batch."""
    if not trl:
        return []
    lines = ["", "rlft against TRL 1.16 (TRL: the padded micro-batch through its fused LM head, as its GRPO "
             "update scores it; same model shape, seed and tokens):", "",
             "| workload | rlft | TRL computed tokens | TRL peak GiB | TRL seconds | rlft peak GiB | rlft seconds "
             "| rlft vs TRL (memory, time) |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for t in trl:
        if "error" in t:
            lines.append(f"| {t['workload']} {t['lengths'][0]:,} | - | TRL: {t['error'][:60]} | | | | | |")
            continue
        if t["workload"] == "sweep":
            mine = [(f"2 x {t['lengths'][0]:,}: {r['variant']}", r) for r in offloads
                    if r["offload_length"] == t["lengths"][0]]
        else:  # what padding_free: null picks: packed where that at least halves the computed tokens
            by = {r["variant"]: r for r in rows if r["workload"] == t["workload"]}
            pick = "prompts" if 2 * by["prompts"]["computed_tokens"] <= by["padded"]["computed_tokens"] else "padded"
            mine = [(f"{t['workload']}: {pick} (rlft's default)", by[pick])]
        for label, r in mine:
            lines.append(f"| {label.split(':')[0]} | {label.split(': ')[1]} | {t['computed_tokens']:,} | "
                         f"{t['peak_gb']:.2f} | {t['seconds']:.3f} | {r['peak_gb']:.2f} | {r['seconds']:.3f} | "
                         f"{r['peak_gb'] / t['peak_gb']:.2f}x, {r['seconds'] / t['seconds']:.2f}x |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="0.5b")
    parser.add_argument("--workloads", nargs="+", choices=sorted(WORKLOADS), default=list(WORKLOADS))
    parser.add_argument("--sweep", nargs="*", type=int, default=[2048, 4096, 8192, 16384])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--scale", type=int, default=1, help="divide every length by this (CPU smoke run)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--vocab", type=int, default=VOCAB)
    parser.add_argument("--offload-sweep", nargs="*", type=int, default=[8192, 16384, 32768],
                        help="completion lengths (2 rows) for the activation_offloading / mlp_chunk_size table")
    parser.add_argument("--trl", action="store_true", help="also score each shape as TRL 1.16 does (padded)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    import torch

    longest = max([p + max(n) for p, n in WORKLOADS.values()] + [64 + s for s in args.sweep + args.offload_sweep])
    model = build_model(args, longest)
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else "CPU"
    rows = []
    for name in args.workloads:
        rows += workload(args, model, name)
        print("\n".join(json.dumps(r) for r in rows[-len(VARIANTS):]), flush=True)
    points = sweep(args, model)
    offloads = offload_sweep(args, model)
    print("\n".join(json.dumps(r) for r in offloads), flush=True)
    trl = []
    if args.trl:  # after rlft's model is gone, so each library's peak holds its own weights only
        del model
        gc.collect()  # the patched forwards hold the model in reference cycles
        torch.cuda.empty_cache() if args.device.startswith("cuda") else None
        trl = trl_rows(args, build_model(args, longest, head="trl"))
    text = report(args, device, rows, points, offloads, trl)
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
