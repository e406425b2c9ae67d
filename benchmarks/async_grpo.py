"""Async vs synchronous GRPO on separate cores: the layout of separate inference and training devices.

The trainer runs on core 0 (one thread), the rollout producer on core 1 (one thread). "sync" is the same
producer with rollout_lag 0 (the trainer waits for each rollout, the producer waits for each update);
"async" is rollout_lag 1 (one-step-off-policy). Runs alternate, each in its own process; s/step is the
median over the steps after the first two (start-up excluded).

    python benchmarks/async_grpo.py --workloads bc --steps 12 --repeats 2 --out benchmarks/results-async.json
    python benchmarks/async_grpo.py --demo --plot docs/figures/async_demo.png \
        --out benchmarks/results-async-demo.json                                      # accuracy vs steps
    python benchmarks/async_grpo.py --demo-split                        # the synchronous demo step's parts
    python benchmarks/async_grpo.py --demo --task calculator --demo-steps 300 \
        --out benchmarks/results-async-calculator.json                  # the tool demo (calculator-env too):
                                                                        # sync, async k=1, async k=1 + partial 1

TRL 1.16's AsyncGRPOTrainer is tried in its own venv (--trl-python); its error goes into the table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRL_PROBE = """
import json, os, tempfile
os.sched_setaffinity(0, {0})
try:
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer
    from datasets import Dataset
    args = AsyncGRPOConfig(output_dir=tempfile.mkdtemp(), max_steps=4, per_device_train_batch_size=8,
                           num_generations=8, max_completion_length=128, report_to="none", use_cpu=True,
                           token_budget=4096)
    AsyncGRPOTrainer(model=%r, reward_funcs=[lambda completions, **k: [0.0] * len(completions)], args=args,
                     train_dataset=Dataset.from_list([{"prompt": "1+1="}] * 16)).train()
    print(json.dumps({"ok": True}))
except Exception as err:
    print(json.dumps({"ok": False, "error": f"{type(err).__name__}: {err}"[:300]}))
