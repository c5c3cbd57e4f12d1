"""The checkpoint store: each trial's latest state on disk, written durably, and its final adapter.

Layout under the store's root::

    trial-00003/
        LATEST                 the name of the newest complete checkpoint (replaced atomically)
        unit-0002/             one checkpoint: the state after the trial's third chunk unit
            tensors.safetensors    weights, optimizer tensors, torch RNG state
            state.json             counters, scheduler, optimizer groups, python/numpy RNG state
            report.json            the unit's value and metrics, committed to storage after the checkpoint
        adapter/               the finished trial's adapter in PEFT format (PeftModel.from_pretrained loads it)

A checkpoint is written to a temporary directory, fsynced, renamed into place, and only then named
in ``LATEST``; older checkpoints are removed after that. A crash at any moment leaves the previous
checkpoint intact and named; a failed write (a full disk) removes what it wrote and raises
`CheckpointError`, leaving the previous checkpoint as it was. Retention: a trial keeps its latest
checkpoint (a pruned or stopped trial can still be cloned warm from it) and, once finished, its
adapter.

A unit's report rides along in its checkpoint, so that a crash after the checkpoint is durable and
before the report reaches storage is committed with exactly the value and metrics it would have had.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .crashpoints import reach
from .runner import RngState, TrialState


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, unreadable or corrupt; names the trial and the file."""


@dataclass
class UnitReport:
    """What a unit commits to storage: its value (``trial.report(value, step=unit)``), metrics and samples."""

    unit: int
    value: float
    metrics: dict[str, Any]
    samples: list[Any]


class CheckpointStore:
    """Checkpoints of a study's trials in a local directory."""

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def trial_dir(self, trial_number: int) -> Path:
        return self.root / f"trial-{trial_number:05d}"

    def adapter_dir(self, trial_number: int) -> Path:
        return self.trial_dir(trial_number) / "adapter"

    # ------------------------------------------------------------------ resume checkpoints
    def save(self, trial_number: int, state: TrialState, report: UnitReport | None = None) -> Path:
        """Write `state` (and the report of the unit that produced it) durably as the trial's latest checkpoint.

        Returns the checkpoint's directory. Raises `CheckpointError` if the write fails (e.g. the disk is
        full); the previous checkpoint is then intact and still the latest.
        """
        from safetensors.torch import save_file

        trial_dir = self.trial_dir(trial_number)
        name = f"unit-{state.units_done:04d}"
        unit = state.units_done - 1
        try:
            trial_dir.mkdir(parents=True, exist_ok=True)
            for stale in trial_dir.glob(".unit-*"):  # left by a process killed mid-write
                shutil.rmtree(stale, ignore_errors=True)
            staging = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=trial_dir))
        except OSError as exc:
            raise self._write_error(trial_number, name, exc) from exc
        try:
            tensors, meta = _flatten(state)
            save_file(tensors, str(staging / "tensors.safetensors"))
            _write_durably(staging / "state.json", json.dumps(meta).encode())
            if report is not None:
                _write_durably(staging / "report.json", json.dumps(asdict(report)).encode())
            _fsync_file(staging / "tensors.safetensors")
            reach("checkpoint-staged", trial=trial_number, unit=unit)
            newer = self.latest(trial_number)
            if newer is not None and newer.name > name:  # a worker whose lease expired, writing late
                raise CheckpointError(f"trial {trial_number}: not writing {name}, the trial already has {newer.name}")
            final = trial_dir / name
            if final.exists():
                shutil.rmtree(final)
            os.replace(staging, final)
            _fsync_dir(trial_dir)
            reach("checkpoint-renamed", trial=trial_number, unit=unit)
            _write_durably(trial_dir / "LATEST", name.encode())
        except BaseException as exc:
            shutil.rmtree(staging, ignore_errors=True)
            if isinstance(exc, CheckpointError):
                raise
            if isinstance(exc, Exception):  # OSError, or safetensors' own error for a failed write
                raise self._write_error(trial_number, name, exc) from exc
            raise
        for old in trial_dir.glob("unit-*"):
            if old.name < name:
                shutil.rmtree(old, ignore_errors=True)
        return final

    def _write_error(self, trial_number: int, name: str, exc: Exception) -> CheckpointError:
        previous = self.latest(trial_number)
        kept = f"the previous checkpoint {previous.name} is kept" if previous else "the trial had no checkpoint yet"
        return CheckpointError(f"trial {trial_number}: writing checkpoint {name} in {self.trial_dir(trial_number)} "
                               f"failed ({exc}); {kept}")

    def latest(self, trial_number: int) -> Path | None:
        pointer = self.trial_dir(trial_number) / "LATEST"
        if not pointer.exists():
            return None
        return self.trial_dir(trial_number) / pointer.read_text().strip()

    def load(self, trial_number: int) -> TrialState | None:
        """The trial's latest checkpoint, or None if it has none; `CheckpointError` if it is unreadable."""
        from safetensors.torch import load_file

        path = self.latest(trial_number)
        if path is None:
            return None
        try:
            meta = json.loads((path / "state.json").read_text())
            tensors = load_file(str(path / "tensors.safetensors"))
            return _unflatten(tensors, meta)
        except Exception as exc:  # noqa: BLE001 - OSError, bad JSON, safetensors' own error for a damaged file
            raise CheckpointError(f"trial {trial_number}: checkpoint {path} is unreadable: {exc}") from exc

    def load_report(self, trial_number: int) -> UnitReport | None:
        """The report stored with the trial's latest checkpoint, or None (no checkpoint, or one without a report)."""
        path = self.latest(trial_number)
        if path is None or not (path / "report.json").exists():
            return None
        try:
            return UnitReport(**json.loads((path / "report.json").read_text()))
        except (OSError, ValueError, TypeError) as exc:
            raise CheckpointError(f"trial {trial_number}: report {path / 'report.json'} is unreadable: {exc}") from exc

    # ------------------------------------------------------------------ warm starts
    def save_warm_start(self, trial_number: int, weights: dict[str, Any], parent: int, from_unit: int) -> Path:
        """The weights a warm-started clone starts from, copied from its parent when the clone is made."""
        from safetensors.torch import save_file

        target = self.trial_dir(trial_number) / "warm-start"
        target.mkdir(parents=True, exist_ok=True)
        tmp = target / ".weights.safetensors.tmp"
        save_file({k: v.detach().contiguous().cpu() for k, v in weights.items()}, str(tmp))
        _fsync_file(tmp)
        os.replace(tmp, target / "weights.safetensors")
        _write_durably(target / "origin.json", json.dumps({"parent": parent, "from_unit": from_unit}).encode())
        return target

    def load_warm_start(self, trial_number: int) -> dict[str, Any]:
        from safetensors.torch import load_file

        path = self.trial_dir(trial_number) / "warm-start" / "weights.safetensors"
        try:
            return load_file(str(path))
        except Exception as exc:  # noqa: BLE001 - OSError, or safetensors' own error for a damaged file
            raise CheckpointError(f"trial {trial_number}: warm-start weights {path} are unreadable: {exc}") from exc

    # ------------------------------------------------------------------ final adapters
    def save_adapter(self, trial_number: int, model: Any, adapter: str, tokenizer: Any = None) -> Path:
        """Save a PEFT adapter so that ``PeftModel.from_pretrained(base, path)`` loads it."""
        target = self.adapter_dir(trial_number)
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".adapter.", dir=target.parent))
        try:
            model.save_pretrained(str(staging), selected_adapters=[adapter])
            # PEFT puts every adapter but "default" in a subdirectory named after it.
            saved = staging / adapter if (staging / adapter).is_dir() else staging
            if tokenizer is not None:
                tokenizer.save_pretrained(str(saved))
            if target.exists():
                shutil.rmtree(target)
            os.replace(saved, target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return target

    def save_model(self, trial_number: int, model: Any, tokenizer: Any = None) -> Path:
        """Save a fully fine-tuned model (no adapter) where the adapter would go."""
        target = self.adapter_dir(trial_number)
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".model.", dir=target.parent))
        model.save_pretrained(str(staging))
        if tokenizer is not None:
            tokenizer.save_pretrained(str(staging))
        if target.exists():
            shutil.rmtree(target)
        os.replace(staging, target)
        return target


