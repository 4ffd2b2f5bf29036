"""User code with a deadline: a reward function now (an environment's step or a tool
call of multi-turn RL later), called so that a call that blocks neither hangs the run
nor makes it deaf to SIGTERM and Ctrl-C.

Python runs a signal handler only in the main thread, between bytecodes: a reward
blocked in the main thread (a request without a timeout, a sleep, a lock) keeps the
run's stop request (`freetx.training.signals`) from ever being looked at. So
`call_with_deadline` runs the call in a daemon thread of its own and the main thread
waits for it in slices of `POLL_S` seconds: the signal handler runs during the wait,
and between slices the wait looks at the caller's stop request and at the deadline.
On either it gives up on the call: Python cannot kill a thread, so the thread is
abandoned, running until its call returns or the process ends (a daemon thread does not
keep the process alive). A subprocess could be killed, but each call would pickle the
function (a closure or a class instance may not pickle), its arguments and its result,
and start or keep processes: costly, for what a run ended by the timeout does not need.
What a thread cannot do: a call that holds the GIL inside C code (a regular expression
backtracking for ever) stops the main thread too; only a process could end that.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")
POLL_S = 0.1  # how often the wait looks at the stop request


class DeadlinePassed(Exception):
    """The call did not return within its timeout (it was abandoned). Not a TimeoutError:
    one that the user's code raises itself is its own failure."""


class Interrupted(Exception):
    """A stop request (a signal) came while waiting for the call (it was abandoned)."""


def call_with_deadline(
    function: Callable[..., T],
    *args: Any,
    timeout_s: float,
    stop: Callable[[], bool] | None = None,
    **kwargs: Any,
) -> T:
    """`function(*args, **kwargs)` in a daemon thread, waited for at most `timeout_s`
    seconds (module docstring): its result, or the exception it raised, raised here;
    DeadlinePassed past the deadline; Interrupted as soon as `stop()` is true (looked at
    every POLL_S seconds while waiting)."""
    done = threading.Event()
    outcome: dict[str, Any] = {}

    def call() -> None:
        try:
            outcome["value"] = function(*args, **kwargs)
        except BaseException as e:  # noqa: BLE001 - raised again in the waiting thread
            outcome["error"] = e
        finally:
            done.set()

    deadline = time.monotonic() + timeout_s
    threading.Thread(target=call, name="freetx-user-call", daemon=True).start()
    while not done.wait(max(min(POLL_S, deadline - time.monotonic()), 0.0)):
        if stop is not None and stop():
            raise Interrupted
        if time.monotonic() >= deadline:
            raise DeadlinePassed(f"no return within {timeout_s:g} s")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def call_named(
    function: Callable[..., Any],
    *args: Any,
    scene: str,
    key: str,
    timeout_s: float,
    error: type[Exception],
    fix: str,
    stop: Callable[[], bool] | None = None,
    raw: bool = False,
    **kwargs: Any,
) -> Any:
    """The user's `function(*args, **kwargs)` (a reward, an environment's step, a tool),
    awaited in its thread when it is `async`, within `timeout_s` (the config's `key`):
    its result; `error` naming `scene` when it passes the deadline, or when it raises
    (`fix`: what to do), unless `raw` (its own exception raised as it is: a tool's, which
    the model reads). Interrupted (`stop()`: a stop signal) passes through."""

    def invoke() -> Any:
        result = function(*args, **kwargs)
        return asyncio.run(_awaited(result)) if inspect.isawaitable(result) else result

    try:
        return call_with_deadline(invoke, timeout_s=timeout_s, stop=stop)
    except Interrupted:  # a stop signal: the caller stops the run
        raise
    except DeadlinePassed:
        raise error(
            f"{scene} did not return within {key}={timeout_s:g} s, and the run stopped (the "
            "call was abandoned). Make it return sooner (a timeout on whatever it waits "
            f"for), or raise {key} if it is slow by nature."
        ) from None
    except Exception as e:
        if raw:
            raise
        raise error(f"{scene} failed: {type(e).__name__}: {str(e).rstrip('.')}. {fix}") from e


async def _awaited(result: Any) -> Any:
    return await result
