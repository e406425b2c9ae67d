"""Scoring at real Qwen2.5 shapes on one GPU: rlft's fused scoring vs TRL 1.16's fused LM head vs logits.

The workload of benchmarks/score_vocab.py (one forward + backward of the per-token log-probs of `rows`
completions of `length` tokens after a 64-token prompt, as one GRPO micro-batch costs), but on a randomly
initialised model of the published Qwen2.5-0.5B or Qwen2.5-1.5B shape (no download), in bfloat16, with
gradient checkpointing on as both libraries' GRPO configs default to. The three ways of scoring are
score_vocab.py's own `score()`:

  rlft   rlft's fused scoring (rlft/model/scoring.py: the LM head in tiles, never [B, T, V] logits), each
         tile's softmax statistics and gradient by its Triton kernels where they run (rlft/core/tile_softmax.py)
  rlft-torch  the same with the kernels switched off (RLFT_TRITON=0): the torch path they replace
  trl    TRL 1.16's fused LM head (trl.trainer.utils.add_fused_lm_head), as its GRPO trainer calls it
  plain  the model's own logits + rlft's chunked float32 log-softmax

Each (shape, library, length) runs in its own child process, so its peak memory is its own; the order of the
libraries flips from one length to the next so drift hits all alike. Per child: peak GPU memory
(torch.cuda.max_memory_allocated, reset once the model is built; peak RSS on a CPU), the median seconds of
`--repeats` forward + backward passes after one untimed warm-up (CUDA synchronised), and checksums (the sum of
the log-probs, the norm of the embedding's gradient) that show the libraries computed the same thing.

    python benchmarks/gpu/bench.py --out benchmarks/gpu/results-h100.md
    python benchmarks/gpu/bench.py --device cpu --shape tiny --lengths 32 --rows 2 --libs rlft plain  # CPU

Prints one JSON line per child and a markdown table; `--out` also writes them, with the GPU, the versions and
the command, to a markdown file.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as a script: `benchmarks` (and, uninstalled, `rlft`) come from this tree
    sys.path.insert(0, str(ROOT))

from benchmarks.score_vocab import PROMPT, score  # noqa: E402

VOCAB = 151_936
# From the published config.json of Qwen/Qwen2.5-0.5B, -1.5B (both tie the LM head to the embedding) and -7B
# (its own LM head; its config pads the vocabulary to 152,064 rows, never tokens: 151,936 here as for the
# others); "tiny" is a CPU smoke test of the script itself, not a measurement.
FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
          "num_key_value_heads")
SHAPES = {"0.5b": (896, 4864, 24, 14, 2), "1.5b": (1536, 8960, 28, 12, 2), "7b": (3584, 18944, 28, 28, 4),
          "tiny": (64, 256, 2, 4, 2)}
UNTIED = {"7b"}
# rlft-torch: rlft with its Triton tile kernels switched off (RLFT_TRITON=0), the torch path they replace
LIBS = ("rlft", "rlft-torch", "trl", "plain")
COMMON = {"hidden_act": "silu", "rms_norm_eps": 1e-6, "attention_dropout": 0.0}


def shape_fields(shape: str) -> dict:
    """The Qwen2Config fields of a shape (SHAPES, COMMON, and whether its LM head is the embedding)."""
    return {**dict(zip(FIELDS, SHAPES[shape])), **COMMON, "tie_word_embeddings": shape not in UNTIED}


def build(args, length: int):
    """The random model (same seed, so the same weights, in every child) and `rows` random token rows."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=args.vocab, max_position_embeddings=PROMPT + length + 8, use_cache=False,
                         **shape_fields(args.shape[0]))
    with torch.device(args.device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype_of(args), attn_implementation="sdpa")
    model.train()
    if args.checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    tokens = torch.Generator().manual_seed(1)
    ids = torch.randint(0, args.vocab, (args.rows, PROMPT + length), generator=tokens).to(args.device)
    return model, ids, torch.ones_like(ids)


def dtype_of(args):
    import torch

    name = args.dtype if args.dtype != "auto" else ("float32" if args.device == "cpu" else "bfloat16")
    return getattr(torch, name)


