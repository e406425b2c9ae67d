"""Triton kernels for the fused head's tiles (issue 57; an optional extra: `pip install rlft[kernels]`).

Each kernel has a torch path that computes the same thing (rlft/core/logprobs.py's definitions) and is
chosen wherever Triton cannot run: no `triton` installed, or a tensor that is not on a CUDA device
(`TRITON_INTERPRET=1` runs them on a CPU, which is how the tests check them against float64).
"""

from rlft.core.tile_softmax import tile_stats, tile_stats_grad, triton_runs

__all__ = ["tile_stats", "tile_stats_grad", "triton_runs"]
