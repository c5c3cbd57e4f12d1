"""A run's `Context` is built whole (`rfopt.engine.running.run`) and not changed after (issue 40 point 5)."""

import dataclasses
from pathlib import Path

import pytest

from rfopt.engine.running.unit import Context


def test_a_context_cannot_be_changed_after_it_is_built():
    ctx = Context(study=None, store=None, plan=None, train_dataset=None, eval_dataset=None, objective="reward",
                  settings=None, pool=None, workdir=Path("work"), subscribers=(print,))
    with pytest.raises(dataclasses.FrozenInstanceError):
        ctx.runner_class = object  # type: ignore[misc]
    assert isinstance(ctx.subscribers, tuple) and isinstance(ctx.callbacks, tuple)
    assert isinstance(ctx.step_listeners, tuple)