"""


def run_one(workload: str, lag: int, steps: int) -> dict:
    """In this process: pin to core 0, train `steps` steps, return the step times and final reward."""
    os.sched_setaffinity(0, {0})
    import torch

    torch.set_num_threads(1)
    from peft import LoraConfig

    from benchmarks.workloads import WORKLOADS, build
    from rlft import AsyncGRPOConfig, AsyncGRPOTrainer

    spec = WORKLOADS[workload]
    work = build(spec)
    args = AsyncGRPOConfig(output_dir=tempfile.mkdtemp(prefix="rlft-async-bench-"), max_steps=steps,
                           report_to="none", disable_tqdm=True, save_strategy="no", seed=0, rollout_lag=lag,
                           max_staleness=max(lag, 1), producer_cpus=[1], producer_threads=1,
                           lr_scheduler_type="linear", **spec.common())
    trainer = AsyncGRPOTrainer(work.model, work.reward_funcs, args, work.rows, processing_class=work.tokenizer,
                               peft_config=LoraConfig(**spec.lora) if spec.hidden else None)
    trainer.train()
    rows = [r for r in trainer.state.log_history if "step_time" in r]
    return {"step_seconds": [r["step_time"] for r in rows],
            "wait_seconds": [r.get("perf/rollout_wait_s", 0.0) for r in rows],
            "generation_seconds": [r.get("rollout/duration_s", 0.0) for r in rows],
            "train_seconds": [r.get("time/train_seconds", 0.0) for r in rows]}


def demo_parts(task: str, folder: str, steps: int, config_class, extra: dict):
    """(config, policy, reward functions, held-out key, trainer kwargs) of a demo task: addition, calculator
    (the add tool) or calculator-env (the same tool as an environment's method)."""
    from rlft.cli.demo import CALCULATOR_KEY, HELDOUT_KEY, calculator_config, demo_config
    from rlft.data import calculator
    from rlft.model.loading import shipped_policy_path
    from rlft.rewards.builtins import exact_match_reward, format_reward

    if task == "addition":
        return (demo_config(folder, steps, True, 0, config_class=config_class, **extra), shipped_policy_path(),
                [exact_match_reward, format_reward], HELDOUT_KEY, {})
    cfg = calculator_config(folder, steps, True, 0, config_class=config_class, **extra)
    given = {"tools": calculator.TOOLS} if task == "calculator" else {"environment_factory": calculator.CalculatorEnv}
    return (cfg, shipped_policy_path("tiny-calculator"), [calculator.answer_reward, calculator.tool_use_reward],
            CALCULATOR_KEY, given)


def demo_curve(lag: int | None, steps: int, extra: dict | None = None, task: str = "addition") -> dict:
    """The demo (LoRA, seed 0): held-out greedy accuracy at each evaluation and the wall-clock seconds at each
    (evaluation included); lag None = GRPOTrainer; `extra`: AsyncGRPOConfig fields."""
    from transformers import TrainerCallback

    from rlft.cli.demo import demo_lora
    from rlft.config import AsyncGRPOConfig, GRPOConfig
    from rlft.data.addition import rows, split_problems
    from rlft.train.async_grpo import AsyncGRPOTrainer
    from rlft.train.grpo import GRPOTrainer

    train, heldout = split_problems()
    folder = tempfile.mkdtemp(prefix="rlft-async-demo-")
    if lag is None:
        config_class, extra, trainer_class = GRPOConfig, {}, GRPOTrainer
    else:  # trainer on core 0, producer on core 1, one thread each (two processes must not share cores)
        os.sched_setaffinity(0, {0})
        import torch

        torch.set_num_threads(1)
        config_class, trainer_class = AsyncGRPOConfig, AsyncGRPOTrainer
        extra = {"rollout_lag": lag, "max_staleness": max(lag, 1), "producer_cpus": [1], "producer_threads": 1,
                 **(extra or {})}
    cfg, policy, rewards, key, given = demo_parts(task, folder, steps, config_class, extra)
    clock = {}

    class Clock(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and key in logs:
                clock[state.global_step] = time.perf_counter() - started

    trainer = trainer_class(str(policy), rewards, cfg, train_dataset=rows(train), eval_dataset=rows(heldout),
                            peft_config=demo_lora(True), callbacks=[Clock()], **given)
    started = time.perf_counter()
    trainer.train()
    curve = [(r["step"], r[key]) for r in trainer.state.log_history if key in r]
    return {"curve": curve, "seconds": time.perf_counter() - started,
            "seconds_at": [clock.get(step) for step, _ in curve]}


def demo_split(steps: int = 60) -> dict:
    """The synchronous demo step's parts (LoRA, both cores, no evaluation): the median over steps 11 on of
    the step, its generation, its rewards and its training, in seconds."""
    import statistics

    from rlft.cli.demo import demo_lora
    from rlft.config import GRPOConfig
    from rlft.data.addition import rows, split_problems
    from rlft.train.grpo import GRPOTrainer

    cfg, policy, rewards, _, _ = demo_parts("addition", tempfile.mkdtemp(prefix="rlft-demo-split-"), steps,
                                            GRPOConfig, {})
    cfg.eval_strategy, cfg.eval_on_start, cfg.logging_steps, cfg.log_completions = "no", False, 1, False
    trainer = GRPOTrainer(str(policy), rewards, cfg, train_dataset=rows(split_problems()[0]),
                          peft_config=demo_lora(True))
    trainer.train()
    logged = [r for r in trainer.state.log_history if "time/train_seconds" in r][10:]
    return {key: statistics.median(r[key] for r in logged) for key in
            ("step_time", "time/generation_seconds", "time/reward_seconds", "time/train_seconds")}


DEMO_RUNS = (("sync", None, {}), ("async k=1", 1, {}),
             ("async k=1, in-flight updates", 1, {"inflight_weight_updates": True}))
# tools and environments: one-step-off, and with partial rollouts (the driver's pool looks one rollout ahead)
AGENT_RUNS = (("sync", None, {}), ("async k=1", 1, {}),
              ("async k=1, partial 1", 1, {"partial_rollouts": 1, "max_staleness": 2}))


def demo(args) -> dict:
    out = {}
    for name, lag, extra in (DEMO_RUNS if args.task == "addition" else AGENT_RUNS):
        if name == "sync" and args.sync_curve:  # a synchronous curve already measured (it is deterministic)
            out[name] = json.loads(Path(args.sync_curve).read_text())
            continue
        if args.reuse and name in json.loads(Path(args.reuse).read_text()):  # kept from an earlier run
            out[name] = json.loads(Path(args.reuse).read_text())[name]
            continue
        run = subprocess.run([sys.executable, __file__, "--demo-one", "none" if lag is None else str(lag),
                              str(args.demo_steps), json.dumps(extra), args.task], cwd=ROOT, capture_output=True,
                             text=True, timeout=3600)
        if run.returncode:
            raise RuntimeError(run.stderr[-3000:])
        out[name] = json.loads(run.stdout.strip().splitlines()[-1])
        print(name, out[name], flush=True)
    final = out["sync"]["curve"][-1][1]
    for run in out.values():
        for key, bar in (("first_step_at_90pct_of_sync_final", 0.9 * final), ("first_step_at_90pct", 0.9)):
            reached = [i for i, (step, acc) in enumerate(run["curve"]) if acc >= bar]
            run[key] = run["curve"][reached[0]][0] if reached else None
            if "seconds_at" in run:
                run[key.replace("first_step", "seconds")] = run["seconds_at"][reached[0]] if reached else None
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.5))
        for name, run in out.items():
            ax.plot(*zip(*run["curve"]), marker="o", label=name)
        ax.set_xlabel("optimiser step")
        ax.set_ylabel("held-out greedy accuracy")
        ax.set_title(f"rlft demo ({args.task}, LoRA): synchronous vs one-step-off async")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
    return out


