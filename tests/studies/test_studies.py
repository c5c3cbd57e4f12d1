"""The study files in rfopt/studies/: each loads, builds configs the engine accepts, and runs end to end.

End-to-end runs swap the study's model for the tiny test model and its data for a few rows
(the Hub studies read small local files in each dataset's real format), through the study
files' own builders: ``build_space(...)`` and ``load_datasets(...)``.
"""

import inspect
import json
import re
from pathlib import Path

import datasets
import optuna
import pytest

import rfopt
from rfopt.chunks import ChunkPlan, trial_schedule
from rfopt.cli import main
from rfopt.config.studyfile import load_spec
from rfopt_testkit import deepmath_rows

STUDIES_DIR = Path(__file__).resolve().parents[2] / "rfopt" / "studies"
STUDY_NAMES = ["arithmetic", "gsm8k_lite", "deepmath", "numina_tir"]


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    # The tiny model gains nothing from a second thread, and two OpenMP threads on a shared 2-core
    # machine stall whenever another process holds a core (measured: 76 s instead of 6 s per run).
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def _datasets_cache_in_tmp(tmp_path, monkeypatch):
    # load_dataset caches what it reads; keep that out of the user's ~/.cache.
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-datasets-cache")


def _module(name):
    load_spec(STUDIES_DIR / f"{name}.py")  # the way `rfopt run` loads it
    import importlib

    return importlib.import_module(f"rfopt.studies.{name}")


def _default_train_rows(module) -> int:
    return inspect.signature(module.load_datasets).parameters["n_train"].default


def _run(study_name, storage, spec, space, train, evaluation):
    study = rfopt.create_study(study_name=study_name, storage=storage, pruner=spec.pruner(), load_if_exists=False)
    study.optimize(
        space,
        train,
        evaluation,
        num_chunks=spec.num_chunks,
        objective=spec.objective,
        eval_settings=spec.eval_settings,
        show_progress_bar=False,
    )
    return study


def _states(study):
    return sorted((t.state.name, len(t.intermediate_values)) for t in study.optuna.trials)


