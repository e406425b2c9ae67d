"""A short real run, straight and resumed, on whatever engine the launch asks for (DDP, FSDP2, ZeRO-2/3).

GRPO (policy MODE lora or full): 4 AdamW steps on a linear schedule with fixed completions (so 1 and 2
processes see the same data), checkpoint every 2 steps; then a second trainer resumes from checkpoint-2
and runs to step 4. Reward model (MODE reward-lora / reward-full): the same with preference pairs.
Distillation (MODE distill-lora / distill-full): the same with DistillationTrainer (beta 0.5) and a tiny Llama
teacher built from a fixed seed (under ZeRO-3 the teacher is its own sharded engine, like a reference).
Writes OUT/straight and OUT/resumed (save_model folders) and OUT/rates.json (learning rates per step).

    accelerate launch --config_file ENGINE.yaml tests/dist/sharded_run.py MODEL_DIR OUT MODE [DTYPE]
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from rlft import DistillationConfig, DistillationTrainer, GRPOConfig, GRPOTrainer, RewardConfig, RewardTrainer
from rlft.train.state import release_processes
from tests.dist.grpo_step import FixedGenerator, token_sum_reward
from tests.helpers import addition_rows, preference_rows

COMMON = dict(max_steps=4, save_steps=2, logging_steps=1, learning_rate=1e-2, lr_scheduler_type="linear", seed=0,
              report_to=["none"], disable_tqdm=True, max_grad_norm=0.5, disable_dropout=True)


def world() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def lora_config(lora: bool, task_type: str):
    from peft import LoraConfig

    return LoraConfig(r=4, target_modules="all-linear", task_type=task_type) if lora else None


def grpo(model_dir: str, out: Path, lora: bool, dtype: str = "auto") -> GRPOTrainer:
    cfg = GRPOConfig(model_init_kwargs={"dtype": dtype}, output_dir=str(out), num_generations=4,
                     per_device_train_batch_size=4, beta=0.04, gradient_accumulation_steps=2 // world(),
                     max_completion_length=8, padding_free=True, **COMMON)  # packed, under every engine
    trainer = GRPOTrainer(model_dir, [token_sum_reward], cfg, addition_rows(16),
                          peft_config=lora_config(lora, "CAUSAL_LM"))
    trainer.generator = FixedGenerator(trainer.tokenizer)
    return trainer


def reward(model_dir: str, out: Path, lora: bool, dtype: str = "auto") -> RewardTrainer:
    cfg = RewardConfig(model_init_kwargs={"dtype": dtype}, output_dir=str(out), per_device_train_batch_size=2,
                       gradient_accumulation_steps=2 // world(), max_length=32, **COMMON)
    return RewardTrainer(model_dir, cfg, train_dataset=preference_rows(32), peft_config=lora_config(lora, "SEQ_CLS"))


def distill(model_dir: str, out: Path, lora: bool, dtype: str = "auto") -> DistillationTrainer:
    from rlft.tiny import make_tiny_model_dir

    teacher = out.parent / "teacher"  # one folder (the run records it): the first process to finish building wins
    if not teacher.exists():
        built = make_tiny_model_dir(out.parent / f"teacher-{os.environ.get('RANK', '0')}", kind="causal",
                                    arch="llama", hidden_size=48, seed=3)
        try:
            os.rename(built, teacher)  # atomic; the other process's rename then fails and it uses this one
        except OSError:
            pass
    cfg = DistillationConfig(model_init_kwargs={"dtype": dtype}, output_dir=str(out), per_device_train_batch_size=4,
                             gradient_accumulation_steps=2 // world(), max_completion_length=8, beta=0.5, **COMMON)
    trainer = DistillationTrainer(model_dir, str(teacher), cfg, addition_rows(16),
                                  peft_config=lora_config(lora, "CAUSAL_LM"))
    trainer.generator = FixedGenerator(trainer.tokenizer)
    return trainer


def main() -> None:
    model_dir, out, mode = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
    dtype = sys.argv[4] if len(sys.argv) > 4 else "auto"
    make = reward if mode.startswith("reward") else distill if mode.startswith("distill") else grpo
    lora = mode.endswith("lora")
    trainer = make(model_dir, out / "run", lora, dtype)
    trainer.train()
    trainer.save_model(out / "straight")
    rates = [row["learning_rate"] for row in trainer.state.log_history if "learning_rate" in row]
    accelerator = trainer.accelerator
    trainer = make(model_dir, out / "run", lora, dtype)
    trainer.train(resume_from_checkpoint=str(out / "run" / "checkpoint-2"))
    trainer.save_model(out / "resumed")
    if accelerator.is_main_process:
        (out / "rates.json").write_text(json.dumps({"rates": rates, "engine": trainer.engine.name}))
    trainer = None
    release_processes(accelerator)


if __name__ == "__main__":
    main()
