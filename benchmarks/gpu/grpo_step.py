"""The whole GRPO step on one GPU, rlft vs TRL 1.16: generation, scoring and the update, on the same random-weight
model of a real Qwen2.5 shape, the same prompts, reward, group size, completion budget and settings.

Each (shape, mode, library) runs in its own child process: a Qwen2 of the shape's published config (vocabulary
151,936, tied embedding, bfloat16 weights, sdpa, gradient checkpointing on as both libraries default to), its
EOS embedding row scaled so that most completions end early while some run to the limit (the long tail
reasoning RL has; `--eos-scale`; the report gives the lengths it reached), 2 prompts x 8 completions of up to
`--length` tokens a step, LoRA r16 on all linear layers or full fine-tuning, loss dapo, no KL, one optimiser
step per generation, learning rate 1e-6 (the policy barely moves, so both sample one length distribution).
Both generate with transformers `generate` (vLLM is not on every GPU machine; `--engine vllm` where it is).
The first step of each run is a warm-up, not counted. Per step, from benchmarks/run_one.py's instrumentation:
time in `generate`, in model forwards outside it (scoring) and in the backward; generated tokens; the model
FLOPs of the training phase (scoring forward + backward, rlft/core/flops.py; checkpointing's recomputation is
not counted) over the measured bfloat16 matmul peak (rlft/telemetry/perf.py): the training phase's MFU. Peak
memory: torch.cuda.max_memory_allocated (peak RSS on a CPU).

    python benchmarks/gpu/grpo_step.py --out benchmarks/gpu/grpo-step-h200.md
    python benchmarks/gpu/grpo_step.py --device cpu --shape tiny --length 24 --steps 2   # CPU smoke run
    python benchmarks/gpu/grpo_step.py --probe --device cpu --length 512   # the lengths --eos-scale gives
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.gpu.bench import SHAPES, VOCAB, shape_fields  # noqa: E402

PROMPTS, GROUP = 2, 8
LORA = dict(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")


def build(args):
    """The model (bfloat16 on a GPU, float32 on a CPU; same seed in every child), tokenizer and prompts."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from benchmarks.workloads import distinct_token_ratio
    from rlft.data.addition import rows, split_problems
    from rlft.tiny import build_tokenizer

    tokenizer = build_tokenizer(seed=0)
    vocab = args.vocab
    tokenizer.add_tokens([f"<tok{i}>" for i in range(vocab - len(tokenizer))])  # every sampled id decodes
    config = Qwen2Config(vocab_size=len(tokenizer), max_position_embeddings=args.length + 256,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                         attn_implementation="sdpa", **shape_fields(args.shape))
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():
        model.get_input_embeddings().weight[tokenizer.eos_token_id] *= args.eos_scale
    model = model.to(torch.bfloat16 if args.device == "cuda" else torch.float32)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model, tokenizer, rows(split_problems()[0][:256]), [distinct_token_ratio]


def probe(args) -> dict:
    """The completion lengths a step's prompts reach (2 prompts x 8 completions, sampled at temperature 1,
    seed 0) from the shape's model with `--eos-scale`: the skew a run will have, measured without a run."""
    import torch

    model, tokenizer, prompts, _ = build(args)
    texts = [tokenizer.apply_chat_template(row["prompt"], tokenize=False, add_generation_prompt=True)
             for row in prompts[:PROMPTS]]
    tokenizer.padding_side = "left"
    encoded = tokenizer(texts, return_tensors="pt", padding=True)
    ids, mask = (t.repeat_interleave(GROUP, 0).to(args.device) for t in (encoded.input_ids, encoded.attention_mask))
    torch.manual_seed(0)
    with torch.no_grad():
        out = model.eval().generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_p=1.0,
                                    max_new_tokens=args.length)
    new = out[:, ids.shape[1]:]
    eos = new == tokenizer.eos_token_id
    lengths = torch.where(eos.any(1), eos.int().argmax(1) + 1, new.shape[1])
    return {"shape": args.shape, "eos_scale": args.eos_scale, "length": args.length,
            "lengths": sorted(lengths.tolist())}


