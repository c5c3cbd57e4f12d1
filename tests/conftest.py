import logging
import os
import tempfile
import warnings

import pytest

pytest_plugins = ["pytester"]

# One torch (OpenMP) thread, here and in the processes tests start: the tiny model gains nothing from more, and on a
# busy 2-core machine two spinning OpenMP threads per process made tests 10x slower.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
warnings.filterwarnings("ignore", category=UserWarning)
# trackio reads its directory once, when first imported: the tests' trackio runs go to a folder of their own, not the
# user's ~/.cache (each test names its own project). Set before any test imports trackio; inherited by subprocesses.
os.environ.setdefault("TRACKIO_DIR", tempfile.mkdtemp(prefix="rfopt-tests-trackio-"))


# ---------------------------------------------------------------------- the two tiers, kept apart
# `make test` runs `-m "not slow"`. What puts a test in the slow tier is what it does, not what someone remembered to
# write: a test marked `e2e` (trains through TRL) or `subprocess` (starts processes that train or load rfopt) is slow
# by that alone (`pytest_collection_modifyitems`), and a test left in the fast tier that trains through TRL or starts
# a Python process fails, naming the marker to add (`_fast_tier_stays_fast`). pyproject.toml sets --strict-markers,
# so a misspelt marker is an error, not a silently unmarked test.
TIER_MARKERS = ("e2e", "subprocess")


class SlowWorkInFastTier(AssertionError):
    """A test outside the slow tier trained through TRL or started a Python process."""


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    for item in items:
        if any(item.get_closest_marker(name) for name in TIER_MARKERS) and not item.get_closest_marker("slow"):
            item.add_marker(pytest.mark.slow)


def _is_python_process(command) -> bool:
    import shlex
    import sys

    argv = shlex.split(command) if isinstance(command, str) else [str(part) for part in command]
    program = os.path.basename(argv[0]) if argv else ""
    return bool(argv) and (argv[0] == sys.executable or program.startswith("python") or program == "rfopt")


@pytest.fixture(autouse=True)
def _fast_tier_stays_fast(request, monkeypatch):
    """Outside the slow tier, TRL's training loop and Python subprocesses refuse to start (see above). The test
    fails even where rfopt catches the refusal (a trial that fails alone), with the marker to add."""
    if request.node.get_closest_marker("slow"):
        yield
        return
    import subprocess

    import transformers

    name = request.node.nodeid
    caught: list[str] = []

    def refuse(message: str):
        caught.append(message)
        raise SlowWorkInFastTier(message)

    def no_training(*args, **kwargs):
        refuse(f"{name} trains through TRL: mark it @pytest.mark.e2e (the slow tier), or train on the scripted "
               "runner (the `scripted` fixture)")

    popen_init = subprocess.Popen.__init__

    def no_python_process(self, args, *rest, **kwargs):
        if _is_python_process(args):
            refuse(f"{name} starts a Python process ({args!r}): mark it @pytest.mark.subprocess (the slow tier)")
        popen_init(self, args, *rest, **kwargs)

    monkeypatch.setattr(transformers.Trainer, "train", no_training)
    monkeypatch.setattr(subprocess.Popen, "__init__", no_python_process)
    yield
    if caught and not getattr(request.node, "_call_failed", False):  # the refusal was caught on its way out
        pytest.fail(caught[0], pytrace=False)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.when == "call":
        item._call_failed = report.failed
    return report


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """Directory of a tiny random Llama chat model with a character-level tokenizer, built offline."""
    from rfopt.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-llama")


@pytest.fixture(scope="session")
def wide_model(tmp_path_factory):
    """The tiny model's kind at hidden size 128: wide enough for bitsandbytes' 4-bit blocks (64 weights), which the
    tiny model (32) is not. Built offline."""
    from rfopt.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("models") / "wide-llama", hidden_size=128)


@pytest.fixture
def scripted(monkeypatch):
    """Every study this test runs in this process trains on scripted runners (tests/scripted_runner.py: no model, no
    TRL, microseconds a unit); the `Scripted` returned sets their values and records what they did."""
    import scripted_runner

    return scripted_runner.use(monkeypatch)


