"""Pruning at rung boundaries: order-independent, stored once per (trial, step), Optuna's meanings.

Synthetic round-robin sweeps on a SQLite file: 8 trials asked up front, each step every live
trial reports, then `decide` runs and the pruned trials are told PRUNED. Order A reports (and
lists) the bad trials first, order B last.
"""

from __future__ import annotations

import importlib.util
import math
import subprocess
import sys
import types
from collections.abc import Callable
from pathlib import Path

import optuna
import pytest
from optuna.pruners import (
    BasePruner,
    HyperbandPruner,
    MedianPruner,
    NopPruner,
    PatientPruner,
    PercentilePruner,
    SuccessiveHalvingPruner,
    ThresholdPruner,
    WilcoxonPruner,
)
from optuna.trial import FrozenTrial, TrialState

from rfopt.errors import PrunerFailed, StaleRead
from rfopt.pruning import PruneDecision, decide, decision_key, load_decision
from rfopt.pruning._halving import Brackets, successive_halving
from rfopt.storage.schema import trial_attrs

optuna.logging.set_verbosity(optuna.logging.WARNING)
pytestmark = pytest.mark.filterwarnings("ignore::optuna.exceptions.ExperimentalWarning")

HAS_SCIPY = importlib.util.find_spec("scipy") is not None
N_STEPS = 8
GOOD = (0, 2, 4, 6)
BAD = (1, 3, 5, 7)
_GOOD_START = {0: 0.80, 2: 0.82, 4: 0.90, 6: 0.95}


