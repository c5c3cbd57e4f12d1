"""Replicates: `study.confirm(top, seeds)` trains the best configs again with new seeds as new Optuna trials linked to
their original, through the same engine (resumed after a crash like any trial), never pruned among themselves; the
answer then reads across seeds: each config's mean of its runs' best values with its between-seed standard error, the
winner or a tie within seed variance, and the checkpoint to take from the winning config's runs."""

import math

import optuna
import pytest
from optuna.trial import TrialState

import rfopt
from crashkit import Died
from rfopt.errors import OpError
from rfopt.reports.replicates import groups
from rfopt.storage.schema import TrialRecord
from rfopt_testkit import prompts_dataset, trial_config

LEARNING_RATES = [1e-3, 5e-3, 1e-2]


def _configs(model):
    return rfopt.grid(trial_config(model), learning_rate=LEARNING_RATES)


def _study(model, storage, checkpoints, pruner=None):
    return rfopt.create_study(study_name="seeds", storage=storage, checkpoint_dir=checkpoints, load_if_exists=True,
                              pruner=pruner)


def _run(study, model, on_unit=None):
    study.optimize(_configs(model), prompts_dataset(8), prompts_dataset(2, "E"), num_chunks=2,
                   show_progress_bar=False, on_unit=on_unit)


def _sweep(scripted, model, storage, checkpoints, pruner=None):
    """Three configs, one seed each: trial 1 best (0.9), trial 0 next (0.5), trial 2 last (0.3). Their replicates
    (trials 3-6) score as `scripted.values` says: trial 0's config better than trial 1's across seeds."""
    scripted.values = {0: [0.2, 0.5], 1: [0.4, 0.9], 2: [0.1, 0.3],
                       3: [0.1, 0.7], 4: [0.3, 0.6], 5: [0.05, 0.2], 6: [0.1, 0.25]}
    study = _study(model, storage, checkpoints, pruner)
    _run(study, model)
    return study


def test_confirm_enqueues_the_best_configs_again_with_new_seeds_and_optunas_params(scripted, tiny_model, tmp_path):
    study = _sweep(scripted, tiny_model, f"sqlite:///{tmp_path / 's.db'}", tmp_path / "ck")
    assert study.confirm(top=2, seeds=2) == [3, 4, 5, 6]
    trials = study.trials
    first = rfopt.TrialConfig.from_json(TrialRecord(trials[0]).config_json).args.seed  # the test configs' seed
    for number, (of, seed) in zip([3, 4, 5, 6], [(1, first + 1), (1, first + 2), (0, first + 1), (0, first + 2)]):
        record = TrialRecord(trials[number])
        assert trials[number].state == TrialState.WAITING
        assert (record.replicate.of, record.replicate.seed, record.replicate.prune) == (of, seed, False)
        assert trials[number].params == trials[of].params  # to Optuna, the same config
        assert trials[number].distributions == trials[of].distributions
        config = rfopt.TrialConfig.from_json(record.config_json)
        original = rfopt.TrialConfig.from_json(TrialRecord(trials[of]).config_json)
        assert config.args.seed == seed and original.args.seed == first
        assert config.args.learning_rate == original.args.learning_rate
    # Asked again it makes only what is missing; more seeds top each config up.
    assert study.confirm(top=2, seeds=2) == []
    assert study.confirm(top=2, seeds=3) == [7, 8]
    assert [TrialRecord(study.trials[n]).replicate.seed for n in (7, 8)] == [first + 3, first + 3]


def test_confirm_refuses_a_count_below_one_and_writes_nothing(scripted, tiny_model, tmp_path):
    study = _sweep(scripted, tiny_model, f"sqlite:///{tmp_path / 's.db'}", tmp_path / "ck")
    for top, seeds, named in [(0, 2, "top=0"), (2, 0, "seeds=0"), (2, True, "seeds=True")]:
        with pytest.raises(OpError, match=f"confirm: {named}; give a whole number of at least 1"):
            study.confirm(top=top, seeds=seeds)
    assert len(study.trials) == 3


