"""What a caller asks of a run: `RunRequest`, built by `Study.optimize` and `Study.work` alike (and by a Ray worker),
with every argument checked on its own when it is made. `rfopt.engine.planning.checks` then checks it against the study and
the datasets, and `rfopt.engine.running.run` carries it out.

    >>> request = RunRequest(space, train, test, n_trials=8, settings=StudySettings(num_chunks=4))   # doctest: +SKIP
    >>> rfopt.engine.running.run.run(study.optuna, request)                                                   # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import optuna
from optuna.trial import FrozenTrial

from rfopt.config.settings import StudySettings
from rfopt.errors import Refusal, TypeRefusal
from rfopt.training.gang import GANG_TRAINING
from rfopt.training.parallel import DataParallel
from rfopt.values import is_int, is_number

from .plan import planned_gang_size


@dataclass(frozen=True)
class Worker:
    """How a worker shares a study with other processes (`Study.work`); a run without one has the study to itself."""

    lease_seconds: float = 30.0
    """A unit whose worker died is trained by another once its lease expires."""
    poll_seconds: float = 1.0
    """How long an idle worker waits before it looks for work again."""
    data_parallel: DataParallel | None = None
    """This process's place in a group that trains each trial together, one device each (`rfopt.training.parallel`)."""

    def __post_init__(self) -> None:
        if not is_number(self.lease_seconds) or not is_number(self.poll_seconds) or self.lease_seconds <= 0 \
                or self.poll_seconds <= 0:
            raise Refusal(f"lease_seconds and poll_seconds must be > 0, got {self.lease_seconds} and "
                             f"{self.poll_seconds}")


@dataclass(frozen=True)
class RunRequest:
    """One run of a study: `Study.optimize`'s and `Study.work`'s arguments, which say what each field means."""

    space: Any
    train_dataset: Any
    eval_dataset: Any
    n_trials: int | None = None
    n_trials_total: int | None = None
    timeout: float | None = None
    callbacks: Sequence[Callable[[optuna.Study, FrozenTrial], None]] = ()
    catch: tuple[type[Exception], ...] | type[Exception] = (Exception,)
    max_concurrent: int | None = None
    settings: StudySettings = field(default_factory=StudySettings)
    """The study's settings this call gives (None fields: the stored ones, else the defaults)."""
    device: str = "cpu"
    precision: str = "auto"
    on_unit: Callable[[int, int, float], None] | None = None
    report_to: str | Sequence[str] | None = None
    gang_size: int | None = None
    """As given: None is resolved by `gang` (where the run trains: a Ray worker resolves its own)."""
    gang_training: str | None = None
    """How a gang's members take their training steps (`rfopt.training.gang.GANG_TRAINING`); None: the default."""
    pruner: Any = None
    """What judges the study's rungs: an Optuna pruner or `rfopt.PopulationBasedTraining` (`rfopt.Study.pruner`);
    None: the Optuna study's pruner."""
    show_progress_bar: bool = False
    prune_collapsed: bool = False
    """Prune a trial whose evaluated completions collapsed (`rfopt.training.diversity`), with that reason."""
    worker: Worker | None = None
    """None: this process runs the study alone (`optimize`); else it is one worker beside others (`work`)."""
    executor: Any = None
    """None: train here; a `rfopt.RayCluster`: one worker per device of the cluster (`rfopt.engine.cluster.ray_cluster`)."""

    def __post_init__(self) -> None:
        for name in ("n_trials", "n_trials_total"):
            value = getattr(self, name)
            if value is not None and (not is_int(value) or value < 0):
                raise Refusal(f"{name} must be a whole number >= 0, got {value!r}")
        if self.timeout is not None and (not is_number(self.timeout) or not self.timeout >= 0):
            raise Refusal(f"timeout must be a number of seconds >= 0, got {self.timeout!r}")
        if self.max_concurrent is not None and (not is_int(self.max_concurrent) or self.max_concurrent < 1):
            raise Refusal(f"max_concurrent must be a whole number >= 1, got {self.max_concurrent!r}")
        callbacks = tuple(self.callbacks or ())
        for callback in callbacks:
            if not callable(callback):
                raise TypeRefusal(f"callbacks: {callback!r} is not callable; a callback is called as "
                                "callback(optuna_study, frozen_trial) after each trial ends")
        catch = self.catch if isinstance(self.catch, tuple) else (self.catch,)
        if not all(isinstance(c, type) and issubclass(c, Exception) for c in catch):
            raise TypeRefusal(f"catch must be a tuple of exception classes, got {self.catch!r}")
        if not isinstance(self.prune_collapsed, bool):  # "no" is truthy: it would turn the guard on
            raise TypeRefusal(f"prune_collapsed={self.prune_collapsed!r}: give True (prune a trial whose completions "
                              "collapsed) or False")
        if self.gang_size is not None and (not is_int(self.gang_size) or self.gang_size < 1):
            raise Refusal(f"gang_size={self.gang_size!r}: give a whole number >= 1 (1 trains one trial at a time)")
        if self.gang_training is not None and self.gang_training not in GANG_TRAINING:
            raise Refusal(f"gang_training={self.gang_training!r}: give one of {', '.join(map(repr, GANG_TRAINING))} "
                          "(batched: one forward and backward for a gang's members; sequential: each its own, exact)")
        data_parallel = self.worker.data_parallel if self.worker is not None else None
        if data_parallel is not None and self.gang > 1:
            raise Refusal(f"gang_size={self.gang_size} with devices per trial ({data_parallel.world_size}): a gang "
                             "trains several trials in lockstep in one process, a data-parallel trial one trial over "
                             "processes, each with its own rollouts; give gang_size=1 (--gang-size 1), or leave "
                             "--devices-per-trial out")
        if self.executor is not None and self.device != "cpu":
            raise Refusal(f"device={self.device!r}: on a cluster each worker trains on the device Ray gives it (a "
                             "GPU each where the cluster has GPUs: RayCluster(gpus=...)); leave device out")
        object.__setattr__(self, "callbacks", callbacks)
        object.__setattr__(self, "catch", catch)

    @property
    def gang(self) -> int:
        """The gang size the run trains with: the one given, else rfopt's default (1 for a trial over several devices,
        which trains one trial at a time)."""
        data_parallel = self.worker.data_parallel if self.worker is not None else None
        return planned_gang_size(self.gang_size, data_parallel=data_parallel is not None)

