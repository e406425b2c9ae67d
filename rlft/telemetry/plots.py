"""Training curves from `metrics.jsonl` to one PNG, readable without any tracker service."""

from __future__ import annotations

import math
from pathlib import Path

from rlft.telemetry.tracking import read_metrics

PANELS = [
    ("reward (train, sampled)",
     lambda k: k == "reward" or (k.startswith("rewards/") and k.endswith("/mean"))),
    ("held-out / eval (greedy)",
     lambda k: k.startswith("eval/") and k.endswith("/mean") or k == "eval/reward"),
    ("KL to reference", lambda k: k == "kl"),
    ("entropy", lambda k: k == "entropy"),
    ("completion length", lambda k: k in ("completions/mean_length", "completions/max_length")),
    ("grad norm", lambda k: k == "grad_norm"),
    ("loss", lambda k: k in ("loss", "accuracy", "margin")),
    ("zero-spread groups", lambda k: k == "frac_reward_zero_std"),
]


def _series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    points = [(r["step"], r[key]) for r in rows
              if isinstance(r.get(key), int | float) and math.isfinite(r[key])]
    return [p[0] for p in points], [p[1] for p in points]


def plot_run(run_dir: str | Path, out: str | Path | None = None, title: str | None = None) -> Path:
    """Write the run's curves to `out` (default RUN_DIR/curves.png) and return the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    rows = read_metrics(run_dir)
    if not rows:
        raise ValueError(f"{run_dir}/metrics.jsonl has no rows to plot")
    keys = sorted({k for r in rows for k in r if k != "step"})
    panels = [(name, [k for k in keys if match(k)]) for name, match in PANELS]
    panels = [(name, found) for name, found in panels if found]
    cols = 2
    rows_count = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows_count, cols, figsize=(11, 3.2 * rows_count), squeeze=False)
    for ax, (name, found) in zip(axes.flat, panels):
        for key in found:
            steps, values = _series(rows, key)
            ax.plot(steps, values, marker="o" if len(steps) < 30 else None, markersize=3, label=key)
        ax.set_title(name)
        ax.set_xlabel("optimizer step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.suptitle(title or f"rlft run: {run_dir}")
    fig.tight_layout()
    out = Path(out) if out else run_dir / "curves.png"
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
