"""How much of generation is transformers' `generate` overhead? (the profile behind issue 8's
"lean KV-cached decode loop" lever)

Times `model.generate` against a minimal KV-cached sampling loop on workload b's model
(8 rows, 128 new tokens forced, temperature 1). Measured 2026-11-22 on 2 CPU cores:
generate 1.68 s, minimal loop 1.62-1.66 s: 2-4%, so generation time is the model's own
forward, not generate's bookkeeping, and a hand-written engine is not worth it here.

    python -m benchmarks.generate_overhead             # the two timings
    python -m benchmarks.generate_overhead --profile   # and where generate's time goes, by operator
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import DynamicCache

from benchmarks.workloads import WORKLOADS, build

NEW_TOKENS = 128


def main() -> None:
    parser_args()  # --help before the model is built
    work = build(WORKLOADS["b"])
    model, tokenizer = work.model.eval(), work.tokenizer
    text = tokenizer.apply_chat_template(work.rows[0]["prompt"], tokenize=False, add_generation_prompt=True)
    ids = torch.tensor([tokenizer(text)["input_ids"]] * 8)
    mask = torch.ones_like(ids)

    def hf_generate():
        return model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_p=1.0,
                              top_k=0, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                              pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)

    def minimal_loop():
        out = model(input_ids=ids, attention_mask=mask, past_key_values=DynamicCache(), use_cache=True,
                    logits_to_keep=1)
        attention, tokens = mask, []
        for t in range(NEW_TOKENS):
            token = torch.multinomial(torch.softmax(out.logits[:, -1].float(), -1), 1)  # [8, 1]
            tokens.append(token)
            attention = torch.cat([attention, torch.ones_like(token)], 1)
            out = model(input_ids=token, attention_mask=attention, past_key_values=out.past_key_values,
                        use_cache=True, position_ids=torch.full_like(token, ids.shape[1] + t))
        return torch.cat(tokens, 1)

    with torch.no_grad():
        hf_generate(), minimal_loop()  # warm-up
        for fn in (hf_generate, minimal_loop, hf_generate, minimal_loop):
            started = time.perf_counter()
            fn()
            print(f"{fn.__name__}: {time.perf_counter() - started:.3f} s")
        if parser_args().profile:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
                hf_generate()
            print(profile.key_averages().table(sort_by="self_cpu_time_total", row_limit=8))


def parser_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", action="store_true", help="also print the operator profile of one generate")
    return parser.parse_args()


if __name__ == "__main__":
    main()
