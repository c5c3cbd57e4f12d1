"""A study's stored state written directly, through rfopt's schema writers and checkpoint store: for the tests that need
a study to refuse against or to read (ops on a finished trial, a clone's checks, a changed dataset), without running
one. What it writes is what a run of the same list of configs writes: the study's identity, plan and settings
(`rfopt.engine.running.run.record`), then each trial's config, schedule, units (metrics, a value per unit), checkpoint, best
checkpoint (`rfopt.engine.outputs.best.keep_if_best`, as a run keeps it) and adapter, and its end.

    >>> study = stored_study(storage, "s", [config], TRAIN, EVAL, values={0: [0.2, 0.4]})   # doctest: +SKIP
"""

from __future__ import annotations

import optuna
import torch

import rfopt
from rfopt.chunks import trial_schedule
from rfopt.config.settings import StudySettings
from rfopt.engine.outputs.best import keep_if_best
from rfopt.engine.planning.checks import check_run
from rfopt.engine.planning.request import RunRequest
from rfopt.engine.running.run import claim_store, record
from rfopt.storage import schema
from rfopt.storage.schema import TrialRef
from rfopt.storage.state import TrialSnapshot, UnitReport


def stored_study(storage: str, name: str, configs: list, train, evaluation, *, num_chunks: int = 2,
                 values: dict[int, list[float]] | None = None, checkpoint_dir=None, **study_kwargs) -> rfopt.Study:
    """The rfopt study `name` in `storage`, as ``optimize(configs, train, evaluation, num_chunks=...)`` leaves it when
    trial `n` reports `values[n]` (one value per unit; a trial not in `values` reports 0.5 after every unit, and a
    trial given fewer values than it has units stays RUNNING after them). Its checkpoints, and a finished trial's
    adapter, hold ``{"w": value}`` as the trial's weights after its last unit, as a scripted runner's
    (tests/scripted_runner.py)."""
    study = rfopt.create_study(study_name=name, storage=storage, load_if_exists=True, checkpoint_dir=checkpoint_dir,
                               **study_kwargs)
    checked = check_run(study.optuna, RunRequest(configs, train, evaluation,
                                                 settings=StudySettings(num_chunks=num_chunks)))
    store = claim_store(study.optuna, None if checkpoint_dir is None else str(checkpoint_dir))
    record(study.optuna, checked)
    for _ in configs:
        trial = study.optuna.ask()
        ref = TrialRef.of(study.optuna, trial)
        config = checked.space.config_for(trial)  # its params suggested, as the run configures a listed trial
        schema.write_config(ref, config.to_json())
        schedule = trial_schedule(checked.plan, config.args)
        schema.write_schedule(ref, schedule)
        reported = (values or {}).get(trial.number, [0.5] * schedule.num_units)
        for unit, value in enumerate(reported):
            metrics = {"chunk": schedule.chunk_of_unit(unit), "eval": {"reward": value},
                       "train": {"reward": value, "loss": 0.0}}
            schema.write_unit(ref, unit, metrics, [], [])
            trial.report(value, step=unit)
            state = TrialSnapshot(units_done=unit + 1, global_step=(unit + 1) * schedule.steps_per_chunk,
                                  tokens_seen=0, weights={"w": torch.tensor([value], dtype=torch.float64)},
                                  optimizer=None, scheduler=None, rng=None)
            report = UnitReport(unit, value, metrics, [])
            store.save(trial.number, state, report)
            keep_if_best(store, ref, _Runner(state.weights), config, report, study.optuna)
        if reported and len(reported) == schedule.num_units:
            weights = {"w": torch.tensor([reported[-1]], dtype=torch.float64)}
            schema.write_adapter(ref, str(store.save_adapter(trial.number, _Adapter(weights), "adapter")))
            study.optuna.tell(trial, reported[-1])
    return study


class _Adapter:
    """What `CheckpointStore.save_adapter` saves a finished trial's adapter from."""

    def __init__(self, weights: dict[str, torch.Tensor]) -> None:
        self.weights = weights

    def save_pretrained(self, path: str, selected_adapters: list[str] | None = None) -> None:
        from safetensors.torch import save_file

        save_file(self.weights, f"{path}/adapter_model.safetensors")


class _Runner:
    """What `keep_if_best` saves a trial's best checkpoint from: its weights, as its model."""

    def __init__(self, weights: dict[str, torch.Tensor]) -> None:
        self.model = _Adapter(weights)
        self.tokenizer = None


def trial_states(study: rfopt.Study) -> list[optuna.trial.TrialState]:
    return [t.state for t in study.optuna.get_trials(deepcopy=False)]