def common(args) -> dict:
    """The config fields both libraries name the same way."""
    return dict(num_generations=GROUP, per_device_train_batch_size=GROUP * PROMPTS, gradient_accumulation_steps=1,
                max_completion_length=args.length, temperature=1.0, top_p=1.0, learning_rate=1e-6, epsilon=0.2,
                scale_rewards="group", num_iterations=1, max_grad_norm=1.0, gradient_checkpointing=True,
                bf16=args.device == "cuda", max_steps=args.steps, logging_steps=1, lr_scheduler_type="constant",
                loss_type="dapo", beta=0.0, seed=0, disable_tqdm=True, log_completions=False)


def train(args, model, tokenizer, prompts, rewards, clock, out_dir: str) -> None:
    from peft import LoraConfig

    from benchmarks.run_one import _ticker

    peft_config = LoraConfig(**LORA) if args.mode == "lora" else None
    vllm = dict(use_vllm=True, vllm_mode="colocate") if args.engine == "vllm" else {}
    if args.child == "rlft":
        from rlft import GRPOConfig, GRPOTrainer

        cfg = GRPOConfig(output_dir=out_dir, overwrite_output_dir=True, report_to=["none"], save_steps=10**6,
                         **common(args), **vllm)
        trainer = GRPOTrainer(model, rewards, cfg, prompts, processing_class=tokenizer, peft_config=peft_config,
                              callbacks=[_ticker(clock)])
    else:
        import datasets
        from trl import GRPOConfig, GRPOTrainer

        cfg = GRPOConfig(output_dir=out_dir, report_to="none", save_strategy="no", steps_per_generation=1,
                         use_cpu=args.device == "cpu", **common(args), **vllm)
        trainer = GRPOTrainer(model=model, reward_funcs=rewards, args=cfg, train_dataset=datasets.Dataset.from_list(
            prompts), processing_class=tokenizer, peft_config=peft_config, callbacks=[_ticker(clock)])
    trainer.train()


def child(args) -> dict:
    """One library, shape and mode in this process: the JSON line the parent collects."""
    import torch

    from benchmarks import run_one
    from rlft.core.flops import mfu, scoring_flops
    from rlft.telemetry.perf import matmul_peak

    cuda = args.device == "cuda"
    model, tokenizer, prompts, rewards = build(args)
    run_one._instrument(model, tokenizer.eos_token_id)
    clock = run_one.StepClock()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    train(args, model, tokenizer, prompts, rewards, clock, str(Path(args.out_dir) / f"{args.child}-{args.mode}"))
    steps = clock.steps[1:]  # the first is a warm-up
    lengths = run_one.ROWS[len(run_one.ROWS) - len(steps) * PROMPTS * GROUP:]
    training = [s["logprobs"] + s["backward"] for s in steps]
    flops = 3 * scoring_flops(model.config, [p for p, _ in lengths], [c for _, c in lengths])
    dtype = torch.bfloat16 if cuda else torch.float32
    completions = [c for _, c in lengths]
    peak = torch.cuda.max_memory_allocated() if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"lib": args.child, "shape": args.shape, "mode": args.mode, "engine": args.engine,
            "device_name": torch.cuda.get_device_name() if cuda else "CPU", "steps": len(steps),
            "step_s": statistics.median(s["seconds"] for s in steps),
            "generation_s": statistics.median(s["generation"] for s in steps),
            "training_s": statistics.median(training),
            "tokens_per_s": sum(completions) / sum(s["seconds"] for s in steps),
            "training_mfu_percent": round(mfu(flops, sum(training), matmul_peak(args.device, dtype)), 2),
            "peak_gib": round(peak / 2**30, 3), "memory": "cuda max_memory_allocated" if cuda else "peak RSS",
            "lengths": {"median": statistics.median(completions), "mean": round(statistics.fmean(completions), 1),
                        "at_limit": sum(c >= args.length for c in completions) / len(completions)}}


