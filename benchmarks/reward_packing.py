"""Reward-model training steps with pairs packed vs padded vs TRL 1.16's RewardTrainer, on identical
pre-tokenized pairs (`chosen_ids` / `rejected_ids`, which both libraries take as they are).

Three variants, each run in its own process, with the same sequence classifier (Qwen2 architecture, random
weights, hidden 256, 4 layers, 4 heads, 2 kv heads, intermediate 768, vocabulary 32k, float32 on CPU, sdpa
attention), full fine-tuning, AdamW, gradient checkpointing on (TRL's default), 4 pairs per micro-batch, one
micro-batch per step:

    rlft-padded   rlft RewardTrainer, padding_free=False (the 8 sequences padded to the longest)
    rlft-packed   rlft RewardTrainer, padding_free=True (one packed sequence, each pair's prompt held once)
    trl           TRL 1.16.0 RewardTrainer (padded to the longest)

Shapes (each pair: one prompt, a chosen and a rejected answer after it):
    long-prompt   a 1,024-token prompt per pair, answers of 32-256 tokens
    skewed        a 64-token prompt per pair, one answer of 1,024 tokens in the batch, the others 32-128

Timed per step: on_step_begin to on_step_end; each run's first step (warm-up, rlft-packed's exactness check)
dropped, the median over the other steps of both runs reported. Memory: peak RSS of each process.

    .venv-bench/bin/python benchmarks/reward_packing.py          # 2 shapes x 3 variants x 2 runs, ~6 minutes
    .venv-bench/bin/python benchmarks/reward_packing.py --quick  # smoke run
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = ("rlft-padded", "rlft-packed", "trl")
SHAPES = {"long-prompt": (1024, (32, 256), None), "skewed": (64, (32, 128), 1024)}
QUICK_SHAPES = {"long-prompt": (96, (4, 24), None), "skewed": (8, (4, 12), 96)}
PAIRS, STEPS = 4, 4


def pairs(shape: tuple, vocab: int, count: int) -> list[dict]:
    """`count` pre-tokenized pairs; with a long answer, each batch of PAIRS has one."""
    prompt_len, (low, high), long = shape
    rng = random.Random(0)
    rows = []
    for i in range(count):
        prompt = [rng.randrange(16, vocab) for _ in range(prompt_len)]
        answers = [[rng.randrange(16, vocab) for _ in range(rng.randint(low, high))] for _ in range(2)]
        if long and i % PAIRS == 0:
            answers[0] = [rng.randrange(16, vocab) for _ in range(long)]
        rows.append({"chosen_ids": prompt + answers[0], "rejected_ids": prompt + answers[1]})
    return rows


def model_dir(quick: bool) -> str:
    import torch
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    from rlft.tiny import build_tokenizer

    folder = tempfile.mkdtemp(prefix="rm-bench-")
    tokenizer = build_tokenizer(seed=0)
    vocab = 1024 if quick else 32000
    tokenizer.add_tokens([f"<tok{i}>" for i in range(vocab - len(tokenizer))])
    hidden, layers = (64, 2) if quick else (256, 4)
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=hidden, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, intermediate_size=3 * hidden,
                         max_position_embeddings=4096, pad_token_id=tokenizer.pad_token_id, num_labels=1)
    torch.manual_seed(0)
    Qwen2ForSequenceClassification(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def worker(variant: str, shape_name: str, folder: str, quick: bool) -> dict:
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback

    torch.set_num_threads(2)
    shape = (QUICK_SHAPES if quick else SHAPES)[shape_name]
    vocab = 1024 if quick else 32000
    data = Dataset.from_list(pairs(shape, vocab, PAIRS * STEPS))
    longest = max(len(r) for row in data for r in (row["chosen_ids"], row["rejected_ids"]))
    times: list[float] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self.started = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            times.append(time.perf_counter() - self.started)

    common = dict(output_dir=tempfile.mkdtemp(), max_steps=STEPS, per_device_train_batch_size=PAIRS,
                  learning_rate=1e-5, logging_steps=1, save_strategy="no", report_to="none", seed=0,
                  max_length=longest, gradient_checkpointing=True, disable_tqdm=True, bf16=False)
    if variant == "trl":
        from trl import RewardConfig, RewardTrainer

        trainer = RewardTrainer(folder, RewardConfig(**common), train_dataset=data, callbacks=[Clock()])
    else:
        from rlft import RewardConfig, RewardTrainer

        cfg = RewardConfig(**common, padding_free=variant == "rlft-packed")
        trainer = RewardTrainer(folder, cfg, train_dataset=data, callbacks=[Clock()])
    trainer.train()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"times": times[1:], "peak_rss_mb": peak}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--worker", nargs=3)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results-reward-packing.json"))
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(*args.worker[:2], args.worker[2], args.quick)))
        return
    folder = model_dir(args.quick)
    results = {"date": str(date.today()), "machine": platform.machine(), "shapes": {}}
    for shape in (QUICK_SHAPES if args.quick else SHAPES):
        runs = {v: [] for v in VARIANTS}
        for _ in range(2):  # alternating
            for variant in VARIANTS:
                cmd = [sys.executable, __file__, "--worker", variant, shape, folder] + \
                      (["--quick"] if args.quick else [])
                out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
                if out.returncode:
                    raise SystemExit(out.stderr[-3000:])
                runs[variant].append(json.loads(out.stdout.strip().splitlines()[-1]))
        results["shapes"][shape] = {
            v: {"step_s": statistics.median(t for r in rs for t in r["times"]),
                "peak_rss_mb": max(r["peak_rss_mb"] for r in rs)} for v, rs in runs.items()}
        print(shape, json.dumps(results["shapes"][shape]), flush=True)
    Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    print("| shape | rlft padded s | rlft packed s | TRL s | packed/TRL time | peak RSS MB padded / packed / "
          "TRL |")
    print("| --- | --- | --- | --- | --- | --- |")
    for shape, r in results["shapes"].items():
        pad, pack, trl = (r[v] for v in VARIANTS)
        print(f"| {shape} | {pad['step_s']:.2f} | {pack['step_s']:.2f} | {trl['step_s']:.2f} | "
              f"{pack['step_s'] / trl['step_s']:.2f}x | {pad['peak_rss_mb']:,.0f} / {pack['peak_rss_mb']:,.0f} / "
              f"{trl['peak_rss_mb']:,.0f} |")


if __name__ == "__main__":
    main()
