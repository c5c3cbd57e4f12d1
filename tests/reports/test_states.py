"""One state per real situation (`rfopt.reports.status.situation`): queued, training, paused, interrupted, pruned,
stopped, complete, failed, cancelled; the same words on the page, the index, `rfopt status` and the trial's
optuna-dashboard note. Only a live, trained trial leads; a request's one undo is its Withdraw; a request that can no
longer apply is not shown as pending."""

from __future__ import annotations

import optuna
import pytest
from optuna.trial import TrialState

from rfopt.chunks import TrialSchedule
from rfopt.dashboard.views import trial_views
from rfopt.engine.trials import ops
from rfopt.engine.outputs.artifacts import trial_note
from rfopt.reports.status import Liveness, situation, state_counts, tally
from rfopt.storage import schema
from rfopt.storage.database import open_storage
from rfopt.storage.schema import TrialRecord

RUNNING = Liveness(True, ["host:1 (run)"], None, [], "running: host:1 (run)")
NOBODY = Liveness(False, [], None, [], "nobody is running this study")


@pytest.fixture
def study(storage):
    """Trials 0-7: 0 complete, 1 pruned, 2 stopped, 3 failed, 4 trained a chunk, 5 asked but not trained, 6 paused,
    7 WAITING."""
    study = optuna.create_study(study_name="s", storage=open_storage(storage), direction="maximize")
    for number in range(7):
        trial = study.ask()
        ref = schema.TrialRef.of(study, trial)
        schema.write_schedule(ref, TrialSchedule(prompts_per_chunk=1, steps_per_chunk=2, num_epochs=1, num_chunks=2))
        if number != 5:
            trial.report(0.1 * number, step=0)
        if number == 2:
            schema.write_stop(ref, schema.Stop(by="me", at="now", after_chunk=0))
        if number == 6:
            schema.write_paused(ref, True)
        if number == 0:
            study.tell(trial, 0.1)
        elif number in (1, 2):
            study.tell(trial, state=TrialState.PRUNED)
        elif number == 3:
            study.tell(trial, state=TrialState.FAIL)
    study.enqueue_trial({})
    return study


def test_each_trial_is_shown_what_it_is_doing(study):
    records = [TrialRecord(t) for t in study.get_trials()]
    assert [situation(r, RUNNING) for r in records] == [
        "complete", "pruned", "stopped", "failed", "training", "queued", "paused", "queued"]
    # Nobody runs the study: what was training is interrupted (the next run continues it); paused stays paused.
    assert [situation(r, NOBODY) for r in records][4:7] == ["interrupted", "interrupted", "paused"]
    assert tally(state_counts(study.get_trials(), NOBODY)) == (
        "1 queued, 1 paused, 2 interrupted, 1 complete, 1 pruned, 1 stopped, 1 failed")


def test_the_page_shows_the_same_words_and_only_a_live_trained_trial_leads(study):
    from rfopt.dashboard.pages import study_page

    page = study_page(study, study.get_trials(), NOBODY, "v1")
    cards = dict(page.cards)
    assert "<span class='state'>interrupted</span>" in cards[4] and "data-situation='paused'" in cards[6]
    assert "<td data-sort='interrupted'>interrupted</td>" in page.parts["leaderboard"]
    assert "1 queued, 1 paused, 2 interrupted, 1 complete" in page.parts["facts"]
    # Trial 6 (paused, 0.6) has the best value, trial 0 is COMPLETE: Optuna's best, not the paused one.
    assert "★ best" in page.parts["leaderboard"].split("</tr>")[1]  # the first row: trial 0


def test_a_pending_request_offers_one_undo_and_a_finished_trials_request_is_not_pending(study):
    ops.request(study, 4, "pause", by="me")
    view = {v.number: v for v in trial_views(study.get_trials(), study, RUNNING)}[4]
    assert view.pending == ["pause"] and view.controls == ["stop"]  # no Resume beside "Withdraw pause"
    ops.request(study, 4, "stop", by="me")
    view = {v.number: v for v in trial_views(study.get_trials(), study, RUNNING)}[4]
    assert view.controls == []  # a stop is pending: its Withdraw is the one control
    paused = {v.number: v for v in trial_views(study.get_trials(), study, RUNNING)}[6]
    assert paused.controls[:2] == ["resume", "stop"]
    study.tell(4, state=TrialState.PRUNED)  # it ended before its requests applied: they never will
    view = {v.number: v for v in trial_views(study.get_trials(), study, RUNNING)}[4]
    assert view.pending == [] and view.controls == []


def test_the_optuna_dashboard_note_says_paused_where_optuna_says_running(study):
    note = trial_note(TrialRecord(study.get_trials()[6]))
    assert note.startswith("### rfopt: trial 6, paused, 1 of 2 chunks")
    assert "Optuna keeps it RUNNING" in note and "Fail Trial" in note
    assert trial_note(TrialRecord(study.get_trials()[2])).startswith("### rfopt: trial 2, stopped")
