"""The package's shape, checked: imports point down the layers, one module spells the storage keys, only the
compatibility package touches other libraries' private internals (each patch with its canary), and every rfopt
exception has one root."""

import ast
import importlib
import inspect
import pkgutil
import re
from pathlib import Path

import rfopt
from rfopt.errors import RfoptError

PACKAGE = Path(__file__).resolve().parents[2] / "rfopt"

# rfopt's sub-packages and top-level modules, lowest first. A module may import from its own group (by the layers
# below) or from a lower group, never from a higher one.
GROUPS = [
    # foundations: rfopt's exceptions, what kind a value is, every patch of another library's internals, the chunk
    # plan, the offline demo model and the test model, the reward functions users pick from, the noise of an eval mean
    {"errors", "values", "compat", "chunks", "smollm2", "tiny", "rewards", "noise"},
    # what outlives a process: Optuna storage, the rfopt:* records, checkpoints, leases (never training)
    {"storage"},
    # rung policies: Optuna's pruners at rung boundaries, population-based training's plan
    {"pruning"},
    # how a trial and a study are written down: configs, their JSON, search spaces, settings, study files
    {"config"},
    # training a trial's chunk on a device with GRPOTrainer, gangs, data parallel, evaluation
    {"training"},
    # what a person reads, from storage alone: times and costs, charts, the progress bar and leaderboard
    {"reports"},
    # the run: the loop, the live trials, one unit, ops, the scheduler, Ray workers
    {"engine"},
    # the public API: the study, and the names ``import rfopt`` offers
    {"study"},
    {"__init__"},
    # front ends: the dashboard (a package), the command line
    {"dashboard", "cli"},
    # ready-to-run studies: users of the public API
    {"studies"},
]
GROUP = {name: i for i, names in enumerate(GROUPS) for name in names}

# Inside a sub-package, lowest first ("__init__" is the package's own module: what it offers its users).
LAYERS = {
    "storage": [{"crashpoints", "state", "database", "schema", "files"}, {"checkpoints", "leases"}, {"__init__"}],
    "pruning": [{"_decision", "_halving", "_view", "_pbt"}, {"_decide", "_outlook"}, {"_policy"}, {"__init__"}],
    "config": [{"usercode", "params", "rewardfuncs", "settings"}, {"codec"}, {"overrides", "studyfile"}, {"arguments"},
               {"trial"}, {"spaces", "form"}, {"__init__"}],
    "training": [{"diversity", "rollouts", "trackers", "loading", "quantization"},
                 {"evaluation", "memory", "batched_step"}, {"models"},
                 {"runner", "baseline"}, {"parallel", "gang", "progress"}, {"__init__"}],
    "reports": [{"results", "outcome", "replicates"}, {"timeline", "status", "trial_svg", "lead"},
                {"charts", "forecast", "leaderboard"},
                {"parallel", "display"}, {"__init__"}],
    "engine": [{"trials", "outputs"}, {"planning"}, {"running"}, {"cluster"}, {"__init__"}],
    "engine.trials": [{"ops"}, {"clones"}, {"population", "replicates"}, {"__init__"}],
    "engine.outputs": [{"best", "artifacts", "baselines"}, {"__init__"}],
    "engine.planning": [{"scheduler"}, {"plan"}, {"request"}, {"checks"}, {"__init__"}],
    "engine.running": [{"unit", "interrupts"}, {"coordinator", "roster"}, {"driver"}, {"run"}, {"__init__"}],
    "engine.cluster": [{"ray_worker"}, {"ray_cluster"}, {"__init__"}],
    "dashboard": [{"access", "actions", "views", "markup"}, {"leaderboard", "samples"}, {"pages"}, {"routes"},
                  {"server"}, {"__init__"}],
    "cli": [{"arguments", "launcher"}, {"training", "status", "ops", "clone", "confirm", "dashboard"}, {"run", "worker"},
            {"program"}, {"__init__"}, {"__main__"}],
}


def _layer(package: tuple[str, ...], name: str) -> int:
    """Where `name` sits among the layers of `package` (0 where none are given, -1 where it has no place)."""
    layers = LAYERS.get(".".join(package))
    return next((i for i, names in enumerate(layers) if name in names), -1) if layers else 0


