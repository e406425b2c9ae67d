"""Two GRPO optimiser steps with DAPO dynamic sampling, in 1 or N processes (torchrun).

Generation is grpo_step's stand-in (completions depend only on the prompt and their index in the group) and the
reward has a spread only for prompts with an even answer, so rounds after the first are needed and the groups
chosen are spread unevenly over the processes that sampled them. Writes, from the main process, the trained
parameters, the logged metrics of each step, every process's trained (prompt, completion, reward) rows in
process order, and how many groups each process received from another.

    torchrun --nproc_per_node 2 --standalone tests/dist/dynamic_step.py MODEL_DIR OUT
"""

from __future__ import annotations

import os
import sys

import torch
from accelerate.utils import gather_object

import rlft.train.sources.dynamic_sampling as dynamic
from rlft import GRPOConfig, GRPOTrainer
from rlft.train.state import release_processes
from tests.dist.grpo_step import FixedGenerator
from tests.helpers import addition_rows

GROUP, PER_DEVICE, GLOBAL_ACCUMULATION = 4, 4, 4
RECEIVED = [0]


def even_answers_spread(completion_ids, answer, **kwargs):
    return [float(sum(ids) % 7) if int(a) % 2 == 0 else 1.0 for ids, a in zip(completion_ids, answer)]


def counting(exchange):
    def wrapped(*args, **kwargs):
        arrived = exchange(*args, **kwargs)
        RECEIVED[0] += len(arrived)
        return arrived
    return wrapped


def main() -> None:
    model_dir, out = sys.argv[1], sys.argv[2]
    world = int(os.environ.get("WORLD_SIZE", "1"))
    dynamic.DynamicSampling._exchange = counting(dynamic.DynamicSampling._exchange)
    cfg = GRPOConfig(output_dir=f"{out}-run", optim="sgd", learning_rate=1.0, max_grad_norm=1e9, seed=0,
                     num_generations=GROUP, per_device_train_batch_size=PER_DEVICE,
                     gradient_accumulation_steps=GLOBAL_ACCUMULATION // world, max_steps=2, beta=0.04,
                     max_completion_length=8, report_to=["none"], disable_tqdm=True, scale_rewards="batch",
                     gradient_checkpointing=False, dynamic_sampling=True, max_num_gen_batches=6,
                     model_init_kwargs={"dtype": "float64"})  # compared to rounding: tests/helpers.py SAME_STEP
    trainer = GRPOTrainer(model_dir, [even_answers_spread], cfg, addition_rows(32))
    trainer.generator = FixedGenerator(trainer.tokenizer)
    steps, rows = [], []
    for rollout_index in range(2):
        batch = trainer._make_rollout(rollout_index)
        rows.append([(s["prompt"], s["completion"], s["reward"]) for s in batch.samples])
        metrics = {**batch.metrics, **trainer.updater.step(batch)}
        steps.append({k: v for k, v in metrics.items()
                      if "time" not in k and k != "tokens_per_second" and not k.startswith("perf/")})
    everyone = [[row for part in gather_object([step]) for row in part] for step in rows]
    received = gather_object([RECEIVED[0]])
    params = {k: v.detach().clone() for k, v in trainer.accelerator.get_state_dict(trainer.model).items()}
    if trainer.accelerator.is_main_process:
        torch.save({"params": params, "metrics": steps, "rows": everyone, "received": received}, out)
    accelerator = trainer.accelerator
    trainer = batch = None
    release_processes(accelerator)


if __name__ == "__main__":
    main()