def test_a_study_that_has_not_run_cannot_be_confirmed(tiny_model, tmp_path):
    study = _study(tiny_model, f"sqlite:///{tmp_path / 's.db'}", tmp_path / "ck")
    with pytest.raises(OpError, match="has not run yet"):
        study.confirm(top=1, seeds=1)


def test_replicates_train_to_the_end_and_are_never_pruned_among_themselves(scripted, tiny_model, tmp_path):
    pruner = optuna.pruners.SuccessiveHalvingPruner(min_resource=1, reduction_factor=2)
    study = _sweep(scripted, tiny_model, f"sqlite:///{tmp_path / 's.db'}", tmp_path / "ck", pruner)
    assert study.trials[2].state == TrialState.PRUNED  # the sweep's pruner works on the sweep
    study.confirm(top=2, seeds=2)
    _run(study, tiny_model)
    for trial in study.trials[3:]:
        assert trial.state == TrialState.COMPLETE and sorted(trial.intermediate_values) == [0, 1]
        assert "runs to its end, never pruned" in TrialRecord(trial).attrs["rfopt:pruning:0"]["reason"]


def test_replicates_resume_after_a_kill_and_end_as_an_uninterrupted_run(scripted, dying, tiny_model, tmp_path):
    reference = _sweep(scripted, tiny_model, f"sqlite:///{tmp_path / 'ref.db'}", tmp_path / "ref")
    reference.confirm(top=2, seeds=2)
    _run(reference, tiny_model)

    study = _sweep(scripted, tiny_model, f"sqlite:///{tmp_path / 'crash.db'}", tmp_path / "crash")
    study.confirm(top=2, seeds=2)
    dying.at("unit-committed:3")  # the third replicate unit is committed, then the process dies
    with pytest.raises(Died):
        _run(study, tiny_model)
    assert TrialState.RUNNING in [t.state for t in study.trials[3:]]
    committed = sum(len(t.intermediate_values) for t in study.trials[3:])
    assert committed == 3
    dying.at(None)
    resumed = []
    _run(study, tiny_model, on_unit=lambda number, step, value: resumed.append((number, step)))
    assert len(resumed) == 8 - committed and len(set(resumed)) == len(resumed)  # no replicate unit trained twice
    for ref, got in zip(reference.trials, study.trials, strict=True):
        assert got.state == ref.state and got.intermediate_values == ref.intermediate_values
        assert TrialRecord(got).replicate == TrialRecord(ref).replicate


def test_a_replicate_groups_summary_is_what_its_stored_trials_say(scripted, tiny_model, tmp_path):
    study = _sweep(scripted, tiny_model, f"sqlite:///{tmp_path / 's.db'}", tmp_path / "ck")
    study.confirm(top=2, seeds=2)
    _run(study, tiny_model)
    found = study.replicates()
    assert [g.original for g in found] == [1, 0]  # best values 0.9, 0.7, 0.6 against 0.5, 0.2, 0.25
    for group in found:
        runs = [study.trials[group.original]] + [t for t in study.trials
                                                 if (r := TrialRecord(t).replicate) and r.of == group.original]
        best = [TrialRecord(t).best.value for t in runs]
        assert [r.trial for r in group.runs] == [t.number for t in runs]
        assert [r.value for r in group.runs] == best
        assert group.mean == pytest.approx(sum(best) / len(best))
        spread = sum((v - group.mean) ** 2 for v in best) / (len(best) - 1)
        assert group.stderr == pytest.approx(math.sqrt(spread / len(best)))
        first = group.runs[0].seed
        assert first == rfopt.TrialConfig.from_json(TrialRecord(runs[0]).config_json).args.seed
        assert [r.seed for r in group.runs] == [first, first + 1, first + 2] and group.done
    assert found == groups(study.trials, maximize=True)


def _replicated(scripted, tiny_model, tmp_path, values):
    study = _sweep(scripted, tiny_model, f"sqlite:///{tmp_path / 's.db'}", tmp_path / "ck")
    scripted.values.update(values)
    study.confirm(top=2, seeds=2)  # trials 3, 4 run trial 1's config again; trials 5, 6 trial 0's
    _run(study, tiny_model)
    return study


