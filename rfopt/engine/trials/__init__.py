"""What happens to a trial besides training: requests on it, clones, population-based training, replicates.

| module | owns |
|---|---|
| `ops` | requests on trials (pause, resume, stop, withdraw, cancel) and a study-level stop (`halt`) |
| `clones` | clones of trials, optionally warm-started, with their lineage and Optuna params |
| `population` | population-based training's rung policy: its stored step carried out (clones made, members stopped) |
| `replicates` | `confirm`: the best configs enqueued again with new seeds, as replicates of their original |
"""
