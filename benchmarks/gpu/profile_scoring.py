"""Where a scoring forward + backward spends its GPU time, rlft's fused LM head against TRL 1.16's: the
workload of bench.py (Qwen2.5 shape, random weights, bfloat16, gradient checkpointing, `--rows` completions
of `--length` tokens after a 64-token prompt), one pass after a warm-up under torch.profiler, the operators
with the most device time for each library.

    python benchmarks/gpu/profile_scoring.py --shape 0.5b --length 4096 --out benchmarks/gpu/profile-h100.md
    python benchmarks/gpu/profile_scoring.py --device cpu --shape tiny --length 32 --rows 2 --libs rlft   # CPU
"""

from __future__ import annotations

import argparse
import gc
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.gpu.bench import SHAPES, VOCAB, build, prepare  # noqa: E402
from benchmarks.score_vocab import score  # noqa: E402


def profile(args, lib: str) -> str:
    import torch
    from torch.profiler import ProfilerActivity, profile

    build_args = argparse.Namespace(shape=[args.shape], vocab=args.vocab, device=args.device, dtype="auto",
                                    checkpointing=True, rows=args.rows, tile_elements=None)
    model, ids, mask = build(build_args, args.length)
    prepare(lib, model, build_args)
    cuda = args.device.startswith("cuda")

    def step():
        model.zero_grad(set_to_none=True)
        score(lib, model, ids, mask, args.length).sum().backward()
        if cuda:
            torch.cuda.synchronize()

    step()  # warm-up
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        step()
    key = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=key, row_limit=args.rows_shown, max_name_column_width=60)
    return f"## {lib}\n\n```\n{table}\n```\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="0.5b")
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--libs", nargs="+", default=["rlft", "trl"])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--vocab", type=int, default=VOCAB)
    parser.add_argument("--rows-shown", type=int, default=25)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    import torch

    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else "CPU"
    parts = [f"# Scoring profile on {device}", "", f"Command: `{shlex.join(['python', *sys.argv])}`", "",
             f"torch {torch.__version__}; Qwen2.5-{args.shape} shape, {args.rows} x (64 + {args.length}) tokens, "
             "one forward + backward after a warm-up.", ""]
    for lib in args.libs:
        parts.append(profile(args, lib))
        gc.collect()  # the model a patched forward holds in a reference cycle goes before the next is built
    text = "\n".join(parts)
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
