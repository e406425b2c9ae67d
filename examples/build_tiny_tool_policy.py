"""Build the shipped tool-calling starting policy `rlft/assets/tiny-calculator` (deterministic, CPU, ~1 minute).

A 0.5M-parameter Qwen2 model with a tool-calling chat template (rlft.tiny.TOOL_CHAT_TEMPLATE, Hermes
format) is warm-started by supervised training on correct addition episodes (loss on the assistant's
tokens only): it calls the `add` tool with the two numbers, reads the result and answers with it
(--tool-share below 1 mixes in episodes that answer directly). Training stops as soon as greedy
accuracy with the tool live, on a development set drawn from the *training* problems, reaches
--stop-at: the policy knows the protocol but often copies a number wrong. GRPO's job
(`rlft demo --task calculator`) is to make it reliable.

    python examples/build_tiny_tool_policy.py               # rebuild the shipped policy
    python examples/build_tiny_tool_policy.py --eval-only   # re-measure held-out accuracy and tool use
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch

from rlft.data.addition import prompt_messages, split_problems
from rlft.data.calculator import TOOLS, add, answer_reward, episode, tool_use_reward
from rlft.rollout.hf import HFGenerator
from rlft.rollout.multiturn import ToolLoop, Toolset
from rlft.rollout.tools import tool_schemas
from rlft.tiny import build_causal_lm, build_tokenizer, save_tiny

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "rlft" / "assets" / "tiny-calculator"


@torch.no_grad()
def tool_accuracy(model, tokenizer, problems: list[tuple[int, int]], batch_size: int = 100,
                  max_completion_length: int = 64) -> tuple[float, float]:
    """(greedy accuracy, share of completions that called the tool) on `problems`, with the add tool live:
    the same tool loop GRPO trains with (rlft/rollout/multiturn.py)."""
    schemas = tool_schemas(TOOLS)
    loop = ToolLoop(HFGenerator(tokenizer, max_new_tokens=max_completion_length), tokenizer,
                    Toolset({"add": add}, schemas), max_completion_length, max_iterations=2, timeout=5.0)
    correct, used = 0.0, 0.0
    for start in range(0, len(problems), batch_size):
        chunk = problems[start:start + batch_size]
        ids = [tokenizer.apply_chat_template(prompt_messages(a, b), tools=schemas, add_generation_prompt=True,
                                             tokenize=True, return_dict=False) for a, b in chunk]
        rollout = loop(model, ids, 1, greedy=True)
        correct += sum(answer_reward(rollout.completions, [str(a + b) for a, b in chunk]))
        used += sum(tool_use_reward(rollout.completions))
    return correct / len(problems), used / len(problems)


def assistant_labels(tokenizer, messages: list[dict]) -> tuple[list[int], list[int]]:
    """Token ids of the whole episode and labels on the assistant turns only (each turn through its EOS)."""
    render = lambda msgs, gen: tokenizer.apply_chat_template(msgs, tools=TOOLS, add_generation_prompt=gen,  # noqa: E731
                                                             tokenize=True, return_dict=False)
    ids = list(render(messages, False))
    labels = [-100] * len(ids)
    for k, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start = len(render(messages[:k], True))
        end = ids.index(tokenizer.eos_token_id, start) + 1
        labels[start:end] = ids[start:end]
    return ids, labels


def sft_batch(tokenizer, problems, use_tool: list[bool]):
    pairs = [assistant_labels(tokenizer, episode(a, b, t)) for (a, b), t in zip(problems, use_tool)]
    width, pad = max(len(i) for i, _ in pairs), tokenizer.pad_token_id
    ids = torch.tensor([i + [pad] * (width - len(i)) for i, _ in pairs])
    labels = torch.tensor([lab + [-100] * (width - len(lab)) for _, lab in pairs])
    mask = torch.tensor([[1] * len(i) + [0] * (width - len(i)) for i, _ in pairs])
    return ids, mask, labels


def train(out: Path, seed: int, max_steps: int, tool_share: float, stop_at: float, eval_every: int) -> dict:
    torch.manual_seed(seed)
    rng = random.Random(seed)
    train_problems, _ = split_problems()
    dev, pool = train_problems[:100], train_problems[100:]
    tokenizer = build_tokenizer(seed, vocab_size=448, tools=True)
    model = build_causal_lm(tokenizer, arch="qwen2", hidden_size=128, num_layers=2, seed=seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    start, step, dev_acc = time.time(), 0, 0.0
    for step in range(1, max_steps + 1):
        problems = rng.sample(pool, 64)
        ids, mask, labels = sft_batch(tokenizer, problems, [rng.random() < tool_share for _ in problems])
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if step % eval_every == 0:
            dev_acc, dev_tool = tool_accuracy(model, tokenizer, dev)
            print(f"step {step:4d} loss {loss.item():.3f} dev greedy accuracy {dev_acc:.2f} tool use {dev_tool:.2f}")
            if dev_acc >= stop_at:
                break
    save_tiny(model, tokenizer, out)
    return {"sft_steps": step, "tool_share": tool_share, "dev_accuracy": dev_acc,
            "seconds": round(time.time() - start, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-steps", type=int, default=600)
    parser.add_argument("--tool-share", type=float, default=1.0, help="share of SFT episodes that call the tool")
    parser.add_argument("--stop-at", type=float, default=0.3, help="dev greedy accuracy that ends SFT")
    parser.add_argument("--eval-every", type=int, default=5)
    parser.add_argument("--eval-only", action="store_true")
    args = parser.parse_args()
    stats = {} if args.eval_only else train(args.out, args.seed, args.max_steps, args.tool_share, args.stop_at,
                                            args.eval_every)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(args.out)
    tokenizer = AutoTokenizer.from_pretrained(args.out)
    _, heldout = split_problems()
    accuracy, tool_use = tool_accuracy(model, tokenizer, heldout)
    stats.update(heldout_greedy_accuracy=accuracy, heldout_greedy_tool_use=tool_use,
                 parameters=sum(p.numel() for p in model.parameters()))
    print(json.dumps(stats))
    if not args.eval_only:
        (args.out / "build_stats.json").write_text(json.dumps(stats, indent=2) + "\n")


if __name__ == "__main__":
    main()
