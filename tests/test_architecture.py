"""The package's shape, checked: imports point down the layers, one module spells the storage keys, only the
compatibility module touches other libraries' private internals, and every rfopt exception has one root."""

import ast
import importlib
import inspect
import pkgutil
import re
from pathlib import Path

import rfopt
from rfopt.errors import RfoptError

PACKAGE = Path(__file__).resolve().parent.parent / "rfopt"

# Lowest first. A module may import modules of its own layer or of a lower one, never of a higher one.
LAYERS = [
    # foundations: no rfopt imports but among themselves
    {"errors", "compat", "crashpoints", "smollm2", "tiny", "state", "chunks", "evaluation", "rewards", "trackers",
     "rollouts"},
    # storage: Optuna storage and retries, the rfopt:* keys, checkpoints, leases (never training)
    {"storage", "schema", "checkpoints", "leases"},
    # how a config is written down: user code by import path, params' names, JSON codecs, FIELD=VALUE overrides
    {"usercode", "params", "codec", "overrides"},
    # the domain: configs and spaces, models and the trial runner, in-chunk progress, scheduling policy, pruning, ops,
    # a study's times and costs, charts
    {"config", "configform", "spaces", "models", "runner", "parallel", "gang", "progress", "scheduler",
     "pruning", "ops", "timeline", "charts"},
    # one unit of work; the artifacts published after it
    {"unit", "artifacts"},
    # live trials reconciled with storage; who may work on which trial
    {"roster", "coordinator"},
    # the one loop
    {"driver"},
    # what a person sees in a terminal; study files
    {"display", "studyfile"},
    # workers placed by a cluster manager (Ray)
    {"cluster"},
    # the public API
    {"study"},
    # front ends: the dashboard (a package: its routes, access checks and pages), the command line
    {"dashboard", "cli"},
    {"__init__"},
    # ready-to-run studies: users of the public API
    {"studies"},
]
LAYER = {name: i for i, names in enumerate(LAYERS) for name in names}


def _modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE)
        name = relative.parts[0].removesuffix(".py")  # a subpackage counts as one module
        yield name, path, ast.parse(path.read_text())


def _rfopt_imports(path: Path, tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from . import x / from .x import y
                base = path.relative_to(PACKAGE).parts[:-1][: max(0, len(path.relative_to(PACKAGE).parts) - node.level)]
                parts = [*base, *(node.module.split(".") if node.module else [])]
                if parts:
                    yield parts[0], node.lineno
                else:
                    yield from ((alias.name, node.lineno) for alias in node.names)
            elif node.module and node.module.split(".")[0] == "rfopt":
                parts = node.module.split(".")
                if len(parts) > 1:
                    yield parts[1], node.lineno
                else:
                    yield from ((alias.name, node.lineno) for alias in node.names)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "rfopt" and len(parts) > 1:
                    yield parts[1], node.lineno


def test_every_module_has_a_layer():
    assert {name for name, _, _ in _modules()} == set(LAYER)


def test_imports_only_point_down_the_layers():
    upward = []
    for name, path, tree in _modules():
        for imported, line in _rfopt_imports(path, tree):
            if imported in LAYER and imported != name and LAYER[imported] > LAYER[name]:
                upward.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {name} imports {imported}")
    assert upward == []


def test_only_the_schema_spells_rfopt_storage_keys():
    spelled = []
    for name, path, _ in _modules():
        if name == "schema":
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"""["']rfopt:[a-z_]""", line):
                spelled.append(f"{path.relative_to(PACKAGE.parent)}:{number}: {line.strip()}")
    assert spelled == []


def test_only_the_compatibility_module_reaches_into_other_libraries_private_internals():
    """No ``obj._private`` attribute of anything but the module's own objects, no import of a private module or name
    of another package, no ``vars()``/``__dict__`` surgery, outside rfopt/compat.py."""
    found = []
    for name, path, tree in _modules():
        if name == "compat":
            continue
        for node in ast.walk(tree):
            where = f"{path.relative_to(PACKAGE.parent)}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                owner = node.value.id if isinstance(node.value, ast.Name) else None
                if owner not in ("self", "cls"):
                    found.append(f"{where}: .{node.attr}")
            elif isinstance(node, ast.Attribute) and node.attr == "__dict__":
                found.append(f"{where}: __dict__")
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "vars":
                found.append(f"{where}: vars()")
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module not in (None, "__future__"):
                private = any(part.startswith("_") for part in node.module.split("."))
                private |= any(alias.name.startswith("_") for alias in node.names)
                if private and not node.module.startswith("rfopt"):
                    found.append(f"{where}: from {node.module} import {', '.join(a.name for a in node.names)}")
    assert found == []


def test_every_exception_class_rfopt_defines_derives_from_rfopt_error():
    """``except rfopt.RfoptError`` catches every error rfopt raises on purpose (a class added in any module, the
    study packages included, must be rooted in `rfopt.errors`)."""
    defined = []
    for info in pkgutil.walk_packages(rfopt.__path__, "rfopt."):
        module = importlib.import_module(info.name)
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if cls.__module__ == info.name and issubclass(cls, BaseException) and not issubclass(cls, Warning):
                defined.append(cls)
    assert len(defined) >= 15  # the walk found them
    assert [f"{c.__module__}.{c.__qualname__}" for c in defined if not issubclass(c, RfoptError)] == []
