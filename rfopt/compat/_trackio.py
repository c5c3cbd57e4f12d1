"""trackio's internals that rfopt relies on: a run per trial in one process, a flush of what a run queued.

``trackio_run_per_trial``  `trackio_run` opens a run with ``trackio.init`` in an empty ``contextvars.Context``:
    ``trackio.init`` finishes the run that is current (``trackio.context_vars.current_run``, a ``ContextVar``) before
    it opens another, so one process could hold one run. In a context of its own each ``init`` sees none and leaves
    the caller's alone. Buys: a trackio run per trial of a gang (`rfopt.training.trackers`).
``trackio_flush``  `trackio_flush` writes what a local trackio run (``Run._is_local``) has queued now (``Run._flush_queues_inline``,
    under ``Run._client_lock``, as its sender thread does every ``BATCH_SEND_INTERVAL``); trackio has no public
    flush but ``finish``. Buys: a committed chunk is in trackio's database when the commit returns, so a crash right
    after it loses nothing of it.
"""

from __future__ import annotations

from typing import Any

from ._versions import check_version, require


def trackio_run(**kwargs: Any) -> Any:
    """``trackio.init(**kwargs)``'s run, the runs opened before it left running (entry ``trackio_run_per_trial``)."""
    import contextvars

    import trackio
    from trackio import context_vars

    check_version("trackio")
    require(context_vars, "current_run", "trackio_run_per_trial")
    return contextvars.Context().run(trackio.init, **kwargs)


def trackio_flush(run: Any) -> None:
    """Write what `run` (a local ``trackio.Run``) has queued now (entry ``trackio_flush``)."""
    require(run, "_flush_queues_inline", "trackio_flush")
    if not getattr(run, "_is_local", False):  # a Space's or server's run: its sender thread sends it
        return
    with run._client_lock:
        run._flush_queues_inline()
