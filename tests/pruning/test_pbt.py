"""Population-based training (rfopt.PopulationBasedTraining): at exploit steps the bottom of the population is
replaced by warm clones of the top, whose explored values stay within the study's distributions; the plan depends
on the stored values and the seed only (not on the order trials reported in); a study SIGKILLed in the middle of
an exploit step, and one run by two workers, end exactly as one uninterrupted process ends."""

import math
import random
from pathlib import Path

import optuna
import pytest
from crashkit import TESTS, assert_same_study, env, rfopt_command, run, trials
from optuna.distributions import (
    CategoricalDistribution,
    FloatDistribution,
    IntDistribution,
)
from optuna.trial import TrialState
from rfopt_testkit import lora_config, prompts_dataset, trial_config

import rfopt
from rfopt.storage.checkpoints import CheckpointStore
from rfopt.pruning import Member, load_decision, perturb, plan_step
from rfopt.storage.schema import TrialRecord, load_pbt_step, study_record

TRAIN, EVAL = prompts_dataset(12), prompts_dataset(2, "E")
PBT_STUDY = TESTS / "tiny_pbt_study.py"


# ---------------------------------------------------------------------- bad input
@pytest.mark.parametrize("kwargs, says", [
    ({"quantile": 0.0}, "quantile=0.0"),
    ({"quantile": 0.6}, "(0, 0.5]"),
    ({"interval": 0}, "interval=0"),
    ({"factors": (0.8, 0.0)}, "factors=(0.8, 0.0)"),
    ({"factors": ()}, "one or more finite numbers > 0"),
    ({"resample_probability": 1.5}, "resample_probability=1.5"),
    ({"explore": "random"}, "explore='random'"),
    ({"max_units": 0}, "max_units=0"),
    ({"params": "learning_rate"}, "a list of Optuna param names"),
])
def test_bad_settings_are_refused_naming_the_setting(kwargs, says):
    with pytest.raises(ValueError, match="PopulationBasedTraining") as info:
        rfopt.PopulationBasedTraining(**kwargs)
    assert says in str(info.value)


def test_every_bad_setting_is_named_at_once():
    with pytest.raises(ValueError) as info:
        rfopt.PopulationBasedTraining(interval=0, quantile=2)
    assert "interval=0" in str(info.value) and "quantile=2" in str(info.value)


def test_it_is_the_studys_rung_policy_and_not_an_optuna_pruner(storage):
    """It replaces trials with clones, which only rfopt can do: it takes the rung-policy slot, and the Optuna study
    holds a pruner that prunes nothing (it used to pose as a BasePruner whose prune() raised)."""
    pbt = rfopt.PopulationBasedTraining(interval=2)
    assert not isinstance(pbt, optuna.pruners.BasePruner)
    study = rfopt.create_study(study_name="slot", storage=storage, pruner=pbt)
    assert study.pruner is pbt and isinstance(study.optuna.pruner, optuna.pruners.NopPruner)
    loaded = rfopt.load_study("slot", storage, pruner=pbt)
    assert loaded.pruner is pbt and isinstance(loaded.optuna.pruner, optuna.pruners.NopPruner)
    trial = study.optuna.ask()
    trial.report(1.0, 0)
    assert not trial.should_prune()
    halving = optuna.pruners.SuccessiveHalvingPruner()
    assert rfopt.create_study(study_name="halving", storage=storage, pruner=halving).optuna.pruner is halving


def test_given_to_optuna_create_study_it_refuses_naming_rfopt_create_study(storage):
    """Issue 35: ``optuna.create_study(pruner=PopulationBasedTraining())`` was accepted, and each trial failed with
    ``AttributeError: ... no attribute 'prune'``; an rfopt.Study made over such a study takes it as its rung policy."""
    from rfopt.errors import PopulationBasedTrainingMisplaced

    pbt = rfopt.PopulationBasedTraining(interval=2)
    plain = optuna.create_study(study_name="plain", storage=storage, pruner=pbt)
    trial = plain.ask()
    trial.report(1.0, 0)
    with pytest.raises(PopulationBasedTrainingMisplaced, match=r"trial 0: .*rfopt.create_study\(pruner=\.\.\.\)"):
        trial.should_prune()
    wrapped = rfopt.Study(plain)
    assert wrapped.pruner is pbt and isinstance(plain.pruner, optuna.pruners.NopPruner)
    assert not trial.should_prune()


