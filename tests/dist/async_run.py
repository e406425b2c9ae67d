"""An AsyncGRPOTrainer run (LoRA, one-step-off-policy) on 1 or N processes (torchrun), each process with its
own producer; optionally resumed from a checkpoint. Writes the trained adapter to OUT/final.

    torchrun --nproc_per_node 2 --standalone tests/dist/async_run.py MODEL_DIR OUT [CHECKPOINT]
"""

from __future__ import annotations

import sys

from peft import LoraConfig

from rlft import AsyncGRPOConfig, AsyncGRPOTrainer
from rlft.train.state import release_processes
from tests.helpers import addition_rows, correct_answer, has_answer_tags


def main() -> None:
    model_dir, out = sys.argv[1], sys.argv[2]
    resume = sys.argv[3] if len(sys.argv) > 3 else None
    cfg = AsyncGRPOConfig(output_dir=out, learning_rate=1e-3, max_steps=4, num_generations=4,
                          per_device_train_batch_size=8, max_completion_length=8, save_steps=2, report_to="none",
                          disable_tqdm=True, seed=0, gradient_checkpointing=False,
                          logging_steps=1, producer_threads=1)
    trainer = AsyncGRPOTrainer(model_dir, [correct_answer, has_answer_tags], cfg, addition_rows(32),
                               peft_config=LoraConfig(r=4, target_modules="all-linear"))
    trainer.train(resume_from_checkpoint=resume)
    trainer.save_model(f"{out}/final")
    accelerator = trainer.accelerator
    trainer = None
    release_processes(accelerator)


if __name__ == "__main__":
    main()
