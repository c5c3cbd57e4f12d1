"""Progress inside a chunk: the runner's step hook, the throttled ``rfopt:progress`` record, what it tells (ETAs, compute
spent), ``rfopt status``, the progress bar (a terminal's, and plain lines in a log), and a study-level stop.

The page showing it while a live study trains is tests/dashboard/test_dashboard_live.py."""

from __future__ import annotations

import io
import re
import time

import optuna
import pytest
from optuna.trial import TrialState
from rfopt_testkit import prompts_dataset, trial_config

import rfopt
from rfopt.engine import ops
from rfopt.storage import schema
from rfopt.chunks import ChunkPlan, TrialSchedule, trial_schedule
from rfopt.cli.status import status_text as _status_text
from rfopt.compat import storage_of, trial_id_of
from rfopt.reports.display import ProgressBar
from rfopt.storage.leases import Presence
from rfopt.training.progress import ProgressPublisher, UnitProgress
from rfopt.training.runner import StepDone
from rfopt.storage.schema import ProgressRecord, StepColumns, TrialRecord
from rfopt.storage.database import open_storage
from rfopt.reports.timeline import NowTraining, clock_time, now_training, study_cost, trial_etas

TRAIN, EVAL = prompts_dataset(16), prompts_dataset(2, "E")


def _ref(study, trial):
    return schema.TrialRef(storage_of(study), trial_id_of(trial), trial.number)


@pytest.fixture
def study(storage):
    """Three trials of 2 chunks of 8 steps: trial 0 COMPLETE (each chunk took 20 s), trials 1 and 2 RUNNING after
    their first chunk (20 s)."""
    study = optuna.create_study(study_name="p", storage=open_storage(storage), direction="maximize")
    schema.write_plan(study, ChunkPlan.build(16, 2, 0))
    for number in range(3):
        trial = study.ask()
        trial.suggest_float("learning_rate", 1e-3, 1e-1, log=True)
        ref = _ref(study, trial)
        schema.write_config(ref, trial_config("tiny-model-not-loaded-here").to_json())
        schema.write_schedule(ref, TrialSchedule(prompts_per_chunk=8, steps_per_chunk=8, num_epochs=1, num_chunks=2))
        for unit in range(2 if number == 0 else 1):
            steps = [{"step": 8 * unit + i + 1, "reward": 0.1 * i, "step_time": 2.0} for i in range(8)]
            train = {"reward": 0.4, "seconds": 18.0, "swap_seconds": 2.0, "eval_seconds": 2.0,
                     "started_at": 1000.0 + 40 * unit}
            schema.write_unit(ref, unit, {"chunk": unit, "train": train, "eval": {"reward": 0.5}}, [], steps)
            trial.report(0.5, step=unit)
        if number == 0:
            study.tell(trial, 0.5)
    return study


# ---------------------------------------------------------------------- the runner's hook
@pytest.mark.e2e
def test_the_runner_tells_its_step_hook_of_every_optimizer_step_with_its_logs(tiny_model, tmp_path):
    from rfopt.training.models import ModelPool
    from rfopt.training.runner import TrialRunner

    config = trial_config(tiny_model)
    plan = ChunkPlan.build(len(TRAIN), 2, 0)
    schedule = trial_schedule(plan, config.args)
    heard: list[StepDone] = []
    pool = ModelPool("cpu")
    try:
        runner = TrialRunner(0, config, plan, schedule, TRAIN, pool, tmp_path)
        chunk = runner.train_chunk(on_step=heard.append)
        runner.train_chunk(on_step=heard.append)
    finally:
        pool.close()
    steps = schedule.steps_per_chunk
    assert [d.step for d in heard] == [*range(0, steps + 1)] * 2  # 0: the chunk's first step starts
    assert [d.global_step for d in heard] == [*range(0, steps + 1), *range(steps, 2 * steps + 1)]
    assert [d.logs for d in heard[1:steps + 1]] == chunk.steps  # what the chunk stores, step by step
    assert heard[0].logs == {} and all(d.steps == steps and d.seconds >= 0 for d in heard)
    assert [d.seconds for d in heard[:steps + 1]] == sorted(d.seconds for d in heard[:steps + 1])


