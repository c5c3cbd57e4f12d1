"""The checkpoint store: each trial's latest state, written durably, and its final adapter; and what a study does
with a store's location (`Location`, `location_exists`, `download`).

Where the files go (a local directory or an object store, and how each is written durably) is
`rfopt.storage.files`; how a `TrialSnapshot` becomes a checkpoint's tensors and ``state.json`` is
`rfopt.storage.state`.

Layout under the store's root (a local directory, or an fsspec URL such as ``s3://bucket/prefix``)::

    rfopt-study.json           which study these checkpoints belong to (its identity, name and storage)
    trial-00003/
        LATEST                 the name of the newest complete checkpoint (replaced atomically)
        unit-0002/             one checkpoint: the state after the trial's third chunk unit
            tensors.safetensors    weights, optimizer tensors, torch RNG state
            state.json             counters, scheduler, optimizer groups, python/numpy RNG state
            report.json            the unit's value and metrics, committed to storage after the checkpoint
        warm-start/            a warm-started clone's starting weights, copied from its parent
        best/                  the adapter after the trial's best-valued chunk (not collapsed), in PEFT format
        adapter/               the finished trial's adapter in PEFT format (PeftModel.from_pretrained loads it)
    gangs/<id>.json            while a gang's units are being named: which checkpoint each member's LATEST names

A checkpoint's files are first written to a local staging directory (the state's files while its unit is being
evaluated, `stage`; the unit's report after), then published, and only then named in ``LATEST``; older checkpoints
are removed after that. ``LATEST`` is the commit point. In a local directory, publishing is fsync and rename, and ``LATEST`` is replaced by rename. In an object
store (no directory rename there), every file of the checkpoint is uploaded first and ``LATEST`` is
then written as one object, which S3 and GCS replace atomically. A crash at any moment leaves the
previous checkpoint intact and named; a failed write (a full disk, a refused upload) raises
`CheckpointError` naming the trial, the checkpoint and the cause, and leaves the previous checkpoint
the latest. Retention: a trial keeps its latest checkpoint (a pruned or stopped trial can still be
cloned warm from it), the adapter of its best chunk so far (``best/``, replaced when a later chunk scores better;
pruned trials keep theirs) and, once finished, its final adapter. So a trial holds at most one resume checkpoint
(adapter, optimizer state and RNG: about 3x the adapter's weights with AdamW) and two adapters (best and final):
for SmolLM2-135M with LoRA r16 on every linear layer, some 56 MiB + 2 x 19 MiB.

A store belongs to exactly one study: ``rfopt-study.json`` names the study's identity (``rfopt:id``, given to
the study when it first runs), and `CheckpointStore.claim` refuses a store that names another study, or one
that holds trials' checkpoints and names none. So a stale directory (of a study whose database was
deleted) or a foreign one (a same-named study in another database) is never taken for this study's.

A gang's units (several trials trained in lockstep, `rfopt.training.gang`) become durable together: every member's
checkpoint is published first, then one record under ``gangs/`` is written (the gang's commit point), then each
member's ``LATEST``; a store read after a crash finishes naming them (`save_gang`). So a rerun either has all of a
gang's units or none, and trains the gang again with the same members.

A unit's report rides along in its checkpoint, so that a crash after the checkpoint is durable and
before the report reaches storage is committed with exactly the value and metrics it would have had.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rfopt.errors import CheckpointError, Refusal, TypeRefusal

from .crashpoints import reach
from .files import files_at, is_url
from .state import TrialSnapshot, UnitReport, from_tensors, to_tensors

Location = Path | str
"""Where something in a store is: a `Path` in a local store, a URL string (``s3://bucket/prefix/...``) in an object store."""

OWNER_FILE = "rfopt-study.json"


@dataclass(frozen=True)
class Staged:
    """A unit's checkpoint whose state is written to a local staging directory (`CheckpointStore.stage`), not yet
    published or named."""

    trial: int
    name: str
    """The checkpoint's name once published (``unit-0002``)."""
    units_done: int
    path: Path


def location_exists(location: Location) -> bool:
    """Whether a file or directory exists at `location` (a local path or a URL)."""
    return files_at(location).exists("")


def download(location: Location, target: str | os.PathLike) -> Path:
    """Copy the directory at `location` (a local path or a URL) into the new local directory `target`, and check every
    safetensors file copied (`safetensors_problem`): a truncated or corrupt one raises `CheckpointError` naming it, and
    leaves no `target` behind."""
    target = Path(target)
    files_at(location).download("", target)
    for path in sorted(target.rglob("*.safetensors")):
        problem = safetensors_problem(path)
        if problem is not None:
            shutil.rmtree(target, ignore_errors=True)
            name = path.relative_to(target).as_posix()
            raise CheckpointError(f"{name} in {location} is not a whole safetensors file: {problem}; nothing was "
                                  "exported (the file was cut short or damaged where it is stored)")
    return target


def export(location: Location, target: str | os.PathLike, *, overwrite: bool, keep: dict[str, Path]) -> Path:
    """Copy the adapter at `location` to the local folder `target` without ever deleting what rfopt did not write, and
    return `target`.

    Refused (`Refusal`) before anything changes: ``""``, ``"."``, the working directory or a folder holding it; a file;
    a folder inside the source or inside `keep` (the study's own files: ``{"the checkpoint store": root, ...}``); a
    folder that is not empty, unless `overwrite`; and even then a folder that holds one of `keep`'s paths or another
    checkpoint store. The copy is made in a hidden sibling folder and checked (`download`) before it is renamed into
    place, so a damaged source or a failed copy leaves `target` as it was.
    """
    if not isinstance(overwrite, bool):
        raise TypeRefusal(f"export_best: overwrite={overwrite!r}: give True or False")
    if str(target).strip() in ("", "."):
        raise Refusal(f"export_best: path {str(target)!r} is the working directory: name a new folder for the adapter "
                      "(e.g. 'best-adapter')")
    given = Path(target)
    where = Path(os.path.realpath(given))
    cwd = Path(os.path.realpath(Path.cwd()))
    if where == cwd or where in cwd.parents:
        raise Refusal(f"export_best: {str(given)!r} is the working directory or holds it: name a new folder for the "
                      "adapter (e.g. 'best-adapter')")
    if given.is_file() or (given.exists() and not given.is_dir()):
        raise Refusal(f"export_best: {str(given)!r} is a file, not a folder: name a new folder for the adapter "
                      "(nothing was changed)")
    sources = {} if is_url(location) else {"the adapter being exported": Path(files_at(location).location(""))}
    guarded = {what: Path(os.path.realpath(path)) for what, path in {**keep, **sources}.items()}
    for what, path in guarded.items():
        if path.is_dir() and (where == path or path in where.parents):
            raise Refusal(f"export_best: {str(given)!r} is inside {what} ({path}): export outside it")
    if given.is_dir() and any(given.iterdir()):
        if not overwrite:
            raise Refusal(f"export_best: {str(given)!r} is a folder that is not empty: name a new folder, or pass "
                          "overwrite=True to replace it (nothing was changed)")
        for what, path in guarded.items():
            if where == path or where in path.parents:
                raise Refusal(f"export_best: {str(given)!r} holds {what} ({path}): overwrite=True never removes it; "
                              "name another folder")
        foreign = _store_under(where)
        if foreign is not None:
            raise Refusal(f"export_best: {str(given)!r} holds a checkpoint store ({foreign}): overwrite=True never "
                          "removes it; name another folder")
    beside = Path(os.path.abspath(given))
    beside.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{beside.name}.export-", dir=beside.parent))
    try:
        copied = download(location, staging / "adapter")
        if given.is_dir():  # empty, or replaced with overwrite=True: set aside until the copy is in place
            os.rename(given, staging / "replaced")
            try:
                os.rename(copied, given)
            except BaseException:
                os.rename(staging / "replaced", given)
                raise
        else:
            os.rename(copied, given)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return given


def _store_under(folder: Path) -> Path | None:
    """A checkpoint store (a folder holding ``rfopt-study.json``) at or under `folder`, or None."""
    for root, _, files in os.walk(folder):
        if OWNER_FILE in files:
            return Path(root)
    return None


def safetensors_problem(path: Path) -> str | None:
    """What is wrong with the safetensors file at `path`, or None: its 8-byte header length, its JSON header, and a
    size that is exactly the header's plus the tensor data the header describes (a truncated file is shorter)."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return f"{size} bytes, fewer than a safetensors header's 8"
        length = int.from_bytes(head, "little")
        if length > size - 8:
            return f"its header says {length} bytes follow, and {size - 8} do"
        try:
            header = json.loads(f.read(length))
            end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
        except (ValueError, KeyError, TypeError, IndexError, AttributeError):
            return "its header is not a safetensors header"
    if 8 + length + end != size:
        return f"{size} bytes, and its header describes {8 + length + end}"
    return None


class CheckpointStore:
    """Checkpoints of a study's trials in a local directory or at an fsspec URL.

    >>> store = CheckpointStore("s3://my-bucket/rfopt/demo")     # or a local or shared directory
    >>> store.latest(3)                                          # 's3://my-bucket/rfopt/demo/trial-00003/unit-0002'

    Paths it returns are `Path`s for a local store and URL strings for an object store.
    """

    def __init__(self, root: str | os.PathLike) -> None:
        self._files = files_at(root)
        self._files.create()
        self.root = self._files.location("")
        self._tokenizers: dict[int, tuple[Any, tuple[Any, ...], dict[str, bytes]]] = {}
        """Each tokenizer's files as ``save_pretrained`` wrote them, by the tokenizer's identity (`_tokenizer_files`)."""

    # ------------------------------------------------------------------ which study the store belongs to
    def owner(self) -> dict[str, Any] | None:
        """The study this store belongs to (``{"id", "study", "storage"}``), or None if it names none."""
        try:
            return json.loads(self._files.read(OWNER_FILE))
        except FileNotFoundError:
            return None
        except Exception as exc:  # noqa: BLE001 - unreadable: say where, do not guess whose it is
            raise CheckpointError(f"checkpoint store {self.root}: {OWNER_FILE} is unreadable: {exc}") from exc

    def claim(self, uid: str, study_name: str, storage: str, *, recorded: bool) -> None:
        """Make this store study `uid`'s, or raise `CheckpointError` saying whose it is and what to do.

        A store that names this study is fine; one that names another study is refused. A store that names no
        study is claimed (its marker written) if it holds no trial's checkpoints, or if the study already records
        this location (`recorded`: a study from an rfopt that wrote no marker).
        """
        owner = self.owner()
        this = f"study {study_name!r} (id {uid}) of {storage}"
        if owner is not None:
            if owner.get("id") == uid:
                return
            raise CheckpointError(
                f"checkpoint store {self.root} belongs to study {owner.get('study')!r} (id {owner.get('id')}) of "
                f"{owner.get('storage')}, not to {this}. If that study is gone (its database deleted), delete "
                f"{self.root}; otherwise give this study a checkpoint location of its own (checkpoint_dir=..., "
                "--checkpoint-dir)"
            )
        if not recorded and any(name.startswith("trial-") for name in self._files.names("")):
            raise CheckpointError(
                f"checkpoint store {self.root} holds trials' checkpoints but names no study, so they may be another "
                f"study's; {this} will not write there. Delete {self.root} if they are stale, or give this study "
                "another checkpoint location"
            )
        data = json.dumps({"id": uid, "study": study_name, "storage": storage}).encode()
        try:
            self._files.write_pointer(OWNER_FILE, data)
        except Exception as exc:  # noqa: BLE001 - the store cannot take writes: the same error as check_writable
            raise CheckpointError(f"checkpoint store {self.root}: cannot write there: {exc}") from exc

    def trial_dir(self, trial_number: int) -> Location:
        return self._files.location(_trial_key(trial_number))

    def adapter_dir(self, trial_number: int) -> Location:
        return self._files.location(f"{_trial_key(trial_number)}/adapter")

    # ------------------------------------------------------------------ resume checkpoints
    def save(self, trial_number: int, state: TrialSnapshot, report: UnitReport | None = None) -> Location:
        """Write `state` (and the report of the unit that produced it) durably as the trial's latest checkpoint.

        Returns the checkpoint's location. Raises `CheckpointError` if the write fails (e.g. the disk is full, an
        upload is refused); the previous checkpoint is then intact and still the latest.
        """
        return self.save_staged(self.stage(trial_number, state), report)

    def stage(self, trial_number: int, state: TrialSnapshot) -> Staged:
        """Write `state`'s files (tensors and ``state.json``) to a new staging directory and flush them to disk; nothing
        is published or named yet. `save_staged` or `save_gang` adds the unit's report and makes it the latest;
        `discard` drops it. The engine stages a unit's checkpoint while the unit is evaluated
        (`rfopt.engine.running.unit`): `state` must not change meanwhile.

        Raises `CheckpointError` if the write fails; nothing is left behind then."""
        from safetensors.torch import save_file

        trial = _trial_key(trial_number)
        name = f"unit-{state.units_done:04d}"
        try:
            staging = self._files.staging(trial, name, stale=".unit-*")
        except OSError as exc:
            raise self._write_error(trial_number, name, exc) from exc
        try:
            tensors, meta = to_tensors(state)
            save_file(tensors, str(staging / "tensors.safetensors"))
            (staging / "state.json").write_bytes(json.dumps(meta).encode())
            self._files.flush(staging)  # on disk now, so that publishing has only the report to flush
        except BaseException as exc:
            shutil.rmtree(staging, ignore_errors=True)
            if isinstance(exc, Exception):  # OSError, safetensors' own error
                raise self._write_error(trial_number, name, exc) from exc
            raise
        return Staged(trial_number, name, state.units_done, staging)

    def discard(self, staged: Staged) -> None:
        """Drop a staged checkpoint that will not be saved (its unit's evaluation failed)."""
        shutil.rmtree(staged.path, ignore_errors=True)

    def save_staged(self, staged: Staged, report: UnitReport | None = None) -> Location:
        """`stage`'s checkpoint, with `report`, published and made the trial's latest: as `save`."""
        self._publish_unit(staged, report)
        self._name_latest(staged.trial, staged.name)
        return self._files.location(f"{_trial_key(staged.trial)}/{staged.name}")

    def save_gang(self, entries: list[tuple[Staged, UnitReport | None]], gang: str
                  ) -> dict[int, Location | CheckpointError]:
        """Publish the staged checkpoints (`stage`) of a gang's units (`rfopt.training.gang`), each with its report, so
        that they become the latest all together or not at all: every checkpoint is published first, then one gang
        record (``gangs/<gang>.json``, the commit point), then each trial's ``LATEST``. A crash before the record
        leaves every trial at its previous checkpoint (the gang trains the unit again, with the same members); after
        it, `load` finishes naming them. `gang` names the record (unique per gang unit).

        Returns each trial's new checkpoint, or the `CheckpointError` that kept its own from being written (its
        previous checkpoint stays its latest; the others' are saved without it). Raises `CheckpointError` when the
        gang record cannot be written (every trial keeps its previous checkpoint)."""
        names, failed = [], {}
        for staged, report in entries:
            try:
                self._publish_unit(staged, report)
                names.append((staged.trial, staged.name))
            except CheckpointError as exc:  # this trial's own write (a full disk, a late worker): it fails alone
                failed[staged.trial] = exc
        if not names:
            return failed
        unit = entries[0][0].units_done - 1
        record = {"units": {str(number): name for number, name in names}}
        reach("gang-units-written", trial=names[0][0], unit=unit)
        try:
            self._files.write_pointer(_gang_key(gang), json.dumps(record).encode())  # the commit point
        except Exception as exc:  # noqa: BLE001 - as a failed checkpoint: the previous ones stay the latest
            raise CheckpointError(f"trials {[n for n, _ in names]}: writing the gang record {_gang_key(gang)} in "
                                  f"{self.root} failed ({exc}); their previous checkpoints are kept") from exc
        reach("gang-saved", trial=names[0][0], unit=unit)
        for number, name in names:
            self._name_latest(number, name)
        self._files.remove(_gang_key(gang))
        return {**failed, **{number: self._files.location(f"{_trial_key(number)}/{name}") for number, name in names}}

    def _publish_unit(self, staged: Staged, report: UnitReport | None) -> None:
        """Add the report to a staged checkpoint and publish its files (not yet named in ``LATEST``)."""
        trial_number, name = staged.trial, staged.name
        unit = staged.units_done - 1
        try:
            if report is not None:
                (staged.path / "report.json").write_bytes(json.dumps(asdict(report)).encode())
            reach("checkpoint-staged", trial=trial_number, unit=unit)
            newer = self._latest_name(trial_number)
            if newer is not None and newer > name:  # a worker whose lease expired, writing late
                raise CheckpointError(f"trial {trial_number}: not writing {name}, the trial already has {newer}")
            self._files.publish(staged.path, f"{_trial_key(trial_number)}/{name}")
            reach("checkpoint-renamed", trial=trial_number, unit=unit)
        except BaseException as exc:
            shutil.rmtree(staged.path, ignore_errors=True)
            if isinstance(exc, CheckpointError):
                raise
            if isinstance(exc, Exception):  # OSError, an object store's refusal
                raise self._write_error(trial_number, name, exc) from exc
            raise

    def _name_latest(self, trial_number: int, name: str) -> None:
        """Make checkpoint `name` the trial's latest (the commit point of a single save), then remove older ones."""
        trial = _trial_key(trial_number)
        try:
            self._files.write_pointer(f"{trial}/LATEST", name.encode())
        except Exception as exc:  # noqa: BLE001 - as a failed write: the previous checkpoint stays the latest
            raise self._write_error(trial_number, name, exc) from exc
        for old in self._files.names(trial):
            if old.startswith("unit-") and old < name:
                self._files.remove(f"{trial}/{old}")

    def _settle_gangs(self) -> None:
        """Finish naming the checkpoints of gangs whose record was written before a crash (`save_gang`)."""
        for entry in self._files.names("gangs"):
            if not entry.endswith(".json"):
                continue
            key = f"gangs/{entry}"
            try:
                record = json.loads(self._files.read(key))
            except FileNotFoundError:  # another process settled it meanwhile
                continue
            for number, name in record["units"].items():
                latest = self._latest_name(int(number))
                if latest is None or latest < name:
                    self._name_latest(int(number), name)
            self._files.remove(key)

    def _write_error(self, trial_number: int, name: str, exc: Exception) -> CheckpointError:
        try:
            previous = self._latest_name(trial_number)
        except Exception as error:  # noqa: BLE001 - the store itself is unreachable: say so, keep the first cause
            kept = f"its previous checkpoint could not be read ({error})"
        else:
            kept = f"the previous checkpoint {previous} is kept" if previous else "the trial had no checkpoint yet"
        return CheckpointError(f"trial {trial_number}: writing checkpoint {name} in {self.trial_dir(trial_number)} "
                               f"failed ({exc}); {kept}")

    def check_writable(self) -> None:
        """Write and remove a small object at the store's root; `CheckpointError` saying why if that fails.

        Run before training, so that a store that cannot take checkpoints (a bucket that does not exist, missing
        credentials, a read-only directory) stops the run with one clear error instead of failing every trial at
        its first checkpoint.
        """
        probe = f".rfopt-write-check-{uuid.uuid4().hex}"  # workers starting together each check their own
        try:
            self._files.write_pointer(probe, b"")
            self._files.remove(probe)
        except Exception as exc:  # noqa: BLE001 - OSError, an object store's refusal, a connection error
            hint = (" (rfopt creates no bucket: create it, and give credentials and for S3-compatible servers "
                    "AWS_ENDPOINT_URL, see the README)" if isinstance(self.root, str) else "")
            raise CheckpointError(f"checkpoint store {self.root}: cannot write there: {exc}{hint}") from exc

    def latest(self, trial_number: int) -> Location | None:
        """The location of the trial's latest checkpoint (the one ``LATEST`` names), or None."""
        name = self._latest_name(trial_number)
        return None if name is None else self._files.location(f"{_trial_key(trial_number)}/{name}")

    def latest_units(self, trial_number: int) -> int | None:
        """The units done in the trial's latest checkpoint (``unit-0002`` holds 2): what a warm clone made now starts
        from; None if it has none."""
        name = self._latest_name(trial_number)
        try:
            return None if name is None else int(name.rsplit("-", 1)[1])
        except (IndexError, ValueError):
            return None

    def _latest_name(self, trial_number: int) -> str | None:
        try:
            return self._files.read(f"{_trial_key(trial_number)}/LATEST").decode().strip()
        except FileNotFoundError:
            return None

    def load(self, trial_number: int) -> TrialSnapshot | None:
        """The trial's latest checkpoint, or None if it has none; `CheckpointError` if it is unreadable."""
        from safetensors.torch import load

        try:
            self._settle_gangs()
            name = self._latest_name(trial_number)
        except CheckpointError:
            raise
        except Exception as exc:  # noqa: BLE001 - an unreadable pointer, an unreachable store
            raise CheckpointError(f"trial {trial_number}: the LATEST pointer in {self.trial_dir(trial_number)} is "
                                  f"unreadable: {exc}") from exc
        if name is None:
            return None
        unit = f"{_trial_key(trial_number)}/{name}"
        meta = self._read(trial_number, f"{unit}/state.json", json.loads)
        tensors = self._read(trial_number, f"{unit}/tensors.safetensors", load)
        try:
            return from_tensors(tensors, meta)
        except Exception as exc:  # noqa: BLE001 - files that parse but do not belong together
            raise CheckpointError(f"trial {trial_number}: checkpoint {self._files.location(unit)} is unreadable: "
                                  f"{exc!r}") from exc

    def load_report(self, trial_number: int) -> UnitReport | None:
        """The report stored with the trial's latest checkpoint, or None (no checkpoint, or one without a report)."""
        name = self._latest_name(trial_number)
        key = f"{_trial_key(trial_number)}/{name}/report.json"
        if name is None or not self._files.exists(key):
            return None
        return self._read(trial_number, key, lambda data: UnitReport(**json.loads(data)))

    def _read(self, trial_number: int, key: str, parse: Callable[[bytes], Any], what: str = "checkpoint file") -> Any:
        try:
            return parse(self._files.read(key))
        except Exception as exc:  # noqa: BLE001 - OSError, bad JSON, safetensors' own error for a damaged file
            raise CheckpointError(f"trial {trial_number}: {what} {self._files.location(key)} is unreadable: "
                                  f"{exc}") from exc

    # ------------------------------------------------------------------ warm starts
    # A clone's starting weights are named by its lineage token, not its trial number, so that they are written
    # before the clone exists: a process that starts the clone the moment it is enqueued finds them, and a crash
    # between the two leaves at worst weights that no trial names (`discard_warm_start`), never a clone without them.
    def save_warm_start(self, token: str, weights: dict[str, Any], parent: int, from_unit: int) -> Location:
        """The weights the clone with lineage `token` starts from, copied from trial `parent` after `from_unit` chunks."""
        from safetensors.torch import save_file

        def write(staging: Path) -> Path:
            save_file({k: v.detach().contiguous().cpu() for k, v in weights.items()}, str(staging / "weights.safetensors"))
            (staging / "origin.json").write_bytes(json.dumps({"parent": parent, "from_unit": from_unit}).encode())
            return staging

        return self._save_dir(_warm_key(token), write)

    def load_warm_start(self, trial_number: int, token: str) -> dict[str, Any]:
        """The starting weights of clone `trial_number`, whose lineage has `token` (a clone made before tokens named
        them has its weights in its own trial directory)."""
        from safetensors.torch import load

        key = f"{_warm_key(token)}/weights.safetensors"
        legacy = f"{_trial_key(trial_number)}/warm-start/weights.safetensors"
        if not token or (not self._files.exists(key) and self._files.exists(legacy)):
            key = legacy
        return self._read(trial_number, key, load, what="warm-start weights")

    def has_warm_start(self, token: str) -> bool:
        return bool(token) and self._files.exists(f"{_warm_key(token)}/weights.safetensors")

    def discard_warm_start(self, token: str) -> None:
        """Remove the starting weights of a clone that will never start (cancelled), or that was never made."""
        if token:
            self._files.remove(_warm_key(token))

    # ------------------------------------------------------------------ final and best adapters
    def save_adapter(self, trial_number: int, model: Any, adapter: str, tokenizer: Any = None) -> Location:
        """Save a PEFT adapter so that ``PeftModel.from_pretrained(base, path)`` loads it (after `download` from a URL)."""
        return self._save_dir(f"{_trial_key(trial_number)}/adapter",
                              _weights_writer(model, adapter, self._tokenizer_files(tokenizer)))

    def save_model(self, trial_number: int, model: Any, tokenizer: Any = None) -> Location:
        """Save a fully fine-tuned model (no adapter) where the adapter would go."""
        return self._save_dir(f"{_trial_key(trial_number)}/adapter",
                              _weights_writer(model, None, self._tokenizer_files(tokenizer)))

    def best_dir(self, trial_number: int) -> Location:
        return self._files.location(f"{_trial_key(trial_number)}/best")

    def save_best(self, trial_number: int, model: Any, adapter: str | None, tokenizer: Any = None) -> Location:
        """Save the trial's weights now as its best checkpoint (``best/``, replacing the one there), in the format of
        its final adapter: a PEFT adapter (`adapter`, its name on the shared model), or with `adapter` None the fully
        fine-tuned model. What makes a checkpoint the best is the engine's (`rfopt.engine.outputs.best`)."""
        return self._save_dir(f"{_trial_key(trial_number)}/best",
                              _weights_writer(model, adapter, self._tokenizer_files(tokenizer)))

    def _tokenizer_files(self, tokenizer: Any) -> dict[str, bytes] | None:
        """The files `tokenizer`'s ``save_pretrained`` writes (None for no tokenizer), serialized once per tokenizer
        and written again from these bytes beside every adapter saved with it: a study saves a trial's best adapter
        after most of its units, and serializing SmolLM2's tokenizer (3.4 MB of JSON) took as long as writing the
        adapter. Serialized again when what ``save_pretrained`` writes may have changed (`_tokenizer_key`)."""
        if tokenizer is None:
            return None
        key = _tokenizer_key(tokenizer)
        cached = self._tokenizers.get(id(tokenizer))
        if cached is not None and cached[0] is tokenizer and cached[1] == key:
            return cached[2]
        with tempfile.TemporaryDirectory(prefix=".rfopt-tokenizer-") as folder:
            tokenizer.save_pretrained(folder)
            files = {str(path.relative_to(folder)): path.read_bytes()
                     for path in sorted(Path(folder).rglob("*")) if path.is_file()}
        self._tokenizers[id(tokenizer)] = (tokenizer, key, files)  # the tokenizer held: its id is not reused
        return files

    def _save_dir(self, key: str, write: Callable[[Path], Path]) -> Location:
        """Write a directory with `write` (into a staging directory; it returns what to publish), then publish it
        at `key`, replacing what was there."""
        parent, _, name = key.rpartition("/")
        staging = self._files.staging(parent, name)
        try:
            self._files.publish(write(staging), key)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return self._files.location(key)


def _weights_writer(model: Any, adapter: str | None, tokenizer: dict[str, bytes] | None) -> Callable[[Path], Path]:
    """What `_save_dir` writes for a trial's weights: adapter `adapter` of a PEFT model (``PeftModel.from_pretrained``
    loads it), or the whole model when `adapter` is None; with the tokenizer's files beside them
    (`CheckpointStore._tokenizer_files`)."""

    def write(staging: Path) -> Path:
        if adapter is None:
            model.save_pretrained(str(staging))
            saved = staging
        else:
            model.save_pretrained(str(staging), selected_adapters=[adapter])
            # PEFT puts every adapter but "default" in a subdirectory named after it.
            saved = staging / adapter if (staging / adapter).is_dir() else staging
        for name, data in (tokenizer or {}).items():
            (saved / name).parent.mkdir(parents=True, exist_ok=True)
            (saved / name).write_bytes(data)
        return saved

    return write


def _tokenizer_key(tokenizer: Any) -> tuple[Any, ...]:
    """What a tokenizer's saved files depend on that code may change after it is loaded (TRL sets a missing pad token,
    a config its padding side or chat template): its files are serialized again when this differs."""
    try:
        size = len(tokenizer)
    except TypeError:
        size = None
    return (size, repr(getattr(tokenizer, "special_tokens_map", None)), getattr(tokenizer, "padding_side", None),
            getattr(tokenizer, "chat_template", None), getattr(tokenizer, "model_max_length", None),
            repr(getattr(tokenizer, "init_kwargs", None)))


def _trial_key(trial_number: int) -> str:
    return f"trial-{trial_number:05d}"


def _gang_key(gang: str) -> str:
    return f"gangs/{gang}.json"


def _warm_key(token: str) -> str:
    return f"warm-starts/{token}"
