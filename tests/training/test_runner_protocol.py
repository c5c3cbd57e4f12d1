"""The declared runner seam (`rfopt.training.runner.Runner`): every runner the engine may be given declares it and
defines each of its members with the protocol's signature, and the protocol covers every member the engine and a gang
call on a runner. Fast: nothing here builds a model."""

from __future__ import annotations

import inspect
import re
import types
from pathlib import Path
from typing import Any

import pytest

import rfopt
from rfopt.training.parallel import DataParallel, DataParallelRunner
from rfopt.training.runner import Runner, TrialRunner
from tests.scripted_runner import ScriptedRunner

RUNNERS = [TrialRunner, DataParallelRunner, ScriptedRunner]
METHODS = sorted(name for name, value in vars(Runner).items()
                 if not name.startswith("_") and inspect.isfunction(value))
DATA = sorted(name for name in Runner.__annotations__)


def _made(cls: type) -> Any:
    """A runner of `cls` as the engine makes one (`rfopt.engine.running.unit.fresh_runner`), on placeholders: constructing a
    runner loads nothing."""
    config = types.SimpleNamespace(args=types.SimpleNamespace(per_device_train_batch_size=2), peft_config=None)
    args = (3, config, None, None, None, None, "work", 0)
    if cls is DataParallelRunner:
        return cls(*args, tracking=None, group=DataParallel(rank=0, world_size=1))
    return cls(*args, tracking=None)


def test_the_protocol_names_the_seam() -> None:
    # what unit.py, roster.py, best.py, gang.py and evaluation call on a runner (a guard against an empty protocol)
    assert {"setup", "cleanup", "train_chunk", "eval_member", "rollout_backend", "chunk_args", "state",
            "load_state", "load_weights", "trainable_weights"} <= set(METHODS)
    assert {"number", "config", "pool", "units_done", "global_step", "model", "tokenizer"} <= set(DATA)


@pytest.mark.parametrize("cls", RUNNERS, ids=lambda c: c.__name__)
def test_each_runner_declares_the_protocol(cls: type) -> None:
    assert Runner in cls.__mro__, f"{cls.__name__} does not declare rfopt.training.runner.Runner"
    assert isinstance(_made(cls), Runner)


@pytest.mark.parametrize("cls", RUNNERS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("name", METHODS)
def test_each_method_is_defined_with_the_protocols_signature(cls: type, name: str) -> None:
    owner = next(k for k in cls.__mro__ if name in vars(k))
    assert owner is not Runner, f"{cls.__name__}.{name} is the protocol's stub, not an implementation"
    want = inspect.signature(getattr(Runner, name)).parameters
    have = inspect.signature(getattr(cls, name)).parameters
    for param, spec in want.items():
        assert param in have, f"{cls.__name__}.{name} lacks the parameter {param!r}"
        got = have[param]
        assert got.kind == spec.kind, f"{cls.__name__}.{name}({param}): {got.kind} where the protocol has {spec.kind}"
        assert got.default == spec.default, (f"{cls.__name__}.{name}({param}): default {got.default!r}, the protocol's "
                                             f"{spec.default!r}")
    extra = [p for p in have.values() if p.name not in want and p.default is inspect.Parameter.empty
             and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    assert not extra, f"{cls.__name__}.{name} requires parameters the engine never passes: {extra}"


@pytest.mark.parametrize("cls", RUNNERS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("name", DATA)
def test_each_attribute_is_there(cls: type, name: str) -> None:
    runner = _made(cls)
    assert name in vars(runner) or any(name in vars(k) for k in cls.__mro__ if k is not Runner), (
        f"{cls.__name__} has no {name!r}, which the engine reads of a runner")


def test_a_runner_does_not_evaluate_itself_the_unit_evaluates_it_through_the_plans_backend() -> None:
    """Evaluation is rfopt's (`rfopt.training.evaluation.evaluate_runners`, through the backend the plan chose), not a
    runner's: a runner offers what evaluating it needs (`eval_member`), so a test's runner runs rfopt's evaluation."""
    assert "eval_member" in METHODS
    assert not {"evaluate", "evaluate_gang"} & set(METHODS)
    assert not any(name in vars(ScriptedRunner) for name in ("evaluate", "evaluate_gang"))


def test_everything_the_engine_a_gang_and_evaluation_call_on_a_runner_is_declared() -> None:
    root = Path(rfopt.__file__).parent
    sources = [*sorted((root / "engine").glob("*.py")), *(root / "training" / name for name in ("gang.py",
                                                                                           "evaluation.py"))]
    called = set()
    for path in sources:
        called |= set(re.findall(r"\brunners?(?:\[0\])?\.([a-z_]\w*)", path.read_text()))
    called.discard("py")  # runner.py named in prose
    assert called, "no runner calls found: the pattern no longer matches the engine's code"
    missing = sorted(called - set(METHODS) - set(DATA))
    assert not missing, (f"the engine, a gang or evaluation calls {missing} on a runner; declare them in "
                         "rfopt.training.runner.Runner")
