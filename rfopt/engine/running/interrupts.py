"""Ctrl-Cs remembered. Python raises a SIGINT's KeyboardInterrupt wherever the main thread is, and where that is a
weakref callback or a ``__del__`` (as garbage collection inside torch, sqlite or regex runs them) it only prints
"Exception ignored" and goes on: the study would run to its end. `remembered` keeps every SIGINT that comes while the
loop runs (`heard`: `rfopt.engine.running.driver` stops before its next unit); a process that must stop at any SIGINT, however
early (a worker process ending with the ``rfopt worker --devices`` process that started it: Linux interrupts it while
it may still be loading), calls `remember_in_this_process` first, and the loop then also stops for one that came
before it started. A unit that fails once one came (`heard`) fails no trial: the run stops, every trial resumable (a
KeyboardInterrupt raised inside torch's context managers can surface as another error)."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator

_HEARD = threading.Event()
"""A SIGINT came to this process since `remember_in_this_process`."""

_heard_now: Callable[[], bool] = lambda: False  # noqa: E731 - what `heard` asks: the `remembered` block's


def _remember(signum: int, frame: object) -> None:
    _HEARD.set()
    signal.default_int_handler(signum, frame)


def remember_in_this_process() -> None:
    """From now on, until this process ends, remember every SIGINT (a Ctrl-C still raises KeyboardInterrupt at once):
    a run started later stops before its first unit if one came, even one whose KeyboardInterrupt was swallowed.
    Call it on the main thread."""
    signal.signal(signal.SIGINT, _remember)


@contextlib.contextmanager
def remembered() -> Iterator[None]:
    """While the block runs, remember every SIGINT: `heard` says whether one came (since the block started, or in a
    process that remembers them, since `remember_in_this_process`). Off the main thread, or with a handler of the
    caller's own, nothing changes (`heard` answers as it did before the block: no, outside any)."""
    global _heard_now
    current = signal.getsignal(signal.SIGINT) if threading.current_thread() is threading.main_thread() else None
    if current is _remember:
        answer = _HEARD.is_set
    elif current is signal.default_int_handler:
        seen = threading.Event()

        def handler(signum: int, frame: object) -> None:
            seen.set()
            signal.default_int_handler(signum, frame)

        signal.signal(signal.SIGINT, handler)
        answer = seen.is_set
    else:
        yield
        return
    before, _heard_now = _heard_now, answer
    try:
        yield
    finally:
        _heard_now = before
        if current is signal.default_int_handler:
            signal.signal(signal.SIGINT, signal.default_int_handler)


def heard() -> bool:
    """Whether a SIGINT came while the `remembered` block running now runs (or, in a process that remembers them, since
    `remember_in_this_process`). A failure then may be the Ctrl-C's doing, not a trial's: a KeyboardInterrupt raised
    inside torch's context managers can surface as their RuntimeError ("trying to pop from empty mode stack")."""
    return _heard_now()


__all__ = ["heard", "remember_in_this_process", "remembered"]
