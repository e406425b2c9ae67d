"""Where metrics go: `metrics.jsonl`, `completions.jsonl`, a rich progress bar, accelerate trackers.

Only the main process writes. On resume, lines of `metrics.jsonl` past the resumed step are
dropped, so the file reads as one uninterrupted run. Trackers file the run where transformers'
integrations (`report_to` in a TRL script) would: under `run_name` and the project those
integrations read (`tracker_target`).
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
# a note is one line in a log file, not cut at 80 columns
console = Console(stderr=True, soft_wrap=True)


def _jsonable(value: Any) -> Any:
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None  # JSON has no inf/NaN: metrics.jsonl stays valid JSON
    return value


def _rows(text: str) -> list[dict]:
    """jsonl rows; a partial last line (a kill mid-append) is dropped, a bad line elsewhere is an
    error."""
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
                 total_steps: int, start_step: int = 0, show_progress: bool = True):
        self.accelerator = accelerator
        self.is_main = accelerator.is_main_process
        self.dir = Path(output_dir)
        self.metrics_path = self.dir / "metrics.jsonl"
        self.samples_path = self.dir / "completions.jsonl"
        self.trackers = [r for r in report_to if r != "none"]
        self.progress = None
        self.total_steps = total_steps
        # Not a terminal (a log file, CI, SLURM, nohup): the rich bar would draw nothing, so one
        # plain line per logged row goes to stderr instead.
        self.plain = show_progress and not console.is_terminal
        if not self.is_main:
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        self._truncate_after(start_step)
        if self.trackers:
            start_trackers(accelerator, config)
        if show_progress and not self.plain:
            self.progress = Progress(TextColumn("[bold]rlft"), BarColumn(), MofNCompleteColumn(),
                                     TimeElapsedColumn(), TextColumn("{task.fields[status]}"),
                                     console=console, transient=False)
            self.task = self.progress.add_task("train", total=total_steps, completed=start_step, status="")
            self.progress.start()

    def _truncate_after(self, step: int) -> None:
        """Drop rows past the resumed step, and the end-of-run summary an interrupted run wrote at
        it (the resumed run logs those steps again). Written to a temporary file and renamed into
        place: a kill during the rewrite leaves the old file whole, never a cut one."""
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
        if self.trackers:  # the step goes as the step, not as a metric (trackio reserves the name)
            self.accelerator.log({k: v for k, v in row.items() if k != "step" and isinstance(v, int | float)},
                                 step=step)

    def track(self, values: dict[str, float], step: int) -> None:
        """Scalars to the trackers only (not metrics.jsonl), from the main process."""
        if self.is_main and self.trackers:
            self.accelerator.log(values, step=step)

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
            end_trackers(self.accelerator)


def end_trackers(accelerator) -> None:
    """Finish every tracker once (accelerate's end_training). accelerate finishes trackio's run
    object but leaves it trackio's current run, which trackio's exit hook then finished again (a
    second "Run finished" line); and a later end_training (Trainer.end) would finish them all
    again."""
    accelerator.end_training()
    accelerator.trackers = []
    trackio = sys.modules.get("trackio")
    if trackio is not None and hasattr(trackio, "context_vars"):
        trackio.context_vars.current_run.set(None)


class Messages:
    """Where a trainer's parts say what they have to say: the open run's log (console and run log,
    on the main process) while `train()` runs, Python's `rlft` logger otherwise (construction,
    evaluate() on its own)."""

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

    def waiting(self, name: str, seconds: float, step, message: str) -> None:
        """A reward function still running (called from its watcher thread): said on the console and
        in the run's log, and its seconds so far to the trackers
        (`rewards/<name>/running_seconds`)."""
        self.warn(message)
        if self.run is not None:
            self.run.track({f"rewards/{name}/running_seconds": seconds}, int(step or 0))


PLAIN_KEYS = ("reward", "loss", "grad_norm", "accuracy", "step_time")


def plain_line(row: dict, total_steps: int) -> str:
    """One readable progress line: `rlft step 20/1500 reward 1.250 loss -0.0012 grad_norm 0.31 ...`;
    evaluation results (eval_*) are shown as they come."""
    shown = [(k, row[k]) for k in PLAIN_KEYS if isinstance(row.get(k), int | float)]
    shown += [(k, v) for k, v in row.items() if k.startswith("eval") and isinstance(v, int | float)]
    text = " ".join(f"{k} {v:.4g}" for k, v in shown)
    return f"rlft step {row['step']}/{total_steps} {text}".rstrip()


# ---- trackers: where transformers' integrations file a run
# ----------------------------------------------- transformers' default project (WandbCallback,
# TrainingArguments.project)
DEFAULT_PROJECT = "huggingface"
# Trackers whose project transformers' integration reads from an environment variable (with its
# default).
PROJECT_VARIABLES = {"wandb": "WANDB_PROJECT", "comet_ml": "COMET_PROJECT_NAME", "swanlab": "SWANLAB_PROJECT"}
# The keyword each tracker's init takes the run name as (accelerate passes init_kwargs on to it).
RUN_NAME_KEYWORDS = {"wandb": "name", "trackio": "name", "mlflow": "run_name", "swanlab": "experiment_name"}


def tracker_target(tracker: str, config: dict) -> tuple[str, dict]:
    """(project, init keywords) for one tracker, as transformers' integration chooses them:
      wandb     project WANDB_PROJECT (default "huggingface"), run name `run_name` (None: wandb
                names it)
      trackio   project the config's `project` field (TrainingArguments', default "huggingface"),
                run name
                `run_name` (None: trackio names it), resume="allow" (a resumed run continues its trackio run)
      tensorboard  the log folder: TENSORBOARD_LOGGING_DIR, else <output_dir>/runs/<run_name>,
                   without a
                run_name <output_dir>/runs/<date>_<host> (transformers' default_logdir)
    The other trackers: their integration's project variable where it has one, else
    "huggingface"."""
    run_name = config.get("run_name")
    if tracker == "tensorboard":
        folder = os.environ.get("TENSORBOARD_LOGGING_DIR")
        if folder:  # absolute: accelerate joins it to output_dir, which an absolute path replaces
            return os.path.abspath(os.path.expanduser(folder)), {}
        if run_name:
            return os.path.join("runs", str(run_name)), {}
        from transformers.integrations.integration_utils import default_logdir

        return default_logdir(), {}
    if tracker == "trackio":
        project = config.get("project") or DEFAULT_PROJECT
    else:
        project = os.environ.get(PROJECT_VARIABLES.get(tracker, ""), DEFAULT_PROJECT) or DEFAULT_PROJECT
    keywords = {"resume": "allow"} if tracker == "trackio" else {}
    if run_name and tracker in RUN_NAME_KEYWORDS:
        keywords[RUN_NAME_KEYWORDS[tracker]] = str(run_name)
    return project, keywords


def start_trackers(accelerator, config: dict) -> None:
    """`init_trackers` once per project (accelerate gives every tracker of one call the same
    project; wandb's and trackio's can differ), each tracker with its run name in init_kwargs."""
    wanted = list(accelerator.log_with)
    groups: dict[str, dict[str, dict]] = {}
    for tracker in wanted:
        project, keywords = tracker_target(str(tracker), config)
        groups.setdefault(project, {})[str(tracker)] = keywords
    try:
        for project, members in groups.items():
            accelerator.log_with = [t for t in wanted if str(t) in members]
            accelerator.init_trackers(project, config=_flat_config(config), init_kwargs=members)
    finally:
        accelerator.log_with = wanted


def _flat_config(config: dict) -> dict:
    return {k: (v if isinstance(v, int | float | str | bool) or v is None else str(v))
            for k, v in config.items()}
