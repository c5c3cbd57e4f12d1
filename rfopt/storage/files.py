"""Where a checkpoint store's files are kept: a local directory or an fsspec URL, behind one small interface.

`CheckpointFiles` names everything by a key relative to the store's root (``trial-00003/unit-0002/state.json``). `_LocalFiles` (a local or mounted shared
directory: files fsynced, directories renamed into place, a pointer replaced by rename) and `_ObjectFiles` (an fsspec
object store such as S3, which has no rename: files uploaded one by one, one small object written whole as the commit
point) are the only code that differs between the two. `files_at` picks one for a location; `is_url` and
`normalize_location` say which kind a location is and how a study records it.

`CheckpointError` lives here, below the store (`rfopt.storage.checkpoints`), because opening an object store raises it
too.

Object stores are reached through fsspec, which takes credentials and endpoints from each filesystem's
usual sources (for S3: ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_ENDPOINT_URL``, ``~/.aws``),
so nothing secret is stored in the study.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Protocol

from rfopt.errors import CheckpointError

_LOCAL_PROTOCOLS = ("file", "local")


def is_url(location: str | os.PathLike) -> bool:
    """Whether `location` is an fsspec URL of a store other than the local filesystem (``s3://``, ``gcs://``, ``memory://``).

    >>> is_url("s3://bucket/rfopt"), is_url("/shared/rfopt"), is_url("file:///shared/rfopt")
    (True, False, False)
    """
    protocol, separator, _ = str(location).partition("://")
    return bool(separator) and protocol not in _LOCAL_PROTOCOLS


def normalize_location(location: str | os.PathLike) -> str:
    """`location` as a study records it: a URL as given, without a trailing slash; else an absolute local path.

    A ``file://`` URL is a local path: it is stored as one, and written durably like one.
    """
    protocol, separator, rest = str(location).partition("://")
    if not separator:
        return str(Path(location).resolve())
    if protocol in _LOCAL_PROTOCOLS:
        return str(Path(rest).resolve())
    return f"{protocol}://{rest.rstrip('/')}"


class CheckpointFiles(Protocol):
    """Where a `CheckpointStore` keeps its files, by key relative to its root: `_LocalFiles` (a directory) and
    `_ObjectFiles` (an fsspec object store). A directory becomes visible whole (`publish`); `write_pointer` is the
    commit point (one small object written whole)."""

    def create(self) -> None:
        """Make the root where one must exist (nothing for an object store)."""

    def location(self, key: str) -> Any:
        """Where `key` is, as a person reads it (a path or a URL)."""

    def read(self, key: str) -> bytes: ...

    def exists(self, key: str) -> bool: ...

    def names(self, key: str) -> list[str]:
        """The entries directly under `key`, sorted; none when it is not there."""

    def remove(self, key: str) -> None:
        """Remove `key` and everything under it; gone already is not an error."""

    def staging(self, key: str, name: str, stale: str | None = None) -> Path:
        """A new local directory to write `name` into before `publish`."""

    def flush(self, staged: Path) -> None:
        """Put what is written so far in a staging directory on disk where publishing would (so that `publish` has
        only what is written after it to flush)."""

    def publish(self, staged: Path, key: str) -> None:
        """Make the staged directory visible at `key`, whole (replacing what was there)."""

    def write_pointer(self, key: str, data: bytes) -> None:
        """Write one small object whole: the commit point of a save."""

    def download(self, key: str, target: Path) -> None:
        """Copy the directory at `key` to the local `target`."""


class _LocalFiles:
    """A local (or mounted shared) directory: files fsynced, directories renamed into place, `LATEST` replaced by
    rename, so a power loss at any moment leaves the previous state."""

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root)

    def create(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)

    def location(self, key: str) -> Path:
        return self.root / key if key else self.root

    def read(self, key: str) -> bytes:
        return (self.root / key).read_bytes()

    def exists(self, key: str) -> bool:
        return self.location(key).exists()

    def names(self, key: str) -> list[str]:
        folder = self.root / key
        return sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []

    def remove(self, key: str) -> None:
        path = self.root / key
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)

    def staging(self, key: str, name: str, stale: str | None = None) -> Path:
        """A new directory to write `name` into before it is published: beside its target, so that it can be renamed."""
        folder = self.root / key
        folder.mkdir(parents=True, exist_ok=True)
        for old in folder.glob(stale) if stale else ():  # left by a process killed mid-write
            shutil.rmtree(old, ignore_errors=True)
        return Path(tempfile.mkdtemp(prefix=f".{name}.", dir=folder))

    def flush(self, staged: Path) -> None:
        for path in staged.rglob("*"):
            if path.is_file():
                _fsync_file(path)

    def publish(self, staged: Path, key: str) -> None:
        self.flush(staged)
        target = self.root / key
        if target.exists():
            shutil.rmtree(target)
        os.replace(staged, target)
        _fsync_dir(target.parent)

    def write_pointer(self, key: str, data: bytes) -> None:
        path = self.root / key
        if not path.parent.is_dir():
            path.parent.mkdir(parents=True, exist_ok=True)
            _fsync_dir(path.parent.parent)
        _write_durably(path, data)

    def download(self, key: str, target: Path) -> None:
        shutil.copytree(self.location(key), target)


class _ObjectFiles:
    """An fsspec filesystem at a URL (S3, GCS, Azure, ...). There is no directory rename: a directory is published by
    uploading its files one by one, and a single object (`LATEST`) written whole is the commit point."""

    def __init__(self, url: str) -> None:
        import fsspec
        from fsspec.registry import known_implementations

        self.url = normalize_location(url)
        try:
            self.fs, path = fsspec.core.url_to_fs(self.url)
        except ImportError as exc:  # fsspec names the package: "Install s3fs to access S3"
            protocol = self.url.partition("://")[0]
            package = known_implementations.get(protocol, {}).get("class", "").partition(".")[0]
            fix = f"; pip install {package}" if package else ""
            raise CheckpointError(f"checkpoint store {self.url}: {exc}{fix}") from exc
        except ValueError as exc:  # "Protocol not known: ..."
            raise CheckpointError(f"checkpoint store {self.url}: {exc}") from exc
        self.path = path.rstrip("/")

    def _path(self, key: str) -> str:
        return f"{self.path}/{key}" if key else self.path

    def create(self) -> None:
        """Nothing to create: an object store has no directories (the bucket must exist)."""

    def location(self, key: str) -> str:
        if not key:
            return self.url
        return f"{self.url}{'' if self.url.endswith('/') else '/'}{key}"

    def read(self, key: str) -> bytes:
        return self.fs.cat_file(self._path(key))

    def exists(self, key: str) -> bool:
        self.fs.invalidate_cache(self._path(key))  # another process may have written it since the last listing
        return self.fs.exists(self._path(key))

    def names(self, key: str) -> list[str]:
        path = self._path(key)
        self.fs.invalidate_cache(path)
        try:
            entries = self.fs.ls(path, detail=False)
        except FileNotFoundError:
            return []
        return sorted(entry.rstrip("/").rpartition("/")[2] for entry in entries)

    def remove(self, key: str) -> None:
        try:
            self.fs.rm(self._path(key), recursive=True)
        except OSError:  # gone already, or refused: retention tries again after the next checkpoint
            pass
        self.fs.invalidate_cache(self._path(key))

    def staging(self, key: str, name: str, stale: str | None = None) -> Path:
        """A local temporary directory to write `name` into before it is uploaded."""
        return Path(tempfile.mkdtemp(prefix=f".{name}."))

    def flush(self, staged: Path) -> None:
        """Nothing: its staged files are uploaded from where they are, and the upload is what makes them durable."""

    def publish(self, staged: Path, key: str) -> None:
        self.remove(key)  # what an earlier, unfinished attempt left under this name
        for path in sorted(staged.rglob("*")):
            if path.is_file():
                target = f"{key}/{path.relative_to(staged).as_posix()}"
                try:
                    self.fs.put_file(str(path), self._path(target))
                except Exception as exc:
                    self.remove(key)  # not named in LATEST, so nothing reads it; do not leave it half-written
                    raise OSError(f"uploading {self.location(target)}: {exc}") from exc

    def write_pointer(self, key: str, data: bytes) -> None:
        self.fs.pipe_file(self._path(key), data)

    def download(self, key: str, target: Path) -> None:
        root = self._path(key)
        self.fs.invalidate_cache(root)
        files = self.fs.find(root)
        if not files:
            raise FileNotFoundError(f"nothing at {self.location(key)}")
        for path in files:
            local = target / path[len(root):].lstrip("/")
            local.parent.mkdir(parents=True, exist_ok=True)
            self.fs.get_file(path, str(local))


def files_at(location: str | os.PathLike) -> CheckpointFiles:
    """The files at `location`: an object store's for a URL, else a local directory's (a ``file://`` URL is one)."""
    if is_url(location):
        return _ObjectFiles(str(location))
    return _LocalFiles(normalize_location(location) if "://" in str(location) else location)


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
