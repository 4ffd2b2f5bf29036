"""Stopping at a step boundary when the scheduler (or a person) asks: SIGTERM, SIGUSR1
and SIGINT.

A signal only sets a flag in the process that gets it (`StopRequest`). Every
step, `TrainingRun.advance` asks every rank whether any of them got one (one
all-reduce of one flag over every rank, on a gloo group of its own: no wait for
the GPU): all ranks learn it in the same step, save a
checkpoint at that step boundary and end, so no rank is left waiting in a
collective. The run then leaves a `PREEMPTED` file in its output_dir, and
`freetx run` exits with PREEMPTED_EXIT_CODE, which the SLURM script `freetx
launch slurm` writes answers with `scontrol requeue`; the requeued job resumes
from that checkpoint. A second Ctrl-C ends the process at once.
"""

from __future__ import annotations

import signal
from typing import Protocol

from freetx.errors import PREEMPTED_EXIT_CODE  # noqa: F401 - where the launchers read it

PREEMPTED_FILE = "PREEMPTED"
SIGNALS = {"SIGTERM": signal.SIGTERM, "SIGUSR1": signal.SIGUSR1, "SIGINT": signal.SIGINT}


class StopAgreement(Protocol):
    """What a long phase inside a step asks of the run (`TrainingRun`: the rollouts wait
    on user rewards): whether this process got a stop signal (no collective), and whether
    any rank did (a collective: every rank calls it at the same point; then `stopping`)."""

    def stop_requested(self) -> bool: ...

    def agree_to_stop(self) -> bool: ...


class StopRequest:
    """This process's stop request (a signal it got) and the ranks' agreement on it."""

    def __init__(self) -> None:
        self.requested: str | None = None  # the signal this process got
        self.agreed = False  # some rank got one: every rank stops at this step

    def install(self) -> None:
        """Turn SIGTERM, SIGUSR1 and SIGINT into a stop request (the main thread only)."""

        def request(signum, _frame):
            if self.requested is not None and signum == signal.SIGINT:
                raise KeyboardInterrupt  # a second Ctrl-C: now
            self.requested = signal.Signals(signum).name

        for sig in SIGNALS.values():
            signal.signal(sig, request)

    def agree(self, any_rank: bool) -> None:
        """Record whether any rank asked (the answer of a collective every rank ran)."""
        self.agreed = self.agreed or any_rank

    @property
    def requested_by(self) -> str:
        return self.requested or "another rank's signal"
