"""Padding-free (packed) scoring vs padded scoring vs TRL: the policy-update step on identical fixed rollouts.

Three variants, each run in its own process, with the same model (Qwen2 architecture, random weights, float32
on CPU, sdpa attention), LoRA (r=16, all-linear), learning rate, loss (dapo), beta=0, num_iterations=1 and
batch: one prompt x G completions per step, all G rows in ONE micro-batch (per_device_train_batch_size=G,
gradient_accumulation_steps=1) in every variant:

    rlft-padded   rlft GRPOTrainer, padding_free=False (a micro-batch padded to its longest prompt and
                  completion)
    rlft-packed   rlft GRPOTrainer, padding_free=True (the rows packed into one sequence, the shared prompt
                  held once: shared_prefix_scoring=True, the default)
    trl           TRL 1.16.0 GRPOTrainer (padded to the batch's longest prompt and completion)

Generation is fixed: `GenerationMixin.generate` (both libraries call `model.generate`) returns the prompt
followed by deterministic completion tokens of the shape's lengths, each ending in EOS, then padding; rlft's
shared prompt prefill (a forward outside `generate`) is off. Timed per step: on_step_begin to on_step_end
(generation, rewards, the scoring forward with log-probs, backward, optimiser step) minus the time inside
`generate`. Each run's first step (warm-up; rlft-packed's exactness check) is dropped; the median over the
other steps of all runs is reported. "computed tokens": tokens through the backbone's forwards in a step (rows
x padded width, or the packed length); "real tokens": prompt + completion tokens without padding, the prompt
counted once per completion (G*P + sum of lengths). The run checks that every variant gets the same
completions (their lengths and a hash of the ids the reward function receives), one forward per step, and
that the forwards' attention masks hold exactly the real tokens.

Shapes (prompt tokens x completion lengths, EOS included): skewed 64 x (one 2048, fifteen 96); shared-prompt
3072 x eight 64; long-completions 64 x eight 1024. Model: hidden 256, 4 layers, 4 heads, 2 kv heads,
intermediate 768, vocab 32k (~11M parameters, 8.2M of them the tied embedding).

Needs rlft and trl==1.16.0 in one environment (same torch / transformers for both); from the repo root:

    python3 -m venv .venv-bench && .venv-bench/bin/pip install torch==2.13.0 && \\
        .venv-bench/bin/pip install -e . trl==1.16.0
    .venv-bench/bin/python benchmarks/packing.py            # full: 3 shapes x 3 variants x 2 repeats
    .venv-bench/bin/python benchmarks/packing.py --quick --out /tmp/packing-quick.json   # tiny smoke run
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = ("rlft-padded", "rlft-packed", "trl")


@dataclass
class Shape:
    prompt: int  # prompt tokens
    lengths: list[int]  # each completion's tokens, EOS included


@dataclass
class Model:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int


SHAPES = {"skewed": Shape(64, [2048] + [96] * 15), "shared-prompt": Shape(3072, [64] * 8),
          "long-completions": Shape(64, [1024] * 8)}
QUICK_SHAPES = {"skewed": Shape(8, [128] + [12] * 15), "shared-prompt": Shape(192, [8] * 8),
                "long-completions": Shape(8, [64] * 8)}
MODEL = Model(hidden=256, layers=4, heads=4, kv_heads=2, intermediate=768, vocab=32000)
QUICK_MODEL = Model(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, vocab=1024)

# ---------------------------------------------------------------------------------------------- worker side

TIMERS = {"generation": 0.0, "computed_tokens": 0, "mask_tokens": 0, "forwards": 0, "grad_forwards": 0}
SEEN: list[dict] = []  # what the reward function got, per call


def build(model_spec: Model, shape: Shape):
    """(model, tokenizer, rows): the prompt is P distinct added tokens, one token each."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from rlft.tiny import build_tokenizer

    tokenizer = build_tokenizer(seed=0)
    tokenizer.add_tokens([f"<tok{i}>" for i in range(model_spec.vocab - len(tokenizer))])
    added = model_spec.vocab - 512  # well clear of the trained BPE tokens and the special ones
    prompt = "".join(f"<tok{i % added}>" for i in range(shape.prompt))
    assert len(tokenizer(prompt, add_special_tokens=False)["input_ids"]) == shape.prompt
    context = shape.prompt + max(shape.lengths) + 64
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=model_spec.hidden,
                         num_hidden_layers=model_spec.layers, num_attention_heads=model_spec.heads,
                         num_key_value_heads=model_spec.kv_heads, intermediate_size=model_spec.intermediate,
                         max_position_embeddings=context, tie_word_embeddings=True,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                         attn_implementation="sdpa")
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.max_length = None
    return model, tokenizer, [{"prompt": prompt} for _ in range(64)]


