"""Checkpoints in an object store (``--checkpoint-dir s3://bucket/prefix``), against a real S3-compatible server
(moto, on 127.0.0.1) reached through s3fs: a checkpoint comes back exactly; an upload that fails partway leaves
the previous checkpoint the latest; a study on S3 ends exactly as on a local directory, survives being killed
between an upload and its LATEST, and exports its best adapter. (Corrupt and missing checkpoints, and late
writers, on S3: tests/storage/test_faults.py; workers on separate hosts sharing S3: tests/engine/test_workers.py.)"""

import dataclasses
import io
import importlib.util
import signal

import fsspec
import numpy as np
import optuna
import pytest
import torch
from peft import PeftModel, get_peft_model_state_dict
from transformers import AutoModelForCausalLM

import rfopt
from rfopt.errors import CheckpointError
from crashkit import (adapter, assert_same_study, commits, env, events, names_in, retrained_after_durable, run,
                      run_command, trials)
from rfopt.storage.state import UnitReport
from rfopt.chunks import ChunkPlan, trial_schedule
from rfopt.storage.checkpoints import CheckpointStore
from rfopt.engine.outputs.artifacts import StudyArtifacts
from rfopt.training.models import ModelPool
from rfopt.training.runner import TrialRunner
from rfopt_testkit import prompts_dataset, trial_config
from rfopt.storage.schema import study_attrs, trial_attrs


@pytest.fixture(scope="module")
def trained_state(tiny_model, tmp_path_factory):
    """A real trial's state after one chunk: LoRA weights, AdamW moments, a cosine schedule, RNG states."""
    dataset = prompts_dataset(16)
    config = trial_config(tiny_model, lr_scheduler_type="cosine", warmup_steps=0.25)
    plan = ChunkPlan.build(len(dataset), num_chunks=2, seed=0)
    runner = TrialRunner(0, config, plan, trial_schedule(plan, config.args), dataset, ModelPool("cpu"),
                         tmp_path_factory.mktemp("runner"))
    runner.train_chunk()
    return runner.state()


def _same(a, b) -> bool:
    """Equal, looking into tensors, arrays, dataclasses, dicts, lists and tuples."""
    if dataclasses.is_dataclass(a) and type(a) is type(b):
        return all(_same(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a))
    if torch.is_tensor(a) or torch.is_tensor(b):
        return torch.is_tensor(a) and torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return np.array_equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def test_a_checkpoint_saved_to_s3_loads_back_identical_and_only_the_latest_is_kept(s3, trained_state):
    store = CheckpointStore(s3.bucket() + "/study")
    for units in (1, 2, 3):
        report = UnitReport(unit=units - 1, value=0.25 * units, metrics={"eval": {"reward": 0.5}}, samples=[{"a": 1}])
        store.save(4, dataclasses.replace(trained_state, units_done=units), report)

    assert store.latest(4) == f"{store.root}/trial-00004/unit-0003"
    assert names_in(store.trial_dir(4)) == ["LATEST", "unit-0003"]  # older units removed once LATEST moved
    assert names_in(store.latest(4)) == ["report.json", "state.json", "tensors.safetensors"]
    loaded = store.load(4)
    expected = dataclasses.replace(trained_state, units_done=3)
    assert loaded.optimizer["state"] and loaded.rng is not None and loaded.scheduler is not None  # all really there
    for field in dataclasses.fields(expected):
        assert _same(getattr(loaded, field.name), getattr(expected, field.name)), field.name
    assert store.load_report(4) == report
    assert store.load(5) is None and store.load_report(5) is None  # a trial with no checkpoint yet


