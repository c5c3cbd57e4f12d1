"""Several workers on one GPU: each worker process binds the same CUDA device and holds its own copy of the base
models, so a worker whose base model weights cannot fit in the GPU's free memory is refused before anything is
stored. No GPU here: torch.cuda is stood in for (the calls rfopt makes are what is checked)."""

import os
import subprocess

import optuna
import pytest
import torch
from rfopt_testkit import prompts_dataset, trial_config

import rfopt
from rfopt.cli import main
from rfopt.training.memory import GIB, model_bytes
from rfopt.training.models import ModelPool
from rfopt.storage.schema import study_attrs

FREE = {"bytes": 80 * GIB}


def _stand_in_cuda(monkeypatch, bound):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", bound.append)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (FREE["bytes"], 80 * GIB))


def _parameters(model_path):
    from transformers import AutoModelForCausalLM

    return sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(model_path).parameters())


def test_a_base_models_size_is_counted_without_loading_it_in_the_dtype_it_loads_in(tiny_model):
    count = _parameters(tiny_model)
    assert model_bytes(trial_config(tiny_model)) == 4 * count  # float32, as TRL loads a model by default
    in_bf16 = trial_config(tiny_model, model_init_kwargs={"dtype": "bfloat16"})
    assert model_bytes(in_bf16) == 2 * count
    assert model_bytes(trial_config("/no/such/model")) is None  # refused elsewhere, with its own message


def test_two_pools_bind_the_same_gpu_and_one_that_cannot_hold_its_base_model_is_refused(tiny_model, monkeypatch):
    bound = []
    _stand_in_cuda(monkeypatch, bound)
    config = trial_config(tiny_model)
    first, second = ModelPool("cuda:0"), ModelPool("cuda:0")
    assert bound == [0, 0] and first.device == second.device == "cuda:0"
    need = model_bytes(config)
    FREE["bytes"] = int(need * 1.3)
    second.check_room([config, trial_config(tiny_model, learning_rate=0.002)])  # one shared copy: it fits
    FREE["bytes"] = int(need * 1.1)
    with pytest.raises(ValueError, match=r"device 'cuda:0': 0\.00 GiB of its 80\.00 GiB are free.*run fewer "
                                         r"workers on this GPU \(--devices cuda:0 once, not cuda:0,cuda:0\)"):
        second.check_room([config])
    ModelPool("cpu").check_room([config])  # the CPU: nothing to check
    FREE["bytes"] = 80 * GIB


def test_a_worker_that_cannot_hold_its_base_model_is_refused_before_the_study_changes(tiny_model, storage,
                                                                                       monkeypatch):
    _stand_in_cuda(monkeypatch, [])
    FREE["bytes"] = 1024
    try:
        study = rfopt.create_study(study_name="gpu", storage=storage)
        with pytest.raises(ValueError, match="run fewer workers on this GPU"):
            study.work([trial_config(tiny_model)], prompts_dataset(8), prompts_dataset(2, "E"), num_chunks=1,
                       device="cuda:0")
    finally:
        FREE["bytes"] = 80 * GIB
    loaded = optuna.load_study(study_name="gpu", storage=storage)
    assert loaded.trials == [] and "rfopt:plan" not in study_attrs(loaded) and "rfopt:id" not in study_attrs(loaded)


def test_worker_devices_cuda0_twice_starts_two_worker_processes_on_that_gpu(tmp_path, monkeypatch):
    study_file = tmp_path / "s.py"
    study_file.write_text("import rfopt\nSTUDY = rfopt.StudySpec(name='s', space=lambda trial: None, "
                          "datasets=lambda: (None, None))\n")
    started = []

    class Process:
        def __init__(self, argv, env):
            assert env["RFOPT_WORKER_PARENT"] == str(os.getpid())  # each worker ends with this process
            started.append(argv)

        def wait(self):
            return 0

    monkeypatch.setattr(subprocess, "Popen", Process)
    assert main(["worker", str(study_file), "--devices", "cuda:0,cuda:0", "--storage",
                 f"sqlite:///{tmp_path / 'w.db'}", "--n-trials-total", "4"]) == 0
    assert len(started) == 2
    for argv in started:
        assert argv[argv.index("--devices") + 1] == "cuda:0" and "--n-trials-total" in argv
