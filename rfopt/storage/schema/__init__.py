"""Every ``rfopt:*`` key rfopt keeps in an Optuna storage, and the typed records they hold.

rfopt keeps a study's state in Optuna's own storage, as *system* attrs (JSON) of the study and its trials, so that
any process on any host can continue, steer or show a study from the storage alone. This package is the only place
that spells those keys: the engine, ops, the command line and the dashboard read a `StudyRecord` or a `TrialRecord`
and write through the functions it offers. Its private modules, lowest first (each imports only from those above it):

``_keys``
    The keys (spelled there only) and where their records are kept (`trial_attrs`, `study_attrs`).
``_values``
    Values as the JSON attrs hold them: `json_safe`, and TRL's per-step logs by column (`StepColumns`).
``_records``
    A trial's small records: `Lineage`, `TrialRequest`, `Withdrawal`, `Cancel`, `AppliedOp`, `Stop`, `PruneDecision`,
    `UnitMetrics`, `BestCheckpoint`, `ProgressRecord`, `Replicate`.
``_study``
    The study's records, read and written: `StudyRecord`, `Halt`, `Baseline`, population-based training's `PbtStep`.
``_trial``
    A trial's record (`TrialRecord`) and its writers (`TrialRef`, ``write_*``).
``_gang``
    The gang a trial's unit trains in (`GangPlan`).

Why system attrs: user attrs are the user's. optuna-dashboard shows every user attr of a trial in its trial page and
trial table (as text cut at 1024 characters, so rfopt's JSON records made the page thousands of pixels wide) and a
study's user attrs on the study page; it shows no system attrs. Optuna, its samplers and `trials_dataframe` leave
``rfopt:*`` system attrs alone. A study written by an earlier rfopt keeps its records in user attrs: they are read
from there too (`TrialRecord`, `StudyRecord`; a system attr wins over a user attr of the same key), and new records go
to system attrs. Only there, and only with the shape rfopt wrote: on a trial whose config is a system attr (or a study
whose plan is), an ``rfopt:*`` user attr is the user's, and one of another shape is skipped with a warning naming the
trial (or study) and the key (`_keys`), so that a user's ``trial.set_user_attr("rfopt:stopped", True)`` never makes a
study unreadable.

On the study:  ``rfopt:id`` (its identity, which its checkpoint location carries), ``rfopt:checkpoint_dir``,
``rfopt:plan`` (the chunk plan), ``rfopt:objective``, ``rfopt:eval`` (evaluation settings),
``rfopt:train_fingerprint``, ``rfopt:eval_fingerprint``, ``rfopt:report_to`` (the trackers its trials report to),
``rfopt:pbt:<step>`` (a population-based training step: who is replaced by a clone of whom, with what values),
``rfopt:halt`` (a request that every process running the study stop at its trials' next chunk boundary),
``rfopt:run_shape`` (how its last run trains it: the pruner's schedule, the gang size; see `RunShape`),
``rfopt:baseline:<key>`` (a base model evaluated with no adapter: the reference its trials are read against; see
`Baseline`).

On a trial:    ``rfopt:config`` (the resolved `TrialConfig` as JSON), ``rfopt:list_index`` (its place in a
list of configs), ``rfopt:schedule``, ``rfopt:clone`` (lineage), ``rfopt:replicate_of``
(a replicate: its original and seed, `Replicate`), ``rfopt:metrics:<unit>`` and
``rfopt:samples:<unit>`` (per chunk unit), ``rfopt:steps:<unit>`` (TRL's logs of each optimizer step of the unit, by
column: see `StepColumns`), ``rfopt:pruning:<step>`` (rung decisions),
``rfopt:request:<time>-<id>`` (op requests, one key each, never rewritten), ``rfopt:withdrawn:<id>`` (a
request taken back before it applied) and ``rfopt:ops`` (the ops applied, with the id of each request),
``rfopt:cancelled`` (a WAITING clone cancelled before it started), ``rfopt:paused``, ``rfopt:stopped``, ``rfopt:fail_reason``,
``rfopt:adapter``, ``rfopt:tracked`` (the units each tracker holds), ``rfopt:tracked_at`` (where each wrote), ``rfopt:best`` (its best checkpoint so far:
`BestCheckpoint`), ``rfopt:baseline_key`` (which `Baseline` it compares with), ``rfopt:progress`` (where the chunk it
trains now stands, and what it does within its phase: see `ProgressRecord`, `Activity`) and
``rfopt:gang:<unit>`` (the gang that trains the unit: see `GangPlan`).

A trial's progress is its reported intermediate values: unit ``u`` is committed once step ``u`` is
reported (`TrialRecord.committed`). Nothing else counts progress; ``rfopt:progress`` only says how far the unit in
flight has got.

    >>> record = TrialRecord(study.trials[3])                          # doctest: +SKIP
    >>> record.committed, record.paused, [r.op for r in record.pending]  # doctest: +SKIP
    (2, False, ['stop'])
"""