# ---------------------------------------------------------------------- the record, throttled
class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_progress_is_written_when_a_unit_starts_after_its_first_step_then_at_most_every_interval_and_at_its_end(
        study, monkeypatch):
    import rfopt.training.progress

    clock = _Clock()
    heard: list[UnitProgress] = []
    writes: list[ProgressRecord] = []
    monkeypatch.setattr(rfopt.training.progress, "write_progress",
                        lambda ref, record: (writes.append(record), schema.write_progress(ref, record)))
    publisher = ProgressPublisher(_ref(study, study.trials[1]), unit=1, num_units=2, steps=8, listeners=[heard.append],
                                  interval=3.0, clock=clock)
    publisher.loading()
    for step in range(1, 9):
        clock.now += 1.0  # a step a second
        publisher.step(StepDone(step=step, steps=8, global_step=8 + step, seconds=float(step),
                                logs={"step": 8 + step, "reward": 0.1 * step}))
    publisher.evaluating()
    # Written: loading, step 1, then steps 4 and 7 (3 s apart), then evaluating: 5 writes for 8 steps.
    assert [(w.phase, w.step) for w in writes] == [("loading", 0), ("training", 1), ("training", 4),
                                                    ("training", 7), ("evaluating", 8)]
    assert [(e.phase, e.step) for e in heard] == [("loading", 0)] + [("training", s) for s in range(1, 9)] + [
        ("evaluating", 8)]  # listeners hear every step
    last = TrialRecord(study.trials[1]).progress
    assert last == writes[-1] and last.step_seconds == 1.0 and last.started == 100.0 and last.updated == 108.0
    assert [w.stepped for w in writes] == [100.0, 101.0, 104.0, 107.0, 108.0]  # when each step ended (or phase began)
    assert [r["reward"] for r in last.step_logs()] == pytest.approx([0.1 * s for s in range(1, 9)])
    assert last.holder and last.gang == ()


def test_a_failed_progress_write_does_not_fail_the_unit():
    class Broken:
        def set_trial_system_attr(self, *args):
            raise RuntimeError("database is locked")

    publisher = ProgressPublisher(schema.TrialRef(Broken(), 1, 1), unit=1, num_units=2, steps=8)
    publisher.loading()
    publisher.step(StepDone(step=1, steps=8, global_step=9, seconds=1.0, logs={"step": 9}))
    assert publisher.writes == 0


def test_a_record_is_in_flight_until_its_unit_commits_and_its_steps_continue_the_trials_axis(study):
    trial = study.trials[1]
    logs = [{"step": 9, "reward": 0.2}, {"step": 10, "reward": 0.3}]
    record = ProgressRecord(unit=1, num_units=2, phase="training", step=2, steps=8, global_step=10, started=50.0,
                            updated=60.0, step_seconds=5.0, logs=StepColumns.encode(logs))
    schema.write_progress(_ref(study, trial), record)
    shown = TrialRecord(study.trials[1])
    assert shown.in_flight == record
    assert shown.in_flight_steps() == [{"step": 9, "reward": 0.2, "unit": 1, "chunk": 1},
                                       {"step": 10, "reward": 0.3, "unit": 1, "chunk": 1}]
    # Its record of unit 0 is history once unit 0 is committed; COMPLETE trials have none in flight.
    schema.write_progress(_ref(study, trial), record.__class__(**{**record.__dict__, "unit": 0}))
    assert TrialRecord(study.trials[1]).in_flight is None and TrialRecord(study.trials[1]).in_flight_steps() == []
    assert TrialRecord(study.trials[0]).in_flight is None


