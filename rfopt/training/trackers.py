"""Each trial's TRL logs sent to the user's experiment tracker through TRL's own ``report_to``.

A study's ``report_to`` (``rfopt.create_study(..., report_to="tensorboard")``, ``rfopt run --report-to``) is given
to every chunk's trainer, with ``run_name="<study>-trial-<n>"``. The Trainer's own integration callbacks then log
each optimizer step at the trainer's global step, which continues across a trial's chunks (`rfopt.training.runner`), and log
the trial's whole config (its ``GRPOConfig``, its LoRA settings: what its Optuna params are values of) as the run's
config. rfopt only tells each integration, through the environment variables and arguments it reads, where the
trial's run is, and only where the user has not said so:

- TensorBoard: ``TENSORBOARD_LOGGING_DIR`` = ``<dir>/<study>/trial-<n>``, ``<dir>`` being the user's
  ``TENSORBOARD_LOGGING_DIR`` or ``runs`` (in the working directory): one run per trial, grouped by study
  (``tensorboard --logdir runs``). Each chunk's trainer opens a writer on that directory and adds an event file
  to it; TensorBoard reads a directory's event files as one run, so the trial's curve is one line over its global
  steps. A trial resumed after a crash or in another process appends to the same directory: the same run.
- Weights & Biases: ``WANDB_PROJECT`` and ``WANDB_RUN_GROUP`` = the study; each trial's run has a fixed id
  (``WANDB_RUN_ID``, from the study and trial; ``WANDB_RESUME=allow``) and is finished after each chunk, so the
  next chunk (in this process or another) resumes the same run rather than logging into another trial's.
- MLflow: ``MLFLOW_EXPERIMENT_NAME`` = the study. The Trainer's MLflow callback ends its run at the end of each
  ``train()``, so each chunk is a run of its own in the study's experiment, all named ``<study>-trial-<n>``.
- trackio: ``project`` = the study (unless the trial's config sets one); trackio resumes a run by its name, so the
  trial's chunks append to one run.

Only W&B, TensorBoard, MLflow and trackio are named here; any other ``report_to`` value TRL accepts is passed on
as it is, with ``run_name``. Training is the same with or without trackers: they log, and draw no random numbers.
"""

from __future__ import annotations

import hashlib
import os
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

NAMED = ("tensorboard", "wandb", "mlflow", "trackio")
"""The trackers rfopt names each trial's run for (others are passed to TRL as they are)."""


# Each tracker's check that its package is installed (transformers' own), and the package to install.
_INSTALLED = {
    "azure_ml": ("is_azureml_available", "azureml-core"), "clearml": ("is_clearml_available", "clearml"),
    "codecarbon": ("is_codecarbon_available", "codecarbon"), "comet_ml": ("is_comet_available", "comet-ml"),
    "dagshub": ("is_dagshub_available", "dagshub mlflow"), "dvclive": ("is_dvclive_available", "dvclive"),
    "flyte": ("is_flytekit_available", "flytekit flytekitplugins-deck-standard"),
    "kubeflow": ("is_kubeflow_available", "kubeflow"), "mlflow": ("is_mlflow_available", "mlflow"),
    "neptune": ("is_neptune_available", "neptune"), "swanlab": ("is_swanlab_available", "swanlab"),
    "tensorboard": ("is_tensorboard_available", "tensorboard"), "trackio": ("is_trackio_available", "trackio"),
    "wandb": ("is_wandb_available", "wandb"),
}


