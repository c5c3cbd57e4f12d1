"""The run: what is asked and planned, the loop that carries it out, what happens to trials besides training, what a
run keeps, and a study on a Ray cluster. Five sub-packages, lowest first:

| package | modules | owns |
|---|---|---|
| `trials` | `ops`, `clones`, `population`, `replicates` | what happens to a trial besides training: requests on it (pause, resume, stop, withdraw, cancel, halt), clones and warm starts, population-based training's stored step carried out, replicates with new seeds (`confirm`) |
| `outputs` | `best`, `artifacts`, `baselines` | what a run keeps beside Optuna's values: each trial's best checkpoint, its note and charts, each base model's score with no adapter |
| `planning` | `request`, `checks`, `scheduler`, `plan` | what a run is asked (`RunRequest`) and checked for before anything is stored (`CheckedRun`), least progress first, and the unit's plan (`UnitPlan`, made by `Planner`): who trains together, on which rollout backend, why a trial trains alone |
| `running` | `run`, `driver`, `interrupts`, `roster`, `coordinator`, `unit` | the one entry point, the one loop, the live trials kept in step with storage, who may work on which trial, one unit of work |
| `cluster` | `ray_cluster`, `ray_worker` | a study on a Ray cluster: the caller's side (`RayCluster`), one worker on a Ray actor |

A unit of work: `running.driver` asks `planning.plan` for the next unit's plan (one trial, or a gang, and its rollout
backend), `running.coordinator` claims its members, `running.roster` reconciles it with storage and applies its
requests (`trials.ops`), `running.unit` trains and commits it (keeping the best checkpoint, `outputs.best`), and
`running.roster` has the rung judged (`rfopt.pruning.RungPolicy`, or `trials.population`) once every live trial reached
it. Each sub-package's docstring lists its modules.
"""