def test_a_list_study_with_nothing_to_explore_is_refused_before_training(scripted, tiny_model, storage):
    study = rfopt.create_study(study_name="same", storage=storage, pruner=rfopt.PopulationBasedTraining())
    same = [trial_config(tiny_model), trial_config(tiny_model)]
    with pytest.raises(ValueError, match="varies none"):
        study.optimize(same, TRAIN, EVAL, num_chunks=3, show_progress_bar=False)
    assert study.optuna.trials == []

    study = rfopt.create_study(study_name="beta", storage=storage,
                               pruner=rfopt.PopulationBasedTraining(params=["beta"]))
    configs = rfopt.grid(trial_config(tiny_model), learning_rate=[1e-3, 5e-3])
    with pytest.raises(ValueError, match=r"does not vary \['beta'\].*searched params are \['learning_rate'\]"):
        study.optimize(configs, TRAIN, EVAL, num_chunks=3, show_progress_bar=False)
    assert study.optuna.trials == []


def _space(model, lora_r=(4,)):
    def space(trial):
        return trial_config(model, learning_rate=trial.suggest_float("learning_rate", 1e-3, 1e-2, log=True),
                            peft=lora_config(r=trial.suggest_categorical("lora_r", list(lora_r))))
    return space


def _untouched(study, storage):
    """Nothing of the refused call is stored: no rfopt attrs, no trials, no checkpoint folder."""
    assert study.optuna.user_attrs == {} and study.optuna.trials == []
    assert not (Path(storage.removeprefix("sqlite:///")).parent / "rfopt-checkpoints").exists()


@pytest.mark.parametrize("pbt, space, says", [
    (dict(params=["learning_rate", "learnin_rate"]), "function",
     r"PopulationBasedTraining\(params=\['learning_rate', 'learnin_rate'\]\): the search space function suggests "
     r"no param \['learnin_rate'\] \(in 8 calls on scratch trials it suggested \['learning_rate', 'lora_r'\]\)"),
    (dict(params=["learning_rate", "lora_r"]), "function (lora_r 4 or 8)",
     r"params=\['learning_rate', 'lora_r'\]\): a warm-started clone cannot change \['lora_r'\] \(it loads its "
     r"parent's weights, so the model and the adapter's shape stay"),
    (dict(params=["lora_r"]), "list (lora_r 4 or 8)", r"a warm-started clone cannot change \['lora_r'\]"),
    (dict(), "list (lora_r 4 or 8)", r"PopulationBasedTraining: no searched param \(\['lora_r'\]\) can change in a "
     r"warm-started clone .* so every clone would copy its parent"),
    (dict(interval=3), "function",
     r"PopulationBasedTraining\(interval=3\): the trials train 3 chunks \(3 chunks a pass over the train set\), "
     r"and it acts every 3 chunks but never after a trial's last, so it would never act. Give interval <= 2, or more "
     r"chunks \(num_chunks\)"),
    (dict(interval=5), "list", r"interval=5\): the trials train 3 chunks"),
])
def test_population_based_training_that_would_never_act_or_only_copy_is_refused_before_anything_is_stored(
        scripted, tiny_model, storage, pbt, space, says):
    study = rfopt.create_study(study_name="refused", storage=storage, pruner=rfopt.PopulationBasedTraining(**pbt))
    if space.startswith("function"):
        chosen = _space(tiny_model, (4, 8) if "lora_r" in space else (4,))
        kwargs = dict(n_trials=4, max_concurrent=4)
    else:
        chosen = (rfopt.grid(trial_config(tiny_model), lora_r=[4, 8]) if "lora_r" in space
                  else rfopt.grid(trial_config(tiny_model), learning_rate=[1e-3, 5e-3]))
        kwargs = {}
    with pytest.raises(ValueError, match=says):
        study.optimize(chosen, TRAIN, EVAL, num_chunks=3, show_progress_bar=False, **kwargs)
    _untouched(study, storage)


