"""accelerate's internals that rfopt relies on: the process-wide gradient state a gang's trainers take turns with,
a gang member's backward routed to the gang.

``gang_gradient_state``  `gradient_state` / `set_gradient_state` read and replace accelerate's process-wide
    ``GradientState`` (one dict, ``GradientState._shared_state``, shared by every instance): each Trainer's
    Accelerator writes its gradient-accumulation plugin and sync flag there, and its dataloader registers there. The
    trainers of a gang (`rfopt.training.gang`) interleave in one process, so each member keeps its own copy, swapped in when it
    runs. Buys: gang members with different ``gradient_accumulation_steps`` training in lockstep correctly.
``gang_backward``  `route_backward` replaces a gang member's ``Accelerator.backward`` on its trainer's accelerator,
    which ``Trainer.training_step`` calls with the step's loss: the member's loss, divided by the accumulation steps as
    accelerate divides it, goes to the gang, which differentiates every member's loss in one backward. Buys: one
    backward for a gang's training.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rfopt.errors import CompatError

from ._versions import check_version, require


def gradient_state() -> dict[str, Any]:
    """A copy of accelerate's process-wide gradient state (entry ``gang_gradient_state``)."""
    from accelerate.state import GradientState

    require(GradientState, "_shared_state", "gang_gradient_state")
    return dict(GradientState._shared_state)


def set_gradient_state(state: dict[str, Any]) -> None:
    """Make `state` (from `gradient_state`) accelerate's process-wide gradient state, in place (every ``GradientState``
    instance shares the one dict)."""
    from accelerate.state import GradientState

    shared = GradientState._shared_state
    shared.clear()
    shared.update(state)


def route_backward(trainer: Any, backward: Callable[[Any], None]) -> bool:
    """Make `trainer`'s ``accelerator.backward(loss)`` call ``backward(loss / gradient_accumulation_steps)`` (the
    loss as accelerate would differentiate it) instead (entry ``gang_backward``); False, and nothing changed, where
    accelerate would do more than ``loss.backward()`` (DeepSpeed, Megatron, a gradient scaler, LOMO)."""
    from accelerate.utils import DistributedType

    check_version("accelerate")
    accelerator = trainer.accelerator
    require(accelerator, "has_lomo_optimizer", "gang_backward")
    if (accelerator.distributed_type != DistributedType.NO or accelerator.scaler is not None
            or accelerator.has_lomo_optimizer):
        return False

    def routed(loss: Any, **kwargs: Any) -> None:
        if kwargs:
            raise CompatError(f"gang_backward: accelerate's backward got {sorted(kwargs)}, which the gang does not pass")
        backward(loss / accelerator.gradient_accumulation_steps)

    accelerator.backward = routed
    return True
