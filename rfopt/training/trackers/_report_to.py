"""A study's ``report_to``: read as TRL reads it, split into the trackers rfopt logs to itself and those passed on to
TRL, and each refused up front where it could not work here (`check`)."""

from __future__ import annotations

import os
from collections.abc import Sequence

from rfopt.errors import MissingPackage, TrackerRefused, TypeRefusal

NAMED = ("tensorboard", "wandb", "mlflow", "trackio")
"""The trackers rfopt logs each trial's run to itself (others are passed to TRL as they are)."""


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
        raise TypeRefusal(f"report_to must be a tracker name or a list of them (e.g. 'tensorboard'), got "
                          f"{type(report_to).__name__} {report_to!r}")
    names = [report_to] if isinstance(report_to, str) else list(report_to)
    if not all(isinstance(n, str) for n in names):
        raise TypeRefusal(f"report_to must be a tracker name or a list of them, got {report_to!r}")
    names = [n.strip() for n in names if n.strip() and n.strip() != "none"]
    if names == ["all"]:
        return names
    from transformers.integrations.integration_utils import INTEGRATION_TO_CALLBACK

    unknown = [n for n in names if n not in INTEGRATION_TO_CALLBACK]
    if unknown:
        raise TrackerRefused(f"report_to: unknown tracker {unknown}; use one of {sorted(INTEGRATION_TO_CALLBACK)}, "
                         "'all' or 'none'")
    names = list(dict.fromkeys(names))
    missing = [n for n in names if not _installed(n)]
    if missing:
        packages = " ".join(_INSTALLED[n][1] for n in missing)
        extra = ("; pip install 'rfopt[trackers]' installs the four that rfopt logs itself"
                 if any(n in NAMED for n in missing) else "")
        raise MissingPackage(
            f"report_to: {', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not installed here, so every "
            f"trial would fail at its first chunk; install {'it' if len(missing) == 1 else 'them'} (pip install "
            f"{packages}) or leave {'it' if len(missing) == 1 else 'them'} out of report_to (installed here: "
            f"{installed() or 'none'}){extra}")
    return names


def installed() -> list[str]:
    """The trackers whose packages are installed here."""
    return [name for name in _INSTALLED if _installed(name)]


def _installed(name: str) -> bool:
    from transformers.integrations import integration_utils

    check = getattr(integration_utils, _INSTALLED[name][0], None) if name in _INSTALLED else None
    return True if check is None else bool(check())  # a tracker rfopt has no check for: TRL decides


def own(report_to: Sequence[str]) -> list[str]:
    """The trackers of `report_to` that rfopt logs to itself (``"all"``: those installed)."""
    return [n for n in NAMED if n in report_to or ("all" in report_to and _installed(n))]


def passed_on(report_to: Sequence[str]) -> list[str]:
    """The trackers of `report_to` given to TRL's ``report_to`` (``"all"``: the other installed ones)."""
    if "all" in report_to:
        from transformers.integrations import get_available_reporting_integrations

        return [n for n in get_available_reporting_integrations() if n not in NAMED]
    return [n for n in report_to if n not in NAMED]


# ---------------------------------------------------------------------- refused up front
def check(report_to: Sequence[str]) -> None:
    """Refuse (`TrackerRefused`) a tracker of `report_to` that could not log here: MLflow whose tracking URI cannot
    be reached, W&B online without credentials or with a server it cannot reach. (`normalize` refused the ones not
    installed.) Call it before anything is stored."""
    trackers = own(report_to)
    if "mlflow" in trackers:
        _check_mlflow()
    if "wandb" in trackers:
        _check_wandb()


_MLFLOW_PROBE = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}
"""A tracking server is asked once, for at most 10 s (MLflow's own default retries for minutes)."""


def _check_mlflow() -> None:
    import mlflow
    from mlflow import MlflowClient

    uri = mlflow.get_tracking_uri()
    fix = ("set MLFLOW_TRACKING_URI to a server that is up (mlflow server ...) or a local store "
           "(sqlite:///mlflow.db), or leave mlflow out of report_to")
    path = _local_path(uri)
    if path is not None:
        folder = os.path.dirname(os.path.abspath(path)) if uri.startswith("sqlite") else os.path.abspath(path)
        while folder and not os.path.exists(folder):  # what would be created: the nearest existing folder decides
            folder = os.path.dirname(folder)
        if not os.access(folder or ".", os.W_OK):
            raise TrackerRefused(f"report_to: mlflow: its tracking store {uri} is in {folder}, which is not writable "
                                 f"here; {fix}")
        return
    saved = {name: os.environ.get(name) for name in _MLFLOW_PROBE}
    os.environ.update(_MLFLOW_PROBE)
    try:
        MlflowClient(uri).search_experiments(max_results=1)
    except Exception as exc:  # noqa: BLE001 - whatever the client says, the URI cannot be logged to
        raise TrackerRefused(f"report_to: mlflow: its tracking URI {uri} cannot be reached ({type(exc).__name__}: "
                             f"{str(exc)[:300]}); {fix}") from exc
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _local_path(uri: str) -> str | None:
    """The file or folder of a local MLflow store (``sqlite:///...``, ``file:...`` or a plain path), else None."""
    if uri.startswith("sqlite:///"):  # sqlite:///relative.db, sqlite:////absolute.db
        return uri[len("sqlite:///"):] or None
    if uri.startswith("file:"):
        return uri[len("file://"):] if uri.startswith("file://") else uri[len("file:"):]
    return uri if "://" not in uri and uri != "databricks" else None


def _check_wandb() -> None:
    import wandb

    settings = wandb.setup().settings
    if settings.mode in ("offline", "dryrun", "disabled"):
        return
    fix = ("run `wandb login` (or set WANDB_API_KEY), or log offline with WANDB_MODE=offline and upload the runs "
           "later with `wandb sync`")
    if not wandb.login(prompt=False, verify=False):
        raise TrackerRefused(f"report_to: wandb is online (WANDB_MODE={os.environ.get('WANDB_MODE', 'unset')}) but "
                             f"has no credentials for {settings.base_url}; {fix}")
    try:
        wandb.login(prompt=False, verify=True)
    except Exception as exc:  # noqa: BLE001 - bad credentials, or a server it cannot reach
        raise TrackerRefused(f"report_to: wandb cannot log in to {settings.base_url} ({type(exc).__name__}: "
                             f"{str(exc)[:300]}); {fix}") from exc
