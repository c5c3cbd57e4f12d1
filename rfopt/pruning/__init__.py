"""Pruning at rung boundaries: Optuna pruners made order-independent for round-robin trials.

rfopt trains every live trial on chunk k before any trial starts chunk k+1, so no trial is
COMPLETE until the sweep ends. Used as Optuna uses them, Median/Percentile pruners would never
prune and SuccessiveHalving/Hyperband would promote whoever reported first. rfopt instead calls
:func:`decide` at a rung boundary, once every trial to be compared at step k has reported step k.

Every input comes from storage (trials' intermediate values and states), so a decision can be
made in any process, on any host, after a restart. A decision is made once per (trial, step) and
stored on the trial as the user attr ``rfopt:pruning:<step>`` holding
``{"prune": bool, "reason": str, "peers": [trial numbers], "pruner": class name}``; asking again
returns it. Kept trials get one too, so the dashboard shows why each trial lives or stopped.
`Study.optimize` does not ask at a trial's last chunk: a trial that has trained all its chunks is
told COMPLETE with that chunk's value, so its last step holds no decision.

Peers at step k are all trials with a value at step k, in any state but FAIL: RUNNING, WAITING,
PRUNED (pruned at or after k) and COMPLETE. A trial pruned before k has no value there and is not
a peer. Decisions depend only on values at or before k, never on who reported first or on the
order of ``trial_numbers``. A trial that joins late (asked after others were pruned, or cloned)
is judged against the values its peers stored at the same step.

What each pruner compares against under rfopt (a "chunk" is a step; chunk 0 is step 0):

``MedianPruner``, ``PercentilePruner``
    The pruner's own ``prune()``, given a view of the study at step k in which every peer is a
    COMPLETE trial whose value is its value at k (intermediate values cut at k) and the judged
    trial is the only RUNNING one. So, as in Optuna's documentation: the trial's best value up
    to k is compared with the median (percentile) of the peers' values at k;
    ``n_startup_trials`` counts peers with a value at k (the trial itself excluded);
    ``n_warmup_steps``, ``interval_steps`` and ``n_min_trials`` keep their meanings; the
    study's direction is respected.
``SuccessiveHalvingPruner``
    Synchronous halving. A trial that reported step k has used k + 1 chunks, so rung i is at
    step ``min_resource * reduction_factor ** (min_early_stopping_rate + i) - 1`` (Optuna's
    rung formula with resources counted in chunks). At a rung, every trial with a value there
    is ranked (ties: lower trial number first; NaN last and always pruned) and the top
    ``ceil(n / reduction_factor)`` are kept: 8 trials with reduction_factor=2 go 8 -> 4 -> 2 ->
    1 at steps 0, 1, 3. Other steps keep everyone. The plan's last chunk is the end of the
    budget, not a rung. ``min_resource="auto"`` is ``max(1, n_steps // reduction_factor**3)``
    (from the chunk plan, not from completed trials). ``bootstrap_count`` as in Optuna: at a
    rung reached by no more than ``bootstrap_count`` trials, all are pruned. A late arrival is
    ranked among all trials with a value at that rung, those decided earlier included, and is
    kept iff it is in the top ``ceil(n_total / reduction_factor)``; earlier decisions stand.
``HyperbandPruner``
    Trials go to brackets exactly as Optuna places them (CRC32 of study name and trial number,
    bracket budgets from ``max_resource / min_resource``); ``max_resource="auto"`` is
    ``n_steps``. Within a bracket b, synchronous halving as above with
    ``min_early_stopping_rate=b``, against the peers of the same bracket only.
``ThresholdPruner``
    The pruner's own ``prune()``: the trial's value at k against ``lower``/``upper``. No peers.
``PatientPruner``
    Optuna's patience test on the trial's own values up to k. When it finds no improvement, the
    wrapped pruner decides with its rfopt semantics above (so Patient(SuccessiveHalving) still
    halves synchronously); with no wrapped pruner, the trial is pruned.
``WilcoxonPruner``
    The pruner's own ``prune()`` on the step-k view, so ``study.best_trial`` is the peer with
    the best value at k, and the trial's values at chunks 0..k are tested against that peer's
    values at the same chunks. Needs scipy once a trial has ``n_startup_steps`` values.
``NopPruner``
    Never prunes (a decision "kept" is still stored).
``rfopt.PopulationBasedTraining``
    Not an Optuna pruner and not judged by :func:`decide`: given as the study's pruner, it is the study's rung policy
    (`RungPolicy`, beside `PrunerRungs` for Optuna's pruners). Its plan for a step is a pure function of the stored
    values (`plan_step`); `rfopt.engine.trials.population` carries it out: at exploit steps the bottom quantile is replaced
    by warm clones of the top (decision reason "replaced by a clone of trial N"), or stopped while a unit budget is
    exceeded; other members are kept. The Optuna study itself holds a ``NopPruner`` (`optuna_pruner`).
Any other ``BasePruner`` subclass
    Its ``prune(study, trial)`` is called with the step-k view above: peers COMPLETE with their
    value at k, the judged trial RUNNING, ``trial.number`` the real number. The view is
    read-only (``get_trials``, ``trials``, ``direction``, ``best_trial``, ``user_attrs``): a
    pruner that writes to storage is not supported. Subclasses of the halving pruners and of
    PatientPruner are run with rfopt's semantics for their base class, from their parameters.

Example::

    from rfopt.pruning import decide

    # every live trial has reported step k
    for d in decide(study, live_numbers, k, study.pruner, n_steps=num_chunks):
        if d.prune:
            study.tell(d.trial_number, state=optuna.trial.TrialState.PRUNED)
"""

from ._decide import decide
from ._decision import DECISION_ATTR_PREFIX, PruneDecision, decision_key, load_decision
from ._outlook import Ladder, Outlook, describe
from ._pbt import Member, PopulationBasedTraining, perturb, plan_step
from ._policy import PrunerRungs, RungOutcome, RungPolicy, optuna_pruner

__all__ = [
    "DECISION_ATTR_PREFIX",
    "Ladder",
    "Member",
    "Outlook",
    "PopulationBasedTraining",
    "PruneDecision",
    "PrunerRungs",
    "RungOutcome",
    "RungPolicy",
    "decide",
    "decision_key",
    "describe",
    "load_decision",
    "optuna_pruner",
    "perturb",
    "plan_step",
]
