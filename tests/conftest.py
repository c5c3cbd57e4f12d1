import os
import warnings

import pytest

# One torch (OpenMP) thread, here and in the processes tests start: the tiny model gains nothing from more, and on a
# busy 2-core machine two spinning OpenMP threads per process made tests 10x slower.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
warnings.filterwarnings("ignore", category=UserWarning)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """Directory of a tiny random Llama chat model with a character-level tokenizer, built offline."""
    from rfopt.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-llama")


@pytest.fixture
def storage(tmp_path):
    return f"sqlite:///{tmp_path / 'study.db'}"
