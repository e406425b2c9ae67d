"""DDP, and one process: every process holds the whole model and the whole optimizer state.

Nothing differs from `TrainingEngine`'s plain behaviour but the name; the class exists so the engine
a run uses is always a named one (the run log says `engine ddp` or `engine single`).
"""

from __future__ import annotations

from rlft.train.engines.engine_base import TrainingEngine


class DDPEngine(TrainingEngine):
    """accelerate's DDP (MULTI_GPU / MULTI_CPU, gloo on CPUs) or no distribution at all."""

    @property
    def name(self) -> str:
        """'ddp' on several processes, 'single' on one: the run log tells the two apart."""
        return "ddp" if self.accelerator.num_processes > 1 else "single"