def _placed(parts: list[str] | tuple[str, ...]) -> tuple[str, ...]:
    """The module that a file's dotted `parts` (below ``rfopt``) counts as: down the sub-packages that `LAYERS` orders
    (``engine.running.unit``); a package whose modules have no order of their own counts as one module
    (``training.rollouts``)."""
    parts = tuple(parts)
    if len(parts) > 1 and parts[-1] == "__init__" and ".".join(parts[:-1]) not in LAYERS:
        parts = parts[:-1]
    depth = 1
    while depth < len(parts) and ".".join(parts[:depth]) in LAYERS:
        depth += 1
    return parts[:depth]


def _module_name(path: Path) -> tuple[str, ...]:
    return _placed(path.relative_to(PACKAGE).with_suffix("").parts)


def _modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        yield _module_name(path), path, ast.parse(path.read_text())


def _known(parts: list[str]) -> tuple[str, ...]:
    """The rfopt module that dotted `parts` (below ``rfopt``) names: a module, a package's ``__init__``, or the module
    holding an imported name."""
    for n in range(len(parts), 0, -1):
        head = parts[:n]
        if (PACKAGE.joinpath(*head).with_suffix(".py")).exists():
            return _placed(head)
        if PACKAGE.joinpath(*head).is_dir():
            return _placed([*head, "__init__"])
    return ("__init__",)


def _rfopt_imports(path: Path, tree: ast.AST):
    """Each rfopt module `path` imports, as (group, inner module, ...) parts, with the line."""
    package = list(path.relative_to(PACKAGE).parts[:-1])
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                parts = [*package[: len(package) - (node.level - 1)], *(node.module or "").split(".")]
            elif node.module and node.module.split(".")[0] == "rfopt":
                parts = node.module.split(".")[1:]
            else:
                continue
            parts = [p for p in parts if p]
            for alias in node.names:
                yield _known([*parts, alias.name]), node.lineno
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "rfopt":
                    yield _known(parts[1:]), node.lineno


def _above(imported: tuple[str, ...], module: tuple[str, ...]) -> bool:
    """Whether `imported` sits above `module`: in a higher group, or, where they part inside one package, in a
    higher layer of it."""
    if imported[0] != module[0]:
        return GROUP[imported[0]] > GROUP[module[0]]
    for depth in range(1, min(len(imported), len(module))):
        if imported[depth] != module[depth]:
            return _layer(imported[:depth], imported[depth]) > _layer(module[:depth], module[depth])
    return False


def test_every_module_has_a_place():
    unplaced = [".".join(m) for m, _, _ in _modules()
                if m[0] not in GROUP or any(_layer(m[:depth], m[depth]) < 0 for depth in range(1, len(m)))]
    assert unplaced == []


def test_a_sub_package_is_placed_by_its_parts_and_its_modules_by_theirs():
    """The engine's sub-packages are layered among themselves, and their modules inside each one: a module of a lower
    sub-package that imported a higher one would be caught (the check above is not blind below two levels)."""
    assert _module_name(PACKAGE / "engine" / "running" / "unit.py") == ("engine", "running", "unit")
    assert _known(["engine", "planning", "plan", "UnitPlan"]) == ("engine", "planning", "plan")
    assert _known(["training", "rollouts", "batched", "decode_env"]) == ("training", "rollouts")
    assert _above(("engine", "running", "unit"), ("engine", "planning", "plan"))
    assert not _above(("engine", "planning", "plan"), ("engine", "running", "unit"))
    assert _above(("engine", "running", "roster"), ("engine", "running", "unit"))
    assert not _above(("engine", "running", "unit"), ("engine", "running", "roster"))
    assert _above(("engine", "running", "__init__"), ("engine", "running", "run"))


REEXPORTING = {"storage", "config"}
"""Sub-packages whose ``__init__`` re-exports names of their modules for users (what ``rfopt.storage`` and
``rfopt.config`` offered as modules before they were split)."""

def test_imports_only_point_down_the_layers():
    upward = []
    for module, path, tree in _modules():
        for imported, line in _rfopt_imports(path, tree):
            if imported != module and _above(imported, module):
                upward.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {'.'.join(module)} imports "
                              f"{'.'.join(imported)}")
    assert upward == []


DYNAMIC_IMPORTS = {("config", "usercode"): "a user's module named in a config (``pkg.module:name``)",
                   ("config", "studyfile"): "a ready-made study by its name (rfopt.studies: users of the API)",
                   ("__init__",): "the names ``import rfopt`` once offered, from their homes below it"}
