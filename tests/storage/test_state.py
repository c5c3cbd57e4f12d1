"""A trial's snapshot as a checkpoint stores it (`rfopt.storage.state`)."""

import torch

from rfopt.storage.state import TrialSnapshot, on_cpu, to_tensors


def test_a_snapshot_brought_to_the_cpu_keeps_its_values_and_a_tensor_held_twice_once():
    """`on_cpu` (what the engine hands the thread that writes a unit's checkpoint while the unit is evaluated) keeps
    every value, the optimizer's groups, and a tensor several entries hold (bitsandbytes' quantization maps) as one,
    so the checkpoint's files are those of the snapshot itself."""
    shared = torch.linspace(-1, 1, 256)
    state = TrialSnapshot(
        units_done=2, global_step=8, tokens_seen=100,
        weights={"lora_A": torch.randn(4, 8), "lora_B": torch.zeros(8, 4)},
        optimizer={"state": {0: {"step": torch.tensor(8.0), "exp_avg": torch.randn(4, 8), "qmap1": shared,
                                 "nested": {"qmap2": shared, "absmax": torch.rand(2)}}},
                   "param_groups": [{"lr": 1e-3, "params": [0]}]},
        scheduler={"last_epoch": 8}, rng=None)
    moved = on_cpu(state)
    entry = moved.optimizer["state"][0]
    assert entry["qmap1"] is entry["nested"]["qmap2"]
    assert moved.optimizer["param_groups"] is state.optimizer["param_groups"] and moved.scheduler == state.scheduler
    assert (moved.units_done, moved.global_step, moved.tokens_seen) == (2, 8, 100)
    tensors, meta = to_tensors(state)
    moved_tensors, moved_meta = to_tensors(moved)
    assert moved_meta == meta and moved_tensors.keys() == tensors.keys()
    for key, value in tensors.items():
        assert moved_tensors[key].device.type == "cpu" and torch.equal(moved_tensors[key], value), key
    assert on_cpu(TrialSnapshot(0, 0, 0, {}, None, None, None)).optimizer is None
