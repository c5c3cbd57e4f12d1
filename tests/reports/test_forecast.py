"""The study's forecast (`rfopt.reports.forecast`): units and time left as the pruner's schedule lets the trials go on,
checked against a recorded run of `tests/forecast_study.py` (6 trials of the tiny model, 4 chunks, two gangs of 3,
successive halving; recorded by `bench/record_forecast.py`) and on small made-up studies."""

from __future__ import annotations

import datetime
import json
from pathlib import Path

import optuna
import pytest
from optuna.trial import FrozenTrial, TrialState

from rfopt.pruning import Outlook, PopulationBasedTraining, describe
from rfopt.reports.forecast import forecast
from rfopt.storage.schema import RunShape, TrialRecord

RECORDED = Path(__file__).resolve().parents[1] / "recorded" / "forecast-halving.json"


def _frozen(data: dict) -> FrozenTrial:
    def when(x):
        return None if x is None else datetime.datetime.fromtimestamp(x)

    return FrozenTrial(number=data["number"], state=TrialState[data["state"]], value=data.get("value"),
                       datetime_start=when(data.get("datetime_start")), datetime_complete=when(data.get("datetime_complete")),
                       params={}, distributions={}, user_attrs={}, system_attrs=data["system_attrs"],
                       intermediate_values={int(k): v for k, v in data["intermediate_values"].items()},
                       trial_id=data["number"])


def _recording():
    data = json.loads(RECORDED.read_text())
    out = []
    for snap in data["snapshots"]:
        records = [TrialRecord(_frozen(t)) for t in snap["trials"]]
        shape = RunShape.from_attr(snap["study_attrs"].get("rfopt:run_shape"))
        decided = sum(1 for r in records for _ in r.decided_steps)
        out.append((snap["time"], records, shape, decided))
    return data["ended"], out


def _units_after(records_at_end: list[TrialRecord], records_now: list[TrialRecord]) -> int:
    """Units the run really trained after a snapshot: committed at the end, less committed then."""
    then = {r.number: r.committed for r in records_now}
    return sum(r.committed - then.get(r.number, 0) for r in records_at_end)


def test_the_forecast_at_each_rung_of_the_recorded_study_is_within_25_percent_of_the_real_time_left():
    ended, snapshots = _recording()
    final = snapshots[-1][1]
    rungs = 0
    previous = 0
    for taken, records, shape, decided in snapshots:
        committed = sum(r.committed for r in records)
        if committed == 0 or ended - taken < 5:
            previous = decided
            continue  # nothing measured yet; or the run's last seconds
        ahead = forecast(records, shape)
        real = ended - taken
        assert ahead.end_at is not None
        error = abs((ahead.end_at - taken) - real) / real
        assert error <= 0.25, (committed, decided, ahead.end_at - taken, real)
        if decided > previous and all(r.decision(s) is not None for r in records for s in r.decided_steps):
            rungs += 1
            # Successive halving's schedule is known: the units it forecasts are the ones the run then trained.
            assert ahead.units_left == pytest.approx(_units_after(final, records), abs=0.25)
            assert ahead.certain and not ahead.ranged
        previous = decided
    assert rungs >= 2  # after chunk 1 (6 -> 3) and after chunk 2 (3 -> 2)


def test_the_recorded_forecast_counts_the_units_halving_will_leave_from_the_start():
    _, snapshots = _recording()
    taken, records, shape, _ = next(s for s in snapshots if any(r.in_flight is not None for r in s[1]))
    ahead = forecast(records, shape)
    # 6 trials, 4 chunks: 6 + 3 + 2 + 2 units if halving keeps 3 of 6, then 2 of 3; 24 if nothing is pruned.
    assert ahead.units_left == pytest.approx(13, abs=0.5)
    assert ahead.units_left_max == pytest.approx(24, abs=0.5)
    assert "SuccessiveHalvingPruner" in ahead.schedule


def test_a_median_pruners_forecast_is_a_range_up_to_no_pruning():
    trials = [_trial(n, committed=1, unit_seconds=10.0) for n in range(4)]
    for t in trials:  # kept after chunk 1
        t.system_attrs["rfopt:pruning:0"] = {"prune": False, "reason": "kept", "peers": [], "pruner": "MedianPruner"}
    records = [TrialRecord(t) for t in trials]
    shape = RunShape(describe(optuna.pruners.MedianPruner(n_startup_trials=0), 4, "s").to_attr(), gang_size=1)
    ahead = forecast(records, shape)
    assert not ahead.certain and ahead.ranged
    # 4 trials at chunk 2 of 4: the checks after chunks 2 and 3 keep about half each time: 4 + 2 + 1 units.
    assert ahead.units_left == pytest.approx(7.0)
    assert ahead.units_left_max == pytest.approx(12.0)
    assert ahead.seconds_left == pytest.approx(70.0) and ahead.seconds_left_max == pytest.approx(120.0)
    assert "up to ~2m00s if nothing more is pruned" in ahead.text()


