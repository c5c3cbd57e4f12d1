"""The demo shows real improvement: a recorded ``rfopt run arithmetic`` (``make demo``; `bench/record_demo.py` records
it) recommends an adapter whose completions did not collapse and that beats the base model, evaluated with no
adapter on the same eval set, on the objective and on correctness; and the recording is of the demo as it is now."""

import json
from pathlib import Path

import optuna
import pytest
from optuna.distributions import json_to_distribution
from optuna.trial import TrialState, create_trial

from rfopt.config.studyfile import load_spec
from rfopt.reports.display import format_recommendation
from rfopt.reports.outcome import outcome
from rfopt.storage.schema import TrialRecord
from rfopt.training.diversity import collapse_reason

RECORD = Path(__file__).resolve().parents[1] / "recorded" / "demo-arithmetic.json"
STUDY_FILE = Path(__file__).resolve().parents[2] / "rfopt" / "studies" / "arithmetic.py"


@pytest.fixture(scope="module")
def recorded():
    data = json.loads(RECORD.read_text())
    study = optuna.create_study(direction=data["study"]["direction"])
    for key, value in data["study"]["system_attrs"].items():
        study._storage.set_study_system_attr(study._study_id, key, value)
    for t in data["trials"]:
        study.add_trial(create_trial(
            state=TrialState[t["state"]], value=t["value"] if t["state"] == "COMPLETE" else None, params=t["params"],
            distributions={k: json_to_distribution(v) for k, v in t["distributions"].items()},
            intermediate_values={int(k): v for k, v in t["intermediate_values"].items()},
            system_attrs=t["system_attrs"]))
    return study, data


def test_the_recording_is_of_the_demo_as_it_is_now(recorded):
    from rfopt.studies import arithmetic

    study, _ = recorded
    spec = load_spec(STUDY_FILE)
    configs = spec.search_space()
    assert len(study.trials) == len(configs)
    for trial, config in zip(study.trials, configs):
        assert trial.params["learning_rate"] == pytest.approx(config.args.learning_rate)
        assert trial.params.get("lora_r", config.peft_config.r) == config.peft_config.r
    (baseline,) = outcome(study).baselines.values()
    assert baseline.metrics["diversity/prompts"] == arithmetic.N_EVAL
    assert max(len(t.intermediate_values) for t in study.trials) == arithmetic.NUM_CHUNKS


def test_the_demo_recommends_an_adapter_that_did_not_collapse_and_beats_the_base_model_on_reward_and_correctness(
        recorded):
    study, data = recorded
    found = outcome(study)
    recommended = found.recommendation
    (baseline,) = found.baselines.values()
    assert recommended is not None and recommended.baseline == baseline
    assert collapse_reason(recommended.metrics) is None
    assert recommended.value > baseline.value
    assert recommended.metrics["rewards/correctness/mean"] > baseline.metrics["rewards/correctness/mean"]
    samples = TrialRecord(study.trials[recommended.trial]).samples()[recommended.unit]
    said = "\n".join(format_recommendation(found, samples))
    assert f"it beats the base model with no adapter on reward: {recommended.value:.4f} vs {baseline.value:.4f}" in said
    # Said at a glance for the correctness reward: 4 of the 32 eval questions right, the base model none.
    assert said.splitlines()[1] == ("it answers 4 of 32 eval questions right (the base model: 0), as the correctness "
                                    "reward judges them")
    # What the run printed said the same.
    assert said.splitlines()[2] in data["run"]["output"]
    assert found.lines()[0].startswith(f"take this adapter: trial {recommended.trial} after chunk "
                                       f"{recommended.unit + 1}, reward {recommended.value:.4f} (+")
    assert "smollm2 with no adapter: the baseline" in data["run"]["output"]
