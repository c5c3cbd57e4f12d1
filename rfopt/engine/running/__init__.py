"""The run carried out: the one entry point, the one loop, the live trials kept in step with storage, one unit of work.

| module | owns |
|---|---|
| `run` | the engine's one entry point: a `RunRequest` carried out here (alone or as a worker) or on a cluster |
| `driver` | the one loop: reconcile, apply requests, decide rungs, ask, plan, run a unit |
| `roster` | the live trials of a run and the one `reconcile` with storage; each trial's lifecycle |
| `interrupts` | Ctrl-Cs remembered, so that one whose KeyboardInterrupt a library swallowed still stops the loop |
| `coordinator` | who may work on which trial: alone, or under leases beside other workers |
| `unit` | one unit: load, train a chunk, evaluate, checkpoint, commit (alone or in a gang); `Live`, a trial live here, changed only through its own transitions |
"""
