"""What length-sorted, trimmed micro-batches save in the policy update (issue 8's "length-sorted
or token-budget micro-batches" lever).

Workload b's model (Qwen2 25M, LoRA r16 all-linear), 2 prompts x 8 completions whose lengths
are spread like a reasoning task's (uniform 16..256 tokens, fixed seed), 4 micro-batches of 4.
Generation is a fixed stand-in so both variants update on identical rollouts; the timed part is
the library's own `_optimizer_step` (forward with log-probs, backward, optimiser step).

- sorted: the trainer as shipped (rows sorted longest first, each micro-batch cut to its longest row)
- rollout order: the same trainer with rows kept in rollout order (each micro-batch still cut to
  its own longest row, which in random order is close to the rollout's longest)

    python -m benchmarks.microbatch_padding
"""

from __future__ import annotations

import statistics
import tempfile
import time

import torch
from peft import LoraConfig

from benchmarks.workloads import WORKLOADS, build, distinct_token_ratio
from rlft import GRPOConfig, GRPOTrainer
from rlft.data.prompts import left_pad
from rlft.rollout.hf import Rollout, completion_mask_from

MAX_LEN, STEPS = 256, 4


class SpreadLengths:
    """Completions of fixed random tokens and lengths spread over 16..MAX_LEN (ending in EOS)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def __call__(self, model, prompt_ids, num_generations, greedy=False):
        repeated = [ids for ids in prompt_ids for _ in range(num_generations)]
        ids, mask = left_pad(repeated, self.tokenizer.pad_token_id)
        g = torch.Generator().manual_seed(0)
        rows = []
        for _ in repeated:
            length = int(torch.randint(16, MAX_LEN + 1, (1,), generator=g))
            tokens = torch.randint(5, 300, (length - 1,), generator=g).tolist() + [self.tokenizer.eos_token_id]
            rows.append(tokens + [self.tokenizer.pad_token_id] * (MAX_LEN - length))
        completion_ids = torch.tensor(rows)
        completion_mask, truncated = completion_mask_from(completion_ids, [self.tokenizer.eos_token_id])
        return Rollout(ids, mask, completion_ids, completion_mask, truncated)


def update_seconds(sort: bool) -> tuple[list[float], float]:
    spec, work = WORKLOADS["b"], build(WORKLOADS["b"])
    with tempfile.TemporaryDirectory() as out:
        cfg = GRPOConfig(output_dir=out, max_steps=STEPS + 1, report_to=["none"], disable_tqdm=True, seed=0,
                         num_generations=8, per_device_train_batch_size=4, gradient_accumulation_steps=4,
                         max_completion_length=MAX_LEN, learning_rate=1e-4)
        trainer = GRPOTrainer(work.model, [distinct_token_ratio], cfg, work.rows, processing_class=work.tokenizer,
                              peft_config=LoraConfig(**spec.lora))
        trainer.generator = SpreadLengths(trainer.tokenizer)
        if not sort:
            trainer.scorer.micro_batches = lambda rollout: list(torch.arange(rollout.completion_ids.shape[0]).split(4))
        seconds = []
        for step in range(STEPS + 1):  # the first step is a warm-up
            batch = trainer._make_rollout(step)
            started = time.perf_counter()
            trainer.updater.step(batch)
            seconds.append(time.perf_counter() - started)
        mask = batch.rollout.completion_mask
        padded = sum(mask[rows].sum(1).max().item() * len(rows) for rows in trainer.scorer.micro_batches(batch.rollout))
        return seconds[1:], mask.sum().item() / padded


def main() -> None:
    torch.set_num_threads(torch.get_num_threads())
    for sort in (False, True, False, True):
        seconds, useful = update_seconds(sort)
        print(f"{'sorted' if sort else 'rollout order'}: update {statistics.median(seconds):.3f} s/step "
              f"(min {min(seconds):.3f}, max {max(seconds):.3f}); real tokens / tokens computed {useful:.0%}")


if __name__ == "__main__":
    main()
