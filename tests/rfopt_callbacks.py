"""A TrainerCallback for tests of per-trial callbacks, stored by import path like a user's. In a module of its own:
the test kit stays light to import (the study files that subprocess tests run import it)."""

from transformers import TrainerCallback

CALLBACK_EVENTS: list = []
"""What `RecordingCallback`s saw: ``(tag, event, global_step)``."""


class RecordingCallback(TrainerCallback):
    """A per-trial TrainerCallback that records the events it sees in `CALLBACK_EVENTS`, tagged with its `tag`."""

    tag = "class"

    def on_train_begin(self, args, state, control, **kwargs):
        CALLBACK_EVENTS.append((self.tag, "train_begin", state.global_step))

    def on_step_end(self, args, state, control, **kwargs):
        CALLBACK_EVENTS.append((self.tag, "step_end", state.global_step))

    def on_train_end(self, args, state, control, **kwargs):
        CALLBACK_EVENTS.append((self.tag, "train_end", state.global_step))


class CollapseAtTheEnd(TrainerCallback):
    """Makes the trial's adapter collapse when its last chunk ends: every token of its own copy of the embedding
    (``modules_to_save=["embed_tokens"]``) becomes the same vector, so that the model sees the same input whatever the
    prompt, and answers every prompt with one fixed string."""

    def on_train_end(self, args, state, control, model=None, **kwargs):
        if state.global_step < state.max_steps:
            return
        import torch

        adapter = model.active_adapter
        for module in model.modules():
            copies = getattr(module, "modules_to_save", None)
            if copies is not None and adapter in copies:
                with torch.no_grad():
                    weight = copies[adapter].weight
                    weight.copy_(weight[5].expand_as(weight))
