"""The unit's plan (`rfopt.engine.planning.plan`): who trains together, on which rollout backend, and why a trial trains alone,
decided in one place and carried out as one value."""

import dataclasses
import logging

import pytest
import rfopt
from rfopt.engine.planning.plan import BATCHED, EXACT, Planner, UnitPlan, planned_gang_size
from rfopt.engine.planning.scheduler import LiveTrial
from rfopt.storage import schema
from rfopt_testkit import prompts_dataset, reward_len, reward_vowels, trial_config


@dataclasses.dataclass
class _Trial:
    """What the planner reads of a live trial."""

    number: int
    config: object
    committed: int = 0

    def candidate(self) -> LiveTrial:
        return LiveTrial(self.number, self.committed, 4, self.config.model_key)


def _full(tiny_model):
    return rfopt.TrialConfig(model=str(tiny_model), reward_funcs=[reward_len, reward_vowels],
                             args=trial_config(tiny_model).args, peft_config=None)


def _gate(trial):
    return "it asks for beams" if trial.number == 2 else None


def test_a_gang_is_one_plan_on_the_batched_backend_with_its_record_id(tiny_model):
    trials = [_Trial(n, trial_config(tiny_model)) for n in range(3)]
    plan = Planner(4, gate=_gate).plan(trials)
    assert plan.members == (0, 1) and plan.backend == BATCHED and plan.alone_because is None
    assert plan.in_gang and len(plan.gang_id) == 12 and plan.training == "batched"  # the default


def test_a_gangs_plan_carries_the_runs_gang_training_and_a_trial_alone_trains_as_plain_trl(tiny_model):
    trials = [_Trial(n, trial_config(tiny_model)) for n in range(3)]
    planner = Planner(4, gate=_gate, training="batched")
    assert planner.plan(trials).training == "batched"
    assert planner.plan([trials[2]]).training == "sequential"  # refused a batch: alone, its own steps
    assert Planner(1, gate=_gate, training="batched").plan(trials).training == "sequential"


def test_a_trial_the_backend_refuses_trains_alone_with_its_reason_said_once(tiny_model, caplog):
    planner = Planner(4, gate=_gate)
    alone = [_Trial(2, trial_config(tiny_model)), _Trial(3, trial_config(tiny_model), committed=1)]
    with caplog.at_level(logging.WARNING, logger="rfopt"):
        plans = [planner.plan(alone) for _ in range(3)]
    assert plans[0] == UnitPlan(members=(2,), backend=EXACT, alone_because="it asks for beams")
    assert all(p == plans[0] for p in plans)
    said = [r.getMessage() for r in caplog.records if "trains alone" in r.getMessage()]
    assert said == ["trial 2 trains alone, on the exact backend (its rollouts cannot share a batch): it asks for "
                    "beams"]


def test_a_trial_whose_backend_cannot_be_built_is_planned_alone_so_that_its_own_unit_fails(tiny_model, caplog):
    def gate(trial):
        raise OSError("no such model")

    with caplog.at_level(logging.WARNING, logger="rfopt"):
        plan = Planner(4, gate=gate).plan([_Trial(0, trial_config(tiny_model))])
    assert plan.members == (0,) and plan.backend == EXACT and "no such model" in plan.alone_because
    assert "trains alone" not in caplog.text  # not a routing: its unit fails, with the model's own error


def test_one_at_a_time_asks_no_backend_and_plans_no_gang(tiny_model):
    asked = []
    planner = Planner(1, gate=lambda trial: asked.append(trial.number))
    plan = planner.plan([_Trial(n, trial_config(tiny_model)) for n in range(3)])
    assert plan == UnitPlan(members=(0,)) and not plan.in_gang and asked == []


def test_the_memory_fit_and_a_stored_gang_shape_the_plan(tiny_model):
    trials = [_Trial(n, trial_config(tiny_model)) for n in range(4)]
    planner = Planner(4, gate=lambda trial: None)
    assert planner.plan(trials, fit=lambda numbers, training: (numbers[:3], training)).members == (0, 1, 2)
    # A batched gang that fits only taking its members' steps one after another is planned so.
    batched = Planner(4, gate=lambda trial: None, training="batched")
    assert batched.plan(trials).training == "batched"
    asked = []

    def sequential_fits(numbers, training):
        asked.append(training)
        return numbers, "sequential"

    plan = batched.plan(trials, fit=sequential_fits)
    assert asked == ["batched"] and (plan.members, plan.training) == ((0, 1, 2, 3), "sequential")
    assert planner.plan(trials, stored={0: (0, 3)}).members == (0, 3)
    assert planner.plan([]) is None


def test_a_plan_names_a_backend_kind_and_keeps_the_members_held():
    with pytest.raises(ValueError, match="'vllm'"):
        UnitPlan(members=(1,), backend="vllm")
    plan = UnitPlan(members=(1, 2, 3), backend=BATCHED, gang_id="x")
    assert plan.keeping([3, 1]).members == (1, 3)


