"""Canaries for rfopt/compat/_trackio.py (trackio): each fails loudly when the library symbol, or the call site, that
one of rfopt's patches of its internals relies on is gone, so an upgrade cannot leave a patch silently doing nothing."""

import os

import pytest

from rfopt import compat


# ---------------------------------------------------------------------- trackio_run_per_trial, trackio_flush
def test_trackio_runs_opened_one_after_another_all_stay_open_and_a_flush_writes_what_they_logged():
    """trackio.init finishes the current run (a ContextVar); opened in a context of their own, two runs both log."""
    pytest.importorskip("trackio", reason="trackio is not installed: pip install -e '.[trackers]'")
    from trackio.sqlite_storage import SQLiteStorage

    project = f"canary-{os.getpid()}"
    a = compat.trackio_run(project=project, name="a", auto_log_cpu=False, auto_log_gpu=False)
    b = compat.trackio_run(project=project, name="b", auto_log_cpu=False, auto_log_gpu=False)
    assert not a._stop_flag.is_set()  # opening b did not finish a (trackio.init alone would have)
    a.log({"x": 1.0}, step=1)
    b.log({"x": 2.0}, step=1)
    compat.trackio_flush(a)
    compat.trackio_flush(b)
    assert [log["x"] for log in SQLiteStorage.get_logs(project, "a")] == [1.0]  # on disk before any finish
    assert [log["x"] for log in SQLiteStorage.get_logs(project, "b")] == [2.0]
    a.finish()
    b.finish()
