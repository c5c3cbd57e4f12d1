"""One trial over several devices (`rfopt.parallel`): on the CPU with the gloo backend, a trial trained by two
processes (each half of every batch, gradients averaged by DDP) matches the same trial trained by one process with
the same global batch: the same rollouts and rewards (each row samples from a stream of its own), and the losses,
gradient norms and adapter equal up to the order of floating-point sums (stated tolerance: 1e-5 absolute)."""

import json
import socket
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from crashkit import TESTS, env

TOLERANCE = 1e-5
"""Floating-point sums in another order (the all-reduce, a half batch's matmuls): measured 7.6e-7 on the adapter."""


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _trial(tiny_model, tmp_path, world):
    out, port = tmp_path / f"world-{world}.json", _free_port()
    processes = [subprocess.Popen([sys.executable, str(TESTS / "parallel_trial.py"), str(rank), str(world), str(port),
                                   str(out)], env=env(tiny_model), cwd=tmp_path, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT) for rank in range(world)]
    for process in processes:
        output = process.communicate(timeout=300)[0].decode(errors="replace")
        assert process.returncode == 0, output[-3000:]
    return json.loads(out.read_text()), load_file(f"{out}.safetensors")


def test_a_trial_on_two_gloo_processes_matches_it_on_one_process_with_the_same_global_batch(tiny_model, tmp_path):
    (one, one_adapter), (two, two_adapter) = _trial(tiny_model, tmp_path, 1), _trial(tiny_model, tmp_path, 2)
    assert two["steps"] == one["steps"] == 4  # the same schedule: 2 chunks x 2 optimizer steps of the global batch
    assert two["values"] == one["values"]
    for chunk, (a, b) in enumerate(zip(one["metrics"], two["metrics"], strict=True)):
        assert (b["reward"], b["reward_std"]) == (a["reward"], a["reward_std"]), f"chunk {chunk}: other rollouts"
        assert b["loss"] == pytest.approx(a["loss"], abs=TOLERANCE) and b["grad_norm"] == pytest.approx(
            a["grad_norm"], abs=TOLERANCE), f"chunk {chunk}"
    assert one_adapter.keys() == two_adapter.keys()
    moved = max((one_adapter[k] - two_adapter[k]).abs().max().item() for k in one_adapter)
    assert moved <= TOLERANCE
    assert any(k.endswith("lora_B.weight") and one_adapter[k].abs().max() > 1e-3 for k in one_adapter)  # it trained


def test_each_row_samples_from_its_own_stream_whatever_the_batch_it_is_in():
    from transformers import GenerationConfig

    from rfopt.parallel import RowSampler

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
    from rfopt.models import ModelPool
    from rfopt.parallel import DataParallel, DataParallelRunner
    from rfopt_testkit import prompts_dataset, trial_config

    config = trial_config(tiny_model, per_device_train_batch_size=4)
    plan = ChunkPlan.build(8, 2, 0)
    with pytest.raises(ValueError, match="trial 5: per_device_train_batch_size 4 .* cannot be split evenly over 3 "
                                         "devices; give a multiple of 3"):
        DataParallelRunner(5, config, plan, trial_schedule(plan, config.args), prompts_dataset(8),
                           ModelPool("cpu", "fp32"), tmp_path, group=DataParallel(0, 3))
