"""SIGKILL a running study at many moments (in a chunk, between chunks, in the middle of a checkpoint write,
between a durable checkpoint and its report) and rerun the same command each time: the study ends exactly
as an uninterrupted run of it ends, and no chunk whose checkpoint was durable is trained again. And the
half-done work a crash leaves in storage (a pruning decided but not told, a trial asked but not configured)
is finished on the rerun.

The matrix runs twice: with `rfopt run` processes training through TRL, killed for real (the slow tier), and in this
process on scripted runners, each run "dying" at a crash point by an exception nothing in rfopt catches (the fast
tier: the same crash points, the same reruns, the same checks of what storage and checkpoints end with)."""

import random
import signal
import time

import optuna
import pytest

import rfopt
from crashkit import (STUDY_FILE, TESTS, assert_same_study, commits, crash_and_rerun_here, env, events,
                      retrained_after_durable, run, run_command, start, trials)
from rfopt_testkit import prompts_dataset, trial_config
from rfopt.storage.schema import trial_attrs

TRAIN, EVAL = prompts_dataset(8), prompts_dataset(2, "E")

# Where the run dies on each attempt: a crash point (the n-th time this process reaches it), or a timer.
CRASH_POINTS = ["checkpoint-staged", "checkpoint-saved", "metrics-stored", "checkpoint-renamed", "chunk-trained",
                "unit-committed", "trial-finishing"]


def _attempts(seed: int) -> list[tuple[str, float]]:
    """Each crash point once (at its first occurrence in that process), in a seeded order, with timed kills at
    seeded moments in between; a trial's finishing comes last, when trials have trained their last chunk."""
    rng = random.Random(seed)
    points = [(point, 1) for point in CRASH_POINTS if point != "trial-finishing"]
    rng.shuffle(points)
    for _ in range(2):
        # A timer waits for the process's n-th event (n = its integer part, 1 to 6: a unit logs about 7), then kills
        # it a random fraction of 0.2 s later: anywhere in a unit, and never so late that it finishes the study
        # (or the trial that finishes first) before the crash points after it are reached, however fast units are.
        points.insert(rng.randint(0, len(points)), ("timer", rng.uniform(1.0, 7.0)))
    return points + [("trial-finishing", 1)]


@pytest.mark.e2e
@pytest.mark.subprocess
@pytest.mark.slow
def test_sigkill_at_random_moments_then_rerun_reproduces_the_uninterrupted_study(
    tiny_model, tiny_study_reference, tmp_path
):
    storage = f"sqlite:///{tmp_path / 'crash.db'}"
    command = run_command(storage, "--checkpoint-dir", str(tmp_path / "ck"))
    log, output = tmp_path / "events.log", tmp_path / "crash.log"
    killed_at = []
    for point, when in _attempts(seed=5):
        if point == "timer":
            # After the process's int(when)-th event (imports take longer than a unit), then (when % 1) * 0.2 s.
            process = start(command, tmp_path, env(tiny_model, RFOPT_EVENT_LOG=log), output)
            while process.poll() is None and sum(e[3] == process.pid for e in events(log)) < int(when):
                time.sleep(0.01)
            time.sleep((when % 1) * 0.2)
            process.send_signal(signal.SIGKILL)
            code = process.wait()
        else:
            crash_env = env(tiny_model, RFOPT_EVENT_LOG=log, RFOPT_CRASH_AT=f"{point}:{when}")
            code = run(command, tmp_path, crash_env, output)
        if code == -signal.SIGKILL:
            killed_at.append(events(log)[-1][0] if point == "timer" else point)
        else:
            assert code == 0, output.read_text()[-3000:]
    assert run(command, tmp_path, env(tiny_model, RFOPT_EVENT_LOG=log), output) == 0, output.read_text()[-3000:]

    # The kills landed where they were meant to: every crash point, and mid-run for the timers.
    assert set(CRASH_POINTS) <= set(killed_at), killed_at
    assert len(killed_at) >= len(CRASH_POINTS) + 1, killed_at
    assert all(t.state != optuna.trial.TrialState.RUNNING for t in trials(storage))
    assert_same_study(*tiny_study_reference, storage, tmp_path / "ck")
    crash_log = events(log)
    assert retrained_after_durable(crash_log) == []
    committed = commits(crash_log)
    reported = {(t.number, step) for t in trials(storage) for step in t.intermediate_values}
    assert set(committed) == reported and set(committed.values()) == {1}, committed


