"""A gang's bookkeeping that changes no number (issue 42 point 2): while a gang trains, the objects alive when it
started are kept out of the cyclic garbage collector's walks (each member's ``Trainer.train`` starts with a full
collection), and handed back when it ends; a process's own freeze is left as it was."""

import gc

import pytest

import rfopt
from rfopt_testkit import prompts_dataset, trial_config
from scripted_runner import ScriptedRunner


@pytest.fixture
def freeze_seen(scripted, monkeypatch):
    """The garbage collector's frozen count as each member's chunk saw it."""
    seen = []
    train_chunk = ScriptedRunner.train_chunk

    def recording(self, *args, **kwargs):
        seen.append(gc.get_freeze_count())
        return train_chunk(self, *args, **kwargs)

    monkeypatch.setattr(ScriptedRunner, "train_chunk", recording)
    return seen


def _optimize(tmp_path, tiny_model):
    study = rfopt.create_study(study_name="heap", storage=f"sqlite:///{tmp_path / 'heap.db'}", num_chunks=2,
                               checkpoint_dir=tmp_path / "ck")
    configs = [trial_config(tiny_model), trial_config(tiny_model, learning_rate=1e-2)]
    study.optimize(configs, prompts_dataset(8), prompts_dataset(2, "E"), gang_size=2, show_progress_bar=False)
    return study


def test_a_gangs_members_train_with_the_heap_it_started_with_frozen_and_it_is_handed_back(
        freeze_seen, tiny_model, tmp_path):
    gc.unfreeze()
    study = _optimize(tmp_path, tiny_model)
    assert all(t.state.name == "COMPLETE" for t in study.trials)
    assert len(freeze_seen) == 4 and all(count > 1000 for count in freeze_seen)  # 2 trials x 2 chunks
    assert gc.get_freeze_count() == 0


def test_a_process_that_froze_its_heap_itself_keeps_its_freeze(freeze_seen, tiny_model, tmp_path):
    gc.unfreeze()
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        _optimize(tmp_path, tiny_model)
        # Not frozen again (the objects made since would join), not handed back (they would leave); a frozen object
        # freed by its last reference leaves the count.
        assert freeze_seen and all(0.99 * frozen < count <= frozen for count in freeze_seen)
        assert 0.99 * frozen < gc.get_freeze_count() <= frozen
    finally:
        gc.unfreeze()