def test_the_gang_size_is_the_runs_or_the_default_and_one_with_a_single_run_tracker(caplog):
    assert planned_gang_size(3) == 3
    assert planned_gang_size(None) == 4 and planned_gang_size(None, data_parallel=True) == 1
    with caplog.at_level(logging.WARNING, logger="rfopt"):
        assert planned_gang_size(4, single_run_trackers=["comet_ml"]) == 1
    assert "gang_size 1 instead of 4" in caplog.text


def test_a_study_says_once_per_trial_which_trials_train_alone_and_why(scripted, tiny_model, tmp_path, caplog):
    configs = [trial_config(tiny_model), trial_config(tiny_model, learning_rate=5e-3), _full(tiny_model)]
    study = rfopt.create_study(study_name="plan", storage=f"sqlite:///{tmp_path / 'plan.db'}", num_chunks=2,
                               checkpoint_dir=tmp_path / "ck")
    with caplog.at_level(logging.WARNING, logger="rfopt"):
        study.optimize(configs, prompts_dataset(8), prompts_dataset(2, "E"), gang_size=4, show_progress_bar=False)
    said = [r.getMessage() for r in caplog.records if "trains alone" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("trial 2 trains alone") and "full fine-tuning" in said[0]
    assert schema.gang_plan(study.trials[0], 1).numbers == (0, 1)
    assert schema.gang_plan(study.trials[2], 0) is None


def test_each_unit_is_evaluated_through_the_backend_its_plan_chose_with_rfopts_evaluation(scripted, tiny_model,
                                                                                          tmp_path):
    """A gang's members are evaluated together through the batched backend they trained on, a trial alone through the
    exact one: whatever backend a plan names (a vLLM one, later) serves evaluation too. What is stored is rfopt's
    evaluation of the backend's completions: each reward's mean, and the per-prompt scores behind the value."""
    configs = [trial_config(tiny_model), trial_config(tiny_model, learning_rate=5e-3), _full(tiny_model)]
    study = rfopt.create_study(study_name="evaluated", storage=f"sqlite:///{tmp_path / 'plan.db'}", num_chunks=2,
                               checkpoint_dir=tmp_path / "ck")
    study.optimize(configs, prompts_dataset(8), prompts_dataset(2, "E"), gang_size=4, show_progress_bar=False)
    assert [t.state.name for t in study.trials] == ["COMPLETE"] * 3
    evaluations = [(kind, [r.adapter for r in requests]) for kind, requests in scripted.generated
                   if all("generation_config" not in r.generate_kwargs for r in requests)]  # not a gang's rollout
    assert sorted(evaluations) == [(BATCHED, ["trial-0", "trial-1"])] * 2 + [(EXACT, [None])] * 2
    for trial in study.trials:
        for unit in schema.TrialRecord(trial).unit_metrics():
            scores = unit.scores_of("reward")
            assert len(scores) == 2 and sum(scores) / 2 == pytest.approx(trial.intermediate_values[unit.unit])
            assert unit.scores_of("reward_len") and "rewards/reward_len/mean" in unit.eval


def test_a_unit_evaluated_again_after_a_crash_goes_through_the_backend_its_plan_chose(scripted, dying, tiny_model,
                                                                                      tmp_path):
    """A gang's checkpoints were durable when the process died, before their reports reached storage, and the reports
    kept with the checkpoints are gone: the rerun forms the gang again and evaluates each member through the batched
    backend it trained on, as its unit would have been evaluated."""
    from crashkit import Died

    configs = [trial_config(tiny_model), trial_config(tiny_model, learning_rate=5e-3)]
    storage, checkpoints = f"sqlite:///{tmp_path / 'plan.db'}", tmp_path / "ck"

    def run():
        study = rfopt.create_study(study_name="again", storage=storage, num_chunks=2, checkpoint_dir=checkpoints,
                                   load_if_exists=True)
        study.optimize(configs, prompts_dataset(8), prompts_dataset(2, "E"), gang_size=2, show_progress_bar=False)
        return study

    dying.at("checkpoint-saved:1")
    with pytest.raises(Died):
        run()
    reports = sorted(checkpoints.glob("trial-*/unit-*/report.json"))
    assert len(reports) == 2
    for report in reports:
        report.unlink()
    dying.at(None)
    scripted.generated.clear()
    study = run()
    assert [t.state.name for t in study.trials] == ["COMPLETE"] * 2
    evaluations = [(kind, [r.adapter for r in requests]) for kind, requests in scripted.generated
                   if all("generation_config" not in r.generate_kwargs for r in requests)]
    assert evaluations[:2] == [(BATCHED, ["trial-0"]), (BATCHED, ["trial-1"])]  # each member's unit, again
    assert evaluations[2:] == [(BATCHED, ["trial-0", "trial-1"])]  # the gang's second unit
