"""An AsyncGRPOTrainer run (LoRA, or --full fine-tuning; one-step-off-policy) on 1 or N processes, each
process with its own producer; optionally resumed from a checkpoint. Writes the trained model to OUT/final.

    torchrun --nproc_per_node 2 --standalone tests/dist/async_run.py MODEL_DIR OUT [--resume CHECKPOINT] [--full]
        [--tools]   (the shipped calculator's add tool: each process's tool loop on its own producer)
        [--partial] (partial_rollouts 1, each process's pool in its own checkpoint part)
    accelerate launch --config_file ENGINE.yaml tests/dist/async_run.py ...   (FSDP2, ZeRO-3)
"""

from __future__ import annotations

import argparse

from peft import LoraConfig

from rlft import AsyncGRPOConfig, AsyncGRPOTrainer
from rlft.train.state import release_processes
from tests.helpers import addition_rows, correct_answer, has_answer_tags


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model_dir")
    parser.add_argument("out")
    parser.add_argument("--resume")
    parser.add_argument("--full", action="store_true")
    parser.add_argument("--tools", action="store_true")
    parser.add_argument("--partial", action="store_true")
    run = parser.parse_args()
    model_dir, out, resume = run.model_dir, run.out, run.resume
    cfg = AsyncGRPOConfig(output_dir=out, learning_rate=1e-3, max_steps=4, num_generations=4,
                          per_device_train_batch_size=8, max_completion_length=8, save_steps=2, report_to="none",
                          disable_tqdm=True, seed=0, gradient_checkpointing=False,
                          logging_steps=1, producer_threads=1, partial_rollouts=1 if run.partial else 0)
    rewards, given = [correct_answer, has_answer_tags], {}
    if run.tools:
        from rlft.data.calculator import TOOLS, answer_reward, tool_use_reward

        cfg.max_completion_length, cfg.temperature = 48, 0.7
        rewards, given = [answer_reward, tool_use_reward], {"tools": TOOLS}
    trainer = AsyncGRPOTrainer(model_dir, rewards, cfg, addition_rows(32),
                               peft_config=None if run.full else LoraConfig(r=4, target_modules="all-linear"),
                               **given)
    trainer.train(resume_from_checkpoint=resume)
    trainer.save_model(f"{out}/final")
    accelerator = trainer.accelerator
    trainer = None
    release_processes(accelerator)


if __name__ == "__main__":
    main()
