"""Drawing the next token: torch.multinomial (what transformers' generate calls) against rlft's inversion sampler
(rlft/core/sampling.py, the TokenSampler rlft's HF engine puts last in the chain), alone and inside a whole
generate run.

1. One draw for 16 rows from softmax(scores) at vocabularies of 32,000 and 151,936 (ms per draw, median of
   alternating repeats).
2. rlft's HF engine generating 16 completions of 64 tokens on workload d's model (a Qwen2 of hidden 512 x 4
   layers at vocabulary 151,936, random weights, float32): `draw_tokens` on (rlft's sampler) and off
   (generate's torch.multinomial), alternating.

    python benchmarks/sampling.py                      # ~3 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from datetime import date
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def draw_ms(vocab: int, repeats: int) -> dict:
    from rlft.core.sampling import inverse_cdf_sample

    scores = torch.randn(16, vocab, generator=torch.Generator().manual_seed(0)) * 3
    ways = {"torch.multinomial": lambda p: torch.multinomial(p, 1),
            "rlft inversion": lambda p: inverse_cdf_sample(p, torch.rand(p.shape[0], dtype=torch.float64))}
    times = {name: [] for name in ways}
    for _ in range(repeats):
        for name, draw in ways.items():
            started = time.perf_counter()
            draw(torch.softmax(scores, -1))
            times[name].append(1000 * (time.perf_counter() - started))
    return {name: statistics.median(t) for name, t in times.items()}


def generate_seconds(repeats: int, new_tokens: int) -> dict:
    from benchmarks.workloads import WORKLOADS, build
    from rlft.rollout.hf import HFGenerator

    work = build(WORKLOADS["d"])
    text = work.tokenizer.apply_chat_template(work.rows[0]["prompt"], add_generation_prompt=True, tokenize=False)
    prompt = work.tokenizer(text)["input_ids"]
    times = {"generate's multinomial": [], "rlft's TokenSampler": []}
    for _ in range(repeats):
        for name, draw in (("generate's multinomial", False), ("rlft's TokenSampler", True)):
            engine = HFGenerator(work.tokenizer, new_tokens, draw_tokens=draw)
            started = time.perf_counter()
            engine(work.model, [prompt], 16)
            times[name].append(time.perf_counter() - started)
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results-sampling.json"))
    args = parser.parse_args()
    torch.set_num_threads(2)
    results = {"date": str(date.today()), "machine": f"{platform.machine()}, 2 CPU threads",
               "torch": torch.__version__, "draw_ms_16_rows": {}}
    for vocab in (32000, 151936):
        results["draw_ms_16_rows"][str(vocab)] = draw_ms(vocab, 10 * args.repeats)
        print(vocab, results["draw_ms_16_rows"][str(vocab)], flush=True)
    results[f"generate_seconds_16x{args.new_tokens}"] = generate_seconds(args.repeats, args.new_tokens)
    print(json.dumps(results, indent=1))
    Path(args.out).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))  # benchmarks.workloads
    main()