def normalize(report_to: str | Sequence[str] | None) -> list[str]:
    """``report_to`` as a list, as TRL reads it: ``None``, ``"none"`` and ``[]`` mean no tracker; ``"all"`` every
    installed one. A name TRL does not know, or a tracker whose package is not installed here (every trial would
    fail at its first chunk), is refused here, before anything runs."""
    if report_to is None:
        return []
    if not isinstance(report_to, (str, list, tuple)):
        raise TypeError(f"report_to must be a tracker name or a list of them (e.g. 'tensorboard'), got "
                        f"{type(report_to).__name__} {report_to!r}")
    names = [report_to] if isinstance(report_to, str) else list(report_to)
    if not all(isinstance(n, str) for n in names):
        raise TypeError(f"report_to must be a tracker name or a list of them, got {report_to!r}")
    names = [n.strip() for n in names if n.strip() and n.strip() != "none"]
    if names == ["all"]:
        return names
    from transformers.integrations.integration_utils import INTEGRATION_TO_CALLBACK

    unknown = [n for n in names if n not in INTEGRATION_TO_CALLBACK]
    if unknown:
        raise ValueError(f"report_to: unknown tracker {unknown}; use one of {sorted(INTEGRATION_TO_CALLBACK)}, "
                         "'all' or 'none'")
    names = list(dict.fromkeys(names))
    missing = [n for n in names if not _installed(n)]
    if missing:
        packages = " ".join(_INSTALLED[n][1] for n in missing)
        raise ValueError(f"report_to: {', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not installed here, "
                         f"so every trial would fail at its first chunk; install {'it' if len(missing) == 1 else 'them'} "
                         f"(pip install {packages}) or leave {'it' if len(missing) == 1 else 'them'} out of report_to "
                         f"(installed here: {installed() or 'none'})")
    return names


def installed() -> list[str]:
    """The trackers whose packages are installed here."""
    return [name for name in _INSTALLED if _installed(name)]


def _installed(name: str) -> bool:
    from transformers.integrations import integration_utils

    check = getattr(integration_utils, _INSTALLED[name][0], None) if name in _INSTALLED else None
    return True if check is None else bool(check())  # a tracker rfopt has no check for: TRL decides


_NAMES = ("TENSORBOARD_LOGGING_DIR", "WANDB_RUN_ID", "WANDB_RESUME", "WANDB_PROJECT", "WANDB_RUN_GROUP",
          "MLFLOW_EXPERIMENT_NAME")
"""The environment variables a chunk's trainer reads to find its trial's run."""

_OPEN: list[dict[str, str | None]] = []
"""The user's values of `_NAMES` saved by each chunk block open now (several in a gang, `rfopt.training.gang`)."""


@dataclass(frozen=True)
class Tracking:
    """Where one study's trials report: its ``report_to`` and name."""

    report_to: list[str]
    study: str

    def run_name(self, number: int) -> str:
        return f"{self.study}-trial-{number}"

    def tensorboard_dir(self, number: int, base: str | None) -> str:
        """Trial `number`'s run under `base`, the user's ``TENSORBOARD_LOGGING_DIR`` (None: TensorBoard's ``runs``)."""
        return os.path.join(base or "runs", self.study, f"trial-{number}")

    def wandb_id(self, number: int) -> str:
        return hashlib.sha1(f"{self.study}\0{number}".encode()).hexdigest()[:16]

    def uses(self, name: str) -> bool:
        return name in self.report_to or "all" in self.report_to

    def single_run_trackers(self) -> list[str]:
        """The trackers used that keep one active run per process (a gang's members cannot each have their own)."""
        return [name for name in ("wandb", "mlflow") if name in self.report_to or
                ("all" in self.report_to and _installed(name))]

    @contextmanager
    def chunk(self, number: int) -> Iterator[None]:
        """The environment of trial `number`'s chunk trainer (built and trained inside this block)."""
        if not self.report_to:
            yield
            return
        # The user's values, as they were before any chunk block: a gang's members open theirs one inside another.
        saved = dict(_OPEN[0]) if _OPEN else {name: os.environ.get(name) for name in _NAMES}
        wanted: dict[str, str] = {}
        if self.uses("tensorboard"):
            wanted["TENSORBOARD_LOGGING_DIR"] = self.tensorboard_dir(number, saved["TENSORBOARD_LOGGING_DIR"])
        if self.uses("wandb"):
            wanted["WANDB_RUN_ID"] = self.wandb_id(number)
            wanted["WANDB_RESUME"] = "allow"
            for name in ("WANDB_PROJECT", "WANDB_RUN_GROUP"):
                wanted[name] = saved[name] or self.study
        if self.uses("mlflow"):
            wanted["MLFLOW_EXPERIMENT_NAME"] = saved["MLFLOW_EXPERIMENT_NAME"] or self.study
        os.environ.update(wanted)
        _OPEN.append(saved)
        try:
            yield
        finally:
            _OPEN.remove(saved)
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
            wandb = sys.modules.get("wandb")
            if wandb is not None and getattr(wandb, "run", None) is not None:
                wandb.finish()  # the next chunk of any trial starts or resumes its own run


__all__ = ["NAMED", "Tracking", "normalize"]