# ---------------------------------------------------------------------- exploring within the distributions
@pytest.mark.parametrize("dist, value", [
    (FloatDistribution(0.001, 0.01), 0.009),
    (FloatDistribution(1e-5, 1e-2, log=True), 1e-5),
    (FloatDistribution(0.0, 1.0, step=0.1), 0.3),
    (IntDistribution(1, 10), 9),
    (IntDistribution(2, 64, log=True), 2),
    (CategoricalDistribution(["constant", "linear", "cosine"]), "linear"),
])
def test_explored_values_stay_within_the_distribution(dist, value):
    pbt = rfopt.PopulationBasedTraining(resample_probability=0.3)
    rng = random.Random(0)
    seen = {perturb(value, dist, pbt, rng) for _ in range(300)}
    for new in seen:
        if isinstance(dist, CategoricalDistribution):
            assert new in dist.choices
        else:
            assert dist.low <= new <= dist.high and isinstance(new, type(value))
            if dist.step:
                assert math.isclose(round((new - dist.low) / dist.step) * dist.step + dist.low, new)
    assert len(seen) > 1


def test_a_perturbed_number_is_the_value_times_a_factor_clipped_to_the_range():
    pbt = rfopt.PopulationBasedTraining(factors=(0.8, 1.25), resample_probability=0.0)
    rng = random.Random(1)
    dist = FloatDistribution(0.001, 0.01)
    assert {perturb(0.004, dist, pbt, rng) for _ in range(50)} == {0.004 * 0.8, 0.004 * 1.25}
    assert {perturb(0.01, dist, pbt, rng) for _ in range(50)} == {0.008, 0.01}
    assert {perturb("linear", CategoricalDistribution(["constant", "linear"]), pbt, rng) for _ in range(20)} == {
        "linear"}


# ---------------------------------------------------------------------- order independence
def _reported(order: list[int], values: list[float]) -> optuna.Study:
    study = optuna.create_study(direction="maximize", sampler=optuna.samplers.RandomSampler(seed=0))
    dist = {"learning_rate": FloatDistribution(1e-3, 1e-1, log=True)}
    made = [study.ask(dist) for _ in values]
    for number in order:
        made[number].report(values[number], 0)
    return study


def _plan(study: optuna.Study, pbt) -> tuple:
    members = [Member(t, t.intermediate_values[0], 3) for t in study.get_trials()]
    plan = plan_step(pbt, study, 0, 4, members, len(members), {m.number: ["learning_rate"] for m in members})
    return plan.ranking, [(r.trial, r.parent, r.params) for r in plan.replacements], plan.reasons


def test_the_plan_is_the_same_whichever_order_the_members_reported_in():
    values = [0.3, 0.9, 0.5, 0.9, 0.1, 0.7, 0.2, 0.6]  # a tie (trials 1 and 3): the lower number ranks first
    pbt = rfopt.PopulationBasedTraining(seed=7)
    first = _plan(_reported(list(range(8)), values), pbt)
    shuffled = list(range(8))
    random.Random(3).shuffle(shuffled)
    assert _plan(_reported(shuffled, values), pbt) == first
    ranking, replacements, reasons = first
    assert ranking == (1, 3, 5, 7, 2, 0, 6, 4)
    assert [r[0] for r in replacements] == [6, 4] and {r[1] for r in replacements} <= {1, 3}
    assert reasons[4].startswith("replaced by a clone of trial ") and reasons[1].startswith("kept: rank 1 of 8")


def test_a_unit_budget_stops_the_bottom_gently_first_then_replaces_within_those_left():
    study = _reported(list(range(8)), [0.3, 0.9, 0.5, 0.8, 0.1, 0.7, 0.2, 0.6])  # ranking 1, 3, 5, 7, 2, 0, 6, 4
    members = [Member(t, t.intermediate_values[0], 4) for t in study.get_trials()]
    explorable = {m.number: ["learning_rate"] for m in members}
    # 6 chunks, exploit steps after chunks 1 and 3; at chunk 1, 8 x 2 spent + 8 x 4 left = 48 > 36. The 20 units
    # left must cover those that go on through chunks 2-3, and (halved) 4-5: 6 members cost 2 x 6 + 2 x 3 = 18,
    # 7 cost 2 x 7 + 2 x 4 = 22 > 20: 6 go on, 2 stop (not the 4 that finishing all of them within 36 would stop).
    pbt = rfopt.PopulationBasedTraining(interval=2, max_units=36, seed=0)
    plan = plan_step(pbt, study, 1, 6, members, 16, explorable)
    assert plan.stopped == (6, 4) and "over max_units=36, so 6 go on" in plan.reasons[4]
    # Of the 6 that go on, the bottom quantile (1) is replaced by a clone of the top one.
    assert [(r.trial, r.parent) for r in plan.replacements] == [(0, 1)]
    assert plan.reasons[1].startswith("kept: rank 1 of 8")
    # A budget that finishing the population meets: no stop, the quantile of all 8 replaced.
    plan = plan_step(rfopt.PopulationBasedTraining(interval=2, max_units=48, seed=0), study, 1, 6, members, 16, {})
    assert plan.stopped == () and [r.trial for r in plan.replacements] == [6, 4]
    # A budget that even one member cannot meet: one goes on (and is not replaced).
    plan = plan_step(rfopt.PopulationBasedTraining(interval=2, max_units=17, seed=0), study, 1, 6, members, 16, {})
    assert plan.stopped == (3, 5, 7, 2, 0, 6, 4) and plan.replacements == ()


