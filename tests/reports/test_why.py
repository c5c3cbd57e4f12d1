""""Why it wins" that explains: log axes for params spanning orders of magnitude, no trial axis, one colour per trial,
Optuna's param importances, the leader against the runner-up reward by reward with the weights, and trials'
completions compared after the same chunk."""

from __future__ import annotations

import re

import optuna
import pytest
from optuna.distributions import FloatDistribution
from rfopt_testkit import trial_config

from rfopt.dashboard.leaderboard import _render_versus
from rfopt.dashboard.samples import render_side_by_side
from rfopt.reports.charts import colour, comparison
from rfopt.reports.lead import lead, param_importance
from rfopt.reports.parallel import parallel_svg
from rfopt.storage import schema
from rfopt.storage.database import open_storage

RATES = (1e-4, 5e-3, 2e-2, 1e-3)


@pytest.fixture
def study(storage):
    """Four trials of a list (learning rates on a linear range, as a list's params are), two chunks each but trial 3
    (one): values rise with the learning rate; per-prompt scores of two reward functions, weighted 1 and 0.5."""
    study = optuna.create_study(study_name="w", storage=open_storage(storage), direction="maximize")
    for number, rate in enumerate(RATES):
        study.enqueue_trial({"learning_rate": rate})
        trial = study.ask()
        trial.suggest_float("learning_rate", 0.0, 0.05)  # a list's param: a linear range
        ref = schema.TrialRef.of(study, trial)
        config = trial_config("tiny-model-not-loaded-here", learning_rate=rate, reward_weights=[1.0, 0.5])
        schema.write_config(ref, config.to_json())
        for unit in range(1 if number == 3 else 2):
            length = [min(1.0, 0.2 + 40 * rate + 0.1 * (i % 3)) for i in range(6)]
            vowels = [0.5] * 6
            total = [a + 0.5 * b for a, b in zip(length, vowels)]
            value = sum(total) / 6
            schema.write_unit(ref, unit, {"chunk": unit, "eval": {
                "reward": value, "rewards/reward_len/mean": sum(length) / 6, "rewards/reward_vowels/mean": 0.5},
                "scores": {"reward": total, "reward_len": length, "reward_vowels": vowels}},
                [{"prompt": f"E{i}", "completion": "x" * (unit + number), "reward": total[i], "reward_len": length[i],
                  "reward_vowels": 0.5} for i in range(2)])
            trial.report(value, step=unit)
    return study


def test_parallel_coordinates_have_no_trial_axis_one_colour_per_trial_and_a_log_axis_where_values_span_decades(study):
    svg = parallel_svg(study.get_trials(), study.direction, "reward")
    heads = re.findall(r'font-weight="bold">([^<]+)</text>', svg)
    assert heads == ["learning_rate", "chunks trained", "reward"]  # no "trial" axis
    for number in range(4):
        assert re.search(rf'data-trial="{number}"[^>]*stroke="{re.escape(colour(number))}"', svg)
    # 1e-4 .. 2e-2 on a log axis: 1e-3 sits between the two ends, not squashed at the bottom beside 1e-4.
    ys = {int(n): float(y) for n, y in re.findall(r'data-trial="(\d)"[^>]*points="[\d.]+,([\d.]+)', svg)}
    bottom, top = ys[0], ys[2]
    assert 0.3 < (bottom - ys[3]) / (bottom - top) < 0.7
    params = next(f for f in comparison(study.get_trials(), study.direction, "reward").figures if f.key == "params")
    assert params.layout["xaxis"]["type"] == "log"


def test_param_importance_is_optunas_over_the_values_after_the_deepest_chunk_three_trials_reached(study):
    found = param_importance(study.get_trials(), study.direction)
    assert found.step == 1 and found.trials == 3  # trial 3 trained one chunk only
    assert found.importances == pytest.approx({"learning_rate": 1.0})
    figure = next(f for f in comparison(study.get_trials(), study.direction, "reward").figures
                  if f.key == "importance")
    assert figure.section == "why" and "get_param_importances" in figure.title