GANG_CRASH_POINTS = ["chunk-trained", "checkpoint-renamed", "gang-units-written", "gang-saved", "checkpoint-saved",
                     "metrics-stored", "unit-committed"]


@pytest.mark.e2e
@pytest.mark.subprocess
@pytest.mark.slow
@pytest.mark.parametrize("training", ["sequential", "batched"])
def test_sigkill_in_a_gang_then_rerun_reproduces_the_uninterrupted_gang_study(tiny_model, tmp_path, request, training):
    """Trials trained in a gang (their rollouts decoded together; their training steps one after another, or batched)
    are killed at each moment of a gang unit, before and after its units became durable together: the rerun forms the
    same gang again, or commits the durable units, and the study ends as the uninterrupted one of the same mode,
    nothing durable trained again."""
    reference = request.getfixturevalue("tiny_gang_study_reference" if training == "sequential"
                                        else "tiny_batched_gang_study_reference")
    storage = f"sqlite:///{tmp_path / 'crash.db'}"
    command = run_command(storage, "--checkpoint-dir", str(tmp_path / "ck"), "--gang-size", "3", "--gang-training",
                          training)
    log, output = tmp_path / "events.log", tmp_path / "crash.log"
    killed_at = []
    for point in GANG_CRASH_POINTS:
        code = run(command, tmp_path, env(tiny_model, RFOPT_EVENT_LOG=log, RFOPT_CRASH_AT=f"{point}:1"), output)
        if code == -signal.SIGKILL:
            killed_at.append(point)
        else:
            assert code == 0, output.read_text()[-3000:]
    assert run(command, tmp_path, env(tiny_model, RFOPT_EVENT_LOG=log), output) == 0, output.read_text()[-3000:]

    assert killed_at == GANG_CRASH_POINTS
    assert_same_study(*reference, storage, tmp_path / "ck")
    assert retrained_after_durable(events(log)) == []
    assert not list((tmp_path / "ck").glob("gangs/*.json"))  # every gang record was settled


class _Crash(BaseException):
    """Stands in for the process dying: nothing in rfopt catches it."""


class _PruneTrialOne(optuna.pruners.BasePruner):
    def prune(self, study, trial):
        return trial.number == 1


def test_a_pruning_decided_before_a_crash_is_carried_out_on_rerun(scripted, tiny_model, storage, monkeypatch):
    configs = rfopt.grid(trial_config(tiny_model), learning_rate=[1e-3, 5e-3])
    real_tell = optuna.Study.tell

    def tell(self, trial, values=None, state=None, **kwargs):
        if state == optuna.trial.TrialState.PRUNED:  # dies after the decision is stored, before it is told
            raise _Crash
        return real_tell(self, trial, values, state, **kwargs)

    monkeypatch.setattr(optuna.Study, "tell", tell)
    study = rfopt.create_study(study_name="p", storage=storage, pruner=_PruneTrialOne())
    with pytest.raises(_Crash):
        study.optimize(configs, TRAIN, EVAL, num_chunks=2, show_progress_bar=False)
    assert study.optuna.trials[1].state == optuna.trial.TrialState.RUNNING
    monkeypatch.undo()

    done = []
    study = rfopt.create_study(study_name="p", storage=storage, pruner=_PruneTrialOne(), load_if_exists=True)
    study.optimize(configs, TRAIN, EVAL, num_chunks=2, show_progress_bar=False,
                   on_unit=lambda number, step, value: done.append((number, step)))
    pruned, complete = study.optuna.trials[1], study.optuna.trials[0]
    assert pruned.state == optuna.trial.TrialState.PRUNED and list(pruned.intermediate_values) == [0]
    assert complete.state == optuna.trial.TrialState.COMPLETE
    assert done == [(0, 1)]