def value(number: int, step: int, *, minimize: bool = False) -> float:
    """Good trials start at 0.80..0.95 and rise; bad ones start at 0.10..0.13 and fall.

    Every trial keeps its rank at every step: 6 > 4 > 2 > 0 > 7 > 5 > 3 > 1.
    With ``minimize`` the values are mirrored (1 - v) so the same trials are good.
    """
    if number in _GOOD_START:
        v = _GOOD_START[number] + 0.02 * step
    else:
        v = 0.10 + 0.01 * (number // 2) - 0.01 * step
    return 1.0 - v if minimize else v


def new_study(tmp_path: Path, file: str, direction: str = "maximize") -> optuna.Study:
    # Same study name in every file: Hyperband's brackets hash it.
    return optuna.create_study(
        storage=f"sqlite:///{tmp_path}/{file}.db", study_name="rr", direction=direction
    )


def report_order(numbers: list[int], bad_first: bool) -> list[int]:
    if bad_first:
        return sorted(numbers, key=lambda n: (n not in BAD, n))
    return sorted(numbers, key=lambda n: (n in BAD, -n))


def sweep(
    study: optuna.Study,
    pruner: BasePruner,
    *,
    bad_first: bool,
    n_steps: int = N_STEPS,
    minimize: bool = False,
    load: Callable[[], optuna.Study] | None = None,
    stop_after: int | None = None,
) -> dict[tuple[int, int], PruneDecision]:
    """Round-robin 8 trials through n_steps chunks; decisions by (trial, step).

    ``load`` gives the study object to decide with (default: ``study``); ``stop_after`` ends the
    sweep after that step, leaving the survivors RUNNING.
    """
    trials = [study.ask() for _ in range(8)]
    pruned: set[int] = set()
    decisions = {}
    last = n_steps - 1 if stop_after is None else stop_after
    for step in range(last + 1):
        live = report_order([t.number for t in trials if t.number not in pruned], bad_first)
        for number in live:
            trials[number].report(value(number, step, minimize=minimize), step)
        deciding = load() if load else study
        for d in decide(deciding, live, step, pruner, n_steps=n_steps):
            decisions[(d.trial_number, step)] = d
            if d.prune:
                study.tell(d.trial_number, state=TrialState.PRUNED)
                pruned.add(d.trial_number)
    if stop_after is None:
        for number in set(range(8)) - pruned:
            study.tell(number, value(number, n_steps - 1, minimize=minimize))
    return decisions


def pruned_at(decisions: dict[tuple[int, int], PruneDecision]) -> dict[int, int]:
    return {n: step for (n, step), d in decisions.items() if d.prune}


def both_orders(
    tmp_path: Path, make_pruner: Callable[[], BasePruner], **kwargs
) -> dict[tuple[int, int], PruneDecision]:
    """Sweep in order A and order B; the decisions, reasons included, must be identical."""
    direction = "minimize" if kwargs.get("minimize") else "maximize"
    a = sweep(new_study(tmp_path, "a", direction), make_pruner(), bad_first=True, **kwargs)
    b = sweep(new_study(tmp_path, "b", direction), make_pruner(), bad_first=False, **kwargs)
    assert a == b
    return a


ALL_BAD_AT_0 = {n: 0 for n in BAD}

SEMANTICS = {
    # Each bad trial is below the median of its 7 peers at chunk 0; no good one is. After that
    # only 3 peers reach each chunk, fewer than n_startup_trials=5.
    "median": (lambda: MedianPruner(), ALL_BAD_AT_0),
    # Kept iff best >= the 75th percentile of the 7 peers (linear interpolation): only 4 and 6.
    "percentile_25": (lambda: PercentilePruner(25.0), {**ALL_BAD_AT_0, 0: 0, 2: 0}),
    # 8 -> 4 -> 2 -> 1 at rungs at chunks 0, 1, 3; chunk 7 is the end of the budget.
    "successive_halving": (
        lambda: SuccessiveHalvingPruner(min_resource=1, reduction_factor=2),
        {**ALL_BAD_AT_0, 0: 1, 2: 1, 4: 3},
    ),
    "threshold": (lambda: ThresholdPruner(lower=0.5), ALL_BAD_AT_0),
    # Bad trials fall, so at chunk 2 they have stalled for patience+1 chunks; the median agrees.
    "patient_median": (
        lambda: PatientPruner(MedianPruner(), patience=1),
        {n: 2 for n in BAD},
    ),
    "nop": (lambda: NopPruner(), {}),
    "median_warmup_2": (lambda: MedianPruner(n_warmup_steps=2), {n: 2 for n in BAD}),
    "median_checks_odd_chunks": (
        lambda: MedianPruner(n_warmup_steps=1, interval_steps=2),
        {n: 1 for n in BAD},
    ),
    # 7 peers at chunk 0 are fewer than n_startup_trials=8 (the trial itself does not count).
    "median_startup_8": (lambda: MedianPruner(n_startup_trials=8), {}),
    "median_min_trials_8": (lambda: MedianPruner(n_min_trials=8), {}),
}


@pytest.mark.parametrize("case", SEMANTICS)
def test_pruned_set_is_the_documented_one_whatever_the_report_order(tmp_path, case):
    make_pruner, expected = SEMANTICS[case]
    assert pruned_at(both_orders(tmp_path, make_pruner)) == expected


def test_successive_halving_keeps_8_4_2_1_at_rungs_0_1_3(tmp_path):
    decisions = both_orders(
        tmp_path, lambda: SuccessiveHalvingPruner(min_resource=1, reduction_factor=2)
    )
    judged = {step: sum(1 for (_, s) in decisions if s == step) for step in range(N_STEPS)}
    kept = {step: sum(1 for (_, s), d in decisions.items() if s == step and not d.prune)
            for step in range(N_STEPS)}
    assert judged == {0: 8, 1: 4, 2: 2, 3: 2, 4: 1, 5: 1, 6: 1, 7: 1}
    assert kept == {0: 4, 1: 2, 2: 2, 3: 1, 4: 1, 5: 1, 6: 1, 7: 1}
    assert decisions[(6, 2)].reason == "kept: chunk 3 is not a rung (rungs after chunks 1, 2, 4)"
    assert decisions[(2, 1)].reason == "rank 3 of 4 at rung 1 (chunk 2; keeps top 2)"
    assert decisions[(2, 1)].peers == (0, 4, 6)


def test_median_reason_names_the_value_the_median_and_the_peers(tmp_path):
    decisions = both_orders(tmp_path, lambda: MedianPruner())
    d = decisions[(1, 0)]
    assert d.pruner == "MedianPruner"
    assert d.peers == (0, 2, 3, 4, 5, 6, 7)
    assert d.reason == "best value 0.1 up to chunk 1 is below the median 0.8 of 7 peers at chunk 1"
    assert decisions[(0, 1)].reason.startswith("kept: 3 peers reached chunk 2")


def test_hyperband_halves_synchronously_within_optunas_brackets(tmp_path):
    decisions = both_orders(
        tmp_path, lambda: HyperbandPruner(min_resource=1, max_resource=8, reduction_factor=2)
    )
    study = optuna.load_study(study_name="rr", storage=f"sqlite:///{tmp_path}/a.db")
    oracle = HyperbandPruner(min_resource=1, max_resource=8, reduction_factor=2)
    oracle._try_initialization(study)
    bracket = {t.number: oracle._get_bracket_id(study, t) for t in study.trials}
    # Bracket b halves with min_early_stopping_rate=b: rungs at resources 2**(b+i) chunks.
    rungs = {0: [0, 1, 3], 1: [1, 3], 2: [3], 3: []}
    expected = {}
    for b in set(bracket.values()):
        alive = sorted((n for n in bracket if bracket[n] == b), key=lambda n: -value(n, 0))
        for step in rungs[b]:
            keep = math.ceil(len(alive) / 2)
            expected.update({n: step for n in alive[keep:]})
            alive = alive[:keep]
    assert expected, "the study name should spread trials so that some bracket halves"
    assert pruned_at(decisions) == expected
    for (n, _), d in decisions.items():
        assert set(d.peers) <= {m for m in bracket if bracket[m] == bracket[n]}


def test_hyperband_brackets_match_optuna_for_many_trials():
    storage = optuna.storages.InMemoryStorage()
    for name, eta, max_resource in [("rr", 2, 8), ("gsm8k", 3, 27), ("x", 4, 100)]:
        study = optuna.create_study(study_name=name, storage=storage)
        oracle = HyperbandPruner(min_resource=1, max_resource=max_resource, reduction_factor=eta)
        oracle._try_initialization(study)
        ours = Brackets.of(oracle, name, n_steps=max_resource)
        for number in range(300):
            trial = optuna.trial.create_trial(value=0.0)
            trial.number = number
            assert ours.index_of(number) == oracle._get_bracket_id(study, trial)


def test_auto_min_resource_comes_from_the_chunk_plan(tmp_path):
    # 16 chunks, eta 2: min_resource = 16 // 2**3 = 2, rungs at resources 2, 4, 8 = chunks 1, 3, 7.
    decisions = both_orders(
        tmp_path, lambda: SuccessiveHalvingPruner(reduction_factor=2), n_steps=16
    )
    assert pruned_at(decisions) == {**{n: 1 for n in BAD}, 0: 3, 2: 3, 4: 7}
    assert decisions[(6, 0)].reason == "kept: chunk 1 is not a rung (rungs after chunks 2, 4, 8)"


def test_auto_resources_equal_explicit_ones_for_eight_chunks():
    # 8 // 2**3 = 1 chunk; Hyperband's max_resource is the plan's 8 chunks.
    assert successive_halving(SuccessiveHalvingPruner(reduction_factor=2), 8) == (
        successive_halving(SuccessiveHalvingPruner(min_resource=1, reduction_factor=2), 8)
    )
    assert Brackets.of(HyperbandPruner(reduction_factor=2), "rr", 8) == Brackets.of(
        HyperbandPruner(min_resource=1, max_resource=8, reduction_factor=2), "rr", 8
    )


@pytest.mark.parametrize(
    ("make_pruner", "expected"),
    [
        (lambda: MedianPruner(), ALL_BAD_AT_0),
        (
            lambda: SuccessiveHalvingPruner(min_resource=1, reduction_factor=2),
            {**ALL_BAD_AT_0, 0: 1, 2: 1, 4: 3},
        ),
    ],
    ids=["median", "successive_halving"],
)
def test_minimize_keeps_the_lowest_values(tmp_path, make_pruner, expected):
    assert pruned_at(both_orders(tmp_path, make_pruner, minimize=True)) == expected


def test_patient_successive_halving_halves_only_stalled_trials(tmp_path):
    # Good trials never stall, so only the bad ones can reach the inner pruner; at rung 0 the
    # patience test needs 3 values, so nobody is halved until the rung at chunk 3.
    decisions = both_orders(
        tmp_path,
        lambda: PatientPruner(
            SuccessiveHalvingPruner(min_resource=1, reduction_factor=2), patience=1
        ),
    )
    assert pruned_at(decisions) == {n: 3 for n in BAD}
    assert "SuccessiveHalvingPruner: rank" in decisions[(1, 3)].reason


@pytest.mark.parametrize(("late_value", "prune"), [(0.47, False), (0.46, True)])
def test_late_trial_is_judged_against_peers_stored_values_at_the_same_step(
    tmp_path, late_value, prune
):
    study = new_study(tmp_path, "late")
    sweep(study, MedianPruner(), bad_first=True, stop_after=2)  # bad trials pruned at chunk 0
    late = study.ask()
    late.report(late_value, 0)
    [d] = decide(study, [late.number], 0, MedianPruner(), n_steps=N_STEPS)
    # Chunk-0 values of all 8 peers, the 4 pruned ones included: median (0.13 + 0.80) / 2.
    # (Against the peers' latest values the median would be 0.485; against running peers only
    # there would be 4, fewer than n_startup_trials.)
    assert d.peers == tuple(range(8))
    assert d.prune is prune
    assert "the median 0.465 of 8 peers at chunk 1" in d.reason


@pytest.mark.parametrize(
    ("late_value", "prune", "rank"), [(0.85, False, 3), (0.5, False, 5), (0.05, True, 9)]
)
def test_late_trial_at_a_rung_is_ranked_among_all_that_reached_it(
    tmp_path, late_value, prune, rank
):
    pruner = SuccessiveHalvingPruner(min_resource=1, reduction_factor=2)
    study = new_study(tmp_path, "late")
    sweep(study, pruner, bad_first=True, stop_after=1)
    late = study.ask()
    late.report(late_value, 0)
    [d] = decide(study, [late.number], 0, pruner, n_steps=N_STEPS)
    assert d.prune is prune
    assert f"rank {rank} of 9 at rung 0 (chunk 1; keeps top 5)" in d.reason
    # Decisions made before it arrived stand.
    assert load_decision(study.trials[0], 0).reason == (
        "kept: rank 4 of 8 at rung 0 (chunk 1; keeps top 4)"
    )


def test_every_decision_is_stored_on_its_trial_kept_ones_too(tmp_path):
    study = new_study(tmp_path, "stored")
    decisions = sweep(study, MedianPruner(), bad_first=True)
    fresh = optuna.load_study(study_name="rr", storage=f"sqlite:///{tmp_path}/stored.db")
    for trial in fresh.trials:
        for step in trial.intermediate_values:
            assert load_decision(trial, step) == decisions[(trial.number, step)]
    assert trial_attrs(fresh.trials[1])[decision_key(0)] == {
        "prune": True,
        "reason": "best value 0.1 up to chunk 1 is below the median 0.8 of 7 peers at chunk 1",
        "peers": [0, 2, 3, 4, 5, 6, 7],
        "pruner": "MedianPruner",
    }
    assert trial_attrs(fresh.trials[0])["rfopt:pruning:7"]["prune"] is False


class CountingMedian(MedianPruner):
    """A user subclass: counts its calls, otherwise Optuna's median rule."""

    def __init__(self) -> None:
        super().__init__(n_startup_trials=1)
        self.calls = 0

    def prune(self, study: optuna.Study, trial: FrozenTrial) -> bool:
        self.calls += 1
        return super().prune(study, trial)


def test_asking_again_returns_the_stored_decision_without_asking_the_pruner(tmp_path):
    study = new_study(tmp_path, "twice")
    trials = [study.ask() for _ in range(3)]
    for t, v in zip(trials, [0.6, 0.4, 0.55]):
        t.report(v, 0)
    pruner = CountingMedian()
    first = decide(study, [0, 1, 2], 0, pruner, n_steps=4)
    assert pruner.calls == 3
    assert [d.prune for d in first] == [False, True, False]  # medians 0.475, 0.575, 0.5
    # New peers would now put trial 0 below the median (0.75); the stored decision stands.
    for v in (0.95, 0.97):
        study.ask().report(v, 0)
    again = decide(study, [2, 0, 1], 0, pruner, n_steps=4)
    assert pruner.calls == 3
    assert again == [first[2], first[0], first[1]]
    # A trial already told PRUNED still answers from its stored decision.
    study.tell(1, state=TrialState.PRUNED)
    assert decide(study, [1], 0, pruner, n_steps=4) == [first[1]]


class BelowPeerMean(BasePruner):
    """A custom pruner: prune when the latest value is below the mean of COMPLETE trials."""

    def __init__(self) -> None:
        self.seen: dict[int, tuple[TrialState, dict[int, tuple[float, list[int]]]]] = {}

    def prune(self, study: optuna.Study, trial: FrozenTrial) -> bool:
        peers = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
        self.seen[trial.number] = (
            trial.state,
            {p.number: (p.value, sorted(p.intermediate_values)) for p in peers},
        )
        mean = sum(p.value for p in peers) / len(peers)
        return trial.intermediate_values[trial.last_step] < mean


def test_custom_pruner_sees_peers_as_complete_at_their_value_at_the_step(tmp_path):
    study = new_study(tmp_path, "custom")
    trials = [study.ask() for _ in range(8)]
    for step in (0, 1):  # everyone is already one chunk ahead of the step judged
        for t in trials:
            t.report(value(t.number, step), step)
    pruner = BelowPeerMean()
    decisions = decide(study, list(range(8)), 0, pruner, n_steps=N_STEPS)
    assert {d.trial_number for d in decisions if d.prune} == set(BAD)
    state, peers = pruner.seen[3]
    assert state == TrialState.RUNNING
    assert peers == {n: (value(n, 0), [0]) for n in range(8) if n != 3}
    assert decisions[3].reason == (
        "BelowPeerMean.prune pruned it, given 7 peers at chunk 1 as COMPLETE trials"
    )


class WritesToStorage(BasePruner):
    def prune(self, study: optuna.Study, trial: FrozenTrial) -> bool:
        study.set_user_attr("x", 1)
        return False


def test_a_pruner_cannot_write_through_the_view(tmp_path):
    study = new_study(tmp_path, "write")
    study.ask().report(0.5, 0)
    with pytest.raises(PrunerFailed, match="WritesToStorage.prune raised AttributeError: .*read-only view") as raised:
        decide(study, [0], 0, WritesToStorage(), n_steps=4)
    assert isinstance(raised.value.__cause__, AttributeError)


class RaisesForTrialOne(BasePruner):
    def prune(self, study: optuna.Study, trial: FrozenTrial) -> bool:
        if trial.number == 1:
            raise ValueError("this pruner cannot judge trial 1")
        return False


def test_a_pruner_that_raises_names_its_trial_and_is_never_taken_for_a_stale_read(tmp_path):
    """Only `StaleRead` means "read again next round" to the engine: a pruner's own ValueError is `PrunerFailed`,
    with the trial it was judging, so that trial fails (as in Optuna) instead of being deferred round after round."""
    study = new_study(tmp_path, "raises")
    for _ in range(3):
        study.ask().report(0.5, 0)
    with pytest.raises(PrunerFailed, match="trial 1, step 0: RaisesForTrialOne.prune raised ValueError: this pruner "
                                           "cannot judge trial 1") as raised:
        decide(study, [0, 1, 2], 0, RaisesForTrialOne(), n_steps=4)
    assert not isinstance(raised.value, StaleRead) and isinstance(raised.value.__cause__, ValueError)
    assert (raised.value.trial_number, raised.value.step) == (1, 0)
    assert not load_decision(study.trials[0], 0).prune  # judged before it: stored, as always
    assert load_decision(study.trials[1], 0) is None and load_decision(study.trials[2], 0) is None


def test_a_trial_that_ends_elsewhere_while_its_rung_is_decided_is_a_stale_read(tmp_path, monkeypatch):
    from rfopt.pruning import _decide

    study = new_study(tmp_path, "stale")
    for _ in range(2):
        study.ask().report(0.5, 0)
    write = _decide.write_decision

    def failed_meanwhile(ref, decision):  # another process fails trial 1 between the read and the write
        if decision.trial_number == 1:
            study.tell(1, state=TrialState.FAIL)
        write(ref, decision)

    monkeypatch.setattr(_decide, "write_decision", failed_meanwhile)
    with pytest.raises(StaleRead, match="trial 1 ended in another process while step 0 was being decided"):
        decide(study, [0, 1], 0, NopPruner(), n_steps=4)
    monkeypatch.setattr(_decide, "write_decision", write)
    with pytest.raises(StaleRead, match="trial 1 is FAIL with no decision stored for step 0"):
        decide(study, [0, 1], 0, NopPruner(), n_steps=4)  # read again: the ended trial is named, nothing decided


def test_decisions_need_only_storage_a_reloaded_study_and_a_new_pruner(tmp_path):
    url = f"sqlite:///{tmp_path}/fresh.db"
    in_process = sweep(
        new_study(tmp_path, "in_process"),
        SuccessiveHalvingPruner(min_resource=1, reduction_factor=2),
        bad_first=True,
    )
    study = optuna.create_study(storage=url, study_name="rr", direction="maximize")
    reloaded = sweep(
        study,
        SuccessiveHalvingPruner(min_resource=1, reduction_factor=2),
        bad_first=True,
        load=lambda: optuna.load_study(
            study_name="rr", storage=optuna.storages.RDBStorage(url)
        ),
    )
    assert reloaded == in_process


@pytest.mark.subprocess
def test_a_new_process_reads_back_the_stored_decision(tmp_path):
    study = new_study(tmp_path, "proc")
    trials = [study.ask() for _ in range(8)]
    for t in trials:
        t.report(value(t.number, 0), 0)
    [here] = decide(study, [5], 0, MedianPruner(), n_steps=N_STEPS)
    script = (
        "import optuna, sys\n"
        "from rfopt.pruning import decide\n"
        f"study = optuna.load_study(study_name='rr', storage='sqlite:///{tmp_path}/proc.db')\n"
        "print(repr(decide(study, [5], 0, optuna.pruners.NopPruner(), n_steps=8)[0]))\n"
    )
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, "-c", script], cwd=root, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == repr(here)  # stored by the first process, not re-decided


