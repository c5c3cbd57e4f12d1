"""What outlives a process: the study's Optuna storage, rfopt's records in it, the checkpoint store, leases.

Nothing here imports training or the engine: storage is the source of truth that they read and write.

| module | owns |
|---|---|
| `database` | opening an Optuna storage, with retries while a database is unreachable |
| `schema` | every ``rfopt:*`` key of a study and its trials, as typed records (a package: the one place that spells them) |
| `checkpoints` | the checkpoint store: a trial's state after each unit, warm starts, adapters; local or fsspec |
| `files` | where a store's files are: a local directory or an object store, each written durably |
| `state` | what a checkpoint holds (`TrialSnapshot`, and its tensors + metadata form) and the unit report stored beside it |
| `leases` | leases on trials, fenced commits, and the presence heartbeats of processes running a study |
| `crashpoints` | named points between durable writes, where tests kill a process |

`rfopt.storage` itself offers what a user opening a study's storage needs (`open_storage` and its errors).
"""

from rfopt.errors import StorageLocationError, StorageRefusedError, StorageUnavailableError
from rfopt.storage.database import open_storage

__all__ = ["StorageLocationError", "StorageRefusedError", "StorageUnavailableError", "open_storage"]
