"""An AsyncGRPOTrainer run fed by a rollout worker (tests/test_worker.py's), full fine-tuning in float64, on 1
or N processes: every process is given a worker, as TRL's trainer is; the main process's alone is used. The
per-process batch is 16 / N, so every process count trains the same rows. Saves the final parameters.

    torchrun --nproc_per_node 2 --standalone tests/dist/worker_run.py MODEL_DIR OUT.pt
"""

from __future__ import annotations

import os
import sys

import torch
from transformers import AutoTokenizer

from rlft import AsyncGRPOConfig, AsyncGRPOTrainer
from rlft.train.state import release_processes
from tests.helpers import addition_rows, correct_answer
from tests.test_worker import Transfer, Worker


def main() -> None:
    model_dir, out = sys.argv[1], sys.argv[2]
    processes = int(os.environ.get("WORLD_SIZE", "1"))
    cfg = AsyncGRPOConfig(output_dir=f"{out}.run", learning_rate=1e-2, max_steps=2, num_generations=4,
                          per_device_train_batch_size=16 // processes, max_completion_length=8, report_to="none",
                          disable_tqdm=True, seed=0, gradient_checkpointing=False, logging_steps=1,
                          model_init_kwargs={"dtype": "float64"})
    worker = Worker(AutoTokenizer.from_pretrained(model_dir), per_version=16)
    trainer = AsyncGRPOTrainer(model_dir, correct_answer, cfg, addition_rows(32), rollout_worker=worker,
                               weight_transfer=Transfer())
    trainer.train()
    if trainer.accelerator.is_main_process:
        model = trainer.accelerator.unwrap_model(trainer.model)
        torch.save({n: p.detach().cpu() for n, p in model.named_parameters()}, out)
    accelerator = trainer.accelerator
    trainer = None
    release_processes(accelerator)


if __name__ == "__main__":
    main()
