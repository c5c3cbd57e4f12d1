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
from rfopt.engine.trials import ops
from rfopt.storage import schema
from rfopt.chunks import ChunkPlan, TrialSchedule, trial_schedule
from rfopt.cli.status import status_text as _status_text
from rfopt.compat import storage_of, trial_id_of
from rfopt.reports.display import ProgressBar
from rfopt.storage.leases import Presence
from rfopt.training.progress import ProgressPublisher, UnitProgress, evaluation_progress
from rfopt.training.rollouts import Decoded
from rfopt.training.runner import StepDone
from rfopt.storage.schema import Activity, ProgressRecord, StepColumns, TrialRecord
from rfopt.storage.database import open_storage
from rfopt.reports.timeline import STUCK_UNKNOWN, NowTraining, clock_time, now_training, study_cost

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
    # A step every 1000 s of the fake clock: a throttled write's timer (it waits the rest of the interval in real
    # seconds) never fires while the test runs, however slowly it runs.
    publisher = ProgressPublisher(_ref(study, study.trials[1]), unit=1, num_units=2, steps=8, listeners=[heard.append],
                                  interval=3000.0, clock=clock)
    publisher.loading()
    for step in range(1, 9):
        clock.now += 1000.0
        publisher.step(StepDone(step=step, steps=8, global_step=8 + step, seconds=1000.0 * step,
                                logs={"step": 8 + step, "reward": 0.1 * step}))
    publisher.evaluating()
    # Written: loading, step 1, then steps 4 and 7 (3000 s apart), then evaluating: 5 writes for 8 steps.
    assert [(w.phase, w.step) for w in writes] == [("loading", 0), ("training", 1), ("training", 4),
                                                    ("training", 7), ("evaluating", 8)]
    assert [(e.phase, e.step) for e in heard] == [("loading", 0)] + [("training", s) for s in range(1, 9)] + [
        ("evaluating", 8)]  # listeners hear every step
    last = TrialRecord(study.trials[1]).progress
    assert last == writes[-1] and last.step_seconds == 1000.0 and last.started == 100.0 and last.updated == 8100.0
    # When each step ended (or phase began).
    assert [w.stepped for w in writes] == [100.0, 1100.0, 4100.0, 7100.0, 8100.0]
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
def test_now_training_gives_the_chunks_end_from_measured_times_and_leaves_the_studys_end_to_the_forecast(study):
    updated = time.time()
    record = ProgressRecord(unit=1, num_units=2, phase="training", step=2, steps=8, global_step=10,
                            started=updated - 10, updated=updated, step_seconds=5.0, logs={})
    schema.write_progress(_ref(study, study.trials[1]), record)
    records = [TrialRecord(t) for t in study.trials]
    [now] = now_training(records)
    assert now.trial == 1
    # 6 steps left at 5 s, then its evaluation (2 s as measured).
    assert now.chunk_end_at == pytest.approx(updated + 6 * 5.0 + 2.0)
    line = now.line(now=updated)
    # One ETA: no per-trial "last chunk done in" beside the study's forecast (it ignored gangs and contradicted it).
    assert line == "trial 1 · chunk 2 of 2 · 2 of 8 steps done · for 10s · 5 s/step · chunk ends in ~32s"
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


def test_units_a_person_stopped_are_said_as_such_not_as_a_cryptic_count(study):
    schema.write_stop(_ref(study, study.trials[2]), schema.Stop(by="me@host", at="t", after_chunk=1))
    study.tell(study.trials[2].number, state=TrialState.PRUNED)
    line = study_cost([TrialRecord(t) for t in study.trials]).line()
    assert line.startswith("pruning saved 0 of 6 chunk units (0%), and stopping trials by hand 1 more · ")


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
    # Named as the clone form names the checkpoint: after the parent's chunk 1.
    assert ("WAITING: trial 3 (clone of trial 1, warm-started from its checkpoint after chunk 1 with {'learning_rate': "
            "0.01}); starts when a slot frees") in text


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
    assert lines == ["demo: trial 0 chunk 1/2: training",  # a line per phase change, then none within the interval
                     "demo: trial 0 chunk 1 committed: 0.25 · 8/32 steps, 1/4 chunks · 2 live · best 0.5"]


