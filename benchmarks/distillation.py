"""On-policy distillation steps side by side: rlft's DistillationTrainer vs TRL 1.16's, on identical fixed
completions, at Qwen's vocabulary (151,936).

Each variant runs in its own process with the same student (Qwen2 architecture, random weights, hidden 256,
4 layers), teacher (Qwen2, hidden 512, 4 layers), vocabulary 151,936 (untied heads, float32 on CPU, sdpa
attention), LoRA on the student (r=16, all-linear: never the LM head, which both libraries read as a weight),
beta 0.5 (the generalized JSD: both distributions are needed in full), temperature 1, gradient checkpointing on
(both libraries' default), and batch: G completions of L tokens behind one 64-token prompt, all in one
micro-batch (per_device_train_batch_size=G, gradient_accumulation_steps=1):

    rlft   rlft DistillationTrainer
    trl    TRL 1.16.0 DistillationTrainer

Generation is fixed: `GenerationMixin.generate` (both call `model.generate`) returns the prompt followed by
deterministic completion tokens, each L tokens ending in EOS, so both libraries train on the same tokens (the
run checks their loss at the first step agrees: the same student, teacher, completions and formula). Timed
per step: on_step_begin to on_step_end minus the time inside `generate`; each run's first step is a warm-up.
Memory: the peak resident set of each process (weights of both models, optimiser, activations, the LM heads'
tiles).

Needs rlft and trl==1.16.0 in one environment (benchmarks/packing.py says how); from the repo root:

    .venv-bench/bin/python benchmarks/distillation.py            # G=4 completions of 1,024 tokens
    .venv-bench/bin/python benchmarks/distillation.py --quick     # tiny smoke run
    .venv-bench/bin/python benchmarks/distillation.py --teachers 2   # rlft with two teachers (below)

With `--teachers 2` rlft distils from two teachers of the teacher's shape (seeds 1 and 2), each row routed by its
`teacher_id` (a, b, a, b: each teacher scores about half the rows), against TRL's one-teacher step on the same rows:
the same teacher work in tokens and FLOPs. TRL 1.16's own multi-teacher trainer (experimental async distillation)
takes its student and teachers from vLLM servers with NCCL weight transfer, which a CPU cannot run, so its
one-teacher DistillationTrainer is the nearest TRL step; rlft holds both teachers in memory, TRL one.
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
VARIANTS = ("rlft", "trl")
FULL = {"vocab": 151936, "student": (256, 4, 768), "teacher": (512, 4, 1536), "prompt": 64, "length": 1024,
        "completions": 4}
QUICK = {"vocab": 4096, "student": (64, 2, 128), "teacher": (96, 2, 192), "prompt": 8, "length": 32,
         "completions": 4}
TIMERS = {"generation": 0.0}


def build(spec: dict):
    """(student, teacher, tokenizer, rows)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from rlft.tiny import build_tokenizer

    tokenizer = build_tokenizer(seed=0)
    tokenizer.add_tokens([f"<tok{i}>" for i in range(spec["vocab"] - len(tokenizer))])
    prompt = "".join(f"<tok{i}>" for i in range(spec["prompt"]))

    def model(hidden, layers, intermediate, seed):
        config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=hidden, num_hidden_layers=layers,
                             num_attention_heads=4, num_key_value_heads=2, intermediate_size=intermediate,
                             max_position_embeddings=spec["prompt"] + spec["length"] + 64,
                             tie_word_embeddings=False, pad_token_id=tokenizer.pad_token_id,
                             eos_token_id=tokenizer.eos_token_id, attn_implementation="sdpa")
        torch.manual_seed(seed)
        built = Qwen2ForCausalLM(config)
        built.generation_config.pad_token_id = tokenizer.pad_token_id
        built.generation_config.eos_token_id = tokenizer.eos_token_id
        built.generation_config.max_length = None
        return built

    teachers = [model(*spec["teacher"], 1 + k) for k in range(spec.get("teachers", 1))]
    return (model(*spec["student"], 0), teachers, tokenizer,
            [{"prompt": prompt, "teacher_id": "ab"[i % 2]} for i in range(64)])


