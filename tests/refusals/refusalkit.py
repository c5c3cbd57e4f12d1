"""What the refusal tests share: a study on a SQLite file in the test's folder and a call of `optimize` on it, and what
a refused call must leave as it was (the study's attrs and trials, the files beside it, every path under a folder)."""

from __future__ import annotations

import optuna

import rfopt
from rfopt.storage.schema import trial_attrs
from rfopt_testkit import prompts_dataset
from stored_study import stored_study

TRAIN, EVAL = prompts_dataset(8), prompts_dataset(2, "E")


def study_at(tmp_path, name="s", **kwargs) -> rfopt.Study:
    """Study `name` in tmp_path/study.db, created or loaded."""
    return rfopt.create_study(study_name=name, storage=f"sqlite:///{tmp_path / 'study.db'}", load_if_exists=True,
                              **kwargs)


def optimize(study, space, train=TRAIN, evaluation=EVAL, **kwargs) -> None:
    """``study.optimize`` on the kit's datasets, in 2 chunks unless told, with no progress bar."""
    kwargs.setdefault("num_chunks", 2)
    study.optimize(space, train, evaluation, show_progress_bar=False, **kwargs)


def stored(tmp_path, configs, num_chunks=2) -> rfopt.Study:
    """Study "s" as `optimize(study, configs)` leaves it, written through the schema writers (tests/stored_study.py)."""
    return stored_study(f"sqlite:///{tmp_path / 'study.db'}", "s", configs, TRAIN, EVAL, num_chunks=num_chunks)


def snapshot(study, tmp_path):
    """What a refused call must leave as it was: the study's attrs, its trials, and every file beside the database."""
    trials = [(t.number, t.state, t.params, t.intermediate_values, t.user_attrs, trial_attrs(t))
              for t in study.optuna.get_trials()]
    files = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file() and p.suffix != ".db")
    return study.optuna.user_attrs, trials, files


def untouched(study, tmp_path) -> None:
    """A study that was never run: no rfopt attrs, no trials, no checkpoint directory."""
    assert study.optuna.user_attrs == {} and study.optuna.get_trials() == []
    assert not (tmp_path / "rfopt-checkpoints").exists()


def paths_under(root) -> list[str]:
    """Every file and folder under `root`, relative to it: a refused call makes none."""
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def contents(folder) -> dict:
    """Every file under `folder` with its contents: what a refused command must leave as it was."""
    return {p: p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def made_study(tmp_path, name="x") -> str:
    """The URL of a study with one RUNNING trial in tmp_path/s.db, made with Optuna directly (nothing is trained)."""
    url = f"sqlite:///{tmp_path / 's.db'}"
    study = optuna.create_study(study_name=name, storage=url, direction="maximize")
    study.ask()
    return url
