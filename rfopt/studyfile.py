"""Ready-made study files: a Python file that defines ``STUDY = rfopt.StudySpec(...)``.

``rfopt run studies/arithmetic.py`` loads the file, creates (or continues) the study in the given
storage, runs it with a progress bar, and prints the leaderboard, the best adapter's location, a few
of its completions and the command that opens optuna-dashboard on the result.

    STUDY = rfopt.StudySpec(
        name="arithmetic",
        space=space,                       # function trial -> TrialConfig, or a list of TrialConfig
        datasets=load_datasets,            # () -> (train_dataset, eval_dataset)
        num_chunks=4,
        n_trials=6,
        pruner=lambda: optuna.pruners.SuccessiveHalvingPruner(min_resource=1, reduction_factor=2),
    )
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .config import ConfigError, load_file_module
from .evaluation import EvalSettings


@dataclass
class StudySpec:
    """Everything `rfopt run` needs to run a study; command-line options override the defaults here."""

    name: str
    """Default study name."""
    space: Any
    """A function ``trial -> TrialConfig``, a list of `TrialConfig`, or a zero-argument function returning one
    (so that heavy imports and model paths resolve only when the study runs)."""
    datasets: Callable[[], tuple[Any, Any]]
    """Returns ``(train_dataset, eval_dataset)``."""
    num_chunks: int = 4
    n_trials: int | None = None
    max_concurrent: int | None = None
    pruner: Callable[[], Any] | None = None
    """Returns the Optuna pruner (a factory, so the file stays cheap to import)."""
    sampler: Callable[[], Any] | None = None
    objective: str = "reward"
    direction: str = "maximize"
    eval_settings: EvalSettings = field(default_factory=EvalSettings)
    description: str = ""
    fast: dict[str, Any] = field(default_factory=dict)
    """Overrides of these fields for ``--fast`` (a quick smoke run, e.g. fewer trials)."""

    def with_fast(self) -> StudySpec:
        return dataclasses.replace(self, **self.fast) if self.fast else self


def load_spec(path: str | Path) -> StudySpec:
    """The `StudySpec` named ``STUDY`` in the Python file at `path`."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"study file {path} does not exist (try one of studies/*.py)")
    try:
        module = load_file_module(path)
    except ConfigError:
        raise
    spec = getattr(module, "STUDY", None)
    if not isinstance(spec, StudySpec):
        raise ConfigError(f"{path}: defines no STUDY = rfopt.StudySpec(...)")
    return spec
