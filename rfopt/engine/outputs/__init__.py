"""What a run keeps beside Optuna's values, for people and for later runs.

| module | owns |
|---|---|
| `best` | each trial's best checkpoint, kept as its units commit (never a collapsed one) |
| `artifacts` | what is published after a unit: the trial's note and charts |
| `baselines` | each base model evaluated once per study with no adapter, before its first trial trains |
"""