def test_deciding_before_a_trial_reported_the_step_names_trial_and_step(tmp_path):
    study = new_study(tmp_path, "errors")
    trials = [study.ask() for _ in range(4)]
    for t in trials:
        t.report(0.5, 0)
    for t in trials[:3]:
        t.report(0.5, 1)
    with pytest.raises(ValueError, match="trial 3 has not reported step 1"):
        decide(study, [0, 3], 1, MedianPruner(), n_steps=4)
    assert decision_key(1) not in study.trials[0].user_attrs  # checked before any write
    with pytest.raises(ValueError, match="step=4 is outside the chunk plan"):
        decide(study, [0], 4, MedianPruner(), n_steps=4)
    with pytest.raises(ValueError, match="trial 9: no such trial"):
        decide(study, [9], 0, MedianPruner(), n_steps=4)
    study.tell(2, state=TrialState.PRUNED)
    with pytest.raises(StaleRead, match="trial 2 is PRUNED with no decision stored for step 1"):
        decide(study, [2], 1, MedianPruner(), n_steps=4)


def test_wilcoxon_pairs_the_trial_with_the_best_peer_at_the_step(tmp_path, monkeypatch):
    # Stand-in for scipy.stats.wilcoxon that records the paired differences it is given.
    seen: list[list[float]] = []

    def wilcoxon(diffs, alternative, zero_method):
        seen.append([round(float(d), 6) for d in diffs])
        return types.SimpleNamespace(pvalue=0.0 if all(d < 0 for d in diffs) else 1.0)

    monkeypatch.setattr(
        optuna.pruners._wilcoxon, "ss", types.SimpleNamespace(wilcoxon=wilcoxon)
    )
    study = new_study(tmp_path, "wilcoxon_pairs")
    trials = [study.ask() for _ in range(8)]
    for step in (0, 1, 2):
        for t in trials:
            t.report(value(t.number, step), step)
    [d] = decide(study, [1], 2, WilcoxonPruner(), n_steps=N_STEPS)
    # Trial 6 has the best value at chunk 2; chunks 0..2 of trial 1 are paired with its own.
    assert seen == [[round(value(1, s) - value(6, s), 6) for s in (0, 1, 2)]]
    assert d.prune
    assert d.reason == (
        "worse than chunks 1..3 of trial 6, the best peer at chunk 3 (Wilcoxon p < 0.1)"
    )


