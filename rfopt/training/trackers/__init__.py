"""Each trial its own run in the user's experiment tracker: TensorBoard, Weights & Biases, MLflow, trackio.

A study's ``report_to`` (``rfopt.create_study(..., report_to="wandb")``, ``rfopt run --report-to wandb``) names the
trackers. rfopt logs to these four itself, through each tracker's own run object or client (one per trial, never the
process's one "active run"), so the trials of a gang, which train in one process at once (`rfopt.training.gang`), each
log into their own run:

| module | tracker | a trial's run | the study |
|---|---|---|---|
| `_tensorboard` | TensorBoard | the directory ``<dir>/<study>/trial-<n>`` | the folder ``<study>/``; the HParams tab |
| `_wandb` | W&B | run id ``rfopt-<study id>-<n>`` | project ``WANDB_PROJECT`` or the study; group the study |
| `_mlflow` | MLflow | a child run, found by its tags | a parent run in ``MLFLOW_EXPERIMENT_NAME`` or the study's experiment |
| `_trackio` | trackio | the run ``<study>-trial-<n>`` | the project named after the study; group the study |

Every process that trains a trial (a rerun after a crash, another worker) continues the same run. What a trial's run
holds (`Tracking`): its Optuna params and whole config; TRL's logs of every optimizer step on ``train/<name>`` at the
trial's global step (a warm clone's continuing its parent's); after each committed chunk, the ``value`` Optuna was
told and the eval metrics (``eval/<name>``); at its end its state (complete, pruned, stopped, failed) and why. At the
end of each run of the study, its leaderboard goes where the tracker groups the study.

Any other tracker TRL knows (``comet_ml``, ``clearml``, ...) is passed to each chunk's trainer as TRL's
``report_to``, with ``run_name="<study>-trial-<n>"``: its integration keeps one run per process, so a run reporting
to one trains a trial at a time (`Tracking.passed_on`).

A tracker that cannot work is refused before anything is stored (`check`): not installed, an MLflow tracking URI
that cannot be reached, W&B online without credentials (or with a server it cannot reach). One that fails while the
study runs is warned about once and logged to no more by this process; the trials go on (storage, not the tracker,
is the record). Training is the same with or without trackers: they log, and draw no random numbers.

| module | owns |
|---|---|
| `_report_to` | a study's ``report_to``: read as TRL reads it, the trackers rfopt logs itself or passes on, `check` |
| `_tracking` | `Tracking`: one process's logging of a study's trials, each into its runs, caught up from storage |
| `_records` | what rfopt tells a tracker about a trial, and the per-trial run (`TrialRun`) each tracker opens |
| `_tensorboard`, `_wandb`, `_mlflow`, `_trackio` | each tracker's runs (the table above) |
"""

from rfopt.errors import TrackerRefused
from ._report_to import NAMED, check, installed, normalize, own, passed_on
from ._tracking import Tracking

__all__ = ["NAMED", "Tracking", "TrackerRefused", "check", "installed", "normalize", "own", "passed_on"]