def test_an_upload_failing_partway_raises_and_the_previous_checkpoint_stays_latest(s3, trained_state, monkeypatch):
    root = s3.bucket() + "/study"
    store = CheckpointStore(root)
    store.save(0, dataclasses.replace(trained_state, units_done=1), UnitReport(0, 0.5, {}, []))

    filesystem, _ = fsspec.core.url_to_fs(root)  # the store's s3fs instance (fsspec caches one per configuration)
    real_put = filesystem.put_file

    def put_file(lpath, rpath, *args, **kwargs):
        if rpath.endswith("unit-0002/state.json"):  # after report.json is uploaded, before tensors.safetensors
            raise PermissionError("Access Denied")
        return real_put(lpath, rpath, *args, **kwargs)

    monkeypatch.setattr(filesystem, "put_file", put_file)
    with pytest.raises(CheckpointError) as error:
        store.save(0, dataclasses.replace(trained_state, units_done=2), UnitReport(1, 0.7, {}, []))
    message = str(error.value)
    assert message.startswith("trial 0: writing checkpoint unit-0002")
    assert f"{root}/trial-00000/unit-0002/state.json" in message and "Access Denied" in message
    assert "the previous checkpoint unit-0001 is kept" in message

    monkeypatch.undo()
    assert names_in(store.trial_dir(0)) == ["LATEST", "unit-0001"]  # the half-uploaded unit was removed
    assert store.load(0).units_done == 1 and store.load_report(0).value == 0.5


def test_a_url_whose_filesystem_package_is_missing_says_what_to_install():
    if importlib.util.find_spec("gcsfs") is not None:
        pytest.skip("gcsfs is installed here")
    with pytest.raises(CheckpointError, match=r"checkpoint store gcs://bucket/rfopt: .*gcsfs.*; pip install gcsfs"):
        CheckpointStore("gcs://bucket/rfopt")


@pytest.mark.e2e
@pytest.mark.subprocess
@pytest.mark.slow
def test_a_study_with_s3_checkpoints_ends_as_with_a_local_directory_and_exports_its_best_adapter(
    s3, tiny_study_reference, tiny_model, tmp_path
):
    storage, root = f"sqlite:///{tmp_path / 's3.db'}", s3.bucket() + "/rfopt/"
    code = run(run_command(storage, "--checkpoint-dir", root), tmp_path, env(tiny_model), tmp_path / "run.log")
    assert code == 0, (tmp_path / "run.log").read_text()[-3000:]
    root = root.rstrip("/")  # the study records the URL without its trailing slash
    assert not (tmp_path / "rfopt-checkpoints").exists()
    assert_same_study(*tiny_study_reference, storage, root)

    study = rfopt.load_study("tiny", storage)
    assert study_attrs(study.optuna)["rfopt:checkpoint_dir"] == root
    best = study.optuna.best_trial
    assert study.best_adapter(best_trial=True) == trial_attrs(best)["rfopt:adapter"] == \
        f"{root}/trial-{best.number:05d}/adapter"
    recommended = study.recommendation()
    assert study.best_adapter() == recommended.location == f"{root}/trial-{recommended.trial:05d}/best"
    # The trial's chunk artifacts (charts, samples) went to the same store, and the dashboard reads them there.
    metas = {m.filename: m.artifact_id for m in optuna.artifacts.get_all_artifact_meta(best, storage=study.optuna._storage)}
    assert set(metas) == {"rfopt-metrics.svg", "rfopt-samples.jsonl"}
    assert set(metas.values()) <= set(names_in(f"{root}/artifacts"))
    reader = StudyArtifacts(study.optuna._storage, tmp_path / "uploads").open_reader(metas["rfopt-metrics.svg"])
    assert reader.read().startswith(b"<svg")
    exported = study.export_best(tmp_path / "best", best_trial=True)
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model), str(exported))
    loaded, saved = get_peft_model_state_dict(model), adapter(best)
    assert loaded.keys() == saved.keys() and all(torch.equal(loaded[k], saved[k]) for k in saved)


