"""Where metrics go: `metrics.jsonl`, `completions.jsonl`, a rich progress bar, accelerate trackers.

Only the main process writes. On resume, lines of `metrics.jsonl` past the resumed step are
dropped, so the file reads as one uninterrupted run.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

logger = logging.getLogger("rlft")
console = Console(stderr=True, soft_wrap=True)  # a note is one line in a log file, not cut at 80 columns


def _jsonable(value: Any) -> Any:
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None  # JSON has no inf/NaN: metrics.jsonl stays valid JSON
    return value


def _rows(text: str) -> list[dict]:
    """jsonl rows; a partial last line (a kill mid-append) is dropped, a bad line elsewhere is an error."""
    lines = [line for line in text.splitlines() if line.strip()]
    rows = []
    for number, line in enumerate(lines):
        try:
            rows.append(json.loads(line))
        except ValueError:
            if number < len(lines) - 1:
                raise
    return rows


def read_metrics(path: str | Path) -> list[dict]:
    path = Path(path)
    if path.is_dir():
        path = path / "metrics.jsonl"
    return _rows(path.read_text())


class RunLog:
    """One run's metrics sink. `log()` is called on every process; only the main one writes."""

    def __init__(self, accelerator, output_dir: str | Path, report_to: list[str], config: dict,
                 total_steps: int, start_step: int = 0, show_progress: bool = True, project: str = "rlft"):
        self.accelerator = accelerator
        self.is_main = accelerator.is_main_process
        self.dir = Path(output_dir)
        self.metrics_path = self.dir / "metrics.jsonl"
        self.samples_path = self.dir / "completions.jsonl"
        self.trackers = [r for r in report_to if r != "none"]
        self.progress = None
        self.total_steps = total_steps
        # Not a terminal (a log file, CI, SLURM, nohup): the rich bar would draw nothing, so one plain line
        # per logged row goes to stderr instead.
        self.plain = show_progress and not console.is_terminal
        if not self.is_main:
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        self._truncate_after(start_step)
        if self.trackers:
            accelerator.init_trackers(project, config=_flat_config(config))
        if show_progress and not self.plain:
            self.progress = Progress(TextColumn("[bold]rlft"), BarColumn(), MofNCompleteColumn(),
                                     TimeElapsedColumn(), TextColumn("{task.fields[status]}"),
                                     console=console, transient=False)
            self.task = self.progress.add_task("train", total=total_steps, completed=start_step, status="")
            self.progress.start()

    def _truncate_after(self, step: int) -> None:
        """Drop rows past the resumed step, and the end-of-run summary an interrupted run wrote at it (the
        resumed run logs those steps again). Written to a temporary file and renamed into place: a kill during
        the rewrite leaves the old file whole, never a cut one."""
        for path in (self.metrics_path, self.samples_path):
            if not path.exists():
                continue
            keep = [row for row in _rows(path.read_text()) if row.get("step", 0) < step or
                    (row.get("step", 0) == step and "train_runtime" not in row)] if step > 0 else []
            tmp = path.with_name(f".{path.name}.tmp")
            tmp.write_text("".join(json.dumps(row) + "\n" for row in keep))
            os.replace(tmp, path)

    def log(self, metrics: dict[str, Any], step: int) -> None:
        if not self.is_main:
            return
        row = {"step": step, **{k: _jsonable(v) for k, v in metrics.items()}}
        logger.info("step %d: %s", step, json.dumps(row))
        if self.plain:
            print(plain_line(row, self.total_steps), file=sys.stderr, flush=True)
        with self.metrics_path.open("a") as handle:
            handle.write(json.dumps(row) + "\n")
        if self.trackers:
            self.accelerator.log({k: v for k, v in row.items() if isinstance(v, int | float)}, step=step)

    def samples(self, rows: list[dict], step: int) -> None:
        if not self.is_main or not rows:
            return
        with self.samples_path.open("a") as handle:
            for row in rows:
                handle.write(json.dumps({"step": step, **{k: _jsonable(v) for k, v in row.items()}},
                                        default=str) + "\n")

    def advance(self, step: int, status: str) -> None:
        if self.progress is not None:
            self.progress.update(self.task, completed=step, status=status)

    def info(self, message: str) -> None:
        if self.is_main:
            console.print(f"[cyan]rlft[/cyan] {message}")
            logger.info(message)

    def warn(self, message: str) -> None:
        if self.is_main:
            console.print(f"[yellow]rlft warning[/yellow] {message}")
            logger.warning(message)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None
        if self.is_main and self.trackers:
            self.accelerator.end_training()


class Messages:
    """Where a trainer's parts say what they have to say: the open run's log (console and run log, on the main
    process) while `train()` runs, Python's `rlft` logger otherwise (construction, evaluate() on its own)."""

    def __init__(self):
        self.run: RunLog | None = None

    def info(self, message: str) -> None:
        if self.run is not None:
            self.run.info(message)
        else:
            logger.info(message)

    def warn(self, message: str) -> None:
        if self.run is not None:
            self.run.warn(message)
        else:
            logger.warning(message)


PLAIN_KEYS = ("reward", "loss", "grad_norm", "accuracy", "step_time")


def plain_line(row: dict, total_steps: int) -> str:
    """One readable progress line: `rlft step 20/1500 reward 1.250 loss -0.0012 grad_norm 0.31 ...`;
    evaluation results (eval_*) are shown as they come."""
    shown = [(k, row[k]) for k in PLAIN_KEYS if isinstance(row.get(k), int | float)]
    shown += [(k, v) for k, v in row.items() if k.startswith("eval") and isinstance(v, int | float)]
    text = " ".join(f"{k} {v:.4g}" for k, v in shown)
    return f"rlft step {row['step']}/{total_steps} {text}".rstrip()


def _flat_config(config: dict) -> dict:
    return {k: (v if isinstance(v, int | float | str | bool) or v is None else str(v))
            for k, v in config.items()}
