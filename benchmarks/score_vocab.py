"""Scoring at Qwen's vocabulary: one forward + backward of the per-token log-probs of `rows` completions of
`length` tokens (after a 64-token prompt), as one GRPO micro-batch costs, on a random Qwen2-shaped model
(hidden 256, 2 layers, vocabulary 151,936; no download). Each library runs in its own process, so each peak
RSS is its own; rows alternate between libraries so a busy machine slows both alike.

  rlft   rlft's fused scoring (rlft/model/scoring.py: the LM head in tiles, never [B, T, V] logits)
  trl    TRL 1.16's fused LM head (trl.trainer.utils.add_fused_lm_head), in the same kind of call
  plain  the model's own logits + rlft's chunked float32 log-softmax (what rlft did before the fused head)

    pip install -e ".[bench]"                                     # TRL 1.16 beside rlft, same torch
    python benchmarks/score_vocab.py --lengths 1024               # the acceptance workload
    python benchmarks/score_vocab.py --lengths 256 512 1024 2048 4096 --libs rlft trl --plot scaling.png

Prints one JSON line per (library, length) and a table; `--trl-python` runs TRL's child with another interpreter.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

VOCAB, HIDDEN, LAYERS, PROMPT = 151_936, 256, 2, 64


def build(rows: int, length: int):
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=4 * HIDDEN, num_hidden_layers=LAYERS,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=PROMPT + length + 8,
                         tie_word_embeddings=True)
    model = AutoModelForCausalLM.from_config(config).float().train()
    ids = torch.randint(0, VOCAB, (rows, PROMPT + length), generator=torch.Generator().manual_seed(1))
    return model, ids, torch.ones_like(ids)


def score(lib: str, model, ids, mask, length: int):
    """Per-token log-probs [rows, length] of the completion tokens, differentiable."""
    targets = ids[:, -length:]
    if lib == "rlft":
        from rlft.model.scoring import Score

        return model(input_ids=ids, attention_mask=mask, rlft_score=Score(targets, mask[:, -length:])).logps
    if lib == "trl":
        labels = ids.clone()
        labels[:, :PROMPT] = -100  # score the completion only, as GRPO does
        out = model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
        return out.log_probs[:, -length:]
    from rlft.core.logprobs import selective_log_softmax

    logits = model(input_ids=ids, attention_mask=mask, logits_to_keep=length + 1).logits[:, :-1]
    return selective_log_softmax(logits, targets)


def child(lib: str, rows: int, length: int, repeats: int) -> dict:
    import torch

    model, ids, mask = build(rows, length)
    if lib == "rlft":
        from rlft.model.scoring import install_scoring

        install_scoring(model)
    elif lib == "trl":
        from trl.trainer.utils import add_fused_lm_head

        add_fused_lm_head(model)
    torch.set_num_threads(torch.get_num_threads())
    times, total = [], None
    for _ in range(repeats):
        model.zero_grad(set_to_none=True)
        started = time.perf_counter()
        logps = score(lib, model, ids, mask, length)
        logps.sum().backward()
        times.append(time.perf_counter() - started)
        total = float(logps.detach().sum())
    rss_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # ru_maxrss is in KiB on Linux
    return {"lib": lib, "rows": rows, "length": length, "seconds": min(times), "peak_rss_gb": round(rss_gb, 3),
            "logp_sum": total}


def with_mfu(result: dict) -> dict:
    """Model FLOPs utilisation of a child's forward + backward, against this machine's measured float32 matmul
    peak (rlft/telemetry/perf.py): the same model FLOPs for every library (the LM head only at completion positions)."""
    if "error" in result:
        return result
    import torch
    from transformers import Qwen2Config

    from rlft.core.flops import mfu, scoring_flops
    from rlft.telemetry.perf import matmul_peak

    config = Qwen2Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=4 * HIDDEN,
                         num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2)
    rows, length = result["rows"], result["length"]
    flops = 3 * scoring_flops(config, [PROMPT] * rows, [length] * rows)  # backward costs 2x forward
    return {**result, "mfu_percent": round(mfu(flops, result["seconds"], matmul_peak("cpu", torch.float32)), 2)}


def run(lib: str, rows: int, length: int, repeats: int, python: str) -> dict:
    command = [python, __file__, "--child", lib, "--rows", str(rows), "--lengths", str(length), "--repeats",
               str(repeats)]
    out = subprocess.run(command, capture_output=True, text=True, check=False)
    if out.returncode:
        return {"lib": lib, "rows": rows, "length": length, "error": out.stderr.strip().splitlines()[-1]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def plot(results: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (memory, seconds) = plt.subplots(1, 2, figsize=(10, 4))
    for lib in sorted({r["lib"] for r in results}):
        rows = sorted((r for r in results if r["lib"] == lib and "error" not in r), key=lambda r: r["length"])
        memory.plot([r["length"] for r in rows], [r["peak_rss_gb"] for r in rows], marker="o", label=lib)
        seconds.plot([r["length"] for r in rows], [r["seconds"] for r in rows], marker="o", label=lib)
    memory.set(xlabel="completion tokens per sequence", ylabel="peak RSS (GB)", title="memory")
    seconds.set(xlabel="completion tokens per sequence", ylabel="forward + backward (s)", title="time")
    for axis in (memory, seconds):
        axis.legend()
        axis.grid(alpha=0.3)
    figure.suptitle(f"scoring {results[0]['rows']} sequences, vocabulary {VOCAB:,}, hidden {HIDDEN}")
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--libs", nargs="+", default=["rlft", "trl", "plain"])
    parser.add_argument("--lengths", nargs="+", type=int, default=[1024])
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--trl-python", default=sys.executable, help="interpreter with trl==1.16.0 installed")
    parser.add_argument("--plot", default=None, help="write a PNG of memory and time against length")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.rows, args.lengths[0], args.repeats)))
        return
    results = []
    for length in args.lengths:
        for lib in args.libs:
            python = args.trl_python if lib == "trl" else sys.executable
            results.append(with_mfu(run(lib, args.rows, length, args.repeats, python)))
            print(json.dumps(results[-1]), flush=True)
    print("\n| library | completion tokens | peak RSS (GB) | forward + backward (s) | MFU (%) | vs trl (RSS, s) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in results:
        trl = next((t for t in results if t["lib"] == "trl" and t["length"] == r["length"] and "error" not in t), None)
        if "error" in r:
            print(f"| {r['lib']} | {r['length']} | - | - | - | {r['error']} |")
            continue
        ratio = f"{r['peak_rss_gb'] / trl['peak_rss_gb']:.2f}x, {r['seconds'] / trl['seconds']:.2f}x" if trl else "-"
        print(f"| {r['lib']} | {r['length']} | {r['peak_rss_gb']:.2f} | {r['seconds']:.1f} | "
              f"{r.get('mfu_percent', float('nan')):.1f} | {ratio} |")
    if args.plot:
        plot(results, args.plot)


if __name__ == "__main__":
    main()