@pytest.mark.e2e
@pytest.mark.subprocess
@pytest.mark.slow
def test_a_study_killed_between_an_upload_and_its_latest_resumes_from_s3_as_if_never_killed(
    s3, tiny_study_reference, tiny_model, tmp_path
):
    storage, root = f"sqlite:///{tmp_path / 'crash.db'}", s3.bucket() + "/rfopt"
    command = run_command(storage, "--checkpoint-dir", root)
    log, output = tmp_path / "events.log", tmp_path / "crash.log"
    # Killed with a unit's files uploaded but LATEST not yet moved; then with LATEST moved, its report not committed.
    for point in ("checkpoint-renamed:2", "checkpoint-saved:3"):
        code = run(command, tmp_path, env(tiny_model, RFOPT_EVENT_LOG=log, RFOPT_CRASH_AT=point), output)
        assert code == -signal.SIGKILL, output.read_text()[-3000:]
    assert any(t.state == optuna.trial.TrialState.RUNNING for t in trials(storage))
    assert run(command, tmp_path, env(tiny_model, RFOPT_EVENT_LOG=log), output) == 0, output.read_text()[-3000:]

    assert_same_study(*tiny_study_reference, storage, root)
    assert retrained_after_durable(events(log)) == []
    committed = commits(events(log))
    reported = {(t.number, step) for t in trials(storage) for step in t.intermediate_values}
    assert set(committed) == reported and set(committed.values()) == {1}


def test_a_run_dying_between_an_upload_and_its_latest_resumes_from_s3_as_if_it_never_died(
        scripted, dying, s3, tiny_model, tmp_path, monkeypatch):
    """The same crashes in this process, on scripted runners, against the reference run with a local directory."""
    from crashkit import STUDY_FILE, crash_and_rerun_here

    monkeypatch.setenv("RFOPT_TEST_TINY_MODEL", str(tiny_model))
    root = s3.bucket() + "/rfopt"
    points = ["checkpoint-renamed:2", "checkpoint-saved:3"]
    died_at, log, storage = crash_and_rerun_here(STUDY_FILE, points, tmp_path, dying,
                                                 checkpoints=(tmp_path / "ref-ck", root))
    assert died_at == points
    assert retrained_after_durable(log) == []
    committed = commits(log)
    reported = {(t.number, step) for t in trials(storage) for step in t.intermediate_values}
    assert set(committed) == reported and set(committed.values()) == {1}


def test_a_bucket_that_does_not_exist_stops_the_run_before_any_trial(s3, tiny_model, tmp_path):
    s3.bucket()  # the server is up; this bucket is not
    study = rfopt.create_study(study_name="nobucket", storage=f"sqlite:///{tmp_path / 'nb.db'}",
                               checkpoint_dir="s3://rfopt-no-such-bucket/ck")
    with pytest.raises(CheckpointError, match=r"checkpoint store s3://rfopt-no-such-bucket/ck: cannot write "
                       r"there: .*rfopt creates no bucket"):
        study.optimize([trial_config(tiny_model)], prompts_dataset(8), prompts_dataset(2, "E"), num_chunks=2)
    assert study.optuna.get_trials() == []  # one clear error, not every trial failing at its first checkpoint



def test_an_artifact_id_is_a_name_in_the_store_never_a_path_out_of_it():
    from rfopt.engine.outputs.artifacts import ObjectArtifactStore

    store = ObjectArtifactStore("memory://rfopt-artifacts-test/study/artifacts")
    fs = fsspec.filesystem("memory")
    store.write("3f2a-b1", io.BytesIO(b"kept"))
    assert store.open_reader("3f2a-b1").read() == b"kept"
    for bad in ("../escaped", "a/b", "..", "/abs", "a\\b"):
        with pytest.raises(ValueError, match="an artifact id is a name, not a path"):
            store.write(bad, io.BytesIO(b"x"))
        with pytest.raises(ValueError, match="an artifact id is a name, not a path"):
            store.open_reader(bad)
    assert sorted(fs.find("/rfopt-artifacts-test")) == ["/rfopt-artifacts-test/study/artifacts/3f2a-b1"]
