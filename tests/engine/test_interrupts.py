"""A Ctrl-C whose KeyboardInterrupt a library swallowed (a ``__del__`` run by garbage collection only prints "Exception
ignored") still stops the loop; in a worker process it does so even when it came before the loop started."""

import os
import signal
import subprocess
import sys
import threading

import optuna
import pytest

import rfopt
from rfopt.engine.running import interrupts
from rfopt_testkit import prompts_dataset, trial_config


class _SwallowsACtrlC:
    """Garbage whose ``__del__`` is where a Ctrl-C lands: Python prints "Exception ignored" and goes on."""

    def __del__(self):
        os.kill(os.getpid(), signal.SIGINT)


def _ctrl_c_swallowed():
    _SwallowsACtrlC()  # collected at once: the KeyboardInterrupt is raised in its __del__, and swallowed there


@pytest.fixture
def swallowed(monkeypatch):
    """The KeyboardInterrupts Python swallowed ("Exception ignored") during the test, which runs with Python's own
    SIGINT handler, as from a terminal (a suite run as a shell's background job has SIGINT ignored); the handler and
    what this process remembers are restored after it."""
    seen = []
    monkeypatch.setattr(sys, "unraisablehook", lambda unraisable: seen.append(unraisable.exc_type))
    monkeypatch.setattr(interrupts, "_HEARD", threading.Event())
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield seen
    signal.signal(signal.SIGINT, before)


def _optimize(study, tiny_model, **kwargs):
    configs = rfopt.grid(trial_config(tiny_model), learning_rate=[1e-3, 2e-3])
    study.optimize(configs, prompts_dataset(8), prompts_dataset(2, "E"), num_chunks=3, show_progress_bar=False,
                   **kwargs)


def test_a_ctrl_c_swallowed_while_the_study_runs_stops_it_before_its_next_unit_every_trial_resumable(
        scripted, tiny_model, storage, swallowed):
    study = rfopt.create_study(study_name="i", storage=storage)
    units = []

    def on_unit(number, unit, value):
        units.append((number, unit))
        if len(units) == 1:
            _ctrl_c_swallowed()

    with pytest.raises(KeyboardInterrupt):
        _optimize(study, tiny_model, on_unit=on_unit)
    assert swallowed == [KeyboardInterrupt]  # Python did swallow it
    assert units == [(0, 0), (1, 0)]  # the round it came in ends, and no other starts
    assert [t.state for t in study.optuna.trials] == [optuna.trial.TrialState.RUNNING] * 2
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the caller's handler is back


def test_a_ctrl_c_swallowed_before_a_study_runs_stops_it_only_in_a_process_that_remembers_them(
        scripted, tiny_model, storage, swallowed):
    _ctrl_c_swallowed()  # in a notebook, say, before this call: it does not stop the study
    study = rfopt.create_study(study_name="plain", storage=storage)
    _optimize(study, tiny_model)
    assert [t.state for t in study.optuna.trials] == [optuna.trial.TrialState.COMPLETE] * 2

    interrupts.remember_in_this_process()  # as a worker process ending with its starter does
    _ctrl_c_swallowed()  # while it loads, say
    assert swallowed == [KeyboardInterrupt] * 2
    study = rfopt.create_study(study_name="worker", storage=storage)
    with pytest.raises(KeyboardInterrupt):
        _optimize(study, tiny_model)
    # Stopped before its first unit: the configs are queued as the run starts, and none was taken or trained.
    assert [t.state for t in study.optuna.trials] == [optuna.trial.TrialState.WAITING] * 2


def test_a_unit_that_fails_after_a_ctrl_c_fails_no_trial_the_run_stops_every_trial_resumable(
        scripted, tiny_model, storage, swallowed, monkeypatch):
    """A Ctrl-C landing inside torch's context managers can surface as their own error ("trying to pop from empty
    mode stack", seen in a worker killed with its starter): not the trial's failure."""
    from rfopt.engine.running import unit

    evaluate = unit.evaluate_runners

    def evaluate_broken_by_a_ctrl_c(backend, runners, *args, **kwargs):
        results = evaluate(backend, runners, *args, **kwargs)
        if runners[0].units_done == 2:
            _ctrl_c_swallowed()
            results[-1] = RuntimeError("trying to pop from empty mode stack")
        return results

    monkeypatch.setattr(unit, "evaluate_runners", evaluate_broken_by_a_ctrl_c)
    study = rfopt.create_study(study_name="torn", storage=storage)
    with pytest.raises(KeyboardInterrupt):
        _optimize(study, tiny_model)
    assert swallowed == [KeyboardInterrupt]
    assert [t.state for t in study.optuna.trials] == [optuna.trial.TrialState.RUNNING] * 2  # none FAIL


@pytest.mark.subprocess
def test_a_worker_process_that_ends_with_its_starter_remembers_a_ctrl_c_from_its_start(tmp_path):
    """Linux interrupts the worker when its starter dies (PR_SET_PDEATHSIG), perhaps while it loads; once
    `end_with_parent` returns, such a Ctrl-C is remembered even where a ``__del__`` swallows it."""
    script = """if True:
        import os, signal
        from rfopt.cli.launcher import end_with_parent
        from rfopt.engine.running.interrupts import heard, remembered

        end_with_parent(os.getppid())

        class Swallows:
            def __del__(self):
                os.kill(os.getpid(), signal.SIGINT)

        Swallows()
        with remembered():
            print("heard" if heard() else "not heard", flush=True)
    """
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=str(rfopt.__path__[0].rpartition(os.sep)[0])))
    assert done.returncode == 0, done.stderr
    assert "Exception ignored" in done.stderr and done.stdout.strip() == "heard"