def instrument(spec: dict, tokenizer) -> None:
    """`generate` returns fixed completions (the time inside it counted and subtracted)."""
    import torch
    from transformers import GenerationMixin

    def fixed_generate(self, *args, **kwargs):
        started = time.perf_counter()
        ids = kwargs["input_ids"] if "input_ids" in kwargs else args[0]
        block = torch.empty((ids.shape[0], spec["length"]), dtype=torch.long)
        for i in range(ids.shape[0]):
            g = torch.Generator().manual_seed(1000 + i)
            block[i] = torch.randint(16, spec["vocab"], (spec["length"],), generator=g)
            block[i, -1] = tokenizer.eos_token_id
        TIMERS["generation"] += time.perf_counter() - started
        return torch.cat([ids, block.to(ids.device)], dim=1)

    GenerationMixin.generate = fixed_generate


def clock(steps: list[dict]):
    from transformers import TrainerCallback

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self.started, self.before = time.perf_counter(), TIMERS["generation"]

        def on_step_end(self, args, state, control, **kwargs):
            seconds = time.perf_counter() - self.started
            steps.append({"update_seconds": seconds - (TIMERS["generation"] - self.before)})

    return Clock()


def worker(variant: str, spec: dict, steps: int, out_dir: str) -> dict:
    import datasets
    import torch
    from peft import LoraConfig

    student, teachers, tokenizer, rows = build(spec)
    teacher = teachers[0] if variant == "trl" or len(teachers) == 1 else dict(zip("ab", teachers))
    instrument(spec, tokenizer)
    lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")
    measured: list[dict] = []
    fields = dict(output_dir=out_dir, max_steps=steps, per_device_train_batch_size=spec["completions"],
                  gradient_accumulation_steps=1, max_completion_length=spec["length"], learning_rate=1e-4,
                  lr_scheduler_type="constant", beta=0.5, temperature=1.0, seed=0, logging_steps=1,
                  gradient_checkpointing=True, disable_tqdm=True, max_grad_norm=1.0)
    if variant == "rlft":
        from rlft import DistillationConfig, DistillationTrainer

        cfg = DistillationConfig(**fields, overwrite_output_dir=True, report_to=["none"], save_steps=10**6,
                                 shared_prompt_prefill=False)
        trainer = DistillationTrainer(student, teacher, cfg, rows, processing_class=tokenizer, peft_config=lora,
                                      callbacks=[clock(measured)])
    else:
        from trl import DistillationConfig, DistillationTrainer

        cfg = DistillationConfig(**fields, report_to="none", save_strategy="no", bf16=False, use_cpu=True)
        trainer = DistillationTrainer(model=student, teacher_model=teacher, args=cfg,
                                      train_dataset=datasets.Dataset.from_list([{"prompt": r["prompt"]}
                                                                                for r in rows]),
                                      processing_class=tokenizer,
                                      peft_config=lora, callbacks=[clock(measured)])
    torch.manual_seed(0)
    trainer.train()
    losses = [row["loss"] for row in trainer.state.log_history if "loss" in row]
    return {"variant": variant, "steps": measured, "losses": losses,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def run(variant: str, steps: int, quick: bool, teachers: int = 1) -> dict:
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", variant, "--steps", str(steps),
               "--teachers", str(teachers)] + (["--quick"] if quick else [])
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    if result.returncode:
        raise RuntimeError(f"{variant} failed:\n{result.stderr[-6000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def alternate(run, args) -> dict[str, list[dict]]:
    """`run(variant)` `args.repeats` times per variant, alternating rlft trl, trl rlft."""
    runs = {v: [] for v in VARIANTS}
    for repeat in range(args.repeats):
        for variant in VARIANTS if repeat % 2 == 0 else VARIANTS[::-1]:
            runs[variant].append(run(variant))
            print(f"{variant} run {repeat}: {[round(s['update_seconds'], 2) for s in runs[variant][-1]['steps']]} "
                  f"s/step, peak RSS {runs[variant][-1]['peak_rss_mb']:.0f} MB", file=sys.stderr, flush=True)
    return runs


def summarize(runs: dict, spec: dict, args) -> dict:
    """Medians of the measured steps (each run's first dropped), peak memory, first-step losses, the ratios."""
    import torch
    import transformers
    import trl

    summary = {}
    for variant, done in runs.items():
        seconds = [s["update_seconds"] for r in done for s in r["steps"][1:]]
        summary[variant] = {"median_update_seconds": statistics.median(seconds), "update_seconds": seconds,
                            "peak_rss_mb": max(r["peak_rss_mb"] for r in done),
                            "first_loss": done[0]["losses"][0]}
    r, t = summary["rlft"], summary["trl"]
    return {"date": str(date.today()), "quick": args.quick, "spec": spec, "rlft_teachers": args.teachers, "steps": args.steps,
            "repeats": args.repeats, "machine": f"{os.cpu_count()} CPU cores ({platform.machine()}), "
            f"torch threads {torch.get_num_threads()}, float32",
            "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                         "trl": trl.__version__},
            "variants": summary,
            "first_loss_relative_gap": abs(r["first_loss"] - t["first_loss"]) / abs(t["first_loss"]),
            "time_ratio": r["median_update_seconds"] / t["median_update_seconds"],
            "memory_ratio": r["peak_rss_mb"] / t["peak_rss_mb"]}


def report(results: dict, spec: dict, out: str | None) -> None:
    """Write the results JSON (when `out`) and print the table and the first-step losses."""
    if out:
        Path(out).write_text(json.dumps(results, indent=2) + "\n")
    r, t = results["variants"]["rlft"], results["variants"]["trl"]
    print(f"| shape | rlft s/step | TRL s/step | time rlft/TRL | rlft peak RSS MB | TRL peak RSS MB | memory rlft/TRL |\n"
          f"| --- | --- | --- | --- | --- | --- | --- |\n"
          f"| {spec['completions']} x {spec['length']} tokens, vocab {spec['vocab']:,} | "
          f"{r['median_update_seconds']:.2f} | {t['median_update_seconds']:.2f} | {results['time_ratio']:.2f}x | "
          f"{r['peak_rss_mb']:.0f} | {t['peak_rss_mb']:.0f} | {results['memory_ratio']:.2f}x |")
    if results.get("rlft_teachers", 1) == 1:  # (two teachers: another loss)
        print(f"first-step loss rlft {r['first_loss']:.6f} vs TRL {t['first_loss']:.6f} "
              f"(relative gap {results['first_loss_relative_gap']:.2e})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=2, help="runs per variant, alternating rlft trl, trl rlft")
    parser.add_argument("--steps", type=int, default=3, help="steps per run; the first is a warm-up")
    parser.add_argument("--quick", action="store_true", help="tiny model and vocabulary: a smoke run")
    parser.add_argument("--out", default=None, help="results JSON (default benchmarks/results-distillation.json; "
                                                    "none with --quick)")
    parser.add_argument("--teachers", type=int, choices=[1, 2], default=1,
                        help="2: rlft distils from two teachers, rows routed by teacher_id (module docstring)")
    parser.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    spec = {**(QUICK if args.quick else FULL), "teachers": args.teachers}
    if args.worker:
        import tempfile

        with tempfile.TemporaryDirectory() as out_dir:
            print(json.dumps(worker(args.worker, spec, args.steps, out_dir)))
        return
    runs = alternate(lambda variant: run(variant, args.steps, args.quick, args.teachers), args)
    name = "results-distillation.json" if args.teachers == 1 else "results-multi-teacher.json"
    out = args.out or (None if args.quick else str(ROOT / "benchmarks" / name))
    report(summarize(runs, spec, args), spec, out)


if __name__ == "__main__":
    main()