def run(args, lib: str, shape: str, mode: str) -> dict:
    python = args.trl_python if lib == "trl" else sys.executable
    command = [python, __file__, "--child", lib, "--shape", shape, "--mode", mode, "--length", str(args.length),
               "--steps", str(args.steps), "--device", args.device, "--engine", args.engine, "--vocab",
               str(args.vocab), "--eos-scale", str(args.eos_scale), "--out-dir", args.out_dir]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}
    out = subprocess.run(command, capture_output=True, text=True, check=False, env=env)
    if out.returncode:
        last = (out.stderr.strip().splitlines() or [f"exit status {out.returncode}"])[-1]
        return {"lib": lib, "shape": shape, "mode": mode, "error": last}
    return json.loads(out.stdout.strip().splitlines()[-1])


def table(results: list[dict]) -> list[str]:
    lines = ["| shape | mode | library | step (s) | generation (s) | training (s) | tokens/s | training MFU "
             "| peak GiB | vs TRL (time, memory) | lengths (median / mean / at limit) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in results:
        head = f"| {r['shape']} | {r['mode']} | {r['lib']} |"
        if "error" in r:
            lines.append(f"{head} {r['error']} | | | | | | | |")
            continue
        trl = next((t for t in results if t["lib"] == "trl" and t["shape"] == r["shape"]
                    and t["mode"] == r["mode"] and "error" not in t), None)
        ratio = f"{r['step_s'] / trl['step_s']:.2f}x, {r['peak_gib'] / trl['peak_gib']:.2f}x" if trl else "-"
        n = r["lengths"]
        lines.append(f"{head} {r['step_s']:.3f} | {r['generation_s']:.3f} | {r['training_s']:.3f} | "
                     f"{r['tokens_per_s']:,.0f} | {r['training_mfu_percent']:.1f}% | {r['peak_gib']:.2f} | {ratio} | "
                     f"{n['median']:.0f} / {n['mean']:.0f} / {n['at_limit']:.0%} |")
    return lines


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", nargs="+", choices=sorted(SHAPES), default=["0.5b"])
    parser.add_argument("--modes", nargs="+", choices=["lora", "full"], default=["lora", "full"])
    parser.add_argument("--libs", nargs="+", choices=["rlft", "trl"], default=["rlft", "trl"])
    parser.add_argument("--length", type=int, default=512, help="max_completion_length")
    parser.add_argument("--steps", type=int, default=4, help="steps per run, the first a warm-up")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--engine", default="hf", choices=["hf", "vllm"])
    parser.add_argument("--vocab", type=int, default=VOCAB)
    parser.add_argument("--eos-scale", type=float, default=4.0,
                        help="the EOS embedding row's factor (benchmarks/gpu/README.md: the lengths 4 gives, "
                             "from --probe)")
    parser.add_argument("--trl-python", default=sys.executable, help="interpreter with trl==1.16.0 installed")
    parser.add_argument("--out-dir", default="/tmp/grpo-step-runs")
    parser.add_argument("--out", default=None, help="write the table and JSON lines to this markdown file")
    parser.add_argument("--probe", action="store_true",
                        help="only sample one step's completions and print their lengths (the skew)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--mode", default="lora", help=argparse.SUPPRESS)
    return parser.parse_args()


def main() -> None:
    args = parse()
    if args.child or args.probe:
        args.shape = args.shape[0]
        print(json.dumps(child(args) if args.child else probe(args)))
        return
    results, turn = [], 0
    for shape in args.shape:
        for mode in args.modes:
            for lib in args.libs if turn % 2 == 0 else args.libs[::-1]:
                started = time.perf_counter()
                results.append(run(args, lib, shape, mode))
                print(json.dumps(results[-1]), f"({time.perf_counter() - started:.0f} s)", flush=True)
            turn += 1
    lines = table(results)
    print("\n".join(lines))
    if args.out:
        device = next((r["device_name"] for r in results if "device_name" in r), "(no child ran)")
        text = [f"# The whole GRPO step, rlft vs TRL 1.16, on {device}", "",
                f"Command: `{shlex.join(['python', *sys.argv])}`", "", *lines, "", "```jsonl",
                *(json.dumps(r) for r in results), "```", ""]
        Path(args.out).write_text("\n".join(text))


if __name__ == "__main__":
    main()
