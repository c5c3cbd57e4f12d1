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