def test_the_bar_fits_100_columns_with_a_gang_in_flight():
    stream = io.StringIO()
    with ProgressBar("a-study-with-a-long-name", stream=stream, plain=False, watch_seconds=0) as bar:
        bar(_Run(6, 26, 48, 208, {n: 1 for n in range(6)}))
        for trial in (3, 4, 5):
            bar.step(UnitProgress(trial=trial, unit=1, num_units=4, phase="training", step=5, steps=8,
                                  step_seconds=12.5, gang=(3, 4, 5)))
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


# ---------------------------------------------------------------------- truthful from the first step
def _flight(study, number, **fields):
    now = time.time()
    record = ProgressRecord(**({"unit": 1, "num_units": 2, "phase": "training", "step": 0, "steps": 8,
                                "global_step": 8, "started": now - 30, "updated": now - 30, "step_seconds": None,
                                "logs": {}, "stepped": now - 30} | fields))
    schema.write_progress(_ref(study, study.trials[number]), record)
    return record


def test_one_stalled_step_does_not_inflate_the_published_pace_so_a_second_stall_is_flagged(study, monkeypatch):
    clock = _Clock()
    publisher = ProgressPublisher(_ref(study, study.trials[1]), unit=1, num_units=2, steps=8, interval=0.0,
                                  clock=clock)
    seconds = 0.0
    for step, took in enumerate([2.0, 2.0, 100.0, 2.0, 2.0], start=1):  # a reward call hung 100 s at step 3
        seconds += took
        clock.now += took
        publisher.step(StepDone(step=step, steps=8, global_step=8 + step, seconds=seconds, logs={}))
    # The mean would be 21.6 s/step (a stall of 108 s would pass); the median stays at the usual 2 s.
    assert publisher.step_seconds == 2.0
    [flight] = now_training([TrialRecord(t) for t in study.trials])
    assert flight.silence.usual == 2.0
    assert flight.stuck(clock.now + 30) and "STUCK? no step for 30s (a step takes ~2 s)" in flight.line(clock.now + 30)


def test_a_first_step_is_judged_against_the_studys_other_trials_named_as_a_prior(study):
    # A fresh trial (no unit of its own committed, its first step not ended) is judged against the study's other
    # trials: their units trained 18 s - 2 s of swap-in over 8 steps, 2 s a step.
    fresh = optuna.create_study(study_name="fresh", storage=study._storage, direction="maximize")
    records = [TrialRecord(t) for t in study.trials]
    trial = fresh.ask()
    ref = _ref(fresh, trial)
    schema.write_schedule(ref, TrialSchedule(prompts_per_chunk=8, steps_per_chunk=8, num_epochs=1, num_chunks=2))
    now = time.time()
    schema.write_progress(ref, ProgressRecord(unit=0, num_units=2, phase="training", step=0, steps=8, global_step=0,
                                              started=now - 100, updated=now - 100, step_seconds=None, logs={},
                                              stepped=now - 100))
    record = TrialRecord(fresh.trials[0])
    [flight] = now_training([record, *records])
    assert flight.silence.usual == 2.0 and flight.silence.prior
    # 100 s into its first step, where each step of the others takes 2 s: stuck, and the prior is said as one.
    assert ("STUCK? no step for 1m40s (a step of this study's other trials takes ~2 s (its own: not measured yet))"
            in flight.line(now))
    # Alone in its study, no time to compare with: a generous bound, named, so a slow first step is not called stuck.
    [alone] = now_training([record])
    assert alone.silence.usual is None and not alone.stuck(now) and alone.stuck(now - 100 + STUCK_UNKNOWN)
    assert (f"no step time to compare with yet: stuck only after {STUCK_UNKNOWN / 60:.0f}m00s, a generous bound"
            in alone.silence.text(now))


