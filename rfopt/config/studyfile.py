"""Ready-made study files: a Python file that defines ``STUDY = rfopt.StudySpec(...)``.

``rfopt run arithmetic`` (a study of `rfopt.studies`) or ``rfopt run my_study.py`` loads the file,
creates (or continues) the study in the given storage, runs it with a progress bar, and prints the
leaderboard, the best adapter's location, a few of its completions and the command that opens
optuna-dashboard on the result.

    STUDY = rfopt.StudySpec(
        name="arithmetic",
        space=space,                       # function trial -> TrialConfig (or configs=: a list's factory)
        datasets=load_datasets,            # () -> (train_dataset, eval_dataset)
        num_chunks=4,
        n_trials_total=6,
        pruner=lambda: optuna.pruners.SuccessiveHalvingPruner(min_resource=1, reduction_factor=2),
    )
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rfopt.errors import ConfigError, MissingFile

from .settings import EvalSettings
from .usercode import failure, load_file_module

BUILTIN_PACKAGE = "rfopt.studies"
"""Where the ready-made studies live: ``rfopt run arithmetic`` runs ``rfopt/studies/arithmetic.py``."""


@dataclass
class StudySpec:
    """Everything `rfopt run` needs to run a study; command-line options override the defaults here.

    Give the search space as `space` (a function ``trial -> TrialConfig``, or a list of configs) or as `configs` (a
    function of no arguments returning the list, so that heavy imports and model paths resolve only when the study
    runs), not both."""

    name: str
    """Default study name."""
    datasets: Callable[[], tuple[Any, Any]]
    """Returns ``(train_dataset, eval_dataset)``."""
    space: Any = None
    """A function ``trial -> TrialConfig``, a list of `TrialConfig`, or `rfopt.grid(...)`."""
    configs: Callable[[], list[Any]] | None = None
    """Returns the study's list of `TrialConfig` (instead of `space`)."""
    num_chunks: int = 4
    n_trials: int | None = None
    """New trials each `rfopt run` starts (as `Study.optimize`'s `n_trials`); default: as many as `n_trials_total`
    allows, or the list's configs not run yet."""
    n_trials_total: int | None = None
    """The study's total, for a function space: a rerun only tops the study up to it (``--n-trials-total``)."""
    max_concurrent: int | None = None
    gang_size: int | None = None
    """Trials trained at once in lockstep (``--gang-size``; `Study.optimize`'s `gang_size`); None: rfopt's default."""
    gang_training: str | None = None
    """How a gang's members take their training steps, ``"batched"`` or ``"sequential"`` (``--gang-training``;
    `Study.optimize`'s `gang_training`); None: rfopt's default (``"batched"``)."""
    pruner: Callable[[], Any] | None = None
    """Returns the Optuna pruner (a factory, so the file stays cheap to import)."""
    prune_collapsed: bool = False
    """Prune a trial whose eval completions collapsed (`Study.optimize`'s `prune_collapsed`)."""
    sampler: Callable[[], Any] | None = None
    objective: str = "reward"
    direction: str = "maximize"
    eval_settings: EvalSettings = field(default_factory=EvalSettings)
    description: str = ""
    fast: dict[str, Any] = field(default_factory=dict)
    """Overrides of these fields for ``--fast`` (a quick smoke run, e.g. fewer trials)."""

    def __post_init__(self) -> None:
        if (self.space is None) == (self.configs is None):
            raise ConfigError(f"StudySpec {self.name!r}: give the search space as space= (a function trial -> "
                              "TrialConfig, or a list) or as configs= (a function returning the list), not "
                              f"{'both' if self.space is not None else 'neither'}")
        if self.configs is not None and not callable(self.configs):
            raise ConfigError(f"StudySpec {self.name!r}: configs= must be a function returning the list of "
                              "TrialConfig; give a list itself as space=")
        if not isinstance(self.prune_collapsed, bool):
            raise ConfigError(f"StudySpec {self.name!r}: prune_collapsed={self.prune_collapsed!r}: give True (prune a "
                              "trial whose completions collapsed) or False")
        unknown = sorted(set(self.fast) - {f.name for f in dataclasses.fields(self)})
        if unknown:
            raise ConfigError(f"StudySpec {self.name!r}: fast= names no field {unknown}")

    def search_space(self) -> Any:
        """What `Study.optimize` takes: `space`, or the list `configs()` returns."""
        return self.configs() if self.configs is not None else self.space

    def with_fast(self) -> StudySpec:
        if not self.fast:
            return self
        changes = dict(self.fast)
        if "space" in changes and "configs" not in changes:
            changes["configs"] = None
        if "configs" in changes and "space" not in changes:
            changes["space"] = None
        return dataclasses.replace(self, **changes)


def load_spec(path: str | Path) -> StudySpec:
    """The `StudySpec` named ``STUDY`` in the Python file at `path`, or in the ready-made study of that name."""
    path = find_study_file(path)
    builtin = _builtin_folder()
    if path.resolve().parent == builtin:  # by its module name, so that what it defines is stored as rfopt.studies.*
        module = importlib.import_module(f"{BUILTIN_PACKAGE}.{path.stem}")
    else:
        module = load_file_module(path)
    spec = getattr(module, "STUDY", None)
    if not isinstance(spec, StudySpec):
        raise ConfigError(f"{path}: defines no STUDY = rfopt.StudySpec(...)")
    return spec


def call(path: str | Path, spec: StudySpec, what: str) -> Any:
    """Call the study file's `what` (``datasets``, ``configs``, ``pruner``, ``sampler``), naming the file, the function
    and the line where it fails: a bare ``ZeroDivisionError`` from a study's data loader says neither."""
    function = getattr(spec, what)
    try:
        return spec.search_space() if what == "configs" else function()
    except (Exception, SystemExit) as exc:
        name = getattr(function, "__qualname__", repr(function))
        file = getattr(getattr(function, "__code__", None), "co_filename", str(path))
        raise ConfigError(f"study file {path}: its {what} function {name} failed: {failure(exc, file)}") from exc


def builtin_studies() -> list[str]:
    """The names of the ready-made studies (``rfopt run <name>``)."""
    return sorted(p.stem for p in _builtin_folder().glob("*.py") if not p.stem.startswith("_"))


def find_study_file(name: str | Path) -> Path:
    """The study file `name` means: a path, or the name of a ready-made study (``arithmetic``)."""
    path = Path(name)
    if path.is_file():
        return path
    if path.suffix != ".py" and len(path.parts) == 1 and path.name in builtin_studies():
        return _builtin_folder() / f"{path.name}.py"
    raise MissingFile(f"study file {name} does not exist; give a path, or a ready-made study: "
                      f"{', '.join(builtin_studies())}")


def _builtin_folder() -> Path:
    return Path(importlib.util.find_spec(BUILTIN_PACKAGE).origin).resolve().parent
