from rfopt.engine.planning.scheduler import LiveTrial, completed_rungs, next_trial


def _live(number, done, key="m", units=4, paused=False):
    return LiveTrial(number=number, units_done=done, num_units=units, model_key=key, paused=paused)


def test_least_progress_first_then_lowest_number():
    live = [_live(0, 2), _live(1, 1), _live(2, 1)]
    assert next_trial(live).number == 1


def test_ties_prefer_a_trial_whose_base_model_is_resident():
    live = [_live(0, 1, key="other"), _live(1, 1, key="here")]
    assert next_trial(live, resident={"here"}).number == 1
    assert next_trial(live, resident=set()).number == 0


def test_paused_and_finished_trials_are_not_scheduled():
    live = [_live(0, 0, paused=True), _live(1, 4), _live(2, 3)]
    assert next_trial(live).number == 2
    assert next_trial([_live(0, 4)]) is None


def test_a_rung_is_complete_when_every_unpaused_live_trial_reported_it():
    assert completed_rungs([_live(0, 2), _live(1, 1)]) == 1
    assert completed_rungs([_live(0, 2), _live(1, 0, paused=True)]) == 2