def test_the_leader_against_the_runner_up_reward_by_reward_with_the_weights(study):
    ahead = lead(study.get_trials(), study.direction, "reward")
    assert (ahead.best, ahead.runner_up) == (2, 1)
    html = _render_versus(study.get_trials(), ahead, "reward")
    rows = re.findall(r"<tr[^>]*><td>([^<]+)</td><td>× ([\d.]+)</td>", html)
    assert rows == [("reward_len", "1"), ("reward_vowels", "0.5")]
    assert "<tr class='lead-from'><td>reward_len</td>" in html and "the lead comes mostly from <b>reward_len</b>" in html
    assert "eval means after chunk 2" in html


def test_completions_are_compared_after_the_same_chunk(study):
    html = render_side_by_side(study.get_trials(), study.direction)
    first = html[html.index("<section class='prompt' data-prompt='0'>"):html.index("</section>")]
    assert set(re.findall(r"<td>(\d)</td><td><pre>", first)) == {"2"}  # every row after chunk 2
    assert sorted(re.findall(r"<tr data-trial='(\d)'>", first)) == ["0", "1", "2"]  # trial 3 has no chunk 2
    earlier = render_side_by_side(study.get_trials(), study.direction, unit=0, url="/x")
    assert "<option value='0' selected>after chunk 1 (4 trials)</option>" in earlier
    assert len(re.findall(r"<tr data-trial='(\d)'>", earlier.split("</section>")[0])) == 4


def test_a_log_scale_param_gets_a_log_axis_whatever_its_span():
    from rfopt.reports.charts import log_scale

    assert log_scale([1e-3, 2e-3], FloatDistribution(1e-4, 1e-2, log=True))
    assert not log_scale([1e-3, 2e-3], FloatDistribution(0.0, 1.0))
    assert not log_scale([0.0, 0.05], FloatDistribution(0.0, 1.0))  # zero: no log axis


# ---------------------------------------------------------------------- noise, said for the answer too
@pytest.fixture
def close(storage):
    """Three COMPLETE trials scored on the same 8 eval prompts: trial 0 answers one prompt more than trials 1 and 2
    (0.5 against 0.375): a lead within noise (paired gap 0.125 ± 0.125)."""
    study = optuna.create_study(study_name="close", storage=open_storage(storage), direction="maximize")
    schema.write_settings(study, {"objective": "reward"})
    scores = ([1, 0, 1, 0, 1, 0, 1, 0], [1, 0, 1, 0, 1, 0, 0, 0], [1, 0, 1, 0, 0, 0, 1, 0])
    for rate, row in zip((1e-4, 1e-3, 1e-2), scores):
        trial = study.ask()
        trial.suggest_float("learning_rate", 1e-5, 1e-1, log=True)
        ref = schema.TrialRef.of(study, trial)
        schema.write_config(ref, trial_config("tiny-model-not-loaded-here", learning_rate=rate).to_json())
        value = sum(row) / len(row)
        schema.write_unit(ref, 0, {"chunk": 0, "eval": {"reward": value}, "scores": {"reward": [float(x) for x in row]}},
                          [], [])
        trial.report(value, step=0)
        study.tell(trial, value)
    return study


def test_the_importance_chart_says_when_its_trials_are_all_within_noise(close, study):
    found = param_importance(close.get_trials(), close.direction, "reward")
    assert found.within_noise and found.caution().startswith(
        "its 3 trials' values are all within noise of each other (best against worst: paired gap 0.125 ± 0.12")
    figure = next(f for f in comparison(close.get_trials(), close.direction, "reward").figures if f.key == "importance")
    assert "caution: its 3 trials' values are all within noise" in figure.layout["title"]["text"]
    assert figure.data[0]["meta"]["within_noise"] is True
    # Trials far apart (the other study: values rise with the learning rate, beyond noise): no caution.
    apart = param_importance(study.get_trials(), study.direction, "reward")
    assert not apart.within_noise and apart.caution() is None


def test_rfopt_status_and_the_terminal_leaderboard_mark_a_tie_within_noise(close, storage):
    import rfopt
    from rfopt.reports.status import summaries

    [summary] = summaries(open_storage(storage))
    assert "; best 0.5000 (trial 0; a tie: within noise of trial 1);" in summary.line()
    text = rfopt.load_study(study_name="close", storage=storage).leaderboard_text()
    rows = {line.split()[1]: line for line in text.splitlines() if line[:1].isdigit()}
    assert "= tie with trial 1 (within noise: paired gap 0.125 ± 0.12 over 8 eval prompts)" in rows["0"]
    assert "= tie with trial 0 (within noise" in rows["1"] and "tie" not in rows["2"]
