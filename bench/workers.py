"""One worker against two on the CPU, for one fixed sweep, and what leases cost per unit (issue 5).

The sweep is tests/tiny_study.py (the tiny offline Llama, LoRA r=4, an explicit grid of learning
rates), sized by ``--trials`` x ``--chunks`` units (default 6 x 4 = 24). Each configuration runs
the whole sweep from an empty SQLite study with ``rfopt worker`` (or ``rfopt run``) and is timed
from the command's start to its exit (so it includes Python start-up, model loading, checkpoints):

- ``run, 1 thread``: ``rfopt run`` in one process, torch on 1 thread (no leases: the baseline loop);
- ``1 worker, 1 thread``: ``rfopt worker --devices cpu``;
- ``2 workers, 1 thread each``: ``rfopt worker --devices cpu,cpu`` (two processes, both cores);
- with ``--two-threads``, also ``1 worker, 2 threads``: one process with torch on both cores;
- with ``--ray``, also ``rfopt run --ray --workers 1`` and ``--workers 2``: the same sweep on a local Ray cluster
  (started by the command, one CPU per worker actor), and Ray's start-up cost alone: ``ray.init`` of a local
  cluster, one actor ready, ``ray.shutdown`` (needs ``pip install 'rfopt[ray]'``).

Every 1-thread configuration must end with the same per-chunk values, metrics, adapters and
checkpoints (checked; torch on 2 threads sums in another order, so its numbers differ). Per unit it
reports the mean time from a unit's start to its commit, and the mean gap between a process's
commit and its next unit's start: the scheduling loop, which for workers includes reading the
study, reading and taking leases and catching up with units other workers trained (loading their
checkpoints). Then the lease operations alone, timed on the same database file: what one unit adds
(read leases, acquire, two heartbeats, fenced commit, release).

    python bench/workers.py                      # about 2 minutes on 2 idle cores
    python bench/workers.py --trials 4 --chunks 3 --storage-dir /tmp/rfopt-bench-workers
    python bench/workers.py --postgres           # lease operations on PostgreSQL too
    python bench/workers.py --trials 4 --ray     # the 4-trial sweep: run, workers by hand, Ray with 1 and 2 workers
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TESTS = REPO / "tests"
sys.path[:0] = [str(REPO), str(TESTS)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=6)
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--storage-dir", help="where studies and checkpoints go (default: a temporary directory)")
    parser.add_argument("--lease-ops", type=int, default=200, help="units of lease operations to time")
    parser.add_argument("--two-threads", action="store_true", help="also time one worker with torch on 2 threads")
    parser.add_argument("--ray", action="store_true", help="also run the sweep on a local Ray cluster with 1 and 2 "
                        "worker actors (rfopt run --ray), and time Ray's start-up alone")
    parser.add_argument("--postgres", action="store_true", help="also time the lease operations on a throwaway "
                        "PostgreSQL server (tests/pg_server.py; needs Debian's postgresql package)")
    args = parser.parse_args()

    from rfopt.tiny import build_tiny_model

    root = Path(args.storage_dir or tempfile.mkdtemp(prefix="rfopt-bench-workers-"))
    root.mkdir(parents=True, exist_ok=True)
    model = build_tiny_model(root / "tiny-llama")
    setups = [
        ("run, 1 thread", "run", "cpu", 1),
        ("1 worker, 1 thread", "worker", "cpu", 1),
        ("2 workers, 1 thread each", "worker", "cpu,cpu", 1),
    ] + [("1 worker, 2 threads", "worker", "cpu", 2)] * args.two_threads
    setups += [("Ray, 1 worker actor", "ray", "1", 1), ("Ray, 2 worker actors", "ray", "2", 1)] * args.ray
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"sweep: tests/tiny_study.py, {args.trials} trials x {args.chunks} chunks = {args.trials * args.chunks} "
          f"units; {os.cpu_count()} CPUs; results in {root}")
    results = []
    for label, command, devices, threads in setups:
        where = root / label.replace(" ", "-").replace(",", "")
        where.mkdir(exist_ok=True)
        results.append((label, where, *_sweep(model, where, command, devices, threads, args)))
    _check_same([r for r in results if "2 threads" not in r[0]])

    print()
    print(f"{'':26} {'wall s':>7} {'units/min':>9} {'unit start->commit s':>21} {'commit->next start ms':>22}")
    base = results[0][2]
    for label, _, wall, per_unit, gap, units in results:
        print(f"{label:26} {wall:7.1f} {units / wall * 60:9.1f} {per_unit:21.3f} {gap * 1000:22.1f}"
              f"   ({base / wall:.2f}x of run)")
    if args.ray:
        print(f"Ray start-up alone (ray.init of a local cluster, one actor ready, ray.shutdown): "
              f"{_ray_startup():.1f} s (inside each Ray row above)")
    print(f"load average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print()
    _lease_costs(f"sqlite:///{root / 'leases.db'}", "SQLite", root, args.lease_ops)
    if args.postgres:
        from pg_server import PostgresServer, find_bindir

        server = PostgresServer(find_bindir())
        server.start()
        try:
            _lease_costs(server.new_database(), "PostgreSQL (local, fsync off)", root, args.lease_ops)
        finally:
            server.destroy()


def _sweep(model: Path, where: Path, command: str, devices: str, threads: int, args):
    log = where / "events.log"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), str(TESTS)]), OMP_NUM_THREADS=str(threads),
               MKL_NUM_THREADS=str(threads), RFOPT_TEST_TINY_MODEL=str(model), RFOPT_TEST_TRIALS=str(args.trials),
               RFOPT_TEST_CHUNKS=str(args.chunks), RFOPT_EVENT_LOG=str(log))
    storage = f"sqlite:///{where / 'study.db'}"
    argv = [sys.executable, "-m", "rfopt.cli", "run" if command == "ray" else command, str(TESTS / "tiny_study.py"),
            "--storage", storage, "--checkpoint-dir", str(where / "ck")]
    if command == "ray":
        argv += ["--no-progress", "--ray", "--workers", devices]
    else:
        argv += ["--no-progress"] if command == "run" else ["--devices", devices]
    started = time.perf_counter()
    with open(where / "output.log", "wb") as out:
        code = subprocess.run(argv, cwd=where, env=env, stdout=out, stderr=subprocess.STDOUT).returncode
    wall = time.perf_counter() - started
    if code != 0:
        raise SystemExit(f"{command} failed; see {where / 'output.log'}")
    from crashkit import events

    rows = events(log)
    starts = {(t, u): at for point, t, u, pid, at in rows if point == "unit-started"}
    per_unit = statistics.mean(at - starts[(t, u)] for point, t, u, pid, at in rows if point == "unit-committed")
    gaps, last_commit = [], {}
    for point, _t, _u, pid, at in rows:
        if point == "unit-committed":
            last_commit[pid] = at
        elif point == "unit-started" and pid in last_commit:
            gaps.append(at - last_commit.pop(pid))
    units = sum(point == "unit-committed" for point, *_ in rows)
    how = f"run --ray --workers {devices}" if command == "ray" else f"{command} --devices {devices}"
    print(f"  {how} with {threads} thread(s): {wall:.1f} s, {units} units")
    return wall, per_unit, statistics.mean(gaps), units


def _ray_startup() -> float:
    """Seconds for a new process to start a local Ray cluster, get one actor ready and shut the cluster down."""
    code = ("import time; t = time.perf_counter(); import ray; ray.init(num_cpus=1, logging_level='ERROR'); "
            "A = ray.remote(num_cpus=1)(type('A', (), {'ping': lambda self: 1})); ray.get(A.remote().ping.remote()); "
            "ray.shutdown(); print(time.perf_counter() - t)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return float(out.strip().splitlines()[-1])


def _check_same(results) -> None:
    from crashkit import assert_same_study

    (_, first, *_), rest = results[0], results[1:]
    for _label, where, *_ in rest:
        assert_same_study(f"sqlite:///{first / 'study.db'}", first / "ck", f"sqlite:///{where / 'study.db'}",
                          where / "ck")
    print("  every run ended with the same per-chunk values, metrics, adapters and checkpoints")


def _lease_costs(storage: str, label: str, root: Path, n: int) -> None:
    """What one unit's lease operations cost, timed alone."""
    import optuna

    import rfopt
    from rfopt.storage.leases import Leases

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = rfopt.create_study(study_name="leases", storage=storage, checkpoint_dir=root / "leases-ck",
                               load_if_exists=True)
    leases = Leases(study.optuna)
    started = time.perf_counter()
    for unit in range(n):
        leases.held_by_others()
        lease = leases.acquire("trial-0", 30.0)
        leases.renew(lease)
        leases.renew(lease)
        leases.commit_unit(lease, 0, unit)
        leases.release(lease)
    each = (time.perf_counter() - started) / n
    print(f"lease operations per unit (read leases, acquire, 2 renewals, fenced commit, release), {label}: "
          f"{each * 1000:.1f} ms")


if __name__ == "__main__":
    main()