# ---------------------------------------------------------------------- what it tells
def test_now_training_gives_the_chunk_and_trials_ends_from_measured_times(study):
    updated = time.time()
    record = ProgressRecord(unit=1, num_units=2, phase="training", step=2, steps=8, global_step=10,
                            started=updated - 10, updated=updated, step_seconds=5.0, logs={})
    schema.write_progress(_ref(study, study.trials[1]), record)
    records = [TrialRecord(t) for t in study.trials]
    [now] = now_training(records)
    assert now.trial == 1
    # 6 steps left at 5 s, then its evaluation (2 s as measured).
    assert now.chunk_end_at == pytest.approx(updated + 6 * 5.0 + 2.0)
    # Round-robin: trial 1's last unit, in flight, has 0.75 left; trial 2's last unit starts after it: 0.75 and 1.75
    # units of 20 s (the mean measured).
    assert trial_etas(records) == pytest.approx({1: 0.75 * 20.0, 2: 1.75 * 20.0})
    line = now.line(now=updated)
    assert line.startswith("trial 1 · chunk 2 of 2 · 2 of 8 steps done · for 10s · 5 s/step · chunk ends in ~32s")
    assert NowTraining.of(records[2]) is None  # nothing published for it


def test_a_unit_with_no_step_for_several_step_times_reads_as_stuck_and_its_etas_are_on_hold(study, storage):
    from rfopt.reports.status import summaries

    now = time.time()
    record = ProgressRecord(unit=1, num_units=2, phase="training", step=2, steps=8, global_step=10, started=now - 60,
                            updated=now - 40, step_seconds=2.0, logs={}, stepped=now - 40)
    schema.write_progress(_ref(study, study.trials[1]), record)
    [flight] = now_training([TrialRecord(t) for t in study.trials])
    silence = flight.silence
    assert silence.usual == 2.0 and silence.stuck_at == pytest.approx(now - 40 + 10.0)  # 5 steps, at least 10 s
    assert not flight.stuck(now - 35) and flight.stuck(now)
    slow = flight.line(now=now - 35)
    assert "chunk ends in ~" in slow and "STUCK" not in slow
    stuck = flight.line(now=now)
    assert "STUCK? no step for 40s (a step takes ~2 s): its ETAs are on hold until it moves" in stuck
    assert "chunk ends in" not in stuck
    # The index and `rfopt status` (studies of a storage) say it too, while a process runs the study.
    with Presence(study, "run"):
        [summary] = summaries(open_storage(storage))
    [line] = summary.stuck
    assert line.startswith("trial 1: no step for 4") and line.endswith("s (a step takes ~2 s)")
    assert "STUCK? trial 1: no step for" in summary.line()


def test_a_unit_evaluating_past_its_usual_evaluation_time_reads_as_stuck_too(study):
    now = time.time()
    record = ProgressRecord(unit=1, num_units=2, phase="evaluating", step=8, steps=8, global_step=16,
                            started=now - 100, updated=now - 60, step_seconds=2.0, logs={}, stepped=now - 60)
    schema.write_progress(_ref(study, study.trials[1]), record)
    [flight] = now_training([TrialRecord(t) for t in study.trials])
    assert flight.silence.usual == 2.0 and flight.silence.what == "evaluation"  # its units' evaluations took 2 s
    assert "STUCK? evaluating for 1m00s (an evaluation takes ~2 s)" in flight.line(now=now)


def test_compute_spent_is_counted_against_a_run_without_pruning(study):
    study.tell(study.trials[2].number, state=TrialState.PRUNED)
    cost = study_cost([TrialRecord(t) for t in study.trials])
    # Trained: 2 + 1 + 1 units; without pruning: 3 trials x 2 units. Left: trial 1's one unit.
    assert (cost.units_trained, cost.units_without_pruning, cost.units_left) == (4, 6, 1)
    assert cost.seconds == pytest.approx(4 * 20.0) and cost.units_saved == 1  # trial 2's second unit
    assert cost.wall_seconds == pytest.approx(60.0)  # the first chunks started at 1000 s, the last one ended at 1060 s
    # Said plainly: what pruning saved, and the summed training time labelled as such beside the wall time.
    assert cost.line() == ("pruning saved 1 of 6 chunk units (17%) · 4 trained so far · 1m20s of training and "
                           "evaluation summed over trials · 1m00s wall time since the first chunk started")