def prepare(lib: str, model, args) -> None:
    """Give the model the forward its library scores with (plain needs nothing)."""
    if lib == "rlft":
        from rlft.model.scoring import install_scoring

        install_scoring(model)
        if args.tile_elements:  # rlft's tile size (float32 logits per tile), to measure the default's choice
            import rlft.core.fused_head as fused_head

            fused_head.TILE_ELEMENTS = fused_head.GPU_TILE_ELEMENTS = args.tile_elements
    elif lib == "trl":
        from trl.trainer.utils import add_fused_lm_head

        add_fused_lm_head(model)


def measure(lib: str, model, ids, mask, length: int, repeats: int, sync) -> dict:
    """Median seconds of `repeats` forward + backward passes after a warm-up; the last one's checksums."""
    times = []
    for _ in range(repeats + 1):
        model.zero_grad(set_to_none=True)
        sync()
        started = time.perf_counter()
        logps = score(lib, model, ids, mask, length)
        logps.sum().backward()
        sync()
        times.append(time.perf_counter() - started)
    grad = model.get_input_embeddings().weight.grad
    seconds = statistics.median(times[1:])
    return {"seconds": round(seconds, 4), "tokens_per_s": round(ids.shape[0] * length / seconds, 1),
            "logp_sum": float(logps.detach().double().sum()), "grad_norm": float(grad.double().norm())}


def versions(lib: str) -> dict:
    import torch
    import transformers

    found = {"python": platform.python_version(), "torch": torch.__version__,
             "transformers": transformers.__version__}
    if lib == "trl":
        import trl

        found["trl"] = trl.__version__
    return found


def child(args) -> dict:
    """One library at one shape and length, in this process: the JSON line the parent collects."""
    import torch

    lib, length, cuda = args.child, args.lengths[0], args.device.startswith("cuda")
    if lib == "rlft-torch":  # read when the kernels are first asked for
        os.environ["RLFT_TRITON"] = "0"
    scorer = "rlft" if lib.startswith("rlft") else lib
    row = {"lib": lib, "shape": args.shape[0], "rows": args.rows, "length": length, "tile_elements": args.tile_elements,
           "dtype": str(dtype_of(args)).removeprefix("torch."), "versions": versions(lib),
           "device_name": torch.cuda.get_device_name(args.device) if cuda else f"CPU ({platform.machine()})"}
    model, ids, mask = build(args, length)
    prepare(scorer, model, args)
    row["model_gb"] = round(sum(p.numel() * p.element_size() for p in model.parameters()) / 2**30, 3)
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(args.device)
    sync = (lambda: torch.cuda.synchronize(args.device)) if cuda else (lambda: None)
    try:
        row.update(measure(scorer, model, ids, mask, length, args.repeats, sync))
    except torch.cuda.OutOfMemoryError:  # a row that says so, with the peak it reached
        row["error"] = "out of memory"
    if cuda:
        row["memory"] = "cuda max_memory_allocated"
        row["peak_gb"] = torch.cuda.max_memory_allocated(args.device)
        row["peak_reserved_gb"] = round(torch.cuda.max_memory_reserved(args.device) / 2**30, 3)
    else:  # ru_maxrss is in KiB on Linux
        row["memory"], row["peak_gb"] = "peak RSS", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 2**10
    row["peak_gb"] = round(row["peak_gb"] / 2**30, 3)
    return row


def run(args, lib: str, shape: str, length: int) -> dict:
    """Run one child with its library's interpreter; a crash becomes a row with its stderr's last line."""
    python = args.trl_python if lib == "trl" else sys.executable
    command = [python, __file__, "--child", lib, "--shape", shape, "--lengths", str(length),
               "--rows", str(args.rows), "--repeats", str(args.repeats), "--device", args.device,
               "--dtype", args.dtype, "--vocab", str(args.vocab)]
    command += [] if args.checkpointing else ["--no-checkpointing"]
    command += ["--tile-elements", str(args.tile_elements)] if args.tile_elements else []
    out = subprocess.run(command, capture_output=True, text=True, check=False)
    if out.returncode:
        last = (out.stderr.strip().splitlines() or [f"exit status {out.returncode}"])[-1]
        return {"lib": lib, "shape": shape, "rows": args.rows, "length": length, "error": last}
    return json.loads(out.stdout.strip().splitlines()[-1])


