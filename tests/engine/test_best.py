"""The best checkpoint of every trial is kept: the adapter of its best-valued chunk (not only its last), recorded with
its chunk and value, through pruning and crashes."""

from pathlib import Path

import optuna
import pytest
from safetensors.torch import load_file

import rfopt
from crashkit import env, events, read_bytes, run, run_command, trials
from rfopt.storage.schema import TrialRecord
from rfopt_testkit import prompts_dataset, reward_len, reward_peak, trial_config


def _same(a, b):
    import torch

    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.e2e
def test_a_trial_whose_last_chunk_scores_worse_keeps_its_best_chunks_adapter_bit_for_bit(tiny_model, storage, tmp_path):
    study = rfopt.create_study(study_name="best", storage=storage, checkpoint_dir=tmp_path / "ck")
    after = {}

    def on_unit(number, unit, value):  # the weights each unit committed (its checkpoint is the latest now)
        after[unit] = study.checkpoints.load(number).weights

    # reward_peak pays 10 at the evaluation after chunk 2 only; training keeps changing the weights after it.
    config = trial_config(tiny_model, rewards=(reward_len, reward_peak))
    study.optimize([config], prompts_dataset(8), prompts_dataset(4, prefix="E"), num_chunks=4, on_unit=on_unit,
                   show_progress_bar=False)
    (trial,) = study.trials
    values = trial.intermediate_values
    assert max(values, key=values.get) == 1 and values[3] < values[1] and trial.value == values[3]

    best = TrialRecord(trial).best
    assert (best.unit, best.chunk, best.value) == (1, 1, values[1])
    kept = load_file(str(Path(best.location) / "adapter_model.safetensors"))
    assert _same(kept, after[1]) and not _same(kept, after[3])
    final = load_file(str(Path(TrialRecord(trial).adapter) / "adapter_model.safetensors"))
    assert _same(final, after[3])
    assert Path(best.location) == Path(study.checkpoints.best_dir(0))
    assert (Path(best.location) / "adapter_config.json").is_file() and (Path(best.location) / "tokenizer.json").is_file()

    # What export_best writes: that chunk's adapter, bit for bit; Optuna's best trial's (best_trial=True): the last.
    assert (study.recommendation().trial, study.recommendation().unit) == (0, 1)
    exported = load_file(str(study.export_best(tmp_path / "take") / "adapter_model.safetensors"))
    assert _same(exported, after[1])
    exported = load_file(str(study.export_best(tmp_path / "last", best_trial=True) / "adapter_model.safetensors"))
    assert _same(exported, after[3])
    assert "degraded after chunk 2: reward " in study.leaderboard_text()


@pytest.mark.e2e
def test_a_pruned_trial_keeps_its_best_checkpoint(tiny_model, storage, tmp_path):
    study = rfopt.create_study(study_name="pruned", storage=storage, checkpoint_dir=tmp_path / "ck",
                               pruner=optuna.pruners.SuccessiveHalvingPruner(min_resource=1, reduction_factor=2))
    configs = [trial_config(tiny_model, learning_rate=lr) for lr in (1e-3, 5e-3)]
    study.optimize(configs, prompts_dataset(8), prompts_dataset(4, prefix="E"), num_chunks=2, show_progress_bar=False)
    (pruned,) = [t for t in study.trials if t.state == optuna.trial.TrialState.PRUNED]
    best = TrialRecord(pruned).best
    assert best is not None and best.unit == 0 and best.value == pruned.intermediate_values[0]
    assert (Path(best.location) / "adapter_model.safetensors").is_file()


@pytest.mark.e2e
@pytest.mark.subprocess
@pytest.mark.parametrize("point", ["checkpoint-saved", "metrics-stored"])
def test_a_crash_around_a_commit_keeps_the_same_best_checkpoint_as_an_uninterrupted_run(
        tiny_model, tiny_study_reference, tmp_path, point):
    reference_storage, _ = tiny_study_reference
    storage = f"sqlite:///{tmp_path / 'crash.db'}"
    command = run_command(storage, "--checkpoint-dir", str(tmp_path / "ck"))
    log = tmp_path / "events"
    code = run(command, tmp_path, env(tiny_model, RFOPT_CRASH_AT=f"{point}:2", RFOPT_EVENT_LOG=log), tmp_path / "log")
    assert code != 0 and any(e[0] == point for e in events(log))
    assert run(command, tmp_path, env(tiny_model), tmp_path / "log") == 0, (tmp_path / "log").read_text()[-3000:]
    for crashed, reference in zip(trials(storage), trials(reference_storage), strict=True):
        kept, expected = TrialRecord(crashed).best, TrialRecord(reference).best
        assert (kept.unit, kept.value) == (expected.unit, expected.value)
        assert read_bytes(f"{kept.location}/adapter_model.safetensors") == \
            read_bytes(f"{expected.location}/adapter_model.safetensors")
