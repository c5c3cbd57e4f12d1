"""What a run is asked and checked for, and the plan of each unit: who trains next, together, on what.

| module | owns |
|---|---|
| `request` | `RunRequest`: what `Study.optimize` and `Study.work` ask, each argument checked |
| `checks` | what a run is checked for against the study before anything is stored (`CheckedRun`); study names |
| `scheduler` | least progress first, and the trials at one progress split into even gangs |
| `plan` | the unit's plan (`UnitPlan`), made in one place (`Planner`): who trains together, on which rollout backend, why a trial trains alone, the gang size |
"""
