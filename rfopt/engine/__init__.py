"""The run: the one entry point, the loop, the live trials kept in step with storage, one unit of work, ops.

| module | owns |
|---|---|
| `run` | the engine's one entry point: a `RunRequest` carried out here (alone or as a worker) or on a cluster |
| `request` | `RunRequest`: what `Study.optimize` and `Study.work` ask, each argument checked |
| `checks` | what a run is checked for against the study before anything is stored (`CheckedRun`); study names |
| `driver` | the one loop: reconcile, apply requests, decide rungs, ask, plan, run a unit |
| `plan` | the unit's plan (`UnitPlan`), made in one place (`Planner`): who trains together, on which rollout backend, why a trial trains alone, the gang size |
| `roster` | the live trials of a run and the one `reconcile` with storage; each trial's lifecycle |
| `coordinator` | who may work on which trial: alone, or under leases beside other workers |
| `unit` | one unit: load, train a chunk, evaluate, checkpoint, commit (alone or in a gang) |
| `artifacts` | what is published after a unit: the trial's note and charts |
| `best` | each trial's best checkpoint, kept as its units commit (never a collapsed one) |
| `baselines` | each base model evaluated once per study with no adapter, before its first trial trains |
| `scheduler` | least progress first, and the trials at one progress split into even gangs |
| `population` | population-based training's rung policy: its stored step carried out (clones made, members stopped) |
| `ops` | requests on trials (pause, resume, stop, withdraw, cancel) and a study-level stop |
| `clones` | clones of trials, optionally warm-started, with their lineage and Optuna params |
| `replicates` | `confirm`: the best configs enqueued again with new seeds, as replicates of their original |
| `ray_worker` | one worker on a Ray actor: the job every actor is given, the actor, its storage reachability check |
| `cluster` | a study on a Ray cluster: one worker per device, the caller's view from storage |

A unit of work: `driver` asks `plan` for the next unit's plan (one trial, or a gang, and its rollout backend),
`coordinator` claims its members, `roster` reconciles it with storage and applies its
requests, `unit` trains and commits it, and `roster` has the rung judged (`rfopt.pruning.RungPolicy`) once every live
trial reached it.
"""