# ---------------------------------------------------------------------- rfopt status
def test_status_says_what_trains_now_the_pending_requests_and_the_waiting_clones(study):
    record = ProgressRecord(unit=1, num_units=2, phase="training", step=3, steps=8, global_step=11,
                            started=time.time() - 20, updated=time.time(), step_seconds=6.0, logs={})
    schema.write_progress(_ref(study, study.trials[2]), record)
    ops.request(study, 1, "pause", by="me@host")
    study.add_trial(optuna.trial.create_trial(state=TrialState.WAITING, system_attrs=schema.new_trial_attrs(
        study.trials[1].system_attrs["rfopt:config"], lineage=schema.Lineage(1, {"learning_rate": 0.01}, True, 1,
                                                                             "me@host", "t"))))
    idle = _status_text(study)
    assert idle.startswith("nobody is running this study") and "now training" not in idle
    with Presence(study, "run"):
        text = _status_text(study)
    lines = text.splitlines()
    assert lines[0].startswith("running: ")
    assert lines[1].startswith("now training: trial 2 · chunk 2 of 2 · 3 of 8 steps done · for 2")  # 20 s, or so
    assert "s · 6 s/step · chunk ends in ~" in lines[1]
    assert "pruning saved 0 of 6 chunk units (0%) · 4 trained so far" in text
    assert "\nstudy: ~" in text and "as if nothing more is pruned" in text and "; ends by " in text
    # the version of the records it read, named by the newest one's time to the millisecond (the progress record's)
    assert f"(as its records of {clock_time(record.updated, millis=True)} say)" in text, text
    assert re.search(r"as its records of \d\d:\d\d:\d\d\.\d\d\d say", text)
    assert "pending: pause trial 1, asked by me@host" in text
    assert ("WAITING: trial 3 (clone of trial 1, warm from chunk 2 with {'learning_rate': 0.01}); starts when a slot "
            "frees") in text


# ---------------------------------------------------------------------- the progress bar
class _Run:
    def __init__(self, done, total, steps_done, steps_total, committed, last=None):
        self.done, self.total, self.steps_done, self.steps_total = done, total, steps_done, steps_total
        self.committed, self.last, self.counts, self.best = committed, last, {"RUNNING": 2}, 0.5


def test_the_bar_advances_at_every_optimizer_step_of_the_units_in_flight():
    stream = io.StringIO()
    with ProgressBar("demo", stream=stream, plain=False) as bar:
        bar(_Run(1, 4, 8, 32, {0: 1, 1: 0}))
        for step in range(1, 4):
            bar.step(UnitProgress(trial=1, unit=0, num_units=2, phase="training", step=step, steps=8, step_seconds=2.0))
            assert bar._bar.n == 8 + step and bar._bar.total == 32
        assert "t1 c1/2 s3/8 2s/st" in bar._bar.desc
        bar(_Run(2, 4, 16, 32, {0: 1, 1: 1}, last=(1, 0, 0.5)))  # its unit committed: counted once
        assert bar._bar.n == 16


def test_not_in_a_terminal_the_progress_is_plain_lines_one_per_chunk_and_at_most_one_per_interval_while_training():
    stream = io.StringIO()
    with ProgressBar("demo", stream=stream, plain_seconds=3600) as bar:  # a StringIO is no terminal
        assert bar.plain
        bar(_Run(0, 4, 0, 32, {0: 0, 1: 0}))
        for step in range(1, 9):
            bar.step(UnitProgress(trial=0, unit=0, num_units=2, phase="training", step=step, steps=8, step_seconds=1.0))
        bar(_Run(1, 4, 8, 32, {0: 1, 1: 0}, last=(0, 0, 0.25)))
    lines = stream.getvalue().splitlines()
    assert "\r" not in stream.getvalue()
    assert lines == ["demo: trial 0 chunk 1/2 step 1/8 (1 s/step) · 1/32 steps, 0/4 chunks · 2 live · best 0.5",
                     "demo: trial 0 chunk 1 committed: 0.25 · 8/32 steps, 1/4 chunks · 2 live · best 0.5"]


def test_the_bar_fits_100_columns_with_a_gang_in_flight():
    stream = io.StringIO()
    with ProgressBar("a-study-with-a-long-name", stream=stream, plain=False, watch_seconds=0) as bar:
        bar(_Run(6, 26, 48, 208, {n: 1 for n in range(6)}))
        for trial in (3, 4, 5):
            bar.step(UnitProgress(trial=trial, unit=1, num_units=4, phase="training", step=5, steps=8,
                                  step_seconds=12.5))
        lines = [line for line in stream.getvalue().split("\r") if line.strip()]
    assert "a-study-with-a-… t3,t4,t5 c2/4 s5/8 12s/st" in lines[-1]  # one group for the gang at the same step
    assert max(len(line.rstrip("\n")) for line in lines) <= 100


