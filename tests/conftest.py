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


@pytest.fixture(scope="session")
def postgres():
    """A PostgreSQL server of its own in a temporary directory (Debian's `postgresql` package; .ci/run installs
    it), run as the `postgres` user when the tests run as root. Skips the test if the server binaries are absent."""
    from pg_server import PostgresServer, find_bindir

    bindir = find_bindir()
    if bindir is None:
        pytest.skip("PostgreSQL server binaries not found: apt-get install postgresql (.ci/run does)")
    server = PostgresServer(bindir)
    server.start()
    try:
        yield server
    finally:
        server.destroy()


@pytest.fixture(scope="session")
def tiny_study_reference(tiny_model, tmp_path_factory):
    """``(storage, checkpoint_dir)`` of tests/tiny_study.py run to the end by one uninterrupted `rfopt run`: what
    crashed, resumed and multi-worker runs of it must reproduce."""
    from crashkit import env, run, run_command

    where = tmp_path_factory.mktemp("reference")
    storage = f"sqlite:///{where / 'ref.db'}"
    code = run(run_command(storage, "--checkpoint-dir", str(where / "ck")), where, env(tiny_model), where / "log")
    assert code == 0, (where / "log").read_text()[-3000:]
    return storage, where / "ck"