def _write_jsonl(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


# ---------------------------------------------------------------------- every study file
@pytest.mark.parametrize("name", STUDY_NAMES)
def test_study_file_loads_and_its_configs_fit_the_chunk_plan(name):
    spec = load_spec(STUDIES_DIR / f"{name}.py")
    module = _module(name)
    assert spec.name == name and spec.description
    for variant in (spec, spec.with_fast()):
        configs = variant.search_space()
        assert configs and all(isinstance(c, rfopt.TrialConfig) for c in configs)
        plan = ChunkPlan.build(_default_train_rows(module), variant.num_chunks)
        for config in configs:
            config.validate()
            assert config.args.num_train_epochs == 1
            schedule = trial_schedule(plan, config.args)
            assert schedule.steps_per_chunk >= 1
            assert rfopt.TrialConfig.from_json(config.to_json()).to_json() == config.to_json()
        assert variant.pruner is None or isinstance(variant.pruner(), optuna.pruners.BasePruner)
        # The banner `rfopt run` prints says how many chunks this variant (--fast too) trains.
        said = re.findall(r"(\d+) chunks|chunks? [\d ,and]+ of (\d+)", variant.description)
        assert all(int(a or b) == variant.num_chunks for a, b in said), (variant.description, variant.num_chunks)


def test_arithmetic_searches_a_poor_learning_rate_and_prunes_with_successive_halving():
    spec = load_spec(STUDIES_DIR / "arithmetic.py")
    rates = sorted(c.args.learning_rate for c in spec.search_space())
    assert rates[0] <= 1e-6 and rates[-1] >= 1e-4
    assert isinstance(spec.pruner(), optuna.pruners.SuccessiveHalvingPruner)
    train, evaluation = spec.datasets()
    assert len(evaluation) <= 32
    # The worked example sits between the system prompt and the question, in train and eval alike.
    for row in (train[0], evaluation[0]):
        roles = [m["role"] for m in row["prompt"]]
        assert roles == ["system", "user", "assistant", "user"]
        assert "<answer>" in row["prompt"][2]["content"]
    assert evaluation[0]["prompt"][-1]["content"] not in train["prompt"][0][-1]["content"]


def test_gsm8k_lite_matches_the_article():
    module = _module("gsm8k_lite")
    configs = module.build_space(optim="adamw_8bit")
    assert {c.model: c.args.learning_rate for c in configs} == {
        "Qwen/Qwen2.5-0.5B-Instruct": 5e-6,
        "meta-llama/Llama-3.2-1B-Instruct": 1e-6,
    }
    for c in configs:
        g = c.args
        assert (g.per_device_train_batch_size, g.gradient_accumulation_steps, g.num_generations) == (4, 2, 8)
        assert g.generation_batch_size == 8  # one prompt x 8 generations per optimizer step
        assert (g.warmup_steps, g.weight_decay, g.max_grad_norm, g.beta) == (0.1, 0.1, 0.1, 0.0)
        assert (g.max_completion_length, g.num_train_epochs, g.optim) == (256, 1, "adamw_8bit")
        assert (c.peft_config.r, c.peft_config.lora_alpha, c.peft_config.lora_dropout) == (16, 16, 0.05)
        assert set(c.peft_config.target_modules) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
        assert c.reward_names == ["correctness", "integer_answer", "strict_format", "soft_format", "tag_count"]
    # 128 prompts in 4 chunks: 32 steps each.
    schedule = trial_schedule(ChunkPlan.build(128, 4), configs[0].args)
    assert (schedule.prompts_per_chunk, schedule.steps_per_chunk) == (32, 32)


def test_gsm8k_lite_keeps_the_articles_8bit_adamw_on_the_cpu_where_bitsandbytes_is_installed(monkeypatch, capsys):
    """bitsandbytes' CPU backend steps 8-bit AdamW: the article's optimizer is kept without CUDA, and what the trainer
    builds from it keeps its moments in 8 bits on CPU tensors."""
    import torch
    from transformers import Trainer

    pytest.importorskip("bitsandbytes")
    module = _module("gsm8k_lite")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    configs = module.build_space()
    assert {c.args.optim for c in configs} == {"adamw_8bit"}
    assert all(not c.args.bf16 and c.args.use_cpu for c in configs)
    assert "warning" not in capsys.readouterr().err
    optimizer_class, kwargs = Trainer.get_optimizer_cls_and_kwargs(configs[0].args)
    layer = torch.nn.Linear(128, 128)  # 16384 weights: over bitsandbytes' min_8bit_size, so its state is 8-bit
    optimizer = optimizer_class(layer.parameters(), **kwargs)
    before = layer.weight.detach().clone()
    layer(torch.randn(4, 128)).square().sum().backward()
    optimizer.step()
    assert not layer.weight.equal(before) and torch.isfinite(layer.weight).all()
    assert optimizer.state[layer.weight]["state1"].dtype == torch.uint8


def test_gsm8k_lite_falls_back_to_adamw_torch_with_a_warning_where_bitsandbytes_is_missing(monkeypatch, capsys):
    import importlib.util

    import torch

    module = _module("gsm8k_lite")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "bitsandbytes" else real(name, *a))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    configs = module.build_space()
    assert {c.args.optim for c in configs} == {"adamw_torch"}
    assert all(not c.args.bf16 and c.args.use_cpu for c in configs)
    err = capsys.readouterr().err
    assert ("optim='adamw_8bit' needs bitsandbytes (bitsandbytes is not installed (pip install 'rfopt[qlora]')); "
            "using optim='adamw_torch' instead") in err


def test_gsm8k_lite_falls_back_where_bitsandbytes_does_not_serve_the_device(monkeypatch, capsys):
    from rfopt.training import quantization

    module = _module("gsm8k_lite")
    monkeypatch.setattr(quantization, "bitsandbytes_devices", lambda: ("xpu",))
    assert module.optimizer() == "adamw_torch"
    assert "the installed bitsandbytes serves xpu, not " in capsys.readouterr().err