def table(results: list[dict]) -> list[str]:
    """The markdown table, with each row's memory and time relative to TRL's at the same shape and length."""
    memory = next((r["memory"] for r in results if "memory" in r), "peak memory")
    lines = [f"| shape | library | completion tokens | {memory} (GiB) | forward + backward (s) | tokens/s "
             "| vs trl (memory, time) | log-prob sum |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in results:
        head = f"| {r['shape']} | {r['lib']} | {r['length']} |"
        if "error" in r:
            peak = f"{r['peak_gb']:.2f}" if "peak_gb" in r else "-"
            lines.append(f"{head} {peak} | - | - | {r['error']} | - |")
            continue
        trl = next((t for t in results if t["lib"] == "trl" and t["shape"] == r["shape"]
                    and t["length"] == r["length"] and "error" not in t), None)
        ratio = f"{r['peak_gb'] / trl['peak_gb']:.2f}x, {r['seconds'] / trl['seconds']:.2f}x" if trl else "-"
        lines.append(f"{head} {r['peak_gb']:.2f} | {r['seconds']:.3f} | {r['tokens_per_s']:,.0f} | {ratio} "
                     f"| {r['logp_sum']:.6g} |")
    return lines


def report(args, results: list[dict]) -> str:
    """The file `--out` names: device, versions, settings, the exact command, the table and the JSON lines."""
    done = [r for r in results if "device_name" in r]
    device = done[0]["device_name"] if done else "(no child ran)"
    stacks: dict[str, list[str]] = {}  # the TRL child may run another interpreter, so each says what it ran
    for r in done:
        libs = stacks.setdefault(", ".join(f"{k} {v}" for k, v in r["versions"].items()), [])
        libs += [] if r["lib"] in libs else [r["lib"]]
    stack = "; ".join(f"{' and '.join(libs)}: {found}" for found, libs in stacks.items())
    settings = (f"{args.rows} rows x ({PROMPT} prompt + completion) tokens, vocabulary {args.vocab:,}, "
                f"dtype {done[0]['dtype'] if done else args.dtype}, gradient checkpointing "
                f"{'on' if args.checkpointing else 'off'}, median of {args.repeats} after 1 warm-up")
    return "\n".join([f"# rlft vs TRL 1.16 scoring on {device}", "",
                      f"Command: `{shlex.join(['python', *sys.argv])}`", "", f"Versions: {stack}", "",
                      f"Settings: {settings}.", "", *table(results), "", "```jsonl",
                      *(json.dumps(r) for r in results), "```", ""])


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", nargs="+", choices=sorted(SHAPES), default=["0.5b", "1.5b"])
    parser.add_argument("--libs", nargs="+", choices=LIBS, default=list(LIBS))
    parser.add_argument("--lengths", nargs="+", type=int, default=[1024, 4096],
                        help="completion tokens per row")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3, help="timed passes per child, after one warm-up")
    parser.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu")
    parser.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"],
                        help="auto: bfloat16 on a GPU, float32 on a CPU")
    parser.add_argument("--vocab", type=int, default=VOCAB)
    parser.add_argument("--no-checkpointing", dest="checkpointing", action="store_false",
                        help="keep every layer's activations (GRPO in both libraries checkpoints by default)")
    parser.add_argument("--tile-elements", type=int, default=None,
                        help="rlft: float32 logits per LM-head tile (default: rlft's own choice)")
    parser.add_argument("--trl-python", default=sys.executable, help="interpreter with trl==1.16.0 installed")
    parser.add_argument("--out", default=None, help="write the table and JSON lines to this markdown file")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    return parser.parse_args()


def main() -> None:
    args = parse()
    if args.child:
        print(json.dumps(child(args)))
        return
    results, turn = [], 0
    for shape in args.shape:
        for length in args.lengths:
            for lib in args.libs if turn % 2 == 0 else args.libs[::-1]:
                results.append(run(args, lib, shape, length))
                print(json.dumps(results[-1]), flush=True)
            turn += 1
    print("\n" + "\n".join(table(results)))
    if args.out:
        Path(args.out).write_text(report(args, results))
        print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
