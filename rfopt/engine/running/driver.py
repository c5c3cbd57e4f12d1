"""The one driver loop: the same for a process that runs a study alone and for workers sharing it.

Each round:

1. reconcile every RUNNING trial with storage (`Roster.reconcile_all`): trials other processes asked,
   moved on or ended; ends a crash left untold;
2. apply pending pause/resume/stop requests, under each trial's claim;
3. decide every complete rung (`rfopt.pruning`; population-based training's steps under the asking lock, since
   they make clones);
4. ask new trials while slots are free, one asker at a time (`Coordinator.asking`);
5. plan the next unit among the trials no other process holds (`rfopt.engine.planning.plan.Planner`: least progress first,
   who trains together, on which rollout backend), and under each member's claim carry it out (`Roster.work_on` ->
   `rfopt.engine.running.unit.run_units`: a trial alone is a gang of one on the exact rollout backend); a trial at an exploit
   step of population-based training waits until that step is decided. With ``gang_size`` > 1 the plan is a gang:
   up to that many trials at the same progress on the same base model, trained together through the batched rollout
   backend (`rfopt.training.gang`); a gang stored before a crash is formed again.

It returns when no trial is left to train and nothing is left to ask (paused trials wait for a
resume: rerun to continue them), or, past its `deadline` (`optimize(timeout=...)`) or once somebody asked every
process running the study to stop (`rfopt.engine.trials.ops.halt`), before it starts another unit. When other processes hold the remaining trials, it waits `poll_seconds` and looks again.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable

from rfopt import compat
from rfopt.storage import schema
from rfopt.storage.schema import study_record
from rfopt.training.gang import DEFAULT_GANG_TRAINING

from rfopt.engine.planning.plan import Planner

from .interrupts import heard, remembered
from .roster import Roster, RunProgress

logger = logging.getLogger("rfopt")


def drive(  # noqa: C901 - one round of the loop, in the order the module docstring gives
    roster: Roster,
    coordinator,
    *,
    max_concurrent: int,
    more_to_ask: Callable[[], bool],
    poll_seconds: float = 1.0,
    on_progress: Callable[[RunProgress], None] | None = None,
    deadline: float | None = None,
    gang_size: int = 1,
    gang_training: str = DEFAULT_GANG_TRAINING,
) -> None:
    """Run the study's units until none is left for this process (see the module docstring)."""
    study = roster.study
    started = time.time()
    planner = Planner(gang_size, roster.rollout_refusal, gang_training)  # who trains together, on which backend (`rfopt.engine.planning.plan`)
    with compat.optimize_loop(study), remembered():  # study.stop() stops asking, as in Study.optimize
        while True:
            if heard():  # a Ctrl-C whose KeyboardInterrupt Python swallowed (`rfopt.engine.running.interrupts`)
                raise KeyboardInterrupt
            if deadline is not None and time.monotonic() >= deadline:
                logger.info("timeout: no unit starts after it; the live trials stay resumable")
                return
            halt = study_record(study).halt
            if halt is not None and halt.at >= started:
                logger.warning("study %r: stopped by %s; each unfinished trial continues from its last committed "
                               "chunk when the study runs again", study.study_name, halt.by)
                return
            records = roster.reconcile_all()
            busy = coordinator.busy()
            for record in records:
                live = roster.live.get(record.number)
                if live is not None and record.pending and live.number not in busy:
                    with coordinator.claim(live.number) as claim:
                        if claim is not None:
                            roster.apply_requests(live, live.ref.read())
            if not roster.rungs.makes_clones:
                roster.decide_rungs()
            elif roster.rungs_to_decide():  # population-based training makes clones: one process at a time
                with coordinator.asking() as allowed:
                    if allowed:
                        roster.decide_rungs()
            asking = lambda: more_to_ask() and not compat.stop_requested(study)  # noqa: E731
            if roster.wants_to_ask(records, max_concurrent, asking):
                with coordinator.asking() as allowed:
                    if allowed:
                        roster.configure()
                        roster.top_up(max_concurrent, asking)
            for live in [live for live in roster.live.values() if live.finished and live.number not in busy]:
                with coordinator.claim(live.number) as claim:  # trained all its units; a crash came before the tell
                    if claim is not None:
                        roster.work_on([(live, claim)])
            if on_progress is not None:
                on_progress(roster.progress())
            held = roster.held_at_rungs()  # waiting for population-based training's decision at their step
            free = [live for live in roster.live.values() if live.number not in busy | held]
            stored = {r.number: gang.numbers for r in records
                      if r.number in roster.live and (gang := schema.gang_plan(r.trial, r.committed)) is not None}
            plan = planner.plan(free, roster.resident_models(), stored, fit=roster.fit_gang)
            if plan is None:
                if roster.active() == 0 and not asking():
                    paused = sorted(n for n, live in roster.live.items() if live.paused)
                    if paused:
                        logger.warning("nothing left to run but paused trials %s; resume them and run the study again",
                                       paused)
                    return
                if not coordinator.shared:  # alone, nothing will change by waiting
                    logger.warning("trials %s are live but none can run; stopping", sorted(roster.live))
                    return
                time.sleep(poll_seconds)  # other processes hold the remaining units
                continue
            with contextlib.ExitStack() as claims:
                held_here = [(roster.live[number], claim) for number in plan.members
                             if (claim := claims.enter_context(coordinator.claim(number))) is not None]
                if held_here:
                    roster.work_on(held_here, plan)
            if on_progress is not None:
                on_progress(roster.progress())
