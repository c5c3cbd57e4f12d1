"""One trial over several devices (`rfopt.training.parallel`): on the CPU with the gloo backend, a study whose trials each
train on two processes (each half of every batch, gradients averaged by DDP) matches the same study trained on one
process with the same global batch: the same per-chunk values, rollouts and rewards (each row samples from a stream
of its own), and losses and adapters equal up to the order of floating-point sums (stated tolerance: 1e-5
absolute), through a crash and resume, and for a clone."""

import pytest
import torch

from crashkit import env

TOLERANCE = 1e-5
"""Floating-point sums in another order (the all-reduce, a half batch's matmuls): measured 7.6e-7 on the adapter."""


def test_each_row_samples_from_its_own_stream_whatever_the_batch_it_is_in():
    from transformers import GenerationConfig

    from rfopt.training.parallel import RowSampler

    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    config = GenerationConfig(do_sample=True, temperature=0.7, top_k=20, top_p=0.9)
    whole = RowSampler(7, (3, 1), 0, config)(None, logits).argmax(dim=1)
    halves = torch.cat([RowSampler(7, (3, 1), 0, config)(None, logits[:2]).argmax(dim=1),
                        RowSampler(7, (3, 1), 2, config)(None, logits[2:]).argmax(dim=1)])
    assert torch.equal(whole, halves)
    assert not torch.equal(RowSampler(7, (3, 2), 0, config)(None, logits).argmax(dim=1), whole)  # another generation
    picked = RowSampler(7, (3, 1), 0, config)(None, logits)
    assert torch.equal((picked == 0).sum(dim=1), torch.ones(4, dtype=torch.long))  # one token left per row


def test_a_batch_that_does_not_split_over_the_devices_is_refused_naming_the_trial_and_the_field(tiny_model, tmp_path):
    from rfopt.chunks import ChunkPlan, trial_schedule
    from rfopt.training.models import ModelPool
    from rfopt.training.parallel import DataParallel, DataParallelRunner
    from rfopt_testkit import prompts_dataset, trial_config

    config = trial_config(tiny_model, per_device_train_batch_size=4)
    plan = ChunkPlan.build(8, 2, 0)
    with pytest.raises(ValueError, match="trial 5: per_device_train_batch_size 4 .* cannot be split evenly over 3 "
                                         "devices; give a multiple of 3"):
        DataParallelRunner(5, config, plan, trial_schedule(plan, config.args), prompts_dataset(8),
                           ModelPool("cpu", "fp32"), tmp_path, group=DataParallel(0, 3))


@pytest.mark.e2e
@pytest.mark.subprocess
@pytest.mark.slow
def test_a_study_trained_two_devices_per_trial_ends_as_with_one_device_also_after_a_crash_and_for_a_clone(
    tiny_model, tmp_path
):
    """`rfopt worker --devices cpu,cpu --devices-per-trial 2`: one worker whose trials each train on both processes.
    Its lead is killed once its second unit's checkpoint is durable (the other rank then fails too: its peer is
    gone); the same command resumes the study from its checkpoints. Then a clone of trial 0 trains the same
    way. Every trial ends as with one device and the same global batch (``--devices-per-trial 1``)."""
    import optuna

    import rfopt
    from crashkit import assert_same_study_but_summation_order, run, trials, worker_command

    sweep = {"RFOPT_TEST_TRIALS": 2, "RFOPT_TEST_CHUNKS": 2}
    storages = {}
    for label, devices in (("one", ["--devices", "cpu", "--devices-per-trial", "1"]),
                           ("two", ["--devices", "cpu,cpu", "--devices-per-trial", "2"])):
        storage, checkpoints = f"sqlite:///{tmp_path / label}.db", tmp_path / f"{label}-ck"
        command = worker_command(storage, checkpoints, *devices)
        if label == "two":
            crashed = run(command, tmp_path, env(tiny_model, RFOPT_CRASH_AT="checkpoint-saved:2", **sweep),
                          tmp_path / "crash.log")
            assert crashed != 0
            assert any(t.state == optuna.trial.TrialState.RUNNING for t in trials(storage))
        assert run(command, tmp_path, env(tiny_model, **sweep), tmp_path / f"{label}.log") == 0, \
            (tmp_path / f"{label}.log").read_text()[-3000:]
        rfopt.load_study("tiny", storage).clone_trial(0, {"learning_rate": 2e-2})
        assert run(command, tmp_path, env(tiny_model, **sweep), tmp_path / f"{label}-clone.log") == 0
        storages[label] = storage

    assert len(trials(storages["two"])) == len(trials(storages["one"])) == 3
    assert_same_study_but_summation_order(storages["one"], storages["two"], TOLERANCE)


def test_gangs_and_several_devices_per_trial_are_refused_together(tiny_model, tmp_path):
    import rfopt
    from rfopt.training.parallel import DataParallel
    from rfopt_testkit import prompts_dataset, trial_config

    study = rfopt.create_study(study_name="g", storage=f"sqlite:///{tmp_path / 'g.db'}")
    with pytest.raises(ValueError, match="gang_size=2 with devices per trial"):
        study.work([trial_config(tiny_model)], prompts_dataset(8), prompts_dataset(2, "E"), gang_size=2,
                   data_parallel=DataParallel(0, 1))
