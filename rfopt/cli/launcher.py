"""The worker processes ``rfopt worker --devices a,b`` starts: one per device, each the same command on its one device
(with its rank in a data-parallel group of ``--devices-per-trial`` devices), each ending with the process that started
it (`end_with_parent`); a Ctrl-C or a signal to the starter interrupts them all, every trial resumable."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from rfopt.errors import Refusal

WORKER_PARENT = "RFOPT_WORKER_PARENT"
"""Set by ``rfopt worker --devices a,b`` on each worker process it starts: the parent's pid, which the worker ends
with (`end_with_parent`)."""


def start_workers(args: argparse.Namespace, devices: list[str]) -> int:
    """Run one worker process per device in `devices` and wait for them; the exit code furthest from 0. Each is the
    user's own command line (``args.argv``) on its one device, with its rank in its data-parallel group: every
    argument the user gave reaches the workers as given."""
    import subprocess

    per_trial = args.devices_per_trial or 1
    if len(devices) % per_trial:
        raise Refusal(f"--devices {args.devices} --devices-per-trial {per_trial}: {len(devices)} devices do "
                         f"not form groups of {per_trial}; list a multiple of {per_trial}")
    ranks = [[] for _ in devices]
    if args.devices_per_trial is not None:
        for start in range(0, len(devices), per_trial):
            port = _free_port()
            for rank in range(per_trial):
                ranks[start + rank] = ["--data-parallel-rank", f"{rank}/{per_trial}@127.0.0.1:{port}"]
    workers = len(devices) // per_trial
    print(f"rfopt: {workers} workers on {', '.join(devices)}"
          + (f", {per_trial} devices per trial" if per_trial > 1 else ""), file=sys.stderr)
    command = [sys.executable, "-m", "rfopt.cli", *without_option(args.argv, "--devices")]
    child_env = dict(os.environ, **{WORKER_PARENT: str(os.getpid())})  # each ends with this process
    processes = [subprocess.Popen([*command, "--devices", d, *rank], env=child_env) for d, rank in zip(devices, ranks)]
    try:
        codes = [p.wait() for p in processes]
    except BaseException:  # Ctrl-C or a signal to this process alone: its workers stop too, as after a Ctrl-C
        _interrupt(processes)
        raise
    return max(codes, key=abs)


def without_option(argv: list[str], flag: str) -> list[str]:
    """`argv` without the option `flag` and its value, given as ``FLAG VALUE`` or ``FLAG=VALUE`` (argparse takes no
    shorter spelling of ``--devices``: it is also the start of ``--devices-per-trial``)."""
    kept: list[str] = []
    tokens = iter(argv)
    for token in tokens:
        if token == flag:
            next(tokens, None)
        elif not token.startswith(flag + "="):
            kept.append(token)
    return kept


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _interrupt(processes: list[Any], seconds: float = 60.0) -> None:
    """Interrupt the worker processes still running (SIGINT: each stops as after a Ctrl-C, every trial resumable) and
    wait for them; kill those still running after `seconds`."""
    import signal
    import subprocess

    for process in processes:
        if process.poll() is None:
            process.send_signal(signal.SIGINT)
    for process in processes:
        try:
            process.wait(timeout=seconds)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def end_with_parent(parent: int) -> None:
    """End this worker when the ``rfopt worker --devices`` process that started it ends, however it ends (SIGKILL
    included): Linux sends SIGINT (a Ctrl-C: every trial stays resumable) when the parent dies (PR_SET_PDEATHSIG);
    elsewhere a thread watches the parent's pid. A parent gone already ends this process at once."""
    import signal
    import threading
    import time

    from rfopt.engine.running.interrupts import remember_in_this_process

    def interrupt() -> None:
        os.kill(os.getpid(), signal.SIGINT)

    # A Ctrl-C ends the worker even where it was started with SIGINT ignored (a shell's background job), and one that
    # comes while it loads (the parent died early), whose KeyboardInterrupt a library's `__del__` may swallow, still
    # stops it before its first unit.
    remember_in_this_process()
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGINT, 0, 0, 0)
    if os.getppid() != parent:  # it died before this process could ask to end with it
        raise SystemExit("rfopt: the `rfopt worker` process that started this worker has ended; so does this worker")
    if sys.platform.startswith("linux"):
        return

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        interrupt()

    threading.Thread(target=watch, name="rfopt-parent-watch", daemon=True).start()


def end_with_starter() -> None:
    """In a worker process this module started (`WORKER_PARENT` set): end with the process that started it."""
    if os.environ.get(WORKER_PARENT, "").isdigit():
        end_with_parent(int(os.environ.pop(WORKER_PARENT)))