def completions(rows: int, shape: Shape, vocab: int, eos: int, pad: int):
    """[rows, longest] deterministic completion tokens: row i has lengths[i % G] tokens, the last one EOS,
    then padding."""
    import torch

    width = max(shape.lengths)
    out = torch.full((rows, width), pad, dtype=torch.long)
    for i in range(rows):
        n = shape.lengths[i % len(shape.lengths)]
        g = torch.Generator().manual_seed(1000 + i)
        out[i, :n - 1] = torch.randint(16, vocab, (n - 1,), generator=g)  # ids 0-15: special and byte tokens
        out[i, n - 1] = eos
    return out


def instrument(shape: Shape, tokenizer, vocab: int) -> None:
    """Fixed generation (time inside it counted) and token counts of every backbone forward outside it."""
    import torch
    from transformers import GenerationMixin
    from transformers.models.qwen2.modeling_qwen2 import Qwen2Model

    def fixed_generate(self, *args, **kwargs):
        started = time.perf_counter()
        ids = kwargs["input_ids"] if "input_ids" in kwargs else args[0]
        block = completions(ids.shape[0], shape, vocab, tokenizer.eos_token_id, tokenizer.pad_token_id)
        TIMERS["generation"] += time.perf_counter() - started
        return torch.cat([ids, block.to(ids.device)], dim=1)

    forward = Qwen2Model.forward

    def counted(self, *args, **kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        mask = kwargs.get("attention_mask")
        TIMERS["computed_tokens"] += int(ids.numel())
        TIMERS["mask_tokens"] += int(ids.numel() if mask is None else mask.sum())
        TIMERS["forwards"] += 1
        TIMERS["grad_forwards"] += int(torch.is_grad_enabled())
        return forward(self, *args, **kwargs)

    GenerationMixin.generate, Qwen2Model.forward = fixed_generate, counted


def reward(completion_ids, **kwargs) -> list[float]:
    """Distinct-token ratio (a spread of rewards), recording what the trainer handed over."""
    digest = hashlib.sha1(json.dumps(sorted(completion_ids)).encode()).hexdigest()[:12]
    SEEN.append({"lengths": sorted((len(ids) for ids in completion_ids), reverse=True), "ids_sha1": digest})
    return [len(set(ids)) / max(len(ids), 1) for ids in completion_ids]


def clock(steps: list[dict]):
    from transformers import TrainerCallback

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self.started, self.before = time.perf_counter(), dict(TIMERS)

        def on_step_end(self, args, state, control, **kwargs):
            seconds = time.perf_counter() - self.started
            delta = {k: TIMERS[k] - self.before[k] for k in TIMERS}
            steps.append({"update_seconds": seconds - delta["generation"], "step_seconds": seconds, **delta})

    return Clock()


def config_fields(shape: Shape, steps: int, out_dir: str) -> dict:
    g = len(shape.lengths)
    return dict(output_dir=out_dir, max_steps=steps, num_generations=g, per_device_train_batch_size=g,
                gradient_accumulation_steps=1, max_completion_length=max(shape.lengths), temperature=1.0,
                top_p=1.0, learning_rate=1e-4, epsilon=0.2, scale_rewards="group", num_iterations=1,
                max_grad_norm=1.0, gradient_checkpointing=False, lr_scheduler_type="constant",
                loss_type="dapo", beta=0.0, seed=0, logging_steps=1, disable_tqdm=True, log_completions=False)


def worker(variant: str, shape: Shape, model_spec: Model, steps: int, out_dir: str) -> dict:
    import torch
    from peft import LoraConfig

    torch.manual_seed(0)
    model, tokenizer, rows = build(model_spec, shape)
    instrument(shape, tokenizer, model_spec.vocab)
    lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear",
                      task_type="CAUSAL_LM")
    measured: list[dict] = []
    fields = config_fields(shape, steps, out_dir)
    if variant.startswith("rlft"):
        from rlft import GRPOConfig, GRPOTrainer

        cfg = GRPOConfig(**fields, overwrite_output_dir=True, report_to=["none"], save_steps=10**6,
                         shared_prompt_prefill=False, padding_free=variant == "rlft-packed",
                         shared_prefix_scoring=True)
        trainer = GRPOTrainer(model, [reward], cfg, rows, processing_class=tokenizer, peft_config=lora,
                              callbacks=[clock(measured)])
    else:
        import datasets
        from trl import GRPOConfig, GRPOTrainer

        cfg = GRPOConfig(**fields, report_to="none", save_strategy="no", bf16=False, use_cpu=True,
                         steps_per_generation=1)
        trainer = GRPOTrainer(model=model, reward_funcs=[reward], args=cfg,
                              train_dataset=datasets.Dataset.from_list(rows), processing_class=tokenizer,
                              peft_config=lora, callbacks=[clock(measured)])
    trainer.train()
    return {"variant": variant, "steps": measured, "seen": SEEN,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}