def test_a_gangs_members_share_one_step_counter_one_pace_and_one_stuck_verdict(study, storage):
    from rfopt.reports.status import summaries

    now = time.time()
    study.add_trial(optuna.trial.create_trial(state=TrialState.RUNNING, system_attrs=study.trials[1].system_attrs))
    # Trials 1, 2, 3 of one gang; 3 stepped last (member 3's reward call hangs now), 1 and 2 wait on it.
    for number, (step, stepped, pace) in {1: (5, now - 40, 2.0), 2: (5, now - 39, 2.5), 3: (4, now - 38, 3.0)}.items():
        _flight(study, number, step=step, stepped=stepped, step_seconds=pace, gang=(1, 2, 3), holder="h:1",
                started=now - 60)
    records = [TrialRecord(t) for t in study.trials]
    [gang] = now_training(records)
    assert gang.members == (1, 2, 3) and gang.progress.step == 4 and gang.progress.step_seconds == 2.5
    assert gang.silence.since == pytest.approx(now - 38) and gang.silence.usual == 2.5
    line = gang.line(now)
    assert line.startswith("trials 1, 2, 3 (one gang) · chunk 2 of 2 · 4 of 8 steps done · ")
    assert line.count("STUCK?") == 1 and "no step for 38s (a step takes ~2.5 s)" in line
    # `rfopt status` and the index say it once, for the gang.
    with Presence(study, "run"):
        text = _status_text(study)
        [summary] = summaries(open_storage(storage))
    assert text.count("now training: ") == 1 and "now training: trials 1, 2, 3 (one gang)" in text
    assert "its end is on hold while trials 1, 2, 3 (one gang) makes no progress" in text
    assert summary.stuck == (summary.stuck[0],) and summary.stuck[0].startswith("trials 1, 2, 3 (one gang): no step")


def test_a_baseline_being_evaluated_is_what_the_study_is_doing_with_its_forecast_on_hold(study):
    heard: list[UnitProgress] = []
    ProgressPublisher(_ref(study, study.trials[2]), unit=1, num_units=2, steps=8, listeners=[heard.append]).baseline()
    assert heard[0].phase == "baseline"
    with Presence(study, "run"):
        text = _status_text(study)
    assert ("now training: trial 2 · chunk 2 of 2 · evaluating the base model with no adapter (the study's baseline)"
            in text), text
    assert "study: its end is on hold while the base model is evaluated with no adapter" in text
    # Not called stuck at two minutes: no time to compare with, a generous bound.
    [flight] = now_training([TrialRecord(t) for t in study.trials])
    assert not flight.stuck(time.time() + 180)


def test_a_unit_saving_its_checkpoint_says_so_and_is_judged_against_the_generous_bound(study):
    heard: list[UnitProgress] = []
    publisher = ProgressPublisher(_ref(study, study.trials[2]), unit=1, num_units=2, steps=8, listeners=[heard.append])
    publisher.saving()
    assert heard[-1].phase == "saving" and TrialRecord(study.trials[2]).progress.phase == "saving"
    [flight] = now_training([TrialRecord(t) for t in study.trials])
    assert flight.line().startswith("trial 2 · chunk 2 of 2 · saving its checkpoint and committing · for ")
    assert not flight.stuck(time.time() + 120) and flight.stuck(time.time() + STUCK_UNKNOWN + 1)


def test_before_the_first_commit_the_studys_end_is_said_to_come_after_the_first_chunk(storage):
    from rfopt.reports.forecast import forecast

    study = optuna.create_study(study_name="first", storage=open_storage(storage), direction="maximize")
    trial = study.ask()
    ref = _ref(study, trial)
    schema.write_schedule(ref, TrialSchedule(prompts_per_chunk=8, steps_per_chunk=8, num_epochs=1, num_chunks=2))
    now = time.time()
    schema.write_progress(ref, ProgressRecord(unit=0, num_units=2, phase="training", step=3, steps=8, global_step=3,
                                              started=now - 10, updated=now, step_seconds=3.0, logs={}, stepped=now))
    ahead = forecast([TrialRecord(t) for t in study.trials], None)
    assert not ahead.firm and ahead.seconds_left is not None  # a guess from the steps in flight, not shown as an end
    assert ahead.text().endswith("its end is estimated after the first chunk commits")


