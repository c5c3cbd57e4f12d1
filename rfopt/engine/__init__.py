"""The run: which trial trains next, one unit of work, the live trials kept in step with storage, and the loop.

| module | owns |
|---|---|
| `driver` | the one loop: reconcile, apply requests, decide rungs, ask, pick, run a unit |
| `roster` | the live trials of a run and the one `reconcile` with storage; each trial's lifecycle |
| `coordinator` | who may work on which trial: alone, or under leases beside other workers |
| `unit` | one unit: load, train a chunk, evaluate, checkpoint, commit (alone or in a gang) |
| `artifacts` | what is published after a unit: the trial's note and charts |
| `scheduler` | least progress first, and who trains together in a gang |
| `ops` | requests (pause, resume, stop), clones, a study-level stop, study summaries |
| `cluster` | a study on a Ray cluster: one worker per device, the caller's view from storage |

A unit of work: `driver` picks a trial, `coordinator` claims it, `roster` reconciles it with storage and applies its
requests, `unit` trains and commits it, and `roster` judges the rung (`rfopt.pruning`) once every live trial reached it.
"""
