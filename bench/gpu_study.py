"""The study file bench/gpu.py gives ``rfopt worker`` for its workers sweep: the benchmark's configs and rows.

``RFOPT_BENCH_GPU_MODEL`` is the model directory bench/gpu.py built; ``RFOPT_BENCH_GPU_DRY=1`` sizes it as the
CPU dry run.
"""

import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu  # noqa: E402

import rfopt  # noqa: E402

SIZES = gpu.DRY if os.environ.get("RFOPT_BENCH_GPU_DRY") == "1" else gpu.GPU
SETUP = gpu.bench_setup(SIZES, Path(os.environ["RFOPT_BENCH_GPU_MODEL"]), Path(tempfile.gettempdir()))

STUDY = rfopt.StudySpec(
    name="gpu-bench",
    configs=lambda: SETUP.configs,
    datasets=lambda: (SETUP.train, SETUP.test),
    num_chunks=SIZES.chunks,
    max_concurrent=SIZES.configs,
    eval_settings=SETUP.settings,
)