def test_the_bar_reads_the_estimator_between_commits_and_says_a_prune_when_it_is_decided(study, monkeypatch):
    import rfopt.reports.display as display

    reads = []
    real = display._StudyView.read
    monkeypatch.setattr(display._StudyView, "read", classmethod(lambda cls, s: reads.append(1) or real(s)))
    stream = io.StringIO()
    with ProgressBar("p", stream=stream, plain=True, study=study, watch_seconds=0.05) as bar:
        bar(_Run(4, 6, 32, 48, {1: 1, 2: 1}))
        time.sleep(0.3)
        assert len(reads) >= 3  # not only at commits
        # Trial 2 is pruned at its rung; no commit follows: the line comes when it is decided.
        study.tell(study.trials[2].number, state=TrialState.PRUNED)
        time.sleep(0.3)
    assert [line for line in stream.getvalue().splitlines() if line.startswith("p: trial 2 pruned: told PRUNED")]


def test_in_a_wide_terminal_the_line_keeps_what_matters_first_and_cuts_from_the_right(monkeypatch):
    import rfopt.reports.display as display

    monkeypatch.setattr(display, "_columns", lambda stream: 160)
    stream = io.StringIO()
    with ProgressBar("demo", stream=stream, plain=False, watch_seconds=0) as bar:
        bar(_Run(6, 26, 48, 208, {n: 1 for n in range(6)}))
        for trial in (3, 4, 5):
            bar.step(UnitProgress(trial=trial, unit=1, num_units=4, phase="training", step=5, steps=8,
                                  step_seconds=12.5, gang=(3, 4, 5)))
        bar._heard = {n: time.monotonic() - 200 for n in (3, 4, 5)}  # no step for 200 s (a step takes 12.5 s)
        bar._draw()
        desc = bar._bar.desc
        monkeypatch.setattr(display, "_columns", lambda stream: 80)
        bar._draw()
        narrow = bar._bar.desc
    assert desc.startswith("demo STUCK? t3,t4,t5 no step 3m2") and desc.endswith("live 2 · best 0.5")
    assert narrow.startswith("demo STUCK? t3,t4,t5 no step") and narrow.endswith("…")
    lines = [line for line in stream.getvalue().split("\r") if line.strip()]
    assert max(len(line.rstrip("\n")) for line in lines) <= 160


def test_a_log_gets_one_line_per_gang_and_phase_change_and_one_overdue_line_per_gang(monkeypatch):
    import rfopt.reports.display as display

    monkeypatch.setattr(display, "STUCK_FLOOR", 0.2)
    stream = io.StringIO()
    with ProgressBar("demo", stream=stream, plain=True, plain_seconds=3600, watch_seconds=0.05) as bar:
        bar(_Run(0, 4, 0, 32, {n: 0 for n in (3, 4, 5)}))
        for phase, step in (("loading", 0), ("training", 0), ("training", 1)):
            for trial in (3, 4, 5):
                bar.step(UnitProgress(trial=trial, unit=0, num_units=2, phase=phase, step=step, steps=8,
                                      step_seconds=0.01 if step else None, gang=(3, 4, 5)))
        time.sleep(0.6)  # no step comes
    lines = stream.getvalue().splitlines()
    assert lines[:2] == ["demo: trials 3, 4, 5 chunk 1/2: loading", "demo: trials 3, 4, 5 chunk 1/2: training"]
    overdue = [line for line in lines if "stuck or very slow" in line]
    assert len(overdue) == 1 and overdue[0].startswith("demo: trials 3, 4, 5 chunk 1/2: no step for ")


def test_while_the_bar_is_drawn_log_records_are_written_above_it_not_over_it(monkeypatch):
    import logging
    import sys

    stream = io.StringIO()
    monkeypatch.setattr(sys, "stderr", stream)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        with ProgressBar("demo", stream=stream, plain=False, watch_seconds=0) as bar:
            bar(_Run(1, 4, 8, 32, {0: 1, 1: 0}))
            logging.getLogger("rfopt").warning("trial 3: something to read")
            bar(_Run(1, 4, 9, 32, {0: 1, 1: 0}))
    finally:
        root.removeHandler(handler)
    assert "WARNING rfopt: trial 3: something to read" in stream.getvalue().replace("\r", "\n").splitlines()


