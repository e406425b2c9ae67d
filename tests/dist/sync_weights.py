"""The weights a vLLM weight sync reads, on every process, under whatever engine the launch asks for.

tests/dist/sharded_run.py's 4 GRPO steps with fixed completions; the rollout engine is a stand-in that, before each
generation after a step, reads its sync exactly as the vLLM engines do, with the training engine's `full_weights`.
MODE lora / full: the whole model, LoRA merged (`synced_weights`); buckets: full fine-tuning read in 16 KiB buckets
(`weight_buckets`); adapter: LoRA as an adapter (the base weights in buckets, then the adapter's tensors). Each
process writes what it would push before step 4 to OUT/rank<r>.safetensors and, for buckets / adapter, how many
parameters were whole at once (OUT/rank<r>.json: before a sync, and at most inside one bucket).

    accelerate launch --config_file ENGINE.yaml tests/dist/sync_weights.py MODEL_DIR OUT MODE
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from rlft.rollout.vllm import StaleAfterStep, engine_weights, module_tensors, synced_weights
from rlft.rollout.weight_sync import adapter_entries, weight_buckets
from rlft.train.state import release_processes
from tests.dist.grpo_step import FixedGenerator
from tests.dist.sharded_run import grpo


def whole_params(model) -> int:
    """Parameters held whole on this process right now (not an FSDP2 shard, not a ZeRO-3 partition)."""
    from torch.distributed.tensor import DTensor

    return sum(1 for p in model.parameters() if not isinstance(p, DTensor)
               and getattr(getattr(p, "ds_status", None), "name", "AVAILABLE") == "AVAILABLE")


class SyncingGenerator(StaleAfterStep, FixedGenerator):
    def __init__(self, tokenizer, full_weights, mode):
        FixedGenerator.__init__(self, tokenizer)
        self.full_weights, self.pushed, self.mode = full_weights, None, mode
        self.whole = {"before": 0, "inside": 0, "largest_bucket": 0, "buckets": 0, "params": 0}

    def _buckets(self, model, entries_of, size):
        self.whole["before"] = whole_params(model)
        self.whole["params"] = len(list(model.parameters()))
        for bucket in weight_buckets(model, entries_of, self.full_weights, torch.float32, size):
            self.whole["inside"] = max(self.whole["inside"], whole_params(model))
            self.whole["largest_bucket"] = max(self.whole["largest_bucket"], len({id(t) for _, t in bucket}))
            self.whole["buckets"] += 1
            yield from ((name, tensor.clone()) for name, tensor in bucket)

    def __call__(self, model, prompt_ids, num_generations, greedy=False):
        if self.stale:
            if self.mode == "buckets":
                self.pushed = dict(self._buckets(model, module_tensors, 16 * 1024))
            elif self.mode == "adapter":
                self.pushed = dict(self._buckets(model, engine_weights, 16 * 1024))
                self.pushed.update(self._buckets(model, adapter_entries, 1 << 40))
            else:
                with synced_weights(model, self.full_weights, torch.float32) as weights:
                    self.pushed = {name: tensor.clone() for name, tensor in weights}
            self.stale, self.syncs = False, self.syncs + 1
        return FixedGenerator.__call__(self, model, prompt_ids, num_generations, greedy)


def main() -> None:
    model_dir, out, mode = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
    dtype = sys.argv[4] if len(sys.argv) > 4 else "auto"  # the policy's (what is pushed is float32)
    trainer = grpo(model_dir, out / "run", mode in ("lora", "adapter"), dtype)
    trainer.generator = SyncingGenerator(trainer.tokenizer, trainer.engine.full_weights, mode)
    trainer.train()
    assert trainer.generator.syncs == 4, trainer.generator.syncs
    rank = int(os.environ.get("RANK", "0"))
    save_file({k: v.contiguous() for k, v in trainer.generator.pushed.items()}, str(out / f"rank{rank}.safetensors"))
    (out / f"rank{rank}.json").write_text(json.dumps(trainer.generator.whole))
    release_processes(trainer.accelerator)


if __name__ == "__main__":
    main()