from ._gang import GangPlan, gang_plan, write_gang_plan
from ._keys import (
    DECISION_ATTR_PREFIX,
    decision_key,
    metrics_key,
    samples_key,
    steps_key,
    study_attrs,
    trial_attrs,
    unit_key,
)
from ._records import (
    CONTROL_OPS,
    STOP_REASON,
    Activity,
    AppliedOp,
    BestCheckpoint,
    Cancel,
    Lineage,
    ProgressRecord,
    PruneDecision,
    Replicate,
    Stop,
    TrialRequest,
    UnitMetrics,
    Withdrawal,
    now,
    who,
)
from ._study import (
    Baseline,
    Halt,
    PbtStep,
    Replacement,
    RunShape,
    StudyRecord,
    load_pbt_step,
    name_metric,
    pbt_steps,
    study_record,
    write_baseline,
    write_checkpoint_dir,
    write_halt,
    write_identity,
    write_pbt_step,
    write_plan,
    write_run_shape,
    write_settings,
)
from ._trial import (
    TrialRecord,
    TrialRef,
    inherited_steps,
    load_decision,
    new_trial_attrs,
    write_adapter,
    write_applied,
    write_baseline_key,
    write_best,
    write_cancel,
    write_config,
    write_decision,
    write_fail_reason,
    write_paused,
    write_progress,
    write_request,
    write_schedule,
    write_stop,
    write_tracked,
    write_tracked_at,
    write_unit,
    write_withdrawal,
)
from ._values import StepColumns, json_safe

__all__ = [
    "CONTROL_OPS",
    "DECISION_ATTR_PREFIX",
    "STOP_REASON",
    "Activity",
    "AppliedOp",
    "Baseline",
    "BestCheckpoint",
    "Cancel",
    "GangPlan",
    "Halt",
    "Lineage",
    "PbtStep",
    "ProgressRecord",
    "PruneDecision",
    "Replacement",
    "Replicate",
    "RunShape",
    "StepColumns",
    "Stop",
    "StudyRecord",
    "TrialRecord",
    "TrialRef",
    "TrialRequest",
    "UnitMetrics",
    "Withdrawal",
    "decision_key",
    "gang_plan",
    "inherited_steps",
    "json_safe",
    "load_decision",
    "load_pbt_step",
    "metrics_key",
    "name_metric",
    "new_trial_attrs",
    "now",
    "pbt_steps",
    "samples_key",
    "steps_key",
    "study_attrs",
    "study_record",
    "trial_attrs",
    "unit_key",
    "who",
    "write_adapter",
    "write_applied",
    "write_baseline",
    "write_baseline_key",
    "write_best",
    "write_cancel",
    "write_checkpoint_dir",
    "write_config",
    "write_decision",
    "write_fail_reason",
    "write_gang_plan",
    "write_halt",
    "write_identity",
    "write_paused",
    "write_pbt_step",
    "write_plan",
    "write_progress",
    "write_request",
    "write_run_shape",
    "write_schedule",
    "write_settings",
    "write_stop",
    "write_tracked",
    "write_tracked_at",
    "write_unit",
    "write_withdrawal",
]
