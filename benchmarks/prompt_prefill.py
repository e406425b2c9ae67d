"""What prefilling each prompt once per group saves in generation (issue 8's "prompt prefill
computed once per group instead of G times" lever).

Workload b's model (Qwen2 25M, LoRA r16 all-linear, float32), 2 prompts x 8 completions of 128
sampled tokens, through the library's own `HFGenerator`: prefill per completion
(`shared_prompt_prefill: false`), once per group (the default), and transformers' static cache
(`cache_implementation: static`, which prefills per completion). Prompts of 19 tokens (workload
b's chat prompt) and of ~200 tokens (a few-shot or retrieval prompt). Alternating runs, median
of 3 after a warm-up.

    python -m benchmarks.prompt_prefill
"""

from __future__ import annotations

import statistics
import time

import torch
from peft import LoraConfig, get_peft_model

from benchmarks.workloads import WORKLOADS, build
from rlft.rollout.hf import HFGenerator

GROUP, NEW_TOKENS, REPEATS = 8, 128, 3


def main() -> None:
    spec = WORKLOADS["b"]
    work = build(spec)
    model = get_peft_model(work.model, LoraConfig(**spec.lora))
    tokenizer = work.tokenizer
    chat = [tokenizer(tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False))
            ["input_ids"] for r in work.rows[:2]]
    g = torch.Generator().manual_seed(0)
    long = [torch.randint(5, 300, (200 - 7 * i,), generator=g).tolist() for i in range(2)]
    engines = {"prefill per completion": HFGenerator(tokenizer, NEW_TOKENS, shared_prompt_prefill=False),
               "once per group": HFGenerator(tokenizer, NEW_TOKENS),
               "static cache": HFGenerator(tokenizer, NEW_TOKENS, cache_implementation="static")}
    for name, prompts in (("19-token prompts", chat), ("~200-token prompts", long)):
        seconds = {engine: [] for engine in engines}
        for repeat in range(REPEATS + 1):
            for engine, generate in engines.items():
                started = time.perf_counter()
                generate(model, prompts, GROUP)
                if repeat:  # the first round is a warm-up
                    seconds[engine].append(time.perf_counter() - started)
        base = statistics.median(seconds["prefill per completion"])
        print(f"{name}: " + ", ".join(f"{engine} {statistics.median(s):.3f} s ({statistics.median(s) / base:.2f}x)"
                                      for engine, s in seconds.items()))


if __name__ == "__main__":
    main()
