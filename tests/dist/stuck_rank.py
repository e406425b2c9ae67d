"""A GRPO run on 2 processes where rank 1's reward function stops answering at step 2.

    torchrun --nproc_per_node 2 --standalone tests/dist/stuck_rank.py MODEL_DIR OUT_DIR
"""

from __future__ import annotations

import os
import signal
import sys
import time

from rlft import GRPOConfig, GRPOTrainer
from tests.helpers import addition_rows


def stuck_on_rank_1(completions, trainer_state, **kwargs):
    if os.environ.get("RANK") == "1" and trainer_state.global_step == 1:
        # once rank 0 has failed, torchrun stops this rank with SIGTERM and waits 30 s before SIGKILL: rlft's
        # handler would defer the exit to the end of a step this rank never reaches, so leave at once
        signal.signal(signal.SIGTERM, lambda *_: os._exit(1))
        time.sleep(300)  # alive, not answering
    return [0.0] * len(completions)


if __name__ == "__main__":
    model, out = sys.argv[1:3]
    args = GRPOConfig(output_dir=out, max_steps=3, num_generations=4, per_device_train_batch_size=4,
                      max_completion_length=4, report_to="none", disable_tqdm=True, gradient_checkpointing=False,
                      ddp_timeout=5, save_steps=1000)
    GRPOTrainer(model, [stuck_on_rank_1], args, addition_rows(16)).train()
