"""The sampler in lower precision than the trainer (issue 55): a colocated vLLM engine in float32 or bfloat16
(`vllm_dtype`) samples, the float32 policy scores the same tokens. Per engine: seconds to generate (median of
3 after a warm-up) and, per completion token, log r = log pi_trainer - log pi_sampler: mean |log r|, its max,
KL(sampler || trainer) by the k3 estimator (mean of r - 1 - log r over the sampler's tokens), the share of
tokens with |log r| > 0.05, and the share a `token_truncate` correction at [0.5, 2] would clip.

Two policies: the shipped demo policy (trained, peaked distributions) and workload c's Qwen2 (~100M, vocabulary
32,000, random weights: near-uniform distributions). Each engine runs in its own process.

    .ci-venv-vllm/bin/python benchmarks/engine_precision.py --out benchmarks/results-engine-precision.json
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
POLICIES = {"demo": "the shipped demo policy (0.54M, trained)", "c": "workload c (Qwen2 ~100M, vocab 32k, random)"}


def run_one(policy: str, dtype: str, prompts: int, group: int, tokens: int) -> dict:
    """In this process: sample with a colocated engine in `dtype`, score with the float32 policy."""
    import torch

    from benchmarks.workloads import WORKLOADS, build
    from rlft import GRPOConfig
    from rlft.rollout.vllm import VLLMColocate

    work = build(WORKLOADS["a" if policy == "demo" else policy])
    model, tokenizer = work.model.float().eval(), work.tokenizer
    args = GRPOConfig(output_dir=tempfile.mkdtemp(prefix="rlft-precision-"), use_vllm=True, vllm_dtype=dtype,
                      max_completion_length=tokens, temperature=1.0, report_to="none", seed=0)
    engine = VLLMColocate(args, tokenizer, model)
    prompt_ids = [tokenizer.apply_chat_template(row["prompt"],
                                                add_generation_prompt=True, return_dict=False)
                  for row in work.rows[:prompts]]
    engine(model, prompt_ids, group)  # warm-up (and the first weight push)
    seconds, rollout = [], None
    for seed in range(3):
        torch.manual_seed(seed)
        started = time.perf_counter()
        rollout = engine(model, prompt_ids, group)
        seconds.append(time.perf_counter() - started)
    ids = torch.cat([rollout.prompt_ids, rollout.completion_ids], dim=1)
    mask = torch.cat([rollout.prompt_mask, rollout.completion_mask], dim=1)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits.float()
    width = rollout.prompt_ids.shape[1]
    trainer = torch.log_softmax(logits[:, width - 1:-1], dim=-1).gather(-1, rollout.completion_ids[..., None])[..., 0]
    scored = rollout.completion_mask.bool()
    log_r = (trainer - rollout.sampling_logps.float())[scored].double()
    return {"seconds": statistics.median(seconds), "tokens": int(scored.sum()),
            "mean_abs_log_ratio": float(log_r.abs().mean()), "max_abs_log_ratio": float(log_r.abs().max()),
            "kl_k3": float((log_r.exp() - 1 - log_r).mean()), "share_over_0.05": float((log_r.abs() > 0.05).double().mean()),
            "share_clipped_0.5_2": float(((log_r.exp() < 0.5) | (log_r.exp() > 2)).double().mean())}


def spawn(policy: str, dtype: str, prompts: int, group: int, tokens: int) -> dict:
    out = subprocess.run([sys.executable, __file__, "--one", policy, dtype, str(prompts), str(group), str(tokens)],
                         cwd=ROOT, capture_output=True, text=True, timeout=1800,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    if out.returncode:
        raise RuntimeError(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--out", default=None)
    parser.add_argument("--one", nargs=5, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        policy, dtype, prompts, group, tokens = args.one
        print(json.dumps(run_one(policy, dtype, int(prompts), int(group), int(tokens))))
        return
    results = {"date": time.strftime("%Y-%m-%d"), "prompts": args.prompts, "group": args.group,
               "tokens": args.tokens, "runs": {}}
    print("| policy | engine | generate (s) | mean abs log r | max abs log r | KL k3 | share over 0.05 | "
          "clipped at [0.5, 2] |\n|---|---|---|---|---|---|---|---|")
    for policy in POLICIES:
        for dtype in ("float32", "bfloat16"):
            r = spawn(policy, dtype, args.prompts, args.group, args.tokens)
            results["runs"][f"{policy}/{dtype}"] = r
            print(f"| {POLICIES[policy]} | {dtype} | {r['seconds']:.2f} | {r['mean_abs_log_ratio']:.2e} | "
                  f"{r['max_abs_log_ratio']:.2e} | {r['kl_k3']:.2e} | {r['share_over_0.05']:.2%} | "
                  f"{r['share_clipped_0.5_2']:.2%} |", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
