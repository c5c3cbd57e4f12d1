"""What a trial keeps for people to look at: TRL's per-step logs, samples with each reward's score, and a clone
described by its own params and progress."""

import math

import optuna
import pytest
from rfopt_testkit import prompts_dataset, trial_config

import rfopt
from rfopt.storage.schema import TrialRecord

TRAIN, EVAL = prompts_dataset(8), prompts_dataset(2, "E")


def _study_with_warm_clone(tiny_model, storage):
    """Two trials of a grid over learning_rate, 4 chunks of 2 steps each; after trial 0's first chunk it is cloned
    warm with a learning_rate outside the grid and a lora_dropout no trial searched."""
    study = rfopt.create_study(study_name="steps", storage=storage, num_chunks=4)
    clones = []

    def on_unit(number, step, value):
        if (number, step) == (0, 0):
            clones.append(study.clone_trial(0, {"learning_rate": 2e-2, "lora_dropout": 0.1}, warm_start=True))

    configs = rfopt.grid(trial_config(tiny_model), learning_rate=[1e-3, 5e-3])
    study.optimize(configs, TRAIN, EVAL, show_progress_bar=False, on_unit=on_unit)
    return study, clones[0]


@pytest.fixture(scope="module")
def study_with_warm_clone(tiny_model, tmp_path_factory):
    """`_study_with_warm_clone` on scripted runners (tests/scripted_runner.py)."""
    import scripted_runner

    with pytest.MonkeyPatch.context() as patch:
        scripted_runner.use(patch)
        return _study_with_warm_clone(tiny_model, f"sqlite:///{tmp_path_factory.mktemp('steps') / 'study.db'}")


@pytest.mark.slow
@pytest.mark.e2e
def test_step_metrics_are_trls_logs_of_every_optimizer_step_under_trls_names(tiny_model, storage):
    study, _ = _study_with_warm_clone(tiny_model, storage)
    steps = TrialRecord(study.optuna.trials[1]).step_metrics()
    assert [row["step"] for row in steps] == list(range(1, 9))
    for name in ("reward", "reward_std", "rewards/reward_len/mean", "rewards/reward_vowels/mean", "loss",
                 "learning_rate", "entropy", "completions/mean_length"):
        assert all(name in row for row in steps), name
    assert "kl" not in steps[0]  # beta=0: TRL logs no KL
    assert all(isinstance(v, (int, float)) and math.isfinite(v) for row in steps for v in row.values())


def test_step_metrics_keep_every_optimizer_step_on_the_trials_axis(study_with_warm_clone):
    study, _ = study_with_warm_clone
    record = TrialRecord(study.optuna.trials[1])
    steps = record.step_metrics()
    assert [row["step"] for row in steps] == list(range(1, 9))  # the global step, continuing across chunks
    assert [row["unit"] for row in steps] == [0, 0, 1, 1, 2, 2, 3, 3]
    chunks = {m.unit: m.chunk for m in record.unit_metrics()}
    assert all(row["chunk"] == chunks[row["unit"]] for row in steps)
    for name in ("reward", "rewards/reward_len/mean", "rewards/reward_vowels/mean", "loss", "learning_rate"):
        assert all(name in row for row in steps), name
    assert all(isinstance(v, (int, float)) and math.isfinite(v) for row in steps for v in row.values())
    # The chunk means stored before are the means of these steps.
    for metrics in record.unit_metrics():
        rows = [row for row in steps if row["unit"] == metrics.unit]
        assert metrics.train["reward"] == pytest.approx(sum(r["reward"] for r in rows) / len(rows))
    # Kept out of optuna-dashboard's user-attr table: one system attr per unit, by column.
    trial = study.optuna.trials[1]
    assert not [k for k in trial.user_attrs if k.startswith("rfopt:")]
    assert sorted(k for k in trial.system_attrs if k.startswith("rfopt:steps:")) == [
        f"rfopt:steps:{u:04d}" for u in range(4)]


def test_warm_clone_inherits_its_parents_steps_and_continues_their_axis(study_with_warm_clone):
    study, clone = study_with_warm_clone
    parent = TrialRecord(study.optuna.trials[0]).step_metrics()
    steps = TrialRecord(study.optuna.trials[clone]).step_metrics()
    assert [row["step"] for row in steps] == list(range(1, 9))
    assert steps[:2] == [row for row in parent if row["unit"] == 0]  # the parent's first chunk, as it was
    assert [row["unit"] for row in steps] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert steps[2]["learning_rate"] != parent[2]["learning_rate"]  # its own from the second chunk on


def test_warm_clone_progress_counts_the_chunks_it_inherited(study_with_warm_clone):
    study, clone = study_with_warm_clone
    trial = study.optuna.trials[clone]
    assert trial.state == optuna.trial.TrialState.COMPLETE
    assert sorted(trial.intermediate_values) == [1, 2, 3]  # it trained 3 chunks itself
    row = next(r for r in study.leaderboard() if r.number == clone)
    assert row.chunks_done == 4 == TrialRecord(trial).committed


