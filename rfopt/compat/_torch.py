"""torch's internals that rfopt relies on: a module tree of its own over a model's weights, DDP's parameters to
ignore.

``ddp_ignored_parameters``  `data_parallel_model` lists every parameter but the active adapter's with
    ``DistributedDataParallel._set_params_and_buffers_to_ignore_for_model`` (torch), so DDP broadcasts and reduces
    only the trial's adapter: the lead of a data-parallel group holds other trials' adapters on the shared base,
    the other ranks do not. Buys: data-parallel trials on a shared base model.
``module_view``  `module_view` makes a second ``torch.nn.Module`` tree over the same weights: a shallow copy of each
    module with a children dict of its own (``Module._modules``), no hooks (``Module._forward_hooks`` and the other
    hook dicts) and no instance ``forward`` attribute (a trainer's wrapper), with some modules replaced. torch has no
    public way to copy a module without its parameters. Buys: the batched rollout backend serves every gang member's
    adapter from its LoRA bank (`rfopt.training.rollouts.bank`) without changing the shared model, and so without
    Python hooks in its decode step (which a CUDA graph captures).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from ._versions import check_version, require


_MODULE_HOOKS = ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_forward_pre_hooks",
                 "_forward_pre_hooks_with_kwargs", "_backward_hooks", "_backward_pre_hooks", "_state_dict_hooks",
                 "_state_dict_pre_hooks", "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks")


def module_view(root: Any, replace: Callable[[Any, Callable[[Any], Any]], Any | None], dtype: Any = None) -> Any:
    """A module tree of its own over `root`'s weights (entry ``module_view``): each module shallow-copied with its own
    children, no hooks and no instance ``forward``; ``replace(module, view_of)`` may return a module to put in its
    place (`view_of` views a child), or None to copy it. With `dtype`, the view's floating-point parameters are copies
    in that dtype (tied weights stay tied; the model's own are untouched), its buffers the model's."""
    import torch.nn as nn

    check_version("torch")
    require(nn.Module(), "_modules", "module_view")
    memo: dict[int, Any] = {}
    converted: dict[int, Any] = {}

    def weight(param: Any) -> Any:
        if param is None or dtype is None or not param.is_floating_point() or param.dtype == dtype:
            return param
        if id(param) not in converted:
            converted[id(param)] = nn.Parameter(param.detach().to(dtype), requires_grad=False)
        return converted[id(param)]

    def view_of(module: Any) -> Any:
        if id(module) in memo:
            return memo[id(module)]
        made = replace(module, view_of)
        if made is None:
            made = copy.copy(module)
            state = vars(made)
            state.pop("forward", None)  # a trainer's wrapper around the shared model's forward
            for hooks in _MODULE_HOOKS:
                if hooks in state:
                    state[hooks] = type(state[hooks])()
            state["_modules"] = {name: (view_of(child) if child is not None else None)
                                 for name, child in module._modules.items()}
            state["_parameters"] = {name: weight(param) for name, param in module._parameters.items()}
        memo[id(module)] = made
        return made

    return view_of(root)


@contextmanager
def data_parallel_model(model: Any) -> Iterator[None]:
    """While the block runs, DDP (which the Trainer wraps the model in under ``torch.distributed``) syncs and reduces
    only the model's trainable parameters: the active trial's adapter.

    Entry ``ddp_ignored_parameters``: ``DistributedDataParallel._set_params_and_buffers_to_ignore_for_model`` (torch;
    it sets ``_ddp_params_and_buffers_to_ignore`` on the module, which DDP reads at construction). DDP broadcasts
    every parameter and buffer from rank 0 when it wraps a model; the lead of a data-parallel group holds other
    trials' adapters on the shared base too, which the other ranks do not, and the broadcast would not match.
    Buys: data-parallel trials on a shared base model (`rfopt.training.parallel`)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        yield
        return
    from torch.nn.parallel import DistributedDataParallel

    trainable = {name for name, param in model.named_parameters() if param.requires_grad}
    ignored = [name for name, _ in model.named_parameters() if name not in trainable]
    ignored += [name for name, _ in model.named_buffers()]
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, ignored)
    try:
        yield
    finally:
        model.__dict__.pop("_ddp_params_and_buffers_to_ignore", None)
