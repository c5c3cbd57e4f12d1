"""Canaries for rfopt/compat/_accelerate.py (accelerate): each fails loudly when the library symbol, or the call site,
that one of rfopt's patches of its internals relies on is gone, so an upgrade cannot leave a patch silently doing
nothing."""

import inspect

from rfopt import compat


# ---------------------------------------------------------------------- gang_gradient_state
def test_accelerates_gradient_state_is_one_dict_every_instance_shares_and_a_member_swaps_in_whole():
    """Canary of ``gang_gradient_state``: every ``GradientState`` reads and writes the class's ``_shared_state`` (its
    ``__dict__``), so a gang member's copy put back with `compat.set_gradient_state` is what every instance sees."""
    from accelerate.state import GradientState

    assert "self.__dict__ = self._shared_state" in inspect.getsource(GradientState.__init__)
    before = compat.gradient_state()
    try:
        state = GradientState()
        mine = compat.gradient_state()
        state.sync_gradients = not mine["sync_gradients"]
        assert GradientState().sync_gradients is not mine["sync_gradients"]  # one state, shared
        compat.set_gradient_state(mine)
        assert GradientState().sync_gradients is mine["sync_gradients"] and state.sync_gradients is mine["sync_gradients"]
    finally:
        compat.set_gradient_state(before)


# ---------------------------------------------------------------------- gang_backward
def test_accelerate_divides_the_loss_by_the_accumulation_steps_and_calls_backward_where_rfopt_routes_it():
    from types import SimpleNamespace

    import torch
    from accelerate import Accelerator

    source = inspect.getsource(Accelerator.backward)
    assert "loss = loss / self.gradient_accumulation_steps" in source and "loss.backward(**kwargs)" in source
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    routed = []
    assert compat.route_backward(SimpleNamespace(accelerator=accelerator), routed.append)
    accelerator.backward(torch.tensor(3.0))
    assert [float(x) for x in routed] == [1.5]