def test_clone_params_describe_the_clone_in_optuna(study_with_warm_clone):
    study, clone = study_with_warm_clone
    trial = study.optuna.trials[clone]
    assert trial.params["learning_rate"] == 2e-2  # outside the grid's range: the range widens
    assert trial.distributions["learning_rate"].high == 2e-2
    assert trial.params["lora_dropout"] == 0.1  # a field no trial searched becomes a param of its own
    frame = study.optuna.trials_dataframe()
    assert frame.loc[frame.number == clone, "params_learning_rate"].item() == 2e-2
    assert frame.loc[frame.number == 0, "params_learning_rate"].item() == 1e-3


def test_samples_carry_prompt_completion_total_and_each_rewards_score(study_with_warm_clone):
    study, _ = study_with_warm_clone
    samples = TrialRecord(study.optuna.trials[0]).samples()
    assert sorted(samples) == [0, 1, 2, 3]
    for sample in samples[3]:
        assert {"prompt", "completion", "reward", "reward_len", "reward_vowels"} <= set(sample)
        assert sample["reward"] == pytest.approx(sample["reward_len"] + sample["reward_vowels"])


def test_trial_note_shows_values_metrics_and_scored_samples_in_plain_optuna_dashboard(study_with_warm_clone):
    from optuna_dashboard import get_note, save_note

    from rfopt.engine.outputs.artifacts import NOTE_END, publish_note
    from rfopt.compat import trial_id_of

    study, _ = study_with_warm_clone
    frozen = study.optuna.trials[1]
    handle = optuna.trial.Trial(study.optuna, trial_id_of(frozen))
    note = get_note(handle)  # written after each chunk by the run
    lines = note.splitlines()
    assert lines[0] == "### rfopt: trial 1, complete, 4 of 4 chunks"  # written again when it ended
    header = next(line for line in lines if line.startswith("| step | after chunk | reward (value) |"))
    assert "rewards/reward_len/mean" in header
    rows = [line for line in lines if line.startswith("| 3 | 4 | ")]
    assert rows and f"{frozen.intermediate_values[3]:.4g}" in rows[0]
    assert "**Samples after chunk 4** (step 3;" in note
    assert f"[This study on rfopt's page](/rfopt/studies/{study.optuna._study_id})" in note
    assert "| prompt | completion | reward | reward_len | reward_vowels |" in note
    sample = TrialRecord(frozen).samples()[3][0]
    assert f"| {sample['reward']:.4g} | {sample['reward_len']:.4g} | {sample['reward_vowels']:.4g} |" in note
    # A person's words below rfopt's part outlive the next update.
    save_note(handle, note + "my own words\n")
    publish_note(handle)
    again = get_note(handle)
    assert again.startswith("### rfopt: trial 1") and again.count(NOTE_END) == 1
    assert again.endswith("my own words\n")


def test_clone_params_hold_every_overridden_value_a_new_choice_under_an_alternate_param():
    from optuna.distributions import (
        CategoricalDistribution,
        FloatDistribution,
        IntDistribution,
    )

    from rfopt.engine.trials.clones import _clone_params

    study = optuna.create_study()
    study.add_trial(optuna.trial.create_trial(
        params={"optim": "adamw_torch", "learning_rate": 1e-3},
        distributions={"optim": CategoricalDistribution(["adamw_torch", "adafactor"]),
                       "learning_rate": FloatDistribution(1e-4, 1e-2, log=True)}, value=0.5))
    parent = study.trials[0]
    notes = []
    params, distributions = _clone_params(study, parent, {"optim": "sgd", "args.learning_rate": 0.5, "lora_r": 8,
                                                          "reward_funcs": ["a.b"]}, notes)
    # A categorical cannot gain a choice: the parent's value leaves, an alternate param holds the clone's, loudly.
    assert "optim" not in params
    assert params["optim#2"] == "sgd" and distributions["optim#2"] == CategoricalDistribution(["sgd"])
    assert notes == ["optim='sgd' cannot be a value of the study's param 'optim' (choices ['adamw_torch', "
                     "'adafactor']): Optuna fixes a param's kind, and a categorical's choices, once trials have it. "
                     "The clone's Optuna params hold it as 'optim#2'; its config, study.best_config, the leaderboard "
                     "and the dashboard's page say what it trains"]
    assert params["learning_rate"] == 0.5 and distributions["learning_rate"] == FloatDistribution(1e-4, 0.5, log=True)
    assert params["lora_r"] == 8 and distributions["lora_r"] == IntDistribution(8, 8)
    assert params["rewards"] == '["a.b"]' and isinstance(distributions["rewards"], CategoricalDistribution)
    study.add_trial(optuna.trial.create_trial(state=optuna.trial.TrialState.WAITING, params=params,
                                              distributions=distributions))  # Optuna takes them beside the parent's
    # A second clone with a third optimizer: optim#2 cannot hold it either, optim#3 does; one with sgd reuses optim#2.
    again, _ = _clone_params(study, parent, {"optim": "lion"})
    assert again["optim#3"] == "lion" and "optim#2" not in again and "optim" not in again
    same, _ = _clone_params(study, parent, {"optim": "sgd"})
    assert same["optim#2"] == "sgd"
