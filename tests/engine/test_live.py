"""A live trial (`rfopt.engine.running.unit.Live`) changes only through its own transitions (issue 40 point 5): the
roster and the unit call them; a field assigned from anywhere else raises."""

import ast
import dataclasses
from pathlib import Path
from types import SimpleNamespace

import pytest

import rfopt
from rfopt.engine.running.unit import Live


class _Runner:
    def __init__(self, name: str, log: list[str]) -> None:
        self.name, self.log = name, log

    def cleanup(self) -> None:
        self.log.append(f"cleanup {self.name}")


def _live(log: list[str], **fields) -> Live:
    schedule = SimpleNamespace(num_units=4)
    values = dict(trial=SimpleNamespace(number=7), ref=None, config=SimpleNamespace(model_key="tiny"),
                  schedule=schedule, runner=_Runner("first", log), start_unit=0, warm_start=False, warm_token="",
                  committed=1, loaded=True)
    return Live(**(values | fields))


def _record(committed: int, paused: bool = False, decided: set[int] = frozenset(), last_value: float | None = None):
    return SimpleNamespace(committed=committed, paused=paused, decided_steps=set(decided), last_value=last_value)


def test_a_live_trials_fields_cannot_be_assigned_from_outside_it():
    live = _live([])
    for name, value in (("committed", 3), ("loaded", False), ("paused", True), ("last_value", 1.0),
                        ("runner", None), ("decided", frozenset({2}))):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(live, name, value)
    assert not hasattr(live.decided, "add")  # its rung decisions are a frozenset, replaced by `rung_decided`
    assert (live.committed, live.loaded, live.paused, live.decided) == (1, True, False, frozenset())


def test_refreshed_from_storage_a_live_trial_takes_its_progress_pause_decisions_and_value():
    live = _live([], decided=frozenset({0}), last_value=0.5)
    live.refresh(_record(committed=1, paused=True, decided={1}))
    assert (live.committed, live.loaded, live.paused, live.decided, live.last_value) == (1, True, True, {0, 1}, 0.5)
    live.refresh(_record(committed=3, paused=False, last_value=0.75))  # moved on elsewhere: its state is loaded again
    assert (live.committed, live.loaded, live.paused, live.decided, live.last_value) == (3, False, False, {0, 1}, 0.75)


def test_a_paused_live_trial_frees_its_runner_and_loads_its_state_again_after_it_resumes():
    log = []
    live = _live(log)
    live.pause()
    assert (live.paused, live.loaded, log) == (True, False, ["cleanup first"])
    live.resume()
    assert (live.paused, live.loaded) == (False, False)
    live.state_loaded()
    assert live.loaded


def test_a_live_trials_units_rungs_and_runner_change_through_its_transitions():
    log = []
    live = _live(log)
    live.committed_unit(1, 0.25)
    live.rung_decided(1)
    assert (live.committed, live.last_value, live.decided, live.finished) == (2, 0.25, {1}, False)
    live.new_runner(lambda: log.append("made second") or _Runner("second", log))
    assert log == ["cleanup first", "made second"] and live.runner.name == "second" and not live.loaded
    live.state_loaded()
    live.state_dropped()
    assert not live.loaded
    live.committed_unit(3, 0.5)
    assert live.finished and live.candidate().units_done == 4


PROGRESS = {"committed", "loaded", "paused", "last_value", "decided", "runner"}
"""What a live trial knows that changes while it runs (its other fields are set once, when it is made)."""


def _writes(source: str) -> list[str]:
    """Each assignment (or in-place update) in `source` of an attribute named in `PROGRESS` on anything but
    ``self``/``cls``, as ``line: .name``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        targets = (node.targets if isinstance(node, ast.Assign) else [node.target]
                   if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in (
                "add", "update", "discard", "remove", "clear"):
            targets = [node.func.value]
        for target in targets:
            for element in (target.elts if isinstance(target, ast.Tuple) else [target]):
                if (isinstance(element, ast.Attribute) and element.attr in PROGRESS
                        and not (isinstance(element.value, ast.Name) and element.value.id in ("self", "cls"))):
                    found.append(f"{node.lineno}: .{element.attr}")
    return found


def test_the_scan_finds_a_live_trials_field_assigned_from_outside_and_not_its_own():
    source = ("live.committed, live.loaded = 3, False\nmember.live.decided.add(2)\nlive.paused |= True\n"
              "self.committed = 1\nlive.refresh(record)\nnames.add('x')\n")
    assert sorted(_writes(source)) == ["1: .committed", "1: .loaded", "2: .decided", "3: .paused"]


def test_no_engine_module_but_its_own_assigns_what_a_live_trial_knows():
    """The frozen dataclass raises at run time; this finds a write on a path no test runs: outside
    rfopt/engine/running/unit.py, no engine module assigns (or updates in place) an attribute of that name on anything
    but itself."""
    engine = Path(rfopt.__file__).parent / "engine"
    found = [f"{path.relative_to(engine.parent.parent)}:{where}" for path in sorted(engine.rglob("*.py"))
             if path != engine / "running" / "unit.py" for where in _writes(path.read_text())]
    assert found == []
