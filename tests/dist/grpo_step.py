"""One GRPO optimiser step on a fixed rollout, per loss_type, in 1 or N processes (torchrun).

Generation is replaced by a deterministic stand-in so every launch sees the same
completions for the same prompt; everything after it (rewards, gathered advantages, global
normalisers, DDP, the optimiser) is the library's own path. Writes the trained parameters
and the logged step metrics of each loss_type to OUT (main process only).

    torchrun --nproc_per_node 2 --standalone tests/dist/grpo_step.py MODEL_DIR OUT GLOBAL_ACCUMULATION
"""

from __future__ import annotations

import sys

import torch

from rlft import GRPOConfig, GRPOTrainer
from rlft.core.losses import LOSS_TYPES
from rlft.data.prompts import left_pad
from rlft.rollout.hf import Rollout, completion_mask_from
from rlft.train.state import release_processes
from tests.helpers import addition_rows

GROUP, PROMPTS, PER_DEVICE = 4, 4, 4


class FixedGenerator:
    """Completions that depend only on the prompt and their index in the group."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def __call__(self, model, prompt_ids, num_generations, greedy=False):
        repeated = [ids for ids in prompt_ids for _ in range(num_generations)]
        ids, mask = left_pad(repeated, self.tokenizer.pad_token_id)
        completions = []
        for row, prompt in enumerate(repeated):
            g = torch.Generator().manual_seed(sum(prompt) * 31 + row % num_generations)
            length = int(torch.randint(2, 7, (1,), generator=g))
            tokens = torch.randint(5, 300, (length,), generator=g).tolist() + [self.tokenizer.eos_token_id]
            completions.append(tokens + [self.tokenizer.pad_token_id] * (8 - len(tokens)))
        completion_ids = torch.tensor(completions)
        completion_mask, truncated = completion_mask_from(completion_ids, [self.tokenizer.eos_token_id])
        return Rollout(ids, mask, completion_ids, completion_mask, truncated)


def token_sum_reward(completion_ids, **kwargs):
    return [float(sum(ids) % 7) for ids in completion_ids]


def main() -> None:
    model_dir, out, global_accumulation = sys.argv[1], sys.argv[2], int(sys.argv[3])
    results = {}
    for loss_type in LOSS_TYPES:
        trainer = None
        world = int(__import__("os").environ.get("WORLD_SIZE", "1"))
        cfg = GRPOConfig(output_dir=f"{out}-run", optim="sgd", learning_rate=1.0, max_grad_norm=1e9, seed=0,
                         num_generations=GROUP, per_device_train_batch_size=PER_DEVICE,
                         gradient_accumulation_steps=global_accumulation // world, max_steps=1, beta=0.04,
                         loss_type=loss_type, max_completion_length=8, report_to=["none"], disable_tqdm=True,
                         scale_rewards="batch", gradient_checkpointing=False)
        trainer = GRPOTrainer(model_dir, [token_sum_reward], cfg, addition_rows(PROMPTS))
        trainer.generator = FixedGenerator(trainer.tokenizer)
        batch = trainer._make_rollout(0)
        metrics = {**batch.metrics, **trainer._optimizer_step(batch)}
        params = {n: p.detach().clone() for n, p in trainer.accelerator.unwrap_model(trainer.model).named_parameters()}
        results[loss_type] = {"params": params, "metrics": {k: v for k, v in metrics.items() if "time" not in k
                                                             and k != "tokens_per_second"}}
    if trainer.accelerator.is_main_process:
        torch.save(results, out)
    accelerator = trainer.accelerator
    trainer = batch = None
    release_processes(accelerator)


if __name__ == "__main__":
    main()