def test_with_its_study_the_bar_shows_the_leaderboards_best_the_counts_the_prunes_and_a_total_that_never_shrinks(
        study):
    stream = io.StringIO()
    with ProgressBar("p", stream=stream, plain=True, study=study, watch_seconds=0) as bar:
        bar(_Run(4, 6, 32, 48, {1: 1, 2: 1}))
        first = bar._steps()[1]
        # Trial 2 is pruned at its rung: the next round's counts change, the bar reads the study again.
        schema.write_decision(_ref(study, study.trials[2]), schema.PruneDecision(
            2, 0, True, "rank 3 of 3 at rung 0 (chunk 1; keeps top 2)", (0, 1), "SuccessiveHalvingPruner"))
        study.tell(study.trials[2].number, state=TrialState.PRUNED)
        run = _Run(4, 5, 32, 40, {1: 1}, last=(1, 0, 0.5))
        run.counts = {"RUNNING": 1, "COMPLETE": 1, "PRUNED": 1}
        bar(run)
        assert bar._steps()[1] >= first  # the forecast expects less now: the total stays
    lines = stream.getvalue().splitlines()
    assert "p: trial 2 pruned: rank 3 of 3 at rung 0 (chunk 1; keeps top 2)" in lines
    committed = next(line for line in lines if "committed" in line)
    # The best as the leaderboard has it (trial 0, COMPLETE at 0.5), and the counts from the study's records.
    assert "1 live, 1 done, 1 pruned" in committed and "best 0.5" in committed


def test_a_log_gets_a_line_when_a_chunk_is_overdue(monkeypatch):
    import rfopt.reports.display as display

    monkeypatch.setattr(display, "STUCK_FLOOR", 0.2)
    stream = io.StringIO()
    with ProgressBar("demo", stream=stream, plain=True, plain_seconds=3600, watch_seconds=0.05) as bar:
        bar(_Run(0, 4, 0, 32, {0: 0}))
        bar.step(UnitProgress(trial=0, unit=0, num_units=2, phase="training", step=3, steps=8, step_seconds=0.01))
        time.sleep(0.6)  # no step comes
    overdue = [line for line in stream.getvalue().splitlines() if "stuck or very slow" in line]
    assert overdue == [overdue[0]] and overdue[0].startswith("demo: trial 0 chunk 1/2: no step for ")
    assert overdue[0].endswith("(a step takes ~0.01 s): stuck or very slow")


# ---------------------------------------------------------------------- a study-level stop
def test_halt_stops_every_process_running_the_study_at_the_next_chunk_boundary_and_the_trials_resume(
        scripted, tiny_model, storage):
    study = rfopt.create_study(study_name="h", storage=storage, direction="maximize")
    configs = [trial_config(tiny_model, learning_rate=lr) for lr in (1e-3, 5e-3)]
    with pytest.raises(ops.OpError, match="nobody is running this study"):
        ops.halt(study.optuna)

    def halt_after_the_first_chunk(number, step, value):
        if number == 0 and step == 0:
            ops.halt(study.optuna, by="me@host")

    # One trial at a time (a gang's members would all have trained their first chunk when trial 0's commits).
    study.optimize(configs, TRAIN, EVAL, num_chunks=2, show_progress_bar=False, on_unit=halt_after_the_first_chunk,
                   gang_size=1)
    trials = study.optuna.get_trials()
    assert [t.state for t in trials] == [TrialState.RUNNING, TrialState.RUNNING]
    assert [len(t.intermediate_values) for t in trials] == [1, 0]  # nothing started after the request
    assert schema.study_record(study.optuna).halt.by == "me@host"
    study.optimize(configs, TRAIN, EVAL, show_progress_bar=False)  # a run started after it is not stopped
    assert [t.state for t in study.optuna.get_trials()] == [TrialState.COMPLETE, TrialState.COMPLETE]