# ---------------------------------------------------------------------------------------------- driver side


def run(variant: str, shape: str, steps: int, quick: bool) -> dict:
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", variant, "--shapes", shape,
               "--steps", str(steps)] + (["--quick"] if quick else [])
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    if result.returncode:
        raise RuntimeError(f"{variant}/{shape} failed:\n{result.stderr[-6000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def expected(shape: Shape) -> dict:
    g, p, total = len(shape.lengths), shape.prompt, sum(shape.lengths)
    return {"real_tokens": g * p + total, "real_tokens_prompt_once": p + total,
            "padded_tokens": g * (p + max(shape.lengths))}


def summarise(runs: list[dict], shape: Shape) -> dict:
    steps = [s for r in runs for s in r["steps"][1:]]  # each run's first step is its warm-up
    seconds = sorted(s["update_seconds"] for s in steps)
    q = statistics.quantiles(seconds, n=4) if len(seconds) > 1 else seconds * 3
    tokens = {s["computed_tokens"] for s in steps}
    mask_tokens = {s["mask_tokens"] for s in steps}
    return {"median_update_seconds": statistics.median(seconds), "p25": q[0], "p75": q[-1],
            "update_seconds": seconds, "steps_measured": len(seconds),
            "computed_tokens": statistics.median(s["computed_tokens"] for s in steps),
            "computed_tokens_seen": sorted(tokens), "mask_tokens_seen": sorted(mask_tokens),
            "forwards_per_step": sorted({(s["forwards"], s["grad_forwards"]) for s in steps}),
            "peak_rss_mb": max(r["peak_rss_mb"] for r in runs),
            "completions_seen": runs[0]["seen"][0] if runs[0]["seen"] else None,
            "completions_identical_across_steps": all(x == r["seen"][0] for r in runs for x in r["seen"])}


def check(shape: Shape, summary: dict) -> list[str]:
    """Problems with what the variants saw: the completions, and the tokens their forwards carried."""
    want, problems = expected(shape), []
    lengths = sorted(shape.lengths, reverse=True)
    seen = {v: s["completions_seen"] for v, s in summary.items()}
    for variant, s in summary.items():
        if seen[variant] is None or seen[variant]["lengths"] != lengths:
            problems.append(f"{variant}: completion lengths {seen[variant]} != {lengths}")
        if not s["completions_identical_across_steps"]:
            problems.append(f"{variant}: completions differ between steps")
        if s["forwards_per_step"] != [(1, 1)]:
            problems.append(f"{variant}: (forwards, with grad) per step {s['forwards_per_step']}, not one")
    if len({json.dumps(x) for x in seen.values()}) > 1:
        problems.append(f"completions differ across variants: {seen}")
    real = {"rlft-padded": want["real_tokens"], "trl": want["real_tokens"],
            "rlft-packed": want["real_tokens_prompt_once"]}
    for variant, s in summary.items():
        if s["mask_tokens_seen"] != [real[variant]]:
            problems.append(f"{variant}: forwards saw {s['mask_tokens_seen']} real tokens, "
                            f"expected {real[variant]}")
    for variant in ("rlft-padded", "trl"):
        if variant in summary and summary[variant]["computed_tokens_seen"] != [want["padded_tokens"]]:
            problems.append(f"{variant}: computed {summary[variant]['computed_tokens_seen']} tokens, "
                            f"expected {want['padded_tokens']} (G x (P + longest))")
    return problems


def table(results: dict) -> str:
    lines = ["| shape | rlft padded s/step | rlft packed s/step | TRL s/step | packed/TRL | packed/padded | "
             "computed tokens (padded / packed / TRL) | real tokens | peak RSS MB (padded / packed / TRL) |",
             "| --- " * 9 + "|"]
    for name, entry in results["shapes"].items():
        r = entry["variants"]
        med = {v: r[v]["median_update_seconds"] for v in VARIANTS}
        cells = [f"{med[v]:.2f} ({r[v]['p25']:.2f}-{r[v]['p75']:.2f})" for v in VARIANTS]
        tokens = " / ".join(f"{r[v]['computed_tokens']:,.0f}" for v in VARIANTS)
        rss = " / ".join(f"{r[v]['peak_rss_mb']:.0f}" for v in VARIANTS)
        ratios = f"{med['rlft-packed'] / med['trl']:.2f}x | {med['rlft-packed'] / med['rlft-padded']:.2f}x"
        real = entry["expected"]["real_tokens"]
        lines.append(f"| {name} | {' | '.join(cells)} | {ratios} | {tokens} | {real:,} | {rss} |")
    lines += ["", f"Median update seconds per step (p25-p75) over {results['steps'] - 1} measured steps x "
                  f"{results['repeats']} runs; real tokens count the prompt once per completion. Measured "
                  f"{results['date']} on {results['machine']}; "
                  + ", ".join(f"{k} {v}" for k, v in results["versions"].items()) + "."]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default=",".join(SHAPES),
                        help="comma-separated, of: " + ", ".join(SHAPES))
    parser.add_argument("--repeats", type=int, default=2,
                        help="runs per variant per shape, alternating A B C, C B A, ...")
    parser.add_argument("--steps", type=int, default=4, help="steps per run; the first is a warm-up")
    parser.add_argument("--quick", action="store_true", help="tiny model and shapes: a smoke run")
    parser.add_argument("--out", default=None, help="results JSON (default benchmarks/results-packing.json; "
                                                    "none with --quick)")
    parser.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    shapes, model_spec = (QUICK_SHAPES, QUICK_MODEL) if args.quick else (SHAPES, MODEL)
    names = [s for s in args.shapes.split(",") if s]
    unknown = sorted(set(names) - set(shapes))
    if unknown:
        parser.error(f"unknown shapes {unknown}")
    if args.steps < 2:
        parser.error("--steps must be at least 2 (the first step is a warm-up)")
    if args.worker:
        import tempfile

        with tempfile.TemporaryDirectory() as out_dir:
            print(json.dumps(worker(args.worker, shapes[names[0]], model_spec, args.steps, out_dir)))
        return
    import accelerate
    import peft
    import torch
    import transformers
    import trl

    versions = {"torch": torch.__version__, "transformers": transformers.__version__,
                "peft": peft.__version__, "accelerate": accelerate.__version__, "trl": trl.__version__}
    results = {"date": str(date.today()), "machine": f"{os.cpu_count()} CPU cores ({platform.machine()}), "
               f"torch threads {torch.get_num_threads()}, float32", "versions": versions, "quick": args.quick,
               "model": vars(model_spec), "steps": args.steps, "repeats": args.repeats,
               "batch": "one prompt x G completions: one micro-batch of G rows, "
                        "gradient_accumulation_steps=1",
               "shapes": {}}
    failed = []
    for name in names:
        shape, runs = shapes[name], {v: [] for v in VARIANTS}
        for repeat in range(args.repeats):
            for variant in VARIANTS if repeat % 2 == 0 else VARIANTS[::-1]:
                started = time.perf_counter()
                runs[variant].append(run(variant, name, args.steps, args.quick))
                median = statistics.median(s["update_seconds"] for s in runs[variant][-1]["steps"][1:])
                print(f"{name} {variant} run {repeat}: median update {median:.3f} s/step "
                      f"(process {time.perf_counter() - started:.0f} s)", file=sys.stderr, flush=True)
        summary = {v: summarise(r, shape) for v, r in runs.items()}
        problems = check(shape, summary)
        failed += [f"{name}: {p}" for p in problems]
        results["shapes"][name] = {"prompt": shape.prompt, "lengths": shape.lengths,
                                   "expected": expected(shape), "checks": problems or "ok",
                                   "variants": summary}
    out = args.out or (None if args.quick else str(ROOT / "benchmarks" / "results-packing.json"))
    if out:
        Path(out).write_text(json.dumps(results, indent=2) + "\n")
    print(table(results))
    for problem in failed:
        print(f"CHECK FAILED: {problem}")
    print("checks: " + ("all passed (completions identical across variants, token counts as expected)"
                        if not failed else f"{len(failed)} failed"))


if __name__ == "__main__":
    main()