def test_without_a_stored_run_shape_the_forecast_is_what_is_left_if_nothing_more_is_pruned():
    records = [TrialRecord(_trial(n, committed=2, unit_seconds=5.0, of=3)) for n in range(3)]
    ahead = forecast(records, None)
    assert ahead.units_left == ahead.units_left_max == 6
    assert ahead.seconds_left == pytest.approx(30.0)
    assert "as if nothing more is pruned" in ahead.schedule


def test_gangs_train_a_levels_trials_at_once():
    # 6 trials at chunk 1 of 2 with gangs of 3 measured at 9 s a round: 2 rounds left, not 6 units' time.
    records = [TrialRecord(_trial(n, committed=1, unit_seconds=9.0, gang=(0, 1, 2) if n < 3 else (3, 4, 5),
                                  units=2, of=2)) for n in range(6)]
    shape = RunShape(Outlook("NopPruner", "none", 2).to_attr(), gang_size=3)
    assert forecast(records, shape).seconds_left == pytest.approx(18.0, abs=1.0)


def test_paused_trials_are_not_counted_and_pruned_ones_leave_the_forecast_at_once():
    paused = _trial(0, committed=1, unit_seconds=5.0, units=2)
    paused.system_attrs["rfopt:paused"] = True
    pruned = _trial(1, committed=1, unit_seconds=5.0, units=2)
    pruned.system_attrs["rfopt:pruning:0"] = {"prune": True, "reason": "rank 2 of 2", "peers": [0], "pruner": "x"}
    going = _trial(2, committed=1, unit_seconds=5.0, units=2)
    ahead = forecast([TrialRecord(t) for t in (paused, pruned, going)], None)
    assert ahead.units_left == 1 and ahead.trials == 1


def test_halving_and_hyperband_schedules_as_stored():
    halving = describe(optuna.pruners.SuccessiveHalvingPruner(min_resource=1, reduction_factor=2), 4, "s")
    assert halving.kind == "halving" and halving.rungs == (0, 1) and halving.certain
    assert Outlook.from_attr(json.loads(json.dumps(halving.to_attr()))) == halving
    band = describe(optuna.pruners.HyperbandPruner(min_resource=1, max_resource=8, reduction_factor=2), 8, "s")
    again = Outlook.from_attr(band.to_attr())
    assert {again.ladder(n).rungs for n in range(40)} == {(0, 1, 3), (1, 3), (3,), ()}
    assert describe(optuna.pruners.ThresholdPruner(lower=0.1), 4, "s").kind == "unknown"
    pbt = describe(PopulationBasedTraining(interval=1), 4, "s")  # its clones train on in the replaced members' place
    assert pbt.kind == "none" and pbt.certain and "clone trains on in its place" in pbt.describe()


def _trial(number: int, *, committed: int, unit_seconds: float, units: int = 4, gang: tuple[int, ...] = (),
           of: int = 4) -> FrozenTrial:
    """A RUNNING trial that committed `committed` units of `units`, each `unit_seconds` long, one after another with
    its `of` peers (or in `gang`), with no time between them."""
    start = 1_000_000.0
    attrs = {"rfopt:schedule": {"prompts_per_chunk": 1, "steps_per_chunk": 2, "num_epochs": 1, "num_chunks": units}}
    for unit in range(committed):
        attrs[f"rfopt:metrics:{unit:04d}"] = {"chunk": unit, "train": {
            "seconds": unit_seconds, "eval_seconds": 0.0,
            "started_at": start + (unit * of + (number // len(gang) if gang else number)) * unit_seconds}}
        if gang:
            attrs[f"rfopt:gang:{unit:04d}"] = {"id": f"g{unit}-{gang[0]}", "members": [[n, unit] for n in gang]}
    return FrozenTrial(number=number, state=TrialState.RUNNING, value=None,
                       datetime_start=datetime.datetime.fromtimestamp(start), datetime_complete=None, params={},
                       distributions={}, user_attrs={}, system_attrs=attrs,
                       intermediate_values={u: 0.1 * number for u in range(committed)}, trial_id=number)


def test_one_stalled_round_does_not_push_the_studys_end_out():
    from rfopt.reports.forecast import _Pace

    steady = _Pace(rounds=[(3, 30.0)] * 3, scaling=0.7, gap=0.0, train_share=0.85, ends=[])
    stalled = _Pace(rounds=[(3, 30.0)] * 3 + [(3, 130.0)], scaling=0.7, gap=0.0, train_share=0.85, ends=[])
    assert stalled.gang_seconds(3) == pytest.approx(steady.gang_seconds(3)) == pytest.approx(30.0)
    # A study that really slowed down: once most rounds are slow, they are its pace.
    slowed = _Pace(rounds=[(3, 30.0)] * 2 + [(3, 130.0)] * 3, scaling=0.7, gap=0.0, train_share=0.85, ends=[])
    assert slowed.gang_seconds(3) > 100.0
