"""Preemption: a run told to stop (SIGTERM from a cluster scheduler before its SIGKILL, SIGUSR1
where a scheduler sends that, Ctrl-C / SIGINT in a terminal or notebook) finishes the step it is in,
writes a checkpoint, says where it is and how to resume, and exits with PREEMPTED_EXIT (75,
sysexits' "temporary failure, retry"; after SIGINT: KeyboardInterrupt, as Python does). The resume
is exact, as from any checkpoint.

The handlers only note the signal; the loop asks after each step (`requested`), every process
together, so all ranks stop at the same step and write the same checkpoint even when only one of
them got the signal. A second SIGINT (an impatient Ctrl-C) raises KeyboardInterrupt at once: a
checkpoint being written is then abandoned (its temporary folder removed) and the previous one stays
as it was.
"""

from __future__ import annotations

import os
import signal
import threading

import torch

from rlft.errors import RlftError

PREEMPTED_EXIT = 75
SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGINT", "SIGUSR1") if hasattr(signal, name))


class Preempted(RlftError, SystemExit):
    """The run stopped on a signal after writing a checkpoint; exits with PREEMPTED_EXIT."""

    def __init__(self, message: str):
        SystemExit.__init__(self, PREEMPTED_EXIT)
        self.message = message

    def __str__(self) -> str:
        return self.message


def _say_heard(signum: int) -> None:
    """At once, from the handler: the stop was heard and what happens next. os.write, not print: a
    handler may run while the main thread is inside a buffered write to the same stream."""
    name = signal.Signals(signum).name
    again = " (Ctrl-C again stops it now, without a checkpoint)" if signum == signal.SIGINT else ""
    text = (f"\nrlft: {name} received: the run stops after the current step and writes a checkpoint"
            f"{again}\n")
    try:
        os.write(2, text.encode())
    except OSError:  # no stderr to write to: the stop still happens
        pass


class Preemption:
    """For the length of train(): the signal handlers (main thread only; elsewhere, nothing to do),
    and the agreed answer to "was this run told to stop?"."""

    def __init__(self, accelerator):
        self.accelerator, self.signal, self.previous = accelerator, None, {}

    def __enter__(self) -> Preemption:
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self.previous[sig] = signal.signal(sig, self._note)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        self.previous = {}

    def _note(self, signum, frame) -> None:
        if self.signal == signal.SIGINT and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: stop now
        if self.signal is None and self.accelerator.is_main_process:
            _say_heard(signum)
        self.signal = self.signal or signum

    def requested(self) -> bool:
        """Whether any process was told to stop (a collective on several processes: every one
        asks)."""
        flag = torch.tensor([0.0 if self.signal is None else float(self.signal)],
                            device=self.accelerator.device)
        if self.accelerator.num_processes > 1:
            flag = self.accelerator.reduce(flag, "max")
        if flag.item() and self.signal is None:
            self.signal = int(flag.item())  # another process's signal
        return bool(flag.item())

    @property
    def name(self) -> str:
        return signal.Signals(self.signal).name if self.signal else "?"