def test_a_trial_asked_just_before_a_crash_resumes_with_its_params(scripted, tiny_model, storage):
    def space(crash):
        def config(trial):
            rate = trial.suggest_float("learning_rate", 1e-3, 1e-2, log=True)
            if crash and trial.number == 1:  # dies after Optuna made the trial, before rfopt stored its config
                raise _Crash
            return trial_config(tiny_model, learning_rate=rate)
        return config

    study = rfopt.create_study(study_name="a", storage=storage, sampler=optuna.samplers.RandomSampler(seed=3))
    with pytest.raises(_Crash):
        study.optimize(space(crash=True), TRAIN, EVAL, n_trials=2, num_chunks=1, show_progress_bar=False)
    asked = study.optuna.trials[1]
    assert asked.state == optuna.trial.TrialState.RUNNING and "rfopt:config" not in trial_attrs(asked)

    study = rfopt.create_study(study_name="a", storage=storage, load_if_exists=True)
    study.optimize(space(crash=False), TRAIN, EVAL, n_trials=0, num_chunks=1, show_progress_bar=False)
    trials = study.optuna.trials
    assert [t.state for t in trials] == [optuna.trial.TrialState.COMPLETE] * 2
    assert trials[1].params == asked.params
    assert study.trial_config(1).args.learning_rate == asked.params["learning_rate"]


def test_a_paused_trial_stays_paused_across_a_crash_and_the_rerun(scripted, tiny_model, storage):
    configs = rfopt.grid(trial_config(tiny_model), learning_rate=[1e-3, 5e-3])
    study = rfopt.create_study(study_name="z", storage=storage)

    def on_unit(number, step, value):
        if (number, step) == (1, 0):
            study.pause_trial(1)
        if (number, step) == (0, 1):
            raise _Crash

    with pytest.raises(_Crash):
        study.optimize(configs, TRAIN, EVAL, num_chunks=3, show_progress_bar=False, on_unit=on_unit)
    done = []
    study = rfopt.create_study(study_name="z", storage=storage, load_if_exists=True)
    study.optimize(configs, TRAIN, EVAL, num_chunks=3, show_progress_bar=False,
                   on_unit=lambda number, step, value: done.append((number, step)))
    paused = study.optuna.trials[1]
    assert paused.state == optuna.trial.TrialState.RUNNING and trial_attrs(paused)["rfopt:paused"] is True
    assert list(paused.intermediate_values) == [0]
    assert done == [(0, 2)] and study.optuna.trials[0].state == optuna.trial.TrialState.COMPLETE


# ---------------------------------------------------------------------- the matrix in this process, scripted
@pytest.mark.parametrize(("flags", "points"), [((), CRASH_POINTS), (("--gang-size", "3"), GANG_CRASH_POINTS)],
                         ids=["alone", "gang"])
def test_a_run_dying_at_each_crash_point_then_rerun_ends_as_the_uninterrupted_study(
        scripted, dying, tiny_model, tmp_path, monkeypatch, flags, points):
    monkeypatch.setenv("RFOPT_TEST_TINY_MODEL", str(tiny_model))
    died_at, log, storage = crash_and_rerun_here(STUDY_FILE, [f"{p}:1" for p in points], tmp_path, dying, *flags)
    assert died_at == [f"{p}:1" for p in points]
    assert retrained_after_durable(log) == []
    committed = commits(log)
    reported = {(t.number, step) for t in trials(storage) for step in t.intermediate_values}
    assert set(committed) == reported and set(committed.values()) == {1}, committed
    assert not list((tmp_path / "ck").glob("gangs/*.json"))  # every gang record was settled


def test_a_pbt_run_dying_in_an_exploit_step_then_rerun_ends_as_the_uninterrupted_study(
        scripted, dying, tiny_model, tmp_path, monkeypatch):
    """Once the first step's plan is stored, then once a clone's warm-start weights are written but the clone is not
    yet in storage, then once the clones are made before any decision."""
    monkeypatch.setenv("RFOPT_TEST_TINY_MODEL", str(tiny_model))
    monkeypatch.setenv("RFOPT_TEST_TRIALS", "4")
    points = ["pbt-planned:1", "clone-weights-saved:1", "pbt-cloned:1"]
    died_at, _, storage = crash_and_rerun_here(TESTS / "tiny_pbt_study.py", points, tmp_path, dying)
    assert died_at == points
    assert sum(t.number >= 4 for t in trials(storage)) == 2  # a clone after each of the first two chunks