# ---------------------------------------------------------------------- how far a phase is (issue 44, point 1)
def test_what_a_unit_does_within_its_phase_is_told_on_change_and_written_within_the_interval_even_if_it_hangs(study):
    heard: list[UnitProgress] = []
    publisher = ProgressPublisher(_ref(study, study.trials[1]), unit=1, num_units=2, steps=8, listeners=[heard.append],
                                  interval=0.3)
    publisher.loading()
    publisher.step(StepDone(step=0, steps=8, global_step=8, seconds=0.0, logs={}))
    began = TrialRecord(study.trials[1]).progress.stepped
    decode = time.time()
    for tokens in range(0, 60):  # a decode's tokens, as fast as a GPU gives them
        publisher.doing(Activity("decoding", done=tokens, total=128, since=decode))
    turn = Activity("member", done=2, total=3, trial=4, since=time.time())
    publisher.doing(turn)  # ... then member 2's turn, whose reward call hangs: nothing more comes
    # Listeners hear each change of kind or member, not every token (one decode: one event within half a second).
    said = [e.activity for e in heard if e.activity is not None]
    assert [(a.what, a.done) for a in said] == [("decoding", 0), ("member", 2)]
    assert all(e.phase == "training" for e in heard[1:])
    time.sleep(0.6)  # the interval is over: the throttled change is written though no call followed it
    record = TrialRecord(study.trials[1]).progress
    assert record.activity == turn and record.phase == "training"
    assert record.stepped == began  # a token or a turn is no step: "stuck" still counts from the last step
    publisher.evaluating()  # a phase clears it
    assert TrialRecord(study.trials[1]).progress.activity is None and heard[-1].activity is None


def test_an_evaluations_progress_is_each_members_prompts_done_and_the_batch_now(study):
    publishers = [ProgressPublisher(_ref(study, study.trials[n]), unit=1, num_units=2, steps=8, interval=0.0)
                  for n in (1, 2)]
    for publisher in publishers:
        publisher.evaluating()
    hear = evaluation_progress(publishers)
    hear(Decoded(rows_done=(16, 8), rows=(32, 32), tokens=40, max_tokens=128, seconds=2.0))
    first, second = (TrialRecord(study.trials[n]).progress.activity for n in (1, 2))
    assert (first.what, first.done, first.total, first.tokens, first.max_tokens) == ("prompts", 16, 32, 40, 128)
    assert first.rate == 20.0 and (second.done, second.total) == (8, 32) and first.since == second.since


def _in_flight(study, number, activity, phase="training", **fields):
    return _flight(study, number, phase=phase, step=fields.pop("step", 2), step_seconds=fields.pop("step_seconds", 5.0),
                   activity=activity, **fields)


def test_status_says_how_far_each_phase_is(study):
    now = time.time()
    cases = [
        ("training", Activity("decoding", done=40, total=128, rate=12.0, since=now - 3),
         "2 of 8 steps done, decoding rollouts: 40 of at most 128 new tokens (12 tokens/s)"),
        ("training", Activity("member", done=2, total=3, trial=4, since=now - 35),
         "2 of 8 steps done, training member 2 of 3 (trial 4), 35s into its turn"),
        ("training", Activity("batched", total=3, since=now), "2 of 8 steps done, the gang's batched step, all 3 "
                                                               "members at once"),
        ("evaluating", Activity("prompts", done=16, total=32, tokens=40, max_tokens=128, rate=20.0, since=now),
         "evaluating after its 8 steps: 16 of 32 prompts (the batch now: 40 of at most 128 tokens (20 tokens/s))"),
        ("baseline", Activity("prompts", done=3, total=32, since=now),
         "evaluating the base model with no adapter (the study's baseline): 3 of 32 prompts"),
    ]
    for phase, activity, words in cases:
        _in_flight(study, 1, activity, phase=phase)
        [flight] = now_training([TrialRecord(t) for t in study.trials])
        assert f"trial 1 · chunk 2 of 2 · {words} · for " in flight.line(now), flight.line(now)
        with Presence(study, "run"):  # read a moment later: "for 35s" may read 36s by then
            assert f"now training: trial 1 · chunk 2 of 2 · {words.split(', 35s')[0]}" in _status_text(study)