def test_a_unit_budget_is_met_exactly_when_every_step_cuts_by_it():
    """The sweep shape of bench/pbt.py's `steady`: 12 members, 8 chunks, interval 2, max_units=48 (half of 96)."""
    pbt = rfopt.PopulationBasedTraining(interval=2, max_units=48, seed=0)
    study = _reported(list(range(12)), [i / 12 for i in range(12)])
    population, spent, sizes = list(study.get_trials()), 0, []
    for step in range(8):
        spent += len(population)
        if not pbt.is_exploit_step(step, 8):
            continue
        members = [Member(t, 0.5 + (t.number % 5) / 10, 8 - step - 1) for t in population]
        plan = plan_step(pbt, study, step, 8, members, spent, {})
        population = [t for t in population if t.number not in plan.stopped]  # a replacement keeps the slot
        sizes.append((len(population), len(plan.replacements)))
    assert sizes == [(6, 1), (4, 1), (2, 1)]  # after chunks 2, 4, 6: 6 go on, then 4, then 2; one clone each time
    assert spent == 12 * 2 + 6 * 2 + 4 * 2 + 2 * 2 == 48


# ---------------------------------------------------------------------- clones that cloning would refuse
def test_an_exploration_whose_clone_would_be_refused_is_drawn_again_then_the_parents_own_values_are_taken():
    study = _reported([0, 1, 2, 3], [0.9, 0.1, 0.5, 0.4])  # trial 0 is the top, trial 1 the bottom
    members = [Member(t, t.intermediate_values[0], 3) for t in study.get_trials()]
    explorable = {m.number: ["learning_rate"] for m in members}
    parent_lr = study.trials[0].params["learning_rate"]
    pbt = rfopt.PopulationBasedTraining(factors=(0.8, 1.25), resample_probability=0.0, seed=0)
    asked = []

    def lower_refused(parent, params):  # a clone whose learning rate went down would be refused
        asked.append(params["learning_rate"])
        return "lower" if params["learning_rate"] < parent.trial.params["learning_rate"] else None

    plan = plan_step(pbt, study, 0, 4, members, 4, explorable, refusal=lower_refused)
    (replacement,) = plan.replacements
    assert replacement.params["learning_rate"] == pytest.approx(min(0.1, parent_lr * 1.25))
    assert asked[-1] == replacement.params["learning_rate"] and all(a < parent_lr for a in asked[:-1])

    def changed_refused(parent, params):  # only the parent's own values would be accepted
        return None if params == parent.trial.params else "args.learning_rate: changed"

    plan = plan_step(pbt, study, 0, 4, members, 4, explorable, refusal=changed_refused)
    (replacement,) = plan.replacements
    assert replacement.params == study.trials[0].params and replacement.changed == {}
    assert plan.reasons[1].endswith("the clone has no value changed (every exploration drawn would have been "
                                    "refused: args.learning_rate: changed)")

    plan = plan_step(pbt, study, 0, 4, members, 4, explorable, refusal=lambda parent, params: "never")
    assert plan.replacements == ()
    assert plan.reasons[1] == ("kept: rank 4 of 4 at chunk 1 (bottom of the population), but no clone of trial 0 "
                               "can be made: never")


