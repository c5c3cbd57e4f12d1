"""Running `rfopt` commands on `tests/tiny_study.py` in subprocesses, killing them, and comparing the studies
they leave: shared by the crash, fault and worker tests and by bench/workers.py. And the same crashes in this process
(`crash_and_rerun_here`: a run "dies" at a crash point by raising `Died`; the `dies_at` fixture sets where)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import fsspec
import optuna
import torch
from safetensors.torch import load
from rfopt.storage.schema import trial_attrs

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
STUDY_FILE = TESTS / "tiny_study.py"
# Per-chunk training metrics that measure time, not training.
TIMINGS = {"seconds", "swap_seconds", "eval_seconds", "started_at", "step_time"}


def env(tiny_model, **extra) -> dict[str, str]:
    """Environment for a subprocess that imports this checkout's rfopt and the test kit, on one thread."""
    variables = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), str(TESTS)]), OMP_NUM_THREADS="1",
                     MKL_NUM_THREADS="1", RFOPT_TEST_TINY_MODEL=str(tiny_model))
    variables.update({k: str(v) for k, v in extra.items()})
    return variables


def rfopt_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "rfopt.cli", *args]


def run_command(storage: str, *extra: str) -> list[str]:
    return rfopt_command("run", str(STUDY_FILE), "--storage", storage, "--no-progress", *extra)


def worker_command(storage: str, checkpoints: Path | str, *extra: str) -> list[str]:
    return rfopt_command("worker", str(STUDY_FILE), "--storage", storage, "--checkpoint-dir", str(checkpoints),
                         *extra)


_SIGINT_AT_DEFAULT = ("import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
                      "os.execvp(sys.argv[1], sys.argv[1:])")
"""Run the rest of the command line (``python -c THIS COMMAND...``) with SIGINT at its default, in the same process."""


def start(command: list[str], cwd: Path, environ: dict[str, str], log: Path) -> subprocess.Popen:
    """Start `command` with SIGINT at its default, as a terminal starts a foreground command, however this process
    holds it: a suite run as a background job of a non-interactive shell (``make test-all &``, ``nohup ... &``)
    inherits SIGINT ignored, and so would every process it starts, which a test's Ctrl-C then does not reach (the
    study runs to its end). The command replaces the small launcher (``exec``): the process's pid is the command's."""
    return subprocess.Popen([sys.executable, "-c", _SIGINT_AT_DEFAULT, *command], cwd=cwd, env=environ,
                            stdout=open(log, "ab"), stderr=subprocess.STDOUT)


def run(command: list[str], cwd: Path, environ: dict[str, str], log: Path, timeout: float = 600) -> int:
    process = start(command, cwd, environ, log)
    try:
        return process.wait(timeout=timeout)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def events(path: Path) -> list[tuple[str, int, int, int, float]]:
    """The crash-point log: (point, trial, unit, pid, time) per line, in order."""
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        point, trial, unit, pid, at = line.split()
        rows.append((point, int(trial), int(unit), int(pid), float(at)))
    return rows


def retrained_after_durable(log: list[tuple]) -> list[tuple[int, int]]:
    """Units whose training started again after their checkpoint was durable: each would be a chunk trained twice."""
    durable: set[tuple[int, int]] = set()
    twice = []
    for point, trial, unit, *_ in log:
        if point == "checkpoint-saved":
            durable.add((trial, unit))
        elif point == "unit-started" and (trial, unit) in durable:
            twice.append((trial, unit))
    return twice


def commits(log: list[tuple]) -> dict[tuple[int, int], int]:
    counts: dict[tuple[int, int], int] = defaultdict(int)
    for point, trial, unit, *_ in log:
        if point == "unit-committed":
            counts[(trial, unit)] += 1
    return dict(counts)


def trials(storage: str, name: str = "tiny") -> list[optuna.trial.FrozenTrial]:
    return optuna.load_study(study_name=name, storage=storage).get_trials()


def train_metrics(trial: optuna.trial.FrozenTrial) -> dict[int, dict]:
    """Per chunk: the eval metrics and the training metrics that do not measure time."""
    out = {}
    for key, value in trial_attrs(trial).items():
        if key.startswith("rfopt:metrics:"):
            train = {k: v for k, v in value.get("train", {}).items() if k not in TIMINGS}
            out[int(key.rsplit(":", 1)[1])] = {"eval": value["eval"], "train": train, "chunk": value["chunk"]}
    return out


def read_bytes(location: Path | str) -> bytes:
    """A file in a checkpoint store: a local path or a URL (``s3://...``)."""
    with fsspec.open(str(location), "rb") as f:
        return f.read()


def names_in(location: Path | str) -> list[str]:
    """What a directory of a checkpoint store holds (a local path or a URL), by name."""
    fs, path = fsspec.core.url_to_fs(str(location))
    fs.invalidate_cache()
    return sorted(entry.rstrip("/").rpartition("/")[2] for entry in fs.ls(path, detail=False))


def adapter(trial: optuna.trial.FrozenTrial) -> dict[str, torch.Tensor]:
    return load(read_bytes(f"{trial_attrs(trial)['rfopt:adapter']}/adapter_model.safetensors"))


def final_checkpoint(checkpoint_dir: Path | str, number: int) -> dict[str, torch.Tensor]:
    """The tensors of a trial's latest checkpoint: weights, optimizer moments and RNG state."""
    trial_dir = f"{checkpoint_dir}/trial-{number:05d}"
    latest = read_bytes(f"{trial_dir}/LATEST").decode().strip()
    return load(read_bytes(f"{trial_dir}/{latest}/tensors.safetensors"))


