"""Each base model of a study evaluated once, with no adapter, before the first trial on it trains: the study's
baselines (`rfopt.training.baseline`, stored as `rfopt.storage.schema.Baseline` on the study).

The roster asks for a trial's baseline right before the trial trains (`Baselines.ensure`): the first time a study
needs a base model's baseline, it is evaluated and stored; every later trial, run or worker finds it stored and only
names it (``rfopt:baseline_key``). A crash before it is stored evaluates it again at the next run; one after never
does. Two workers starting together may both evaluate it and write the same record. A baseline whose evaluation fails
(a reward function that raises, say) is skipped with a warning: the trial then fails, or not, on its own.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import Any

import optuna

from rfopt.config.settings import EvalSettings
from rfopt.config.trial import TrialConfig
from rfopt.storage import schema
from rfopt.storage.schema import Baseline, TrialRef, study_record
from rfopt.training.baseline import baseline_key, evaluate_baseline, model_label
from rfopt.training.models import ModelPool
from rfopt.training.rollouts import Progress

logger = logging.getLogger("rfopt")


class Baselines:
    """The baselines one run has made sure of: evaluated here, or found stored."""

    def __init__(self, study: optuna.Study, pool: ModelPool, eval_dataset: Any, settings: EvalSettings,
                 objective: str) -> None:
        self.study = study
        self.pool = pool
        self.eval_dataset = eval_dataset
        self.settings = settings
        self.objective = objective
        self._known: dict[str, Baseline] = {}
        self._failed: set[str] = set()

    def ensure(self, ref: TrialRef, config: TrialConfig, named: str | None,
               announce: Callable[[], Progress | None] | None = None) -> Baseline | None:
        """The baseline of trial ``ref.number`` (whose config is `config`), evaluated now if the study has none yet
        (`announce` is called first: the trial's progress then says the base model is being evaluated, and the
        decoding's progress callback it returns hears how many prompts are done); the trial names it unless it does
        already (`named`). None if its evaluation failed."""
        key = baseline_key(config, self.settings)
        if key in self._failed:
            return None
        if key not in self._known:
            baseline = study_record(self.study).baselines.get(key)
            if baseline is None:
                progress = announce() if announce is not None else None
                baseline = self._evaluate(key, config, progress)
            if baseline is None:
                self._failed.add(key)
                return None
            self._known[key] = baseline
        if named != key:
            schema.write_baseline_key(ref, key)
        return self._known[key]

    def _evaluate(self, key: str, config: TrialConfig, progress: Progress | None = None) -> Baseline | None:
        started = time.perf_counter()
        try:
            result = evaluate_baseline(self.pool, config, self.eval_dataset, self.settings, progress)
            value = result.objective(self.objective)
        except Exception as exc:  # noqa: BLE001 - a baseline is a reference, never a reason to stop the study
            logger.warning("the base model %s could not be evaluated as a baseline (%s: %s); its trials show no "
                           "baseline", model_label(config), type(exc).__name__, exc)
            return None
        if not math.isfinite(value):
            logger.warning("the base model %s scores %s on the eval set; its trials show no baseline",
                           model_label(config), value)
            return None
        baseline = Baseline(key=key, model=model_label(config), objective=self.objective, value=value,
                            metrics=result.metrics, samples=result.samples, at=time.time(),
                            seconds=time.perf_counter() - started)
        schema.write_baseline(self.study, baseline)
        logger.info("baseline: %s with no adapter scores %s = %.4f on the eval set", baseline.model, self.objective,
                    value)
        return baseline