def _flatten(state: TrialState) -> tuple[dict[str, Any], dict[str, Any]]:
    import torch

    tensors: dict[str, Any] = {f"weights.{k}": v.detach().contiguous().cpu() for k, v in state.weights.items()}
    meta: dict[str, Any] = {
        "units_done": state.units_done,
        "global_step": state.global_step,
        "tokens_seen": state.tokens_seen,
        "scheduler": state.scheduler,
        "optimizer": None,
        "rng": None,
    }
    if state.optimizer is not None:
        plain_state: dict[str, dict[str, Any]] = {}
        for index, entry in state.optimizer["state"].items():
            plain_state[str(index)] = {}
            for key, value in entry.items():
                if torch.is_tensor(value):
                    tensors[f"optimizer.{index}.{key}"] = value.detach().contiguous().cpu()
                    plain_state[str(index)][key] = {"tensor": f"optimizer.{index}.{key}"}
                else:
                    plain_state[str(index)][key] = value
        meta["optimizer"] = {"state": plain_state, "param_groups": state.optimizer["param_groups"]}
    if state.rng is not None:
        tensors["rng.torch"] = state.rng.torch
        for i, cuda_state in enumerate(state.rng.cuda):
            tensors[f"rng.cuda.{i}"] = cuda_state
        version, internal, gauss = state.rng.python
        kind, keys, pos, has_gauss, cached = state.rng.numpy
        meta["rng"] = {
            "python": [version, list(internal), gauss],
            "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)],
            "cuda_devices": len(state.rng.cuda),
        }
    return tensors, meta


def _unflatten(tensors: dict[str, Any], meta: dict[str, Any]) -> TrialState:
    import numpy as np

    weights = {k[len("weights.") :]: v for k, v in tensors.items() if k.startswith("weights.")}
    optimizer = None
    if meta["optimizer"] is not None:
        opt_state = {}
        for index, entry in meta["optimizer"]["state"].items():
            opt_state[int(index)] = {
                key: tensors[value["tensor"]] if isinstance(value, dict) and "tensor" in value else value
                for key, value in entry.items()
            }
        optimizer = {"state": opt_state, "param_groups": meta["optimizer"]["param_groups"]}
    rng = None
    if meta["rng"] is not None:
        version, internal, gauss = meta["rng"]["python"]
        kind, keys, pos, has_gauss, cached = meta["rng"]["numpy"]
        rng = RngState(
            python=(version, tuple(internal), gauss),
            numpy=(kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached),
            torch=tensors["rng.torch"],
            cuda=[tensors[f"rng.cuda.{i}"] for i in range(meta["rng"]["cuda_devices"])],
        )
    return TrialState(
        units_done=meta["units_done"],
        global_step=meta["global_step"],
        tokens_seen=meta["tokens_seen"],
        weights=weights,
        optimizer=optimizer,
        scheduler=meta["scheduler"],
        rng=rng,
    )


def _write_durably(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