def test_a_gang_shows_what_it_does_now_from_its_newest_record(study):
    now = time.time()
    study.add_trial(optuna.trial.create_trial(state=TrialState.RUNNING, system_attrs=study.trials[1].system_attrs))
    # Member 3's record was written last: the gang is in its turn now (member 2's record still says the decode).
    _in_flight(study, 1, Activity("decoding", done=60, total=64, since=now - 9), gang=(1, 2, 3), holder="h:1")
    _in_flight(study, 2, Activity("member", done=2, total=3, trial=2, since=now - 6), gang=(1, 2, 3), holder="h:1")
    _in_flight(study, 3, Activity("member", done=3, total=3, trial=3, since=now - 4), gang=(1, 2, 3), holder="h:1")
    [gang] = now_training([TrialRecord(t) for t in study.trials])
    assert ("trials 1, 2, 3 (one gang) · chunk 2 of 2 · 2 of 8 steps done, training member 3 of 3 (trial 3), 4s into its "
            "turn") in gang.line(now)


def test_the_page_shows_how_far_a_phase_is(study):
    from rfopt.dashboard.pages import study_page
    from rfopt.reports.status import liveness

    _in_flight(study, 1, Activity("member", done=2, total=3, trial=4, since=time.time() - 5))
    with Presence(study, "run"):
        trials = study.get_trials(deepcopy=False)
        page = study_page(study, trials, liveness(study, trials), "v1")
    # The turn's time is a clock the page counts (nothing is written while a reward call hangs in it).
    assert re.search(r"2 of 8 steps done, training member 2 of 3 \(trial 4\), <span class='clock' data-into='\d+'>\d+s into "
                     r"its turn</span>", page.parts["now"]), page.parts["now"]


def test_the_bar_shows_how_far_a_phase_is_and_a_log_gets_no_line_per_turn_or_token():
    now = time.time()
    stream = io.StringIO()
    events = [UnitProgress(trial=t, unit=0, num_units=2, phase="training", step=1, steps=8, step_seconds=2.0,
                           gang=(3, 4), activity=Activity("member", done=k, total=2, trial=t, since=now + k))
              for k, t in ((1, 3), (2, 4))]
    with ProgressBar("demo", stream=stream, plain=False, watch_seconds=0) as bar:
        bar(_Run(0, 4, 0, 32, {3: 0, 4: 0}))
        for event in events:
            bar.step(event)
        assert "t3,t4 c1/2 s1/8 2s/st m2/2 t4" in bar._bar.desc
    log = io.StringIO()
    with ProgressBar("demo", stream=log, plain=True, plain_seconds=0.2, watch_seconds=0) as bar:
        bar(_Run(0, 4, 0, 32, {3: 0, 4: 0}))
        for tokens in range(50):  # a decode, then each member's turn: no line of their own
            bar.step(UnitProgress(trial=3, unit=0, num_units=2, phase="training", step=1, steps=8, step_seconds=2.0,
                                  gang=(3, 4), activity=Activity("decoding", done=tokens, total=64, since=now)))
        for event in events:
            bar.step(event)
        time.sleep(0.25)
        bar.step(events[-1])  # the interval is over: one line, saying what the gang does now
    lines = log.getvalue().splitlines()
    assert lines[0] == "demo: trials 3, 4 chunk 1/2: training" and len(lines) == 2, lines
    assert lines[1].startswith("demo: trials 3, 4 chunk 1/2 step 1/8 (2 s/step), training member 2 of 2 (trial 4), ")


def test_the_bar_calls_stuck_what_the_page_calls_stuck_a_turn_or_a_token_is_no_step(monkeypatch):
    import rfopt.reports.display as display

    monkeypatch.setattr(display, "STUCK_FLOOR", 0.2)
    stream = io.StringIO()
    with ProgressBar("demo", stream=stream, plain=True, plain_seconds=3600, watch_seconds=0.05) as bar:
        bar(_Run(0, 4, 0, 32, {0: 0, 1: 0}))
        for trial in (0, 1):
            bar.step(UnitProgress(trial=trial, unit=0, num_units=2, phase="training", step=3, steps=8,
                                  step_seconds=0.01, gang=(0, 1)))
        turn = Activity("member", done=2, total=2, trial=1, since=time.time())
        for _ in range(12):  # the gang's turns go on being heard, but no step comes
            time.sleep(0.05)
            for trial in (0, 1):
                bar.step(UnitProgress(trial=trial, unit=0, num_units=2, phase="training", step=3, steps=8,
                                      step_seconds=0.01, gang=(0, 1), activity=turn))
    overdue = [line for line in stream.getvalue().splitlines() if "stuck or very slow" in line]
    assert len(overdue) == 1 and overdue[0].startswith("demo: trials 0, 1 chunk 1/2: no step for ")
    assert "training member 2 of 2 (trial 1), " in overdue[0]