"""The modules that import by a computed name (``importlib.import_module``), which the layering test cannot follow,
and what they import so."""


def test_no_module_reaches_up_through_importlib():
    """An import by name is an import the test above cannot see: only the modules of `DYNAMIC_IMPORTS` make one, and a
    literal ``rfopt.*`` name points down like any import (``rfopt.errors`` once reached 19 higher modules so)."""
    hidden = []
    for module, path, tree in _modules():
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and (getattr(node.func, "attr", None) == "import_module"
                                               or getattr(node.func, "id", None) in ("import_module", "__import__")):
                arg = node.args[0] if node.args else None
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and arg.value.startswith("rfopt."):
                    imported = _known(arg.value.split(".")[1:])
                    if imported != module and _above(imported, module):
                        hidden.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: {arg.value}")
                elif module not in DYNAMIC_IMPORTS:
                    hidden.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: a computed name")
    assert hidden == []


def test_rfopt_imports_a_name_from_the_module_that_defines_it_not_through_a_re_export():
    """`rfopt.storage` and `rfopt.config` re-export names for users; rfopt's own modules import from the module that
    defines them (so the layers above hold)."""
    through_init = []
    for module, path, tree in _modules():
        for imported, line in _rfopt_imports(path, tree):
            if imported[-1] == "__init__" and imported[0] in REEXPORTING and module != ("__init__",):
                through_init.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {'.'.join(imported)}")
    assert through_init == []


def test_only_the_schema_spells_rfopt_storage_keys():
    spelled = []
    for name, path, _ in _modules():
        if name[:2] == ("storage", "schema"):
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"""["']rfopt:[a-z_]""", line):
                spelled.append(f"{path.relative_to(PACKAGE.parent)}:{number}: {line.strip()}")
    assert spelled == []


# Public names that begin with an underscore by their library's own convention, not private internals.
PUBLIC_UNDERSCORED = {("os", "_exit")}


def test_only_the_compatibility_package_reaches_into_other_libraries_private_internals():
    """No ``obj._private`` attribute of anything but the module's own objects, no import of a private module or name
    of another package, no ``vars()``/``__dict__`` surgery, outside rfopt/compat/ (its modules count as one)."""
    found = []
    for name, path, tree in _modules():
        if name == ("compat",):
            continue
        for node in ast.walk(tree):
            where = f"{path.relative_to(PACKAGE.parent)}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                owner = node.value.id if isinstance(node.value, ast.Name) else None
                if owner not in ("self", "cls") and (owner, node.attr) not in PUBLIC_UNDERSCORED:
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


def test_every_patch_of_another_library_has_a_canary_in_that_librarys_test_module():
    """Each module of rfopt/compat/ (a library's) lists its entries in its docstring (````name``  what it relies on,
    why, what it buys``); tests/compat/test_<library>.py holds a canary for each, under a comment naming it."""
    tests = PACKAGE.parent / "tests" / "compat"
    missing = []
    for path in sorted((PACKAGE / "compat").glob("_*.py")):
        if path.name == "__init__.py":
            continue
        entries = re.findall(r"^``([a-z0-9_]+)``  ", ast.get_docstring(ast.parse(path.read_text())) or "", re.M)
        canaries = tests / f"test{path.stem}.py"
        if not canaries.exists():
            missing.append(f"{canaries.name} (for {path.name})")
            continue
        headings = " ".join(re.findall(r"^# -+ (.*)$", canaries.read_text(), re.M))
        missing += [f"{canaries.name}: {entry}" for entry in entries if not re.search(rf"\b{entry}\b", headings)]
    assert missing == []


def test_a_packages_private_modules_are_imported_only_inside_it():
    """``rfopt.compat``, ``rfopt.pruning``, ``rfopt.storage.schema``, ... offer their private modules' names in their
    ``__init__``: rfopt's other modules import them from there (``from rfopt.compat import storage_of``)."""
    reached = []
    for _, path, tree in _modules():
        here = path.relative_to(PACKAGE).parent.parts
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("rfopt."):
                parts = tuple(node.module.split(".")[1:])
                private = next((i for i, part in enumerate(parts) if part.startswith("_")), None)
                if private is not None and here[:private] != parts[:private]:
                    reached.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: {node.module}")
    assert reached == []


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