def test_a_clone_whose_learning_rate_would_be_0_is_explored_again_and_made(scripted, tiny_model, storage, caplog):
    """A clone of a parent with a learning rate of 0, perturbed by a factor, keeps 0: cloning refuses it. The plan
    draws again (a resampled rate), so each exploit step's clone is made."""
    scripted.values = {0: [0.9] * 3, 1: [0.1] * 3, 2: [0.2] * 3, 3: [0.3] * 3}
    configs = rfopt.grid(trial_config(tiny_model), learning_rate=[0.0, 2e-3, 5e-3, 1e-2])
    pbt = rfopt.PopulationBasedTraining(interval=1, resample_probability=0.5, seed=5)
    study = rfopt.create_study(study_name="zero", storage=storage, pruner=pbt)
    study.optimize(configs, TRAIN, EVAL, num_chunks=3, show_progress_bar=False)
    assert "could not be made" not in caplog.text
    clones = [t for t in study.optuna.trials if TrialRecord(t).lineage is not None]
    assert len(clones) == 2  # one at each exploit step (after chunks 1 and 2)
    first = next(c for c in clones if TrialRecord(c).lineage.parent == 0)
    assert first.params["learning_rate"] > 0 and study.trial_config(first.number).args.learning_rate > 0
    assert all(study.trial_config(c.number).args.learning_rate > 0 for c in clones)
    assert all(load_pbt_step(study.optuna, step).replacements for step in (0, 1))


def test_a_parent_none_of_whose_clones_can_be_made_leaves_the_bottom_member_training(scripted, tiny_model, storage,
                                                                                        caplog):
    """Without resampling, every clone of a parent with a learning rate of 0 has a learning rate of 0: the plan holds
    no clone, and the bottom member goes on, its decision saying why."""
    scripted.values = {0: [0.9] * 3, 1: [0.1] * 3, 2: [0.2] * 3, 3: [0.3] * 3}
    configs = rfopt.grid(trial_config(tiny_model), learning_rate=[0.0, 2e-3, 5e-3, 1e-2])
    pbt = rfopt.PopulationBasedTraining(interval=1, resample_probability=0.0, seed=0)
    study = rfopt.create_study(study_name="zero", storage=storage, pruner=pbt)
    study.optimize(configs, TRAIN, EVAL, num_chunks=3, show_progress_bar=False)
    assert "could not be made" not in caplog.text
    assert [t.state for t in study.optuna.trials] == [TrialState.COMPLETE] * 4  # no clone; nobody replaced
    for step in (0, 1):
        assert load_pbt_step(study.optuna, step).replacements == ()
        decision = load_decision(study.optuna.trials[1], step)
        assert not decision.prune
        assert decision.reason == (f"kept: rank 4 of 4 at chunk {step + 1} (bottom of the population), but no clone "
                                   "of trial 0 can be made: clone of trial 0: args.learning_rate: 0.0; give a number > "
                                   "0 (a clone with a learning rate of 0.0 trains nothing)")


# ---------------------------------------------------------------------- replicates
def test_replicates_are_never_ranked_replaced_or_cloned_by_the_population(scripted, tiny_model, storage):
    """Replicates confirmed mid-study reach an exploit step beside the members: one config's runs across seeds are
    not members (the bottom one replaced by a clone of the top one would lose the seed variance they measure)."""
    configs = rfopt.grid(trial_config(tiny_model), learning_rate=[2e-3, 5e-3, 1e-2, 3e-3])
    # The members' values are their scripted w (trial 2, lr 1e-2, leads); the replicates (trials 4 and 5) would be
    # the bottom and the top of the population.
    scripted.values = {4: [0.0] * 4, 5: [9.0] * 4}
    pbt = rfopt.PopulationBasedTraining(interval=2, resample_probability=0.0, seed=0)
    study = rfopt.create_study(study_name="confirmed", storage=storage, pruner=pbt)
    reported = []

    def confirm_after_chunk_1(number, step, value):
        reported.append((number, step))
        if sum(s == 0 for _, s in reported) == 4 and len(reported) == 4:  # every member's first chunk
            assert study.confirm(top=1, seeds=2) == [4, 5]

    study.optimize(configs, TRAIN, EVAL, num_chunks=4, max_concurrent=6, show_progress_bar=False,
                   on_unit=confirm_after_chunk_1)
    trials = study.optuna.trials
    assert [TrialRecord(trials[n]).replicate.of for n in (4, 5)] == [2, 2]
    plan = load_pbt_step(study.optuna, 1)  # the one exploit step (after chunk 2)
    assert set(plan.ranking) == {0, 1, 2, 3}
    assert [(r.trial, r.parent) for r in plan.replacements] == [(0, 2)]
    for number, seed in ((4, 8), (5, 9)):  # the original's seed is 7
        assert trials[number].state == TrialState.COMPLETE and sorted(trials[number].intermediate_values) == [0, 1, 2, 3]
        decision = load_decision(trials[number], 1)
        assert not decision.prune and decision.reason == (
            f"kept: a replicate of trial 2 (seed {seed}) runs to its end, outside the population: never replaced, "
            "never cloned (study.confirm)")
    assert all(TrialRecord(t).lineage.parent not in (4, 5) for t in trials
               if TrialRecord(t).lineage is not None and TrialRecord(t).replicate is None)