@pytest.mark.skipif(not HAS_SCIPY, reason="WilcoxonPruner needs scipy, which is not installed")
def test_wilcoxon_compares_with_the_best_peer_at_the_step(tmp_path):
    decisions = both_orders(tmp_path, lambda: WilcoxonPruner(p_threshold=0.1))
    pruned = pruned_at(decisions)
    assert set(BAD) <= set(pruned)
    assert 6 not in pruned  # the best trial is never shown worse than the runner-up


@pytest.mark.skipif(HAS_SCIPY, reason="checks the error when scipy is missing")
def test_wilcoxon_without_scipy_says_what_to_install(tmp_path):
    study = new_study(tmp_path, "wilcoxon")
    trials = [study.ask() for _ in range(3)]
    for step in (0, 1):
        for t in trials:
            t.report(value(t.number, step), step)
    # One value per trial is below n_startup_steps: decided without scipy.
    assert not any(d.prune for d in decide(study, [0, 1, 2], 0, WilcoxonPruner(), n_steps=4))
    with pytest.raises(PrunerFailed, match="needs scipy") as raised:
        decide(study, [0, 1, 2], 1, WilcoxonPruner(), n_steps=4)
    assert isinstance(raised.value.__cause__, ImportError)


# What samplers see of a study pruned at rungs (README: "What samplers see"). Optuna 5.0 private
# functions, read in optuna/samplers/_tpe/sampler.py and _cmaes.py; a change there should fail here.


