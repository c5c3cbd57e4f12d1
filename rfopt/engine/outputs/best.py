"""Each trial's best checkpoint, kept as its units commit: what a study recommends is the best model it produced, not
Optuna's last value (TRL's ``load_best_model_at_end`` with ``metric_for_best_model``, per trial).

When a unit commits (`rfopt.engine.running.unit.commit`), its adapter is kept as the trial's best (the checkpoint store's
``best/``, then the trial's ``rfopt:best`` record: `rfopt.storage.schema.BestCheckpoint`) if its value beats the one
recorded, in the study's direction, and its completions had not collapsed (`rfopt.training.diversity`; against the
trial's baseline: a base model that answers every prompt alike already makes no collapse): a collapsed checkpoint is
never kept as best, whatever it scored. A tie keeps the earlier unit.

Repeating it is safe, as every write after the commit fence is (the README's "Workers"): the adapter is written
before the record that names it, so a crash in between leaves the record naming the previous best, whose unit is worse,
and the unit's commit, done again from its checkpoint, writes both again.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import optuna
from optuna.study import StudyDirection

from rfopt.config.trial import TrialConfig
from rfopt.storage import schema
from rfopt.storage.checkpoints import CheckpointStore
from rfopt.storage.schema import BestCheckpoint, TrialRef, study_record
from rfopt.storage.state import UnitReport
from rfopt.training.diversity import collapse_reason
from rfopt.training.models import adapter_name
from rfopt.training.runner import Runner


def keep_if_best(store: CheckpointStore, ref: TrialRef, runner: Runner, config: TrialConfig, report: UnitReport,
                 study: optuna.Study) -> BestCheckpoint | None:
    """Keep `runner`'s weights, which scored `report`, as trial ``ref.number``'s best checkpoint of `study` if they are
    (see the module docstring); returns the trial's best checkpoint after it (None while it has none)."""
    record = ref.read()
    recorded = record.best
    if not better(report, recorded, study.direction == StudyDirection.MAXIMIZE):
        return recorded
    baseline = study_record(study).baselines.get(record.baseline_key or "")
    if collapsed(report, None if baseline is None else baseline.metrics) is not None:
        return recorded
    adapter = adapter_name(ref.number) if config.peft_config is not None else None
    location = store.save_best(ref.number, runner.model, adapter, runner.tokenizer)
    best = BestCheckpoint(unit=report.unit, chunk=int(report.metrics.get("chunk", report.unit)), value=report.value,
                          location=str(location))
    schema.write_best(ref, best)
    return best


def better(report: UnitReport, recorded: BestCheckpoint | None, maximize: bool) -> bool:
    """Whether `report`'s value beats the recorded best (a finite value beats none; a unit recorded already is not
    written again)."""
    if not math.isfinite(report.value):
        return False
    if recorded is None:
        return True
    if recorded.unit == report.unit:
        return False
    return report.value > recorded.value if maximize else report.value < recorded.value


def collapsed(report: UnitReport, reference: Mapping[str, float] | None = None) -> str | None:
    """Why the unit's evaluated completions had collapsed where the `reference` (its baseline's) had not
    (`rfopt.training.diversity.collapse_reason`), or None."""
    evaluated = report.metrics.get("eval")
    if not isinstance(evaluated, Mapping):
        return None
    return collapse_reason({k: float(v) for k, v in evaluated.items()
                            if isinstance(v, (int, float)) and not isinstance(v, bool)}, reference)