# ---------------------------------------------------------------------- a real study
def test_the_bottom_member_is_replaced_by_a_warm_clone_of_the_top_starting_from_its_weights(
        scripted, tiny_model, storage):
    configs = rfopt.grid(trial_config(tiny_model), learning_rate=[2e-3, 5e-3, 1e-2, 3e-3])
    pbt = rfopt.PopulationBasedTraining(interval=1, quantile=0.25, resample_probability=0.0, seed=0)
    study = rfopt.create_study(study_name="pbt", storage=storage, pruner=pbt)
    at_step_0 = {}

    def keep_weights(number, step, value):  # each trial's weights after chunk 0, before anything trains further
        if step == 0:
            store = CheckpointStore(study_record(study.optuna).checkpoint_dir)
            at_step_0[number] = {k: v.clone() for k, v in store.load(number).weights.items()}

    study.optimize(configs, TRAIN, EVAL, num_chunks=3, show_progress_bar=False, on_unit=keep_weights)

    all_trials = study.optuna.trials
    plan = load_pbt_step(study.optuna, 0)
    (replacement,) = plan.replacements
    replaced, parent = all_trials[replacement.trial], all_trials[replacement.parent]
    assert replacement.trial == plan.ranking[-1] and replacement.parent == plan.ranking[0]
    assert replaced.state == TrialState.PRUNED and list(replaced.intermediate_values) == [0]
    decision = load_decision(replaced, 0)
    assert decision.prune and decision.reason.startswith(f"replaced by a clone of trial {parent.number}")
    assert decision.pruner == "PopulationBasedTraining"
    assert load_decision(parent, 0).reason.startswith("kept: rank 1 of 4")

    clone = next(t for t in all_trials if TrialRecord(t).lineage and TrialRecord(t).lineage.parent == parent.number
                 and TrialRecord(t).lineage.start_unit == 1)
    lineage = TrialRecord(clone).lineage
    assert lineage.warm_start and lineage.by == "PopulationBasedTraining"
    assert min(clone.intermediate_values) == 1  # it reports at the parent's step numbers onward
    dist = parent.distributions["learning_rate"]
    new = clone.params["learning_rate"]
    assert dist.low <= new <= dist.high and clone.distributions["learning_rate"] == dist
    assert new in {max(dist.low, min(dist.high, parent.params["learning_rate"] * f)) for f in (0.8, 1.25)}
    assert study.trial_config(clone.number).args.learning_rate == new
    # Its first chunk starts from the parent's weights after chunk 0.
    store = CheckpointStore(study_record(study.optuna).checkpoint_dir)
    warm = store.load_warm_start(clone.number, lineage.token)
    assert warm.keys() == at_step_0[parent.number].keys()
    assert all(warm[k].equal(at_step_0[parent.number][k]) for k in warm)
    assert not all(warm[k].equal(at_step_0[replaced.number][k]) for k in warm)

    # The population stays 4 live trials; every member ends COMPLETE or replaced; the leaderboard says why.
    assert sum(t.state == TrialState.COMPLETE for t in all_trials) == 4
    assert f"replaced by a clone of trial {parent.number}" in study.leaderboard_text()


class Interrupted(Exception):
    pass


def test_explore_sampler_in_a_list_study_plans_the_same_values_after_an_interruption(scripted, tiny_model, tmp_path):
    """A list study's sampler draws nothing but PBT's values, so a study resumed by a new process (a new, seeded
    sampler) before a step is planned plans it as the uninterrupted study did."""
    configs = rfopt.grid(trial_config(tiny_model), learning_rate=[2e-3, 5e-3, 1e-2, 3e-3])

    def study(name):
        pbt = rfopt.PopulationBasedTraining(interval=1, explore="sampler", seed=0)
        return rfopt.create_study(study_name=name, storage=f"sqlite:///{tmp_path / name}.db", pruner=pbt,
                                  sampler=optuna.samplers.TPESampler(seed=0), load_if_exists=True)

    def run(study, on_unit=None):
        study.optimize(configs, TRAIN, EVAL, num_chunks=3, show_progress_bar=False, on_unit=on_unit)

    def interrupt(number, step, value):
        if step == 1:  # the step-0 plan is carried out; nobody has planned step 1
            raise Interrupted

    run(study("whole"))
    with pytest.raises(Interrupted):
        run(study("resumed"), interrupt)
    assert load_pbt_step(study("resumed").optuna, 1) is None
    run(study("resumed"))
    whole, resumed = study("whole").optuna.trials, study("resumed").optuna.trials
    assert [(t.state, t.params, t.intermediate_values) for t in resumed] == [
        (t.state, t.params, t.intermediate_values) for t in whole]
    assert load_pbt_step(study("resumed").optuna, 1).replacements  # a step-1 clone was planned, by the sampler
    assert all(r.changed for r in load_pbt_step(study("whole").optuna, 1).replacements)


