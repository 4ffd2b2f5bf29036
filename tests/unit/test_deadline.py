"""User code with a deadline (freetx.objectives.deadline): the call's result or exception,
a call that passes its deadline abandoned, and a stop signal heard while a call blocks."""

from __future__ import annotations

import os
import signal
import time

import pytest

from freetx.objectives.deadline import DeadlinePassed, Interrupted, call_with_deadline


def test_a_call_returns_its_value_or_raises_its_own_exception():
    assert call_with_deadline(lambda a, b=0: a + b, 1, b=2, timeout_s=5) == 3
    with pytest.raises(TimeoutError, match="its own"):  # the user's TimeoutError is its own
        call_with_deadline(lambda: (_ for _ in ()).throw(TimeoutError("its own")), timeout_s=5)


def test_a_call_past_its_deadline_is_abandoned():
    started = time.monotonic()
    with pytest.raises(DeadlinePassed, match="0.2 s"):
        call_with_deadline(time.sleep, 60, timeout_s=0.2)
    assert time.monotonic() - started < 1.0


def test_a_signal_while_a_call_blocks_is_heard_at_once():
    got = []
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: got.append(signum))

    def blocks() -> None:  # the signal comes while the main thread waits
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(60)

    started = time.monotonic()
    try:
        with pytest.raises(Interrupted):
            call_with_deadline(blocks, timeout_s=60, stop=lambda: bool(got))
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert time.monotonic() - started < 1.0
