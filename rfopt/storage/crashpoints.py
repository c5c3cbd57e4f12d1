"""Crash points: named moments in the engine where a test can kill the process, and a log of them.

Crash-safety is a claim about every moment of a run; these hooks let a test pick the moment. Both
are off unless their environment variable is set, and then cost one dictionary lookup per point.

- ``RFOPT_CRASH_AT=point:n`` SIGKILLs this process the n-th time it reaches ``point`` (as power loss
  would: no handler, no flush, no cleanup).
- ``RFOPT_EVENT_LOG=path`` appends ``point trial unit pid time`` for every point reached, one line each,
  so a test can check what was trained and committed across crashes and restarts.

    >>> reach("unit-committed", trial=3, unit=1)   # a no-op unless one of the variables is set
"""

from __future__ import annotations

import os
import signal
import time

POINTS = (
    "unit-started",        # a unit's training begins
    "chunk-trained",       # the chunk is trained, not yet evaluated
    "checkpoint-staged",   # the checkpoint's files are written in a staging directory, not yet published
    "checkpoint-renamed",  # the checkpoint is in place (renamed, or uploaded to an object store), LATEST not yet updated
    "gang-units-written",  # a gang's checkpoints are all in place, its record (the commit point) not yet written
    "gang-saved",          # a gang's record is written: its units are durable; LATEST not yet moved for each
    "checkpoint-saved",    # the checkpoint is durable and named in LATEST; the report is not committed
    "metrics-stored",      # the unit's metrics are in storage, its report is not
    "unit-committed",      # the unit's report is in storage: the unit is committed
    "trial-finishing",     # the finished trial's adapter is saved, the trial not yet told COMPLETE
    "pbt-planned",         # population-based training's plan for a step is stored; no clone made yet
    "clone-weights-saved", # a warm clone's starting weights are written; the clone is not in storage yet
    "pbt-cloned",          # the step's clones are made; no member's decision is stored yet
)

_counts: dict[str, int] = {}


def reach(point: str, *, trial: int, unit: int) -> None:
    """Mark that this process reached `point` for a trial's unit; log it and die there if asked to."""
    log = os.environ.get("RFOPT_EVENT_LOG")
    if log:
        line = f"{point} {trial} {unit} {os.getpid()} {time.time():.3f}\n".encode()
        fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line)
            os.fsync(fd)
        finally:
            os.close(fd)
    crash_at = os.environ.get("RFOPT_CRASH_AT")
    if crash_at:
        name, _, nth = crash_at.partition(":")
        if name == point:
            _counts[point] = _counts.get(point, 0) + 1
            if _counts[point] == int(nth or 1):
                _die()


def _die() -> None:
    """Die as power loss would: SIGKILL, no handler, no flush, no cleanup. (A test that crashes runs inside its own
    process replaces it with an exception nothing in rfopt catches: tests/engine/test_crash.py.)"""
    os.kill(os.getpid(), signal.SIGKILL)