@pytest.fixture(params=["scripted", pytest.param("trl", marks=(pytest.mark.e2e, pytest.mark.slow))])
def scripted_or_trl(request, monkeypatch):
    """Runs the test twice: on scripted runners (the fast tier; the `Scripted` is the fixture's value), and training
    through TRL (the slow tier; None)."""
    if request.param == "trl":
        return None
    import scripted_runner

    return scripted_runner.use(monkeypatch)


@pytest.fixture
def dying(monkeypatch):
    """Runs in this process that die at crash points as ``RFOPT_CRASH_AT`` kills a process (`crashkit.DyingRuns`)."""
    from crashkit import DyingRuns

    return DyingRuns(monkeypatch)


@pytest.fixture
def storage(tmp_path):
    return f"sqlite:///{tmp_path / 'study.db'}"


# A valid study file whose data cannot be loaded: `rfopt run` on it gets as far as reading its data and no further,
# so a test sees what run does before training (the banner, the storage check) without training anything.
STUDY_FILE_WITHOUT_DATA = """
import rfopt

def datasets():
    raise ValueError("this test's study has no data")

STUDY = rfopt.StudySpec(name="file-name", space=lambda trial: None, datasets=datasets)
"""


@pytest.fixture
def study_file(tmp_path):
    """tmp_path/study.py, holding STUDY_FILE_WITHOUT_DATA."""
    path = tmp_path / "study.py"
    path.write_text(STUDY_FILE_WITHOUT_DATA)
    return path


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


@pytest.fixture(scope="session")
def tiny_gang_study_reference(tiny_model, tmp_path_factory):
    """``(storage, checkpoint_dir)`` of tests/tiny_study.py run to the end in gangs of 3 (``--gang-size 3``), their
    members taking their steps one after another (``--gang-training sequential``), by one uninterrupted `rfopt run`."""
    return _gang_study_reference(tiny_model, tmp_path_factory, "sequential")


@pytest.fixture(scope="session")
def tiny_batched_gang_study_reference(tiny_model, tmp_path_factory):
    """`tiny_gang_study_reference` with ``--gang-training batched``: one forward and backward for a gang's members."""
    return _gang_study_reference(tiny_model, tmp_path_factory, "batched")


def _gang_study_reference(tiny_model, tmp_path_factory, training):
    from crashkit import env, run, run_command

    where = tmp_path_factory.mktemp(f"gang-reference-{training}")
    storage = f"sqlite:///{where / 'ref.db'}"
    code = run(run_command(storage, "--checkpoint-dir", str(where / "ck"), "--gang-size", "3", "--gang-training",
                           training), where, env(tiny_model), where / "log")
    assert code == 0, (where / "log").read_text()[-3000:]
    return storage, where / "ck"


class _S3Buckets:
    """Hands out new empty buckets on the test S3 server, as ``s3://`` URLs."""

    def __init__(self) -> None:
        self.count = 0

    def bucket(self) -> str:
        import fsspec

        self.count += 1
        name = f"rfopt-test-{self.count}"
        fsspec.filesystem("s3").mkdir(name)
        return f"s3://{name}"


@pytest.fixture(scope="session")
def s3():
    """An S3-compatible server (moto) on 127.0.0.1 for the session, reached through s3fs exactly as a real S3 or MinIO
    is: by the standard AWS variables (AWS_ENDPOINT_URL, keys, region), set here for this process and the processes
    its tests start. ``s3.bucket()`` makes a new empty bucket and returns its URL. Skips if moto or s3fs is missing."""
    pytest.importorskip("s3fs", reason="s3fs is not installed: pip install -e '.[test]' (make test does)")
    moto_server = pytest.importorskip("moto.server", reason="moto[server] is not installed: pip install -e '.[test]'")
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no line per request
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    variables = {"AWS_ENDPOINT_URL": f"http://{host}:{port}", "AWS_ACCESS_KEY_ID": "rfopt-test",
                 "AWS_SECRET_ACCESS_KEY": "rfopt-test", "AWS_DEFAULT_REGION": "us-east-1"}
    try:
        with pytest.MonkeyPatch.context() as patch:
            for name, value in variables.items():
                patch.setenv(name, value)
            yield _S3Buckets()
    finally:
        server.stop()


@pytest.fixture(params=["local", "s3"])
def checkpoint_root(request, tmp_path):
    """Where a test's checkpoints go: a local directory, and in the test's second run a bucket on the S3 server."""
    if request.param == "local":
        return str(tmp_path / "ck")
    return request.getfixturevalue("s3").bucket() + "/ck"
