"""The importance ratio pi_trainer / pi_sampler at an on-policy step when sampling truncates (top_p 0.8, top_k 20,
temperature 1, float32, the shipped tiny policy): with the sampler's kept ids replayed in the trainer
(`replay_sampling_mask`, the default) and without. Per engine: transformers' generate, the async producer at
rollout_lag 0, and vLLM colocated and as a server when vLLM is installed (its own venv: docs/vllm.md).
Prints the table in docs/vllm.md#truncated-sampling.

    python examples/truncated_sampling.py [--out table.md]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

from rlft import AsyncGRPOConfig, AsyncGRPOTrainer, GRPOConfig, GRPOTrainer
from rlft.data.addition import rows, split_problems
from rlft.model.loading import shipped_policy_path

TRUNCATED = dict(temperature=1.0, top_p=0.8, top_k=20)


def exact_answer(completions, answer, **kwargs):
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [1.0 if f"<answer>{a}</answer>" in t else 0.0 for t, a in zip(texts, answer)]


def config(out: Path, **fields) -> dict:
    return dict(output_dir=str(out), max_steps=1, num_generations=4, per_device_train_batch_size=8,
                max_completion_length=8, report_to="none", disable_tqdm=True, seed=0, gradient_checkpointing=False,
                **TRUNCATED, **fields)


def measured(trainer) -> dict[str, float]:
    """Ratios of 8 prompts x 4 fresh samples at the weights that sampled them."""
    trainer.model.eval()
    rollout = trainer.generator(trainer.accelerator.unwrap_model(trainer.model),
                                trainer.train_prompts.batch(list(range(8)))["prompt_ids"], 4)
    mask = rollout.completion_mask.bool()
    delta = (trainer.scorer.logps(trainer.model, rollout) - rollout.sampling_logps) * mask
    ratio = delta[mask].exp()
    return {"mean": ratio.mean().item(), "sequence": delta.sum(1).exp().mean().item(),
            "outside": ((ratio < 0.9) | (ratio > 1.1)).float().mean().item(), "max_delta": delta.abs().max().item()}


def synchronous(out: Path, replay: bool, **fields) -> dict[str, float]:
    trainer = GRPOTrainer(str(shipped_policy_path()), [exact_answer],
                          GRPOConfig(**config(out, replay_sampling_mask=replay, **fields)), rows(split_problems()[0][:16]))
    if not getattr(trainer.generator, "holds_own_weights", False):
        trainer.generator.return_logps = True  # generate's own log-prob of each token, as vLLM returns it
    try:
        return measured(trainer)
    finally:
        trainer.generator.close()


def producer(out: Path, replay: bool) -> dict[str, float]:
    args = AsyncGRPOConfig(**config(out, rollout_lag=0, replay_sampling_mask=replay, logging_steps=1))
    trainer = AsyncGRPOTrainer(str(shipped_policy_path()), [exact_answer], args, rows(split_problems()[0][:16]))
    trainer.train()
    row = trainer.state.log_history[0]
    return {"mean": row["sampling/importance_sampling_ratio/mean"], "sequence": float("nan"),
            "outside": row["sampling/importance_sampling_ratio/outside_fraction"],
            "max_delta": row["sampling/sampling_logp_difference/max"]}


@contextlib.contextmanager
def server(out: Path):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    log = (out / "server.log").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "rlft.cli", "vllm-serve", "--model", str(shipped_policy_path()),
                             "--port", str(port), "--dtype", "float32", "--max-model-len", "512"],
                            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        yield port
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)


def engines(out: Path) -> dict[str, callable]:
    found = {"transformers generate": lambda r: synchronous(out / f"hf{r}", r),
             "async producer (generate, rollout_lag 0)": lambda r: producer(out / f"async{r}", r)}
    try:
        import vllm  # noqa: F401
    except ImportError:
        return found
    found["vLLM colocate"] = lambda r: synchronous(out / f"colocate{r}", r, use_vllm=True)
    found["vLLM server"] = "server"
    return found


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    out = Path(tempfile.mkdtemp(prefix="rlft-truncated-"))
    lines = ["| engine | replay | token ratio mean | sequence ratio mean | tokens outside [0.9, 1.1] | max abs "
             "delta log-prob |", "| --- | --- | --- | --- | --- | --- |"]
    for name, run in engines(out).items():
        with server(out) if run == "server" else contextlib.nullcontext() as port:
            for replay in (True, False):
                result = synchronous(out / f"server{replay}", replay, use_vllm=True, vllm_mode="server",
                                     vllm_server_port=port, vllm_server_timeout=240) if run == "server" \
                    else run(replay)
                sequence = "-" if result["sequence"] != result["sequence"] else f"{result['sequence']:.4f}"
                lines.append(f"| {name} | {'on' if replay else 'off'} | {result['mean']:.4f} | {sequence} | "
                             f"{result['outside']:.1%} | {result['max_delta']:.2g} |")
                print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