def same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def assert_same_study(reference: str, ref_checkpoints: Path | str, got: str, got_checkpoints: Path | str,
                      name: str = "tiny"):
    """Every trial of `got` ended as in `reference`: state, per-chunk values and metrics, adapter, last checkpoint."""
    expected, actual = trials(reference, name), trials(got, name)
    assert len(actual) == len(expected)
    for ref, trial in zip(expected, actual):
        assert trial.state == ref.state, f"trial {trial.number}: {trial.state} != {ref.state}"
        assert trial.value == ref.value
        assert trial.intermediate_values == ref.intermediate_values, f"trial {trial.number}"
        assert train_metrics(trial) == train_metrics(ref), f"trial {trial.number}: per-chunk metrics differ"
        if ref.state == optuna.trial.TrialState.COMPLETE:
            assert same_tensors(adapter(trial), adapter(ref)), f"trial {trial.number}: adapter weights differ"
        assert same_tensors(final_checkpoint(got_checkpoints, trial.number),
                            final_checkpoint(ref_checkpoints, ref.number)), f"trial {trial.number}: checkpoint differs"


def assert_same_study_but_summation_order(reference: str, got: str, tolerance: float, name: str = "tiny"):
    """Every trial of `got` ended as in `reference` with the same per-chunk values and rollouts' rewards, and losses
    and adapters within `tolerance` (absolute): what a data-parallel trial promises against one device."""
    import pytest

    expected, actual = trials(reference, name), trials(got, name)
    assert len(actual) == len(expected)
    for one, two in zip(expected, actual):
        assert two.state == one.state, f"trial {one.number}: {two.state} != {one.state}"
        assert two.intermediate_values == one.intermediate_values, f"trial {one.number}"
        for chunk, metrics in train_metrics(one).items():
            got_train, want = train_metrics(two)[chunk]["train"], metrics["train"]
            assert (got_train["reward"], got_train["reward_std"]) == (want["reward"], want["reward_std"])
            assert got_train["loss"] == pytest.approx(want["loss"], abs=tolerance)
        if one.state == optuna.trial.TrialState.COMPLETE:
            a, b = adapter(one), adapter(two)
            assert a.keys() == b.keys() and max((a[k] - b[k]).abs().max().item() for k in a) <= tolerance
            assert any(k.endswith("lora_B.weight") and a[k].abs().max() > 1e-4 for k in a)  # it did train


# ---------------------------------------------------------------------- crashes in this process
class Died(BaseException):
    """A run that died at a crash point (`rfopt.storage.crashpoints`, in this process): nothing in rfopt catches it."""


def run_here(study_file: Path, storage: str, checkpoints: Path | str, *flags: str) -> int:
    """`rfopt run STUDY_FILE` in this process; its exit code."""
    from rfopt.cli import main

    return main(["run", str(study_file), "--storage", storage, "--no-progress", "--checkpoint-dir", str(checkpoints),
                 *flags])


class DyingRuns:
    """Where the runs in this process die: ``at("point:n")``, the n-th time each reaches the crash point
    (`rfopt.storage.crashpoints`), raising `Died`; ``at(None)``, nowhere. Undone with the test's `monkeypatch`."""

    def __init__(self, monkeypatch) -> None:
        from rfopt.storage import crashpoints

        def die():
            raise Died

        self.monkeypatch, self.crashpoints = monkeypatch, crashpoints
        monkeypatch.setattr(crashpoints, "_die", die)

    def at(self, point: str | None) -> None:
        self.monkeypatch.setattr(self.crashpoints, "_counts", {})  # each run counts from 0, as a new process does
        if point is None:
            self.monkeypatch.delenv("RFOPT_CRASH_AT", raising=False)
        else:
            self.monkeypatch.setenv("RFOPT_CRASH_AT", point)

    def log_events(self, path: Path | None) -> None:
        """Log every crash point reached to `path` (``RFOPT_EVENT_LOG``); None: stop."""
        if path is None:
            self.monkeypatch.delenv("RFOPT_EVENT_LOG", raising=False)
        else:
            self.monkeypatch.setenv("RFOPT_EVENT_LOG", str(path))


def crash_and_rerun_here(study_file: Path, points: list[str], where: Path, dying: DyingRuns, *flags: str,
                         checkpoints: tuple[Path | str, Path | str] | None = None, name: str = "tiny"):
    """Run `study_file` in this process uninterrupted, then again dying once at each of `points` (``point:n``) and
    once more to its end, each run as a new process would; check that both studies ended alike
    (`assert_same_study`). `checkpoints`: the two runs' checkpoint locations (default: under `where`); `name`: the
    study's.
    Returns (the points it died at, the event log of the crashed study, its storage)."""
    reference_ck, ck = checkpoints or (where / "ref-ck", where / "ck")
    reference = f"sqlite:///{where / 'ref.db'}"
    assert run_here(study_file, reference, reference_ck, *flags) == 0
    log = where / "events.log"
    dying.log_events(log)
    storage = f"sqlite:///{where / 'crash.db'}"
    died_at = []
    for point in points:
        dying.at(point)
        try:
            assert run_here(study_file, storage, ck, *flags) == 0
        except Died:
            died_at.append(point)
    dying.at(None)
    assert run_here(study_file, storage, ck, *flags) == 0
    assert all(t.state != optuna.trial.TrialState.RUNNING for t in trials(storage, name))
    assert_same_study(reference, reference_ck, storage, ck, name)
    return died_at, events(log), storage
