"""The weights a vLLM weight sync reads, on every process, under whatever engine the launch asks for.

tests/dist/sharded_run.py's 4 GRPO steps (LoRA or full, MODE) with fixed completions; the rollout engine is a stand-in that, before each
generation after a step, reads its sync exactly as the vLLM engines do (`synced_weights` inside the trainer's
generation context, with the training engine's `full_weights`). Each process writes what it would push before
step 4 to OUT/rank<r>.safetensors (vLLM checkpoint names, LoRA merged).

    accelerate launch --config_file ENGINE.yaml tests/dist/sync_weights.py MODEL_DIR OUT MODE
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from rlft.rollout.vllm import StaleAfterStep, synced_weights
from rlft.train.state import release_processes
from tests.dist.grpo_step import FixedGenerator
from tests.dist.sharded_run import grpo


class SyncingGenerator(StaleAfterStep, FixedGenerator):
    def __init__(self, tokenizer, full_weights):
        FixedGenerator.__init__(self, tokenizer)
        self.full_weights, self.pushed = full_weights, None

    def __call__(self, model, prompt_ids, num_generations, greedy=False):
        if self.stale:
            with synced_weights(model, self.full_weights, torch.float32) as weights:
                self.pushed = {name: tensor.clone() for name, tensor in weights}
            self.stale, self.syncs = False, self.syncs + 1
        return FixedGenerator.__call__(self, model, prompt_ids, num_generations, greedy)


def main() -> None:
    model_dir, out, mode = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
    trainer = grpo(model_dir, out / "run", mode == "lora")
    trainer.generator = SyncingGenerator(trainer.tokenizer, trainer.engine.full_weights)
    trainer.train()
    assert trainer.generator.syncs == 4, trainer.generator.syncs
    rank = int(os.environ.get("RANK", "0"))
    save_file({k: v.contiguous() for k, v in trainer.generator.pushed.items()}, str(out / f"rank{rank}.safetensors"))
    release_processes(trainer.accelerator)


if __name__ == "__main__":
    main()
