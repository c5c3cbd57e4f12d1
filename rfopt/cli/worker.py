"""``rfopt worker``: join a study file's study as a worker on one device, beside workers on other devices or hosts;
given several devices, one worker process each (`rfopt.cli.launcher`)."""

from __future__ import annotations

import argparse
import textwrap
from typing import Any

from rfopt.errors import Refusal

from .arguments import add_command
from .launcher import start_workers
from .training import load_spec, open_study_file, run_arguments, sharing_options, study_options


def register(commands: Any) -> None:
    worker = add_command(
        commands,
        "worker",
        help="join a study as workers, one process per device, beside workers on other devices or hosts",
        description="Train a study file's study together with every other worker on the same storage: each unit "
        "is trained under a lease on its trial, kept in the study's database (renewed while it trains; a worker "
        "whose lease expired cannot commit; a dead worker's unit is trained by another once its lease expires). "
        "PostgreSQL for many hosts (with a checkpoint store every host can reach: a shared directory or an fsspec URL "
        "such as s3://bucket/prefix), SQLite on one host.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=textwrap.dedent(
            """\
            examples:
              rfopt worker arithmetic --devices auto                  # one worker per GPU, or the CPU
              rfopt worker arithmetic --devices cuda:0,cuda:1 --storage postgresql://db/rfopt \\
                  --checkpoint-dir s3://my-bucket/rfopt      # or a directory every host mounts
              rfopt worker arithmetic --devices cpu,cpu --n-trials-total 16      # two workers on the CPU
            """
        ),
    )
    study_options(worker, worker=True)
    worker.add_argument("--devices", default="cpu", help="auto (every CUDA device, else the CPU), cpu, cuda:N, or a "
                        "comma-separated list: one worker process each (default: %(default)s)")
    sharing_options(worker, worker=True)
    worker.add_argument("--data-parallel-rank", help=argparse.SUPPRESS)  # RANK/K@ADDRESS:PORT, for the group's processes
    worker.set_defaults(handler=work)


def work(args: argparse.Namespace) -> int:
    devices = _devices(args.devices)
    group = _data_parallel(args, devices)
    if group is not None:
        group.start(devices[0])  # before the study file builds its configs: Accelerate reads the group once
    if len(devices) > 1:  # one process per device, each this same command on its one device
        from rfopt.storage.database import check_lasting_url
        from rfopt.study import check_study_name
        from rfopt.training.trackers import normalize as trackers_of

        check_lasting_url(args.storage)  # bad input fails here once, not in every worker
        check_study_name(args.study_name)
        trackers_of(args.report_to)
        load_spec(args.study_file)
        return start_workers(args, devices)

    spec, study, space, train, evaluation = open_study_file(args, f"worker on {devices[0]} for study")
    study.work(space, train, evaluation, **run_arguments(args, spec, space), device=devices[0],
               lease_seconds=args.lease_seconds, data_parallel=group)
    if group is not None:
        group.stop()
    if group is None or group.lead:
        print(study.leaderboard_text())
    if group is not None and group.world_size > 1:
        _leave_without_teardown()
    return 0


def _leave_without_teardown() -> None:
    """End a process of a data-parallel group now, its work committed and its output flushed, without the
    interpreter's teardown. There, one process in a few died with "terminate called without an active exception"
    (SIGABRT, the launcher's exit 250). The cause, from a core dump: once a model has been wrapped in DDP, the gloo
    process group outlives ``destroy_process_group`` (torch keeps a C++ reference no Python object shows), so its worker
    threads are not joined there; a worker thread drops the last collective's work (``broadcast_object_list``'s
    tensors, whose Python objects they own) a moment after the main thread resumed, and where the interpreter is
    finalizing by then, the GIL it takes for that ends the thread (``pthread_exit``) inside a noexcept destructor.
    A 40-line torch-only script (two gloo ranks, a DDP forward and backward, broadcast_object_list, destroy) aborts
    so in 7 runs of 25 on a loaded 2-core machine, in none of 13 without DDP. Skipping the teardown skips it."""
    import logging
    import os
    import sys

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _data_parallel(args: argparse.Namespace, devices: list[str]) -> Any:
    """This process's place in a data-parallel group: from ``--data-parallel-rank`` (a process of a group the command
    started), or rank 0 of 1 for ``--devices-per-trial 1`` on one device (one device, rollouts sampled per row, as a
    group's trial)."""
    from rfopt.training.parallel import DataParallel

    if args.data_parallel_rank:
        place, _, where = args.data_parallel_rank.partition("@")
        rank, _, world = place.partition("/")
        address, _, port = where.rpartition(":")
        return DataParallel(int(rank), int(world), address, int(port))
    if args.devices_per_trial is not None and len(devices) == 1:
        if args.devices_per_trial != 1:
            raise Refusal(f"--devices-per-trial {args.devices_per_trial} needs that many devices in --devices "
                             f"(got {devices[0]})")
        return DataParallel(0, 1)
    return None


def _devices(spec: str) -> list[str]:
    """`--devices`: auto (every CUDA device, else the CPU), or a comma-separated list such as cuda:0,cuda:1."""
    if spec == "auto":
        import torch

        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        return [f"cuda:{i}" for i in range(count)] or ["cpu"]
    devices = [d.strip() for d in spec.split(",") if d.strip()]
    bad = [d for d in devices if not (d == "cpu" or d == "cuda" or (d.startswith("cuda:") and d[5:].isdigit()))]
    if not devices or bad:
        raise Refusal(f"--devices {spec!r}: give auto, cpu, cuda:N, or a comma-separated list of them")
    return devices