def spawn(workload: str, lag: int, steps: int) -> dict:
    out = subprocess.run([sys.executable, __file__, "--one", workload, str(lag), str(steps)], cwd=ROOT,
                         capture_output=True, text=True, timeout=3600)
    if out.returncode:
        raise RuntimeError(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def probe_trl(python: str, model: str) -> str:
    out = subprocess.run([python, "-c", TRL_PROBE % model], capture_output=True, text=True, timeout=900)
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if not lines:
        return f"exit {out.returncode}: {out.stderr.strip().splitlines()[-1][:300] if out.stderr else ''}"
    result = json.loads(lines[-1])
    return "ran" if result["ok"] else result["error"]


def speed(args) -> dict:
    results = {"date": time.strftime("%Y-%m-%d"), "steps": args.steps, "workloads": {}}
    for workload in args.workloads:
        runs = {"sync": [], "async": []}
        for _ in range(args.repeats):
            for mode, lag in (("sync", 0), ("async", 1)):  # alternating
                runs[mode].append(spawn(workload, lag, args.steps))
        summary = {}
        for mode, reps in runs.items():
            steps = [s for rep in reps for s in rep["step_seconds"][2:]]
            summary[mode] = {"median_step_seconds": statistics.median(steps),
                             "median_wait_seconds": statistics.median(
                                 [s for rep in reps for s in rep["wait_seconds"][2:]]),
                             "median_generation_seconds": statistics.median(
                                 [s for rep in reps for s in rep["generation_seconds"][2:]]),
                             "median_train_seconds": statistics.median(
                                 [s for rep in reps for s in rep["train_seconds"][2:]])}
        summary["ratio"] = summary["async"]["median_step_seconds"] / summary["sync"]["median_step_seconds"]
        results["workloads"][workload] = summary
        print(json.dumps({workload: summary}), flush=True)
    if args.trl_python:
        from rlft.model.loading import shipped_policy_path

        results["trl"] = probe_trl(args.trl_python, str(shipped_policy_path()))
    return results


def table(results: dict) -> str:
    lines = ["| workload | sync s/step | async s/step | async / sync | producer s/rollout | trainer s/update "
             "| trainer waits (async) |", "|---|---|---|---|---|---|---|"]
    for workload, s in results["workloads"].items():
        lines.append(f"| {workload} | {s['sync']['median_step_seconds']:.2f} | "
                     f"{s['async']['median_step_seconds']:.2f} | {s['ratio']:.2f} | "
                     f"{s['async']['median_generation_seconds']:.2f} | {s['async']['median_train_seconds']:.2f} | "
                     f"{s['async']['median_wait_seconds']:.2f} |")
    if "trl" in results:
        lines.append(f"| any | TRL 1.16 AsyncGRPOTrainer: {results['trl']} | | | | | |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workloads", default="bc")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--trl-python", default=None)
    parser.add_argument("--out", default=None)
    parser.add_argument("--demo", action="store_true", help="accuracy vs steps on the demo task")
    parser.add_argument("--demo-split", action="store_true",
                        help="the synchronous demo step's generation / reward / training seconds")
    parser.add_argument("--demo-steps", type=int, default=1500)
    parser.add_argument("--task", default="addition", choices=("addition", "calculator", "calculator-env"),
                        help="the demo task: addition, or the calculator with its add tool as a tool or an "
                             "environment's method")
    parser.add_argument("--plot", default=None)
    parser.add_argument("--sync-curve", default=None, help="reuse a synchronous demo curve (JSON)")
    parser.add_argument("--reuse", default=None, help="an earlier --demo results file: its runs are kept, "
                                                      "only the others run")
    parser.add_argument("--one", nargs=3, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--demo-one", nargs=4, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.demo_one:
        lag = None if args.demo_one[0] == "none" else int(args.demo_one[0])
        print(json.dumps(demo_curve(lag, int(args.demo_one[1]), json.loads(args.demo_one[2]), args.demo_one[3])))
        return
    if args.demo_split:
        print(json.dumps(demo_split()))
        return
    if args.demo:
        results = demo(args)
        if args.out:
            Path(args.out).write_text(json.dumps(results, indent=1))
        return
    if args.one:
        print(json.dumps(run_one(args.one[0], int(args.one[1]), int(args.one[2]))))
        return
    results = speed(args)
    print(table(results))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
