"""GKD steps side by side: rlft's GKDTrainer vs TRL 1.16's experimental GKDTrainer, on the same dataset
completions, at Qwen's vocabulary (151,936).

The models, vocabulary, LoRA and gradient checkpointing are benchmarks/distillation.py's (student Qwen2 hidden
256 x 4 layers, teacher hidden 512 x 4 layers, random weights, untied heads, float32 on CPU, sdpa). GKD's own
settings: beta 0.5 (the generalized JSD: both distributions in full), lmbda 0 (every step trains on the
dataset's completions, so both libraries train on the same tokens without generating), TRL's `messages`
format: a 64-token user turn and a 1,024-token assistant turn per row, rendered by the same chat template.
Batch: G rows in one micro-batch (per_device_train_batch_size=G, gradient_accumulation_steps=1).

    rlft   rlft GKDTrainer (the divergence tile by tile over the vocabulary: rlft/core/distill.py)
    trl    TRL 1.16.0 trl.experimental.gkd.GKDTrainer (student and teacher logits [G, T, V] in full)

Timed per step (on_step_begin to on_step_end; the first step of each run is a warm-up); memory: each
process's peak resident set. G is 2 by default: TRL's step holds about ten [G, T, V] float32 tensors at once,
which at G = 4 exceeds this machine's 24 GiB.

Needs rlft and trl==1.16.0 in one environment (benchmarks/packing.py says how); from the repo root:

    .venv-bench/bin/python benchmarks/gkd.py            # G=2 rows with 1,024-token completions
    .venv-bench/bin/python benchmarks/gkd.py --quick    # tiny smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.distillation import (  # noqa: E402 (the same models, clock and report)
    FULL,
    QUICK,
    alternate,
    build,
    clock,
    report,
    summarize,
)

VARIANTS = ("rlft", "trl")


def rows(spec: dict, tokenizer) -> list[dict]:
    """TRL's GKD format: a user turn and the assistant turn distilled on (fixed tokens ending the text)."""
    import torch

    prompt = "".join(f"<tok{i}>" for i in range(spec["prompt"]))
    out = []
    for i in range(64):
        g = torch.Generator().manual_seed(1000 + i)
        ids = torch.randint(0, spec["vocab"] - 400, (spec["length"],), generator=g)  # added "<tokN>" tokens
        completion = "".join(f"<tok{int(t)}>" for t in ids)
        out.append({"messages": [{"role": "user", "content": prompt},
                                 {"role": "assistant", "content": completion}]})
    return out


def worker(variant: str, spec: dict, steps: int, out_dir: str) -> dict:
    import datasets
    import torch
    from peft import LoraConfig

    student, teacher, tokenizer, _ = build(spec)
    dataset = datasets.Dataset.from_list(rows(spec, tokenizer))
    lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")
    measured: list[dict] = []
    fields = dict(output_dir=out_dir, max_steps=steps, per_device_train_batch_size=spec["completions"],
                  gradient_accumulation_steps=1, learning_rate=1e-4, lr_scheduler_type="constant", beta=0.5,
                  lmbda=0.0, seed=0, logging_steps=1, gradient_checkpointing=True, disable_tqdm=True,
                  max_grad_norm=1.0, max_new_tokens=spec["length"] + 8)
    if variant == "rlft":
        from rlft import GKDConfig, GKDTrainer

        cfg = GKDConfig(**fields, overwrite_output_dir=True, report_to=["none"], save_steps=10**6,
                        max_prompt_length=spec["prompt"] + 32)
    else:
        from trl.experimental.gkd import GKDConfig, GKDTrainer

        cfg = GKDConfig(**fields, report_to="none", save_strategy="no", bf16=False, use_cpu=True,
                        max_length=spec["prompt"] + spec["length"] + 64)
    trainer = GKDTrainer(model=student, teacher_model=teacher, args=cfg, train_dataset=dataset,
                         processing_class=tokenizer, peft_config=lora, callbacks=[clock(measured)])
    torch.manual_seed(0)
    trainer.train()
    losses = [row["loss"] for row in trainer.state.log_history if "loss" in row]
    return {"variant": variant, "steps": measured, "losses": losses,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def run(variant: str, steps: int, quick: bool, completions: int) -> dict:
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", variant, "--steps", str(steps),
               "--completions", str(completions)] + (["--quick"] if quick else [])
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    if result.returncode:
        raise RuntimeError(f"{variant} failed:\n{result.stderr[-6000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=2, help="runs per variant, alternating rlft trl, trl rlft")
    parser.add_argument("--steps", type=int, default=3, help="steps per run; the first is a warm-up")
    parser.add_argument("--completions", type=int, default=2, help="rows per step (G)")
    parser.add_argument("--quick", action="store_true", help="tiny model and vocabulary: a smoke run")
    parser.add_argument("--out", default=None, help="results JSON (default benchmarks/results-gkd.json; none "
                                                    "with --quick)")
    parser.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    spec = {**(QUICK if args.quick else FULL), "completions": args.completions}
    if args.worker:
        import tempfile

        with tempfile.TemporaryDirectory() as out_dir:
            print(json.dumps(worker(args.worker, spec, args.steps, out_dir)))
        return
    runs = alternate(lambda variant: run(variant, args.steps, args.quick, args.completions), args)
    out = args.out or (None if args.quick else str(ROOT / "benchmarks" / "results-gkd.json"))
    report(summarize(runs, spec, args), spec, out)


if __name__ == "__main__":
    main()
