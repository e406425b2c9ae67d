"""Build the shipped starting policy `rlft/assets/tiny-adder` (deterministic, CPU, ~1 minute).

A 0.5M-parameter Qwen2 model is warm-started by supervised training on the addition task
(completion-only loss) and stopped as soon as greedy accuracy on a development set drawn
from the *training* problems reaches --stop-at, so it knows the answer format but is often
wrong. Its accuracy on the held-out problems (never trained on) is then measured and
written to the model folder's README.

    python examples/build_tiny_policy.py                 # rebuild the shipped policy
    python examples/build_tiny_policy.py --eval-only     # re-measure held-out accuracy
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch

from rlft.data.addition import greedy_accuracy, prompt_messages, split_problems, target_text
from rlft.tiny import build_causal_lm, build_tokenizer, save_tiny

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "rlft" / "assets" / "tiny-adder"


def sft_batch(tokenizer, problems):
    """Right-padded prompt+answer+eos ids, with labels only on the answer tokens."""
    input_ids, labels = [], []
    for a, b in problems:
        prompt = tokenizer.apply_chat_template(prompt_messages(a, b), tokenize=False, add_generation_prompt=True)
        p_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        c_ids = tokenizer(target_text(a, b), add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        input_ids.append(p_ids + c_ids)
        labels.append([-100] * len(p_ids) + c_ids)
    width = max(map(len, input_ids))
    pad = tokenizer.pad_token_id
    ids = torch.tensor([x + [pad] * (width - len(x)) for x in input_ids])
    lab = torch.tensor([y + [-100] * (width - len(y)) for y in labels])
    return ids, (ids != pad).long() | (lab != -100).long(), lab


def train(out: Path, seed: int, stop_at: float, max_steps: int, eval_every: int, vocab_size: int = 384,
          tag_tokens: bool = True) -> dict:
    torch.manual_seed(seed)
    rng = random.Random(seed)
    train_problems, heldout = split_problems()
    dev, pool = train_problems[:200], train_problems[200:]
    tokenizer = build_tokenizer(seed, vocab_size=vocab_size, tag_tokens=tag_tokens)
    model = build_causal_lm(tokenizer, arch="qwen2", hidden_size=128, num_layers=2, seed=seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    start, step, dev_acc = time.time(), 0, 0.0
    for step in range(1, max_steps + 1):
        ids, mask, labels = sft_batch(tokenizer, rng.sample(pool, 64))
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if step % eval_every == 0:
            dev_acc = greedy_accuracy(model, tokenizer, dev, max_new_tokens=8 if tag_tokens else 16)
            print(f"step {step:4d} loss {loss.item():.3f} dev greedy accuracy {dev_acc:.3f}")
            if dev_acc >= stop_at:
                break
    save_tiny(model, tokenizer, out)
    stats = {"sft_steps": step, "dev_accuracy": dev_acc, "seconds": round(time.time() - start, 1)}
    return stats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--stop-at", type=float, default=0.25, help="dev greedy accuracy that ends SFT")
    parser.add_argument("--max-steps", type=int, default=600)
    parser.add_argument("--eval-every", type=int, default=5)
    parser.add_argument("--eval-only", action="store_true")
    parser.add_argument("--vocab-size", type=int, default=384, help="the BPE vocabulary (the shipped one: 384)")
    parser.add_argument("--no-tag-tokens", action="store_true",
                        help="<answer> / </answer> left to BPE, several tokens each (another tokenizer: a "
                             "teacher for cross-tokenizer distillation)")
    args = parser.parse_args()
    stats = {} if args.eval_only else train(args.out, args.seed, args.stop_at, args.max_steps, args.eval_every,
                                            args.vocab_size, not args.no_tag_tokens)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(args.out)
    tokenizer = AutoTokenizer.from_pretrained(args.out)
    _, heldout = split_problems()
    # (tags left to BPE: 13 tokens at most, not 7)
    stats["heldout_greedy_accuracy"] = greedy_accuracy(model, tokenizer, heldout,
                                                       max_new_tokens=16 if args.no_tag_tokens else 8)
    stats["parameters"] = sum(p.numel() for p in model.parameters())
    print(json.dumps(stats))
    if not args.eval_only:
        (args.out / "build_stats.json").write_text(json.dumps(stats, indent=2) + "\n")


if __name__ == "__main__":
    main()