def test_tpe_ranks_complete_trials_first_then_pruned_ones_by_last_step_then_value(tmp_path):
    from optuna.samplers._tpe.sampler import _split_trials

    study = new_study(tmp_path, "tpe")
    # 8 -> 4 -> 2 -> 1: bad trials pruned at chunk 0, 0 and 2 at chunk 1, 4 at chunk 3; 6 COMPLETE.
    sweep(study, SuccessiveHalvingPruner(min_resource=1, reduction_factor=2), bad_first=True)
    trials = study.get_trials(states=(TrialState.COMPLETE, TrialState.PRUNED))
    below, _ = _split_trials(study, trials, n_below=3)
    # Trial 2 (0.84 at chunk 1) beats trial 0 (0.82 at chunk 1), and both lose to trial 4, which
    # was pruned later with a lower value than either had: the last step counts first.
    assert [t.number for t in below] == [2, 4, 6]
    below, _ = _split_trials(study, trials, n_below=5)
    assert [t.number for t in below] == [0, 2, 4, 6, 7]  # 7 is the best of those pruned at 0


def test_tpe_constant_liar_counts_live_trials_as_bad_whatever_their_values(tmp_path):
    from optuna.samplers._tpe.sampler import _split_trials

    study = new_study(tmp_path, "liar")
    sweep(study, SuccessiveHalvingPruner(min_resource=1, reduction_factor=2), bad_first=True,
          stop_after=1)  # trials 4 and 6, the leaders, are still RUNNING
    # TPESampler(constant_liar=True), the default, reads COMPLETE, PRUNED and RUNNING trials.
    trials = study.get_trials(
        states=(TrialState.COMPLETE, TrialState.PRUNED, TrialState.RUNNING)
    )
    below, above = _split_trials(study, trials, n_below=2)
    assert [t.number for t in below] == [0, 2]
    assert {4, 6} <= {t.number for t in above}


def test_cmaes_with_pruned_trials_takes_their_last_intermediate_value(tmp_path):
    study = new_study(tmp_path, "cmaes")
    sweep(study, SuccessiveHalvingPruner(min_resource=1, reduction_factor=2), bad_first=True)
    sampler = optuna.samplers.CmaEsSampler(consider_pruned_trials=True)
    seen = {t.number: t.value for t in sampler._get_trials(study)}
    assert seen == {
        **{n: value(n, 0) for n in BAD}, 0: value(0, 1), 2: value(2, 1), 4: value(4, 3),
        6: value(6, N_STEPS - 1),
    }
    assert set(t.number for t in optuna.samplers.CmaEsSampler()._get_trials(study)) == {6}
