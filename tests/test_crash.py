"""SIGKILL a running study at many moments (in a chunk, between chunks, in the middle of a checkpoint write,
between a durable checkpoint and its report) and rerun the same command each time: the study ends exactly
as an uninterrupted run of it ends, and no chunk whose checkpoint was durable is trained again."""

import random
import signal
import time

import optuna

from crashkit import (assert_same_study, commits, env, events, retrained_after_durable, run, run_command, start,
                      trials)

# Where the run dies on each attempt: a crash point (the n-th time this process reaches it), or a timer.
CRASH_POINTS = ["checkpoint-staged", "checkpoint-saved", "metrics-stored", "checkpoint-renamed", "chunk-trained",
                "unit-committed", "trial-finishing"]


def _attempts(seed: int) -> list[tuple[str, float]]:
    """Each crash point once (at its first occurrence in that process), in a seeded order, with timed kills at
    seeded moments in between; a trial's finishing comes last, when trials have trained their last chunk."""
    rng = random.Random(seed)
    points = [(point, 1) for point in CRASH_POINTS if point != "trial-finishing"]
    rng.shuffle(points)
    for _ in range(3):
        points.insert(rng.randint(0, len(points)), ("timer", rng.uniform(0.0, 1.5)))
    return points + [("trial-finishing", 1)]


def test_sigkill_at_random_moments_then_rerun_reproduces_the_uninterrupted_study(tiny_model, tmp_path):
    ref_storage = f"sqlite:///{tmp_path / 'ref.db'}"
    assert run(run_command(ref_storage, "--checkpoint-dir", str(tmp_path / "ref-ck")), tmp_path,
               env(tiny_model), tmp_path / "ref.log") == 0, (tmp_path / "ref.log").read_text()[-3000:]

    storage = f"sqlite:///{tmp_path / 'crash.db'}"
    command = run_command(storage, "--checkpoint-dir", str(tmp_path / "ck"))
    log, output = tmp_path / "events.log", tmp_path / "crash.log"
    killed_at = []
    for point, when in _attempts(seed=5):
        if point == "timer":
            # `when` seconds after the process trains its first unit (imports take longer than a unit).
            process = start(command, tmp_path, env(tiny_model, RFOPT_EVENT_LOG=log), output)
            while process.poll() is None and not any(e[3] == process.pid for e in events(log)):
                time.sleep(0.05)
            time.sleep(when)
            process.send_signal(signal.SIGKILL)
            code = process.wait()
        else:
            crash_env = env(tiny_model, RFOPT_EVENT_LOG=log, RFOPT_CRASH_AT=f"{point}:{when}")
            code = run(command, tmp_path, crash_env, output)
        if code == -signal.SIGKILL:
            killed_at.append(events(log)[-1][0] if point == "timer" else point)
        else:
            assert code == 0, output.read_text()[-3000:]
    assert run(command, tmp_path, env(tiny_model, RFOPT_EVENT_LOG=log), output) == 0, output.read_text()[-3000:]

    # The kills landed where they were meant to: every crash point, and mid-run for the timers.
    assert set(CRASH_POINTS) <= set(killed_at), killed_at
    assert len(killed_at) >= len(CRASH_POINTS) + 2, killed_at
    assert all(t.state != optuna.trial.TrialState.RUNNING for t in trials(storage))
    assert_same_study(ref_storage, tmp_path / "ref-ck", storage, tmp_path / "ck")
    crash_log = events(log)
    assert retrained_after_durable(crash_log) == []
    committed = commits(crash_log)
    reported = {(t.number, step) for t in trials(storage) for step in t.intermediate_values}
    assert set(committed) == reported and set(committed.values()) == {1}, committed
