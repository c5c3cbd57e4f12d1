"""A clone form people can read: the searched params first, under the leaderboard's names; the trial's set fields
next; everything else folded; a warm start labelled with the checkpoint the clone will use; the first form served at
once (TRL's import is done when the dashboard starts)."""

from __future__ import annotations

import threading
import time

from rfopt_testkit import trial_config

from rfopt.config.form import form_fields
from rfopt.engine.trials.clones import Clone
from rfopt.storage import schema


def test_the_searched_params_come_first_under_the_leaderboards_names():
    config = trial_config("tiny-model-not-loaded-here", learning_rate=0.01)
    fields = form_fields(config.to_json(), {"lora_r": 4, "learning_rate": 0.01})
    first = [(f.label, f.name, f.group) for f in fields[:2]]
    assert first == [("lora_r", "peft_config.r", "searched"), ("learning_rate", "learning_rate", "searched")]
    groups = [f.group for f in fields]
    assert groups == sorted(groups, key=["searched", "set", "peft_config", "trial", "more"].index)
    shown = [f.name for f in fields if f.group != "more"]
    # What the trial sets (the test kit's batch shape, seed, ...), not what TRL fills in by itself.
    assert "per_device_train_batch_size" in shown and "seed" in shown
    assert not {"accelerator_config", "debug", "dataloader_pin_memory", "pad_to_multiple_of"} & set(shown)
    assert len(shown) < 20 < len(fields)


def test_a_warm_clone_says_which_checkpoint_it_starts_from():
    made = Clone(7, (), {"learning_rate": 2e-6}, start_unit=2)
    assert made.describe(3, True) == ("trial 7: clone of trial 3 with learning_rate=2e-06 enqueued from its parent's "
                                      "checkpoint after chunk 2")
    assert "after chunk 2" in made.describe_check(3, True) and "checkpoint" not in made.describe(3, False)


def test_the_dashboard_warms_up_the_clone_form_when_it_starts(tmp_path):
    import optuna

    from rfopt.dashboard import make_server
    from rfopt.dashboard.actions import clone_form

    storage = f"sqlite:///{tmp_path / 'w.db'}"
    study = optuna.create_study(study_name="w", storage=storage)
    server = make_server(storage, port=0)
    try:
        for warming in [t for t in threading.enumerate() if t.name == "rfopt-warm-up"]:  # unless done already
            warming.join(timeout=120)
        trial = study.ask()
        schema.write_config(schema.TrialRef.of(study, trial), trial_config("tiny-model-not-loaded-here").to_json())
        started = time.perf_counter()
        form = clone_form(study, study.trials[0])
        assert time.perf_counter() - started < 1.0 and form["fields"]
    finally:
        server.server_close()
