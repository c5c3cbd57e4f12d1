"""The user's code by import path: reward functions, callbacks and model factories are stored as ``"module:qualname"``
(``"/path/to/file.py:qualname"`` for one defined in a script or a file that is not importable as a module) and
imported again by any process that needs them.

A user file imported to find such a function must not be a script that starts a study when it is imported (it would
run its study again): `resolve_import` refuses one whose top level creates or runs a study (`study_on_import`), the
running script is taken as it is (never imported a second time), and `Study.optimize` refuses a run started while a
user file is being imported (`importing_user_file`, the stack of files being imported).

    >>> resolve_import(import_path(rewards.correctness)) is rewards.correctness     # doctest: +SKIP
    True
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

from rfopt.errors import ConfigError


def import_path(obj: Any) -> str:
    """``"module:qualname"`` for an importable function or class (a file path for ``__main__`` objects)."""
    qualname = getattr(obj, "__qualname__", None)
    module = getattr(obj, "__module__", None)
    if not qualname or not module or "<" in qualname:
        raise ConfigError(
            f"{obj!r} cannot be stored by import path (a lambda or a nested function or class); "
            "define it at the top level of a module"
        )
    if module == "__main__" or module not in sys.modules or not _is_importable(module):
        file = getattr(sys.modules.get(module), "__file__", None)
        if file is None or file.startswith("<") or not Path(file).is_file():
            source = ("a script read from standard input (python - < script.py)" if file == "<stdin>"
                      else f"{module!r}, which has no file" if file is None or file.startswith("<")
                      else f"{file}, which is not a file")
            raise ConfigError(
                f"{qualname}: defined in {source}; rfopt stores it by import path, for the other processes that "
                "need it (a worker, a resumed run, the dashboard's clone), and none can import it from there. Save "
                "the script as a file and run it (python script.py), or define the function in a module"
            )
        module = str(Path(file).resolve())
    return f"{module}:{qualname}"


def resolve_import(path: str) -> Any:
    """Inverse of `import_path`: ``"pkg.module:name"`` or ``"/path/to/file.py:name"``."""
    module_name, sep, qualname = path.partition(":")
    if not sep or not qualname:
        raise ConfigError(f"{path!r}: expected 'module:name' or '/path/file.py:name'")
    try:
        if module_name.endswith(".py"):
            module = _running_script(Path(module_name)) or _import_user_file(Path(module_name))
        else:
            module = importlib.import_module(module_name)
        obj: Any = module
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except ConfigError:
        raise
    except (ImportError, AttributeError, FileNotFoundError) as exc:
        raise ConfigError(f"{path!r} cannot be imported: {exc}") from exc
    except (Exception, SystemExit) as exc:  # the module's own code failed as it was imported (a broken study file)
        raise ConfigError(f"{path!r} cannot be imported: {failure(exc, module_name)}") from exc
    return obj


def failure(exc: BaseException, file: str | Path) -> str:
    """What went wrong running a user file's code, for a message: the exception (``sys.exit(3)`` by name) and the
    line of `file` it came from, if it did."""
    import traceback

    if isinstance(exc, SystemExit):
        what = f"it called sys.exit({exc.code!r})"
    else:
        text = str(exc).strip()
        what = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    here = os.path.abspath(str(file))
    line = next((f.lineno for f in reversed(traceback.extract_tb(exc.__traceback__))
                 if os.path.abspath(f.filename) == here), None)
    return f"{what} (line {line})" if line else what


def load_file_module(path: Path):
    name = "rfopt_user_" + "".join(c if c.isalnum() else "_" for c in str(path.resolve()))
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


_IMPORTING: list[Path] = []
"""User files being imported to find a function stored by path (innermost last)."""


def study_on_import(path: Path, where: str) -> ConfigError:
    """The refusal to import a user file that runs a study when imported (`where`: what in it does)."""
    return ConfigError(
        f"{path} cannot be imported: it starts a study when it is imported ({where}), and rfopt imports it to find "
        "a reward function or model factory defined in it, which would run the study again. Put the study's run "
        "under `if __name__ == \"__main__\":`, or define those functions in a module of their own"
    )


def importing_user_file() -> Path | None:
    """The user file rfopt is importing right now to find a reward function or model factory, if any: a study run
    started while it imports is that file running its study again, which `Study.optimize` refuses."""
    return _IMPORTING[-1] if _IMPORTING else None


class _StudyCall(str):
    lineno: int


def _starts_a_study(path: Path) -> _StudyCall | None:
    """The first call at the top level of the file (outside ``if __name__ == "__main__":`` and functions) that creates
    or runs a study, if any: importing such a file would run its study."""
    import ast

    try:
        tree = ast.parse(path.read_text(), str(path))
    except (OSError, SyntaxError, ValueError):
        return None  # importing it says what is wrong
    pending = list(tree.body)
    while pending:
        node = pending.pop(0)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test):
            pending.extend(node.orelse)
            continue
        for call in ast.walk(node):
            if isinstance(call, ast.Call) and isinstance(call.func, (ast.Attribute, ast.Name)):
                name = call.func.attr if isinstance(call.func, ast.Attribute) else call.func.id
                if name in ("optimize", "work", "create_study", "load_study"):
                    found = _StudyCall(f"{ast.unparse(call.func)}(...)")
                    found.lineno = call.lineno
                    return found
    return None


def _running_script(path: Path) -> Any | None:
    """The running script's module, if `path` is that script: its functions are taken from it, never imported again
    (which would run the script a second time)."""
    main = sys.modules.get("__main__")
    file = getattr(main, "__file__", None)
    return main if file is not None and Path(file).resolve() == path.resolve() else None


def _import_user_file(path: Path) -> Any:
    started = _starts_a_study(path)
    if started is not None:
        raise study_on_import(path, f"{started}, line {started.lineno}")
    _IMPORTING.append(path.resolve())
    try:
        return load_file_module(path)
    finally:
        _IMPORTING.pop()


def _is_importable(module: str) -> bool:
    if module.startswith("rfopt_user_"):
        return False
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False
