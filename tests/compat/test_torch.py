"""Canaries for rfopt/compat/_torch.py (torch): each fails loudly when the library symbol, or the call site, that one of
rfopt's patches of its internals relies on is gone, so an upgrade cannot leave a patch silently doing nothing."""

import inspect

from rfopt import compat


# ---------------------------------------------------------------------- ddp_ignored_parameters
def test_ddp_reads_the_parameters_to_ignore_from_the_attribute_rfopt_sets():
    import torch
    from torch.nn.parallel import DistributedDataParallel

    module = torch.nn.Linear(2, 2)
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, ["bias"])
    assert module._ddp_params_and_buffers_to_ignore == ["bias"]
    assert "_ddp_params_and_buffers_to_ignore" in inspect.getsource(DistributedDataParallel.__init__)


# ---------------------------------------------------------------------- module_view
def test_a_module_view_shares_the_weights_keeps_no_hook_or_instance_forward_and_leaves_the_model_alone(tiny_model):
    """Canary of ``module_view``: torch keeps a module's children in ``_modules`` and its hooks in the dicts the view
    empties; a view computes what the model computes, with a hook and a trainer's ``forward`` wrapper left behind."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    ids = torch.tensor([[3, 4, 5]])
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    calls = []
    hook = model.model.layers[0].register_forward_hook(lambda *args: calls.append(1))
    model.forward = lambda *a, **k: (_ for _ in ()).throw(AssertionError("the instance forward ran"))
    replaced = []

    def replace(module, view_of):
        if module is model.lm_head:
            replaced.append(module)
        return None

    view = compat.module_view(model, replace)
    with torch.no_grad():
        got = view(input_ids=ids).logits
    assert torch.equal(got, expected) and calls == [] and replaced == [model.lm_head]
    assert view.lm_head.weight is model.lm_head.weight and view.model.layers[0] is not model.model.layers[0]
    assert "forward" in vars(model) and len(model.model.layers[0]._forward_hooks) == 1  # the model keeps its own
    hook.remove()
