"""Stopping at a step boundary when the scheduler (or a person) asks: SIGTERM, SIGUSR1
and SIGINT.

A signal only sets a flag in the process that gets it. Every step, the flag rides
along the all-reduce that counts the step's loss units (`count_over_ranks`), so
every rank learns in the same step that one of them was asked to stop: they all
save a checkpoint at that step boundary and end (no rank is left waiting in a
collective). The run then leaves a `PREEMPTED` file in its output_dir, and
`freetx run` exits with PREEMPTED_EXIT_CODE, which the SLURM script `freetx launch
slurm` writes answers with `scontrol requeue`; the requeued job resumes from that
checkpoint. A second Ctrl-C ends the process at once.
"""

from __future__ import annotations

import signal

from freetx.errors import PREEMPTED_EXIT_CODE  # noqa: F401 - where the launchers read it

PREEMPTED_FILE = "PREEMPTED"
SIGNALS = {"SIGTERM": signal.SIGTERM, "SIGUSR1": signal.SIGUSR1, "SIGINT": signal.SIGINT}

current_step: int = 0  # the step being trained (for messages when a collective hangs)
_requested: str | None = None  # the signal this process got
_agreed = False  # some rank got one: every rank stops at this step


def install_stop_handlers() -> None:
    """Turn SIGTERM, SIGUSR1 and SIGINT into a stop request (the main thread only)."""

    def request(signum, _frame):
        global _requested
        if _requested is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: now
        _requested = signal.Signals(signum).name

    for sig in SIGNALS.values():
        signal.signal(sig, request)


def local_request() -> float:
    """1.0 when this process was asked to stop (the value all-reduced every step)."""
    return 1.0 if _requested is not None else 0.0


def agree(total: float) -> None:
    """Record the all-reduced requests: any rank's request stops every rank."""
    global _agreed
    _agreed = _agreed or total > 0


def stop_agreed() -> bool:
    return _agreed


def requested_by() -> str:
    return _requested or "another rank's signal"