def test_gsm8k_lite_offline_stops_with_the_loaders_message_not_a_traceback(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    code = main(["run", str(STUDIES_DIR / "gsm8k_lite.py"), "--storage", f"sqlite:///{tmp_path / 'g.db'}", "--no-progress"])
    assert code == 1
    err = capsys.readouterr().err
    line = next(line for line in err.splitlines() if line.startswith("rfopt: error: "))
    assert "its datasets function" in line and "gsm8k: could not load 'openai/gsm8k'" in line
    assert "Traceback" not in err


# ---------------------------------------------------------------------- end to end on the tiny model
ARITHMETIC_ON_TINY = """
import dataclasses
from rfopt.studies import arithmetic

STUDY = dataclasses.replace(
    arithmetic.STUDY,
    name="arithmetic-tiny",
    configs=lambda: arithmetic.build_space(model={model!r}, configs=[(1e-6, 4), (5e-3, 4)], max_completion_length=8),
    datasets=lambda: arithmetic.load_datasets(n_train=8, n_eval=2),
    eval_settings=dataclasses.replace(arithmetic.STUDY.eval_settings, max_new_tokens=8),
)
"""


def test_arithmetic_study_runs_end_to_end_through_the_cli(scripted_or_trl, tiny_model, tmp_path, capsys):
    study_file = tmp_path / "arithmetic_tiny.py"
    study_file.write_text(ARITHMETIC_ON_TINY.format(model=str(tiny_model)))
    storage = f"sqlite:///{tmp_path / 'a.db'}"
    assert main(["run", str(study_file), "--storage", storage, "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "recommended adapter (PEFT format; trial " in out and "sample completions" in out
    assert "take this adapter: trial " in out and "with no adapter: the baseline" in out
    study = rfopt.load_study("arithmetic-tiny", storage)
    # Successive halving keeps one of two trials after chunk 1; the kept one trains every chunk.
    chunks = _module("arithmetic").NUM_CHUNKS
    assert _states(study) == [("COMPLETE", chunks), ("PRUNED", 1)]
    best = study.optuna.best_trial.number
    metrics = study.chunk_metrics(best)
    assert len(metrics) == chunks
    assert {"rewards/strict_format/mean", "rewards/correctness/mean", "reward"} <= set(metrics[-1]["eval"])
    assert (Path(study.best_adapter()) / "adapter_config.json").is_file()


def test_gsm8k_lite_runs_end_to_end_on_a_local_copy(scripted_or_trl, tiny_model, tmp_path, storage):
    module = _module("gsm8k_lite")
    rows = lambda split, n: [  # noqa: E731 - GSM8K's shape: a worked solution ending "#### n"
        {"question": f"{split} {i}: 2 boxes of {i + 1},000 pins?", "answer": f"2 * {i + 1}000 = <<2*{i + 1}000>>\n#### {2 * (i + 1)},000"}
        for i in range(n)
    ]
    _write_jsonl(tmp_path / "gsm8k" / "train.jsonl", rows("train", 6))
    _write_jsonl(tmp_path / "gsm8k" / "test.jsonl", rows("test", 3))
    train, evaluation = module.load_datasets(source=tmp_path / "gsm8k", n_train=4, n_test=2)
    space = module.build_space(models={str(tiny_model): 5e-6}, optim="adamw_torch", max_completion_length=8)
    study = _run("gsm8k-tiny", storage, module.STUDY, space, train, evaluation)
    assert _states(study) == [("COMPLETE", 4)]  # NopPruner: the article stops nothing by itself


def test_gsm8k_lite_trial_with_an_unreachable_model_fails_with_the_reason(tmp_path, storage):
    module = _module("gsm8k_lite")
    train = datasets.Dataset.from_list([{"prompt": [{"role": "user", "content": f"q{i}"}], "answer": "1"} for i in range(4)])
    space = module.build_space(models={"meta-llama/Llama-3.2-1B-Instruct": 1e-6}, optim="adamw_torch")
    study = _run("gsm8k-offline", storage, module.STUDY, space, train, train)
    (row,) = study.leaderboard()
    assert row.state == "FAIL" and "could not be loaded" in row.reason


def test_deepmath_runs_end_to_end_on_a_local_copy(scripted_or_trl, tiny_model, tmp_path, storage):
    module = _module("deepmath")
    rows = deepmath_rows(6)
    path = tmp_path / "deepmath.parquet"
    datasets.Dataset.from_list(rows).to_parquet(str(path))
    train, evaluation = module.load_datasets(source=path, n_train=4, n_test=2)
    space = module.build_space(models=[str(tiny_model)], learning_rates=[1e-5], lora_ranks=[4], max_completion_length=8)
    study = _run("deepmath-tiny", storage, module.STUDY, space, train, evaluation)
    assert _states(study) == [("COMPLETE", 4)]
    eval_metrics = study.chunk_metrics(0)[-1]["eval"]
    assert eval_metrics["rewards/math_accuracy/mean"] == 0.0  # a random model boxes nothing right
    assert "rewards/soft_overlong_punishment/mean" in eval_metrics


def test_numina_tir_runs_end_to_end_on_a_local_copy(scripted_or_trl, tiny_model, tmp_path, storage):
    module = _module("numina_tir")

    def rows(split, n):
        out = []
        for i in range(n):
            problem, solution = f"{split} {i}: halve {2 * i}.", f"```python\nprint({2 * i}/2)\n```\nSo $\\boxed{{{i}}}$."
            out.append({"problem": problem, "solution": solution, "messages": [
                {"role": "user", "content": problem}, {"role": "assistant", "content": solution}]})
        return out

    _write_jsonl(tmp_path / "numina" / "train.jsonl", rows("train", 6))
    _write_jsonl(tmp_path / "numina" / "test.jsonl", rows("test", 3))
    train, evaluation = module.load_datasets(source=tmp_path / "numina", n_train=4, n_test=2)
    space = module.build_space(
        models=[str(tiny_model)], learning_rates=[1e-5, 1e-3],
        per_device_train_batch_size=4, gradient_accumulation_steps=1, max_completion_length=8,
    )
    study = _run("numina-tiny", storage, module.STUDY, space, train, evaluation)
    assert _states(study) == [("COMPLETE", 4), ("PRUNED", 1)]
    assert {"rewards/think_format/mean", "rewards/math_accuracy/mean"} <= set(study.chunk_metrics(0)[0]["eval"])