# ---------------------------------------------------------------------- crash and workers
@pytest.fixture(scope="module")
def pbt_reference(tiny_model, tmp_path_factory):
    where = tmp_path_factory.mktemp("pbt-reference")
    storage = f"sqlite:///{where / 'ref.db'}"
    command = rfopt_command("run", str(PBT_STUDY), "--storage", storage, "--no-progress", "--checkpoint-dir",
                            str(where / "ck"))
    assert run(command, where, env(tiny_model, RFOPT_TEST_TRIALS=4), where / "log") == 0, (where / "log").read_text()
    assert sum(t.number >= 4 for t in trials(storage)) == 2  # a clone after each of the first two chunks
    return storage, where / "ck"


@pytest.mark.e2e
@pytest.mark.subprocess
@pytest.mark.slow
def test_sigkill_in_an_exploit_step_then_rerun_reproduces_the_uninterrupted_study(pbt_reference, tiny_model,
                                                                                 tmp_path):
    storage = f"sqlite:///{tmp_path / 'crash.db'}"
    command = rfopt_command("run", str(PBT_STUDY), "--storage", storage, "--no-progress", "--checkpoint-dir",
                            str(tmp_path / "ck"))
    # Dies once the first step's plan is stored, then once a clone's warm-start weights are written but the clone is
    # not yet in storage, then once the clones are made before any decision.
    for point in ("pbt-planned:1", "clone-weights-saved:1", "pbt-cloned:1"):
        code = run(command, tmp_path, env(tiny_model, RFOPT_TEST_TRIALS=4, RFOPT_CRASH_AT=point), tmp_path / "log")
        assert code == -9, (tmp_path / "log").read_text()[-3000:]
    assert run(command, tmp_path, env(tiny_model, RFOPT_TEST_TRIALS=4), tmp_path / "log") == 0
    assert all(t.state != TrialState.RUNNING for t in trials(storage))
    assert_same_study(*pbt_reference, storage, tmp_path / "ck")


@pytest.fixture(scope="module")
def pbt_sequential_reference(tiny_model, tmp_path_factory):
    """The PBT study run to the end by one `rfopt run` whose gangs take their members' steps one after another."""
    where = tmp_path_factory.mktemp("pbt-sequential-reference")
    storage = f"sqlite:///{where / 'ref.db'}"
    command = rfopt_command("run", str(PBT_STUDY), "--storage", storage, "--no-progress", "--checkpoint-dir",
                            str(where / "ck"), "--gang-training", "sequential")
    assert run(command, where, env(tiny_model, RFOPT_TEST_TRIALS=4), where / "log") == 0, (where / "log").read_text()
    return storage, where / "ck"


@pytest.mark.e2e
@pytest.mark.subprocess
@pytest.mark.slow
def test_two_workers_run_a_pbt_study_as_one_process_does(pbt_sequential_reference, tiny_model, tmp_path):
    # With several workers, which trials share a gang depends on timing: only the sequential mode's values do not
    # depend on who shares a gang (a batched step's rounding does; README, "Gangs").
    storage = f"sqlite:///{tmp_path / 'workers.db'}"
    command = rfopt_command("worker", str(PBT_STUDY), "--storage", storage, "--checkpoint-dir", str(tmp_path / "ck"),
                            "--devices", "cpu,cpu", "--gang-training", "sequential")
    assert run(command, tmp_path, env(tiny_model, RFOPT_TEST_TRIALS=4), tmp_path / "log") == 0, (
        (tmp_path / "log").read_text()[-3000:])
    assert_same_study(*pbt_sequential_reference, storage, tmp_path / "ck")