def test_a_log_says_a_gangs_phase_once_its_members_are_all_in_it():
    # Member 3 starts training (and the gang's turn is heard by every member) while 4 and 5 are still loading.
    stream = io.StringIO()
    turn = Activity("member", done=1, total=3, trial=3, since=time.time())
    with ProgressBar("demo", stream=stream, plain=True, plain_seconds=3600, watch_seconds=0) as bar:
        bar(_Run(0, 4, 0, 32, {n: 0 for n in (3, 4, 5)}))
        for trial in (3, 4, 5):
            bar.step(UnitProgress(trial=trial, unit=0, num_units=2, phase="loading", step=0, steps=8,
                                  step_seconds=None, gang=(3, 4, 5)))
        for trial in (3, 4, 5):
            bar.step(UnitProgress(trial=3, unit=0, num_units=2, phase="training", step=0, steps=8, step_seconds=None,
                                  gang=(3, 4, 5), activity=turn))
            for other in (4, 5):
                bar.step(UnitProgress(trial=other, unit=0, num_units=2, phase="loading" if other > trial else "training",
                                      step=0, steps=8, step_seconds=None, gang=(3, 4, 5), activity=turn))
    assert stream.getvalue().splitlines() == ["demo: trials 3, 4, 5 chunk 1/2: loading",
                                              "demo: trials 3, 4, 5 chunk 1/2: training"]


def test_a_running_study_says_whose_turn_it_is_how_far_its_decode_and_its_evaluation_are(scripted, tiny_model,
                                                                                       storage, monkeypatch):
    import functools

    import rfopt.training.gang
    from rfopt.engine.running import run

    monkeypatch.setattr(run, "Context", functools.partial(run.Context, progress_seconds=0.0))  # every change written
    monkeypatch.setattr(rfopt.training.gang, "TOKENS_SECONDS", 0.0)  # and every token told (a scripted decode is instant)
    study = rfopt.create_study(study_name="phases", storage=storage, direction="maximize")
    seen: dict[str, list[str]] = {"turn": [], "decode": [], "eval": []}

    def status() -> str:
        return next(line for line in _status_text(study.optuna).splitlines() if line.startswith("now training: "))

    scripted.on_train_step = lambda number, step: seen["turn"].append(status())
    scripted.on_decode = lambda token: seen["decode"].append(status()) if token == 3 else None
    scripted.on_eval = lambda number, done: seen["eval"].append(status())
    configs = [trial_config(tiny_model, learning_rate=lr) for lr in (1e-3, 5e-3)]
    study.optimize(configs, TRAIN, EVAL, num_chunks=2, gang_size=2, show_progress_bar=False)
    gang = "now training: trials 0, 1 (one gang) · chunk 1 of 2 · "
    # In member k's turn (its reward calls), `rfopt status` names it; in the gang's decode, the tokens so far.
    assert any(line.startswith(gang) and re.search(r"training member 1 of 2 \(trial 0\), \d+s into its turn", line)
               for line in seen["turn"]), seen["turn"]
    assert any(line.startswith(gang) and re.search(r"training member 2 of 2 \(trial 1\), \d+s into its turn", line)
               for line in seen["turn"])
    assert any(line.startswith(gang) and "decoding rollouts: 3 of at most " in line for line in seen["decode"])
    # Its evaluation, prompt by prompt (the member furthest behind: trial 1's prompts come after trial 0's here).
    assert any(line.startswith(gang) and "evaluating after its " in line and ": 0 of 2 prompts" in line
               for line in seen["eval"]), seen["eval"]
