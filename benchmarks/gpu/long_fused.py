"""Long completions on a GPU: the LM head's gradients formed in the forward from the loss's gradient
(rlft/core/fused_head.py) and chunked MLPs (rlft/model/memory/chunked_mlp.py), at a real Qwen2.5 shape.

Part 1, the head alone: forward + backward of the fused head at N positions x 151,936 vocabulary, a trainable
head (full fine-tuning), the loss GRPO's clipped token mean, with the recomputing backward and with the
loss's gradient given to the forward; the gradients of the two compared. Part 2, the scoring forward +
backward of 2 completions of L tokens behind a 64-token prompt (padded, gradient checkpointing, SDPA) on a
random-weight model of the shape, each setting twice after a warm-up: checkpointing alone, attention kept
(`recompute_attention: false`), + the loss's gradient, + MLP chunks, + activation offloading. Peak memory is
torch.cuda.max_memory_allocated above the built model; time the median of the timed passes.

    python benchmarks/gpu/long_fused.py --out benchmarks/gpu/long-fused-h100.md
    python benchmarks/gpu/long_fused.py --device cpu --shape tiny --lengths 64 --positions 256   # smoke
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as a script: `benchmarks` (and, uninstalled, `rlft`) come from this tree
    sys.path.insert(0, str(ROOT))

from benchmarks.gpu.bench import SHAPES, VOCAB, shape_fields  # noqa: E402
from benchmarks.long_completions import grpo_loss  # noqa: E402 (the CPU benchmark's loss, the same here)
from benchmarks.long_completions import loss_gradient as gradient_of  # noqa: E402

SETTINGS = {"checkpointing": (False, False, None, False), "attention kept": (True, False, None, False),
            "kept + loss gradient": (True, True, None, False),
            "kept + loss gradient + chunks 4096": (True, True, 4096, False),
            "kept + loss gradient + chunks 4096 + offload": (True, True, 4096, True)}


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def timed(device, fn, repeats):
    fn()
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def head_part(args, hidden_size):
    from rlft.core.fused_head import fused_token_logprobs

    g = torch.Generator(device=args.device).manual_seed(0)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    h = torch.randn(args.positions, hidden_size, device=args.device, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(VOCAB, hidden_size, device=args.device, generator=g) * 0.02).to(dtype).requires_grad_()
    y = torch.randint(0, VOCAB, (args.positions,), device=args.device, generator=g)
    adv = torch.randn(args.positions, device=args.device, generator=g)
    rows, grads = [], {}
    closed = gradient_of(adv[None]).build(args.positions).select(lambda t: t[0])  # per-token advantages

    def closed_form(logps, rows):  # the closed form at a tile's rows (rlft/model/scoring.py: _predictor)
        return closed.select(lambda t: t[rows])(logps[rows])
    closed_form.closed_form = True
    for name, predict in (("recomputing backward", None), ("closed-form loss gradient in the forward", closed_form)):
        def step(predict=predict):
            h.grad = w.grad = None
            logps, _ = fused_token_logprobs(h, w, y, entropy=True, predict=predict)
            grpo_loss(logps, adv).backward()
        if args.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        seconds = timed(args.device, step, args.repeats)
        peak = torch.cuda.max_memory_allocated() / 2**30 if args.device == "cuda" else float("nan")
        grads[name] = (h.grad.float().clone(), w.grad.float().clone())
        rows.append(f"| {name} | {seconds * 1000:.1f} | {peak:.2f} |")
    (ha, wa), (hb, wb) = grads.values()
    diff = max(float((ha - hb).norm() / ha.norm()), float((wa - wb).norm() / wa.norm()))
    return rows, diff


def model_part(args, length, setting):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from rlft.model.memory.chunked_mlp import chunk_mlps
    from rlft.model.memory.offload import offload_activations
    from rlft.model.memory.selective_checkpoint import AttentionKeeper
    from rlft.model.scoring import install_scoring, score_rows
    from rlft.rollout.base import Rollout

    keep, fused, chunk, offload = SETTINGS[setting]
    torch.manual_seed(0)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    config = Qwen2Config(vocab_size=VOCAB, max_position_embeddings=length + 128, attn_implementation="sdpa",
                         **shape_fields(args.shape))
    with torch.device(args.device):  # initialised where it runs (a 0.5B model's CPU init takes seconds)
        model = Qwen2ForCausalLM(config).to(dtype)
    keeper = AttentionKeeper() if keep else None
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={
        "use_reentrant": False, **({"context_fn": keeper.context_fn} if keeper else {})})
    model.train()
    install_scoring(model)
    if chunk:
        chunk_mlps(model, chunk)
    if offload:
        offload_activations(model)
    g = torch.Generator().manual_seed(1)
    rollout = Rollout(prompt_ids=torch.randint(16, VOCAB, (2, 64), generator=g).to(args.device),
                      prompt_mask=torch.ones(2, 64, dtype=torch.long, device=args.device),
                      completion_ids=torch.randint(16, VOCAB, (2, length), generator=g).to(args.device),
                      completion_mask=torch.ones(2, length, dtype=torch.long, device=args.device),
                      truncated=torch.zeros(2, dtype=torch.bool, device=args.device))
    adv = torch.tensor([[1.0], [-1.0]], device=args.device)
    out = {}

    def step():
        model.zero_grad(set_to_none=True)
        logps = score_rows(model, rollout, torch.arange(2), loss_grad=gradient_of(adv) if fused else None).logps
        grpo_loss(logps, adv).backward()
        out["logp_sum"] = float(logps.detach().float().sum())
        out["grad_norm"] = float(model.model.embed_tokens.weight.grad.float().norm())

    if args.device == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    seconds = timed(args.device, step, args.repeats)
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30 if args.device == "cuda" else float("nan")
    return f"| {length:,} | {setting} | {peak:.2f} | {seconds:.3f} | {out['logp_sum']:.1f} | {out['grad_norm']:.4g} |"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="0.5b")
    parser.add_argument("--lengths", type=int, nargs="+", default=[8192, 16384])
    parser.add_argument("--positions", type=int, default=16384)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--settings", nargs="+", choices=list(SETTINGS), default=list(SETTINGS))
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    import transformers

    lines = [f"# Long completions on {device}", "",
             f"torch {torch.__version__}, transformers {transformers.__version__}, shape {args.shape}, "
             f"{'bfloat16' if args.device == 'cuda' else 'float32'}, vocabulary {VOCAB:,}, median of "
             f"{args.repeats} after a warm-up.", "",
             f"## The head alone: {args.positions:,} positions, trainable head, entropy logged", "",
             "| backward | ms (forward + backward) | peak GiB |", "| --- | --- | --- |"]
    rows, diff = head_part(args, SHAPES[args.shape][0])
    lines += rows + ["", f"Largest relative difference of the two's dL/dh and dL/dW: {diff:.2e}", "",
                     "## Scoring forward + backward, 2 completions of L tokens, gradient checkpointing", "",
                     "| L | setting | peak GiB above the model | s | log-prob sum | embedding grad norm |",
                     "| --- | --- | --- | --- | --- | --- |"]
    for length in args.lengths:
        for setting in args.settings:
            try:
                lines.append(model_part(args, length, setting))
            except torch.OutOfMemoryError:
                lines.append(f"| {length:,} | {setting} | out of memory | | | |")
            if args.device == "cuda":
                torch.cuda.empty_cache()
            print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        open(args.out, "w").write(text)


if __name__ == "__main__":
    main()