def test_a_config_that_wins_across_seeds_is_named_with_its_margin(scripted, tiny_model, tmp_path):
    study = _replicated(scripted, tiny_model, tmp_path, {3: [0.3, 0.85], 4: [0.3, 0.88], 5: [0.2, 0.52],
                                                         6: [0.2, 0.48]})
    found = study.outcome()
    assert (found.seeds.winner.original, found.seeds.runner_up.original) == (1, 0)
    assert not found.seeds.within_seed_noise
    assert found.seeds.difference == pytest.approx((0.9 + 0.85 + 0.88) / 3 - 0.5)
    assert found.seeds.stderr == pytest.approx(math.hypot(found.seeds.winner.stderr, found.seeds.runner_up.stderr))
    assert found.lines()[:3] == [
        "trial 1 over 3 seeds: reward 0.8767 ± 0.015 (trial 1 0.9, trial 3 0.85, trial 4 0.88)",
        "trial 0 over 3 seeds: reward 0.5 ± 0.012 (trial 0 0.5, trial 5 0.52, trial 6 0.48)",
        "across seeds, the config of trial 1 wins: reward 0.8767 ± 0.015 over 3 seeds against trial 0's 0.5 ± 0.012 "
        "over 3 (gap 0.377 ± 0.019, more than its seed variance)"]
    assert found.recommendation.trial == 1


def test_a_lucky_seed_is_found_out_and_the_checkpoint_comes_from_the_leading_configs_runs(scripted, tiny_model,
                                                                                          tmp_path):
    # Trial 1's config won the sweep with 0.9 and scores 0.2 and 0.25 with other seeds; trial 0's scores about 0.5.
    study = _replicated(scripted, tiny_model, tmp_path, {3: [0.1, 0.2], 4: [0.1, 0.25], 5: [0.05, 0.45],
                                                         6: [0.1, 0.55]})
    found = study.outcome()
    assert found.seeds.winner.original == 0 and found.seeds.within_seed_noise
    assert found.lines()[:3] == [  # as the README shows it
        "trial 0 over 3 seeds: reward 0.5 ± 0.029 (trial 0 0.5, trial 5 0.45, trial 6 0.55)",
        "trial 1 over 3 seeds: reward 0.45 ± 0.23 (trial 1 0.9, trial 3 0.2, trial 4 0.25)",
        "across seeds, the finalists are within their seed variance: the config of trial 0 leads, reward 0.5 ± 0.029 "
        "over 3 seeds against trial 1's 0.45 ± 0.23 over 3 (gap 0.05 ± 0.23); either could win another run"]
    assert found.recommendation.trial == 6  # the best checkpoint of trial 0's config's runs (0.55), not trial 1's 0.9
    assert "take this adapter: trial 6 after chunk 2" in study.leaderboard_text()


def test_rfopt_confirm_enqueues_the_replicates_and_says_how_they_train(scripted, tiny_model, tmp_path, capsys):
    from rfopt.cli import main

    storage = f"sqlite:///{tmp_path / 's.db'}"
    _sweep(scripted, tiny_model, storage, tmp_path / "ck")
    assert main(["confirm", "--study", "seeds", "--storage", storage, "--top", "1", "--seeds", "2"]) == 0
    out = capsys.readouterr().out.splitlines()
    seed = rfopt.TrialConfig.from_json(TrialRecord(rfopt.load_study("seeds", storage).trials[1]).config_json).args.seed
    assert out[:2] == [f"trial 3: replicate of trial 1 with seed {seed + 1} enqueued",
                       f"trial 4: replicate of trial 1 with seed {seed + 2} enqueued"]
    assert "rerun the study's `rfopt run` command" in out[2]
    assert main(["confirm", "--study", "seeds", "--storage", storage, "--top", "1", "--seeds", "2"]) == 0
    assert capsys.readouterr().out.startswith("nothing to enqueue: each of the 1 best configs has its 2 replicates")
    with pytest.raises(SystemExit, match="2"):  # a count below 1 is a bad argument
        main(["confirm", "--study", "seeds", "--storage", storage, "--top", "0"])
