"""The ``rfopt`` command line (``rfopt --help``; the README's "Command line"): a package of commands, each of which
registers its own arguments and runs.

| module | owns |
|---|---|
| `program` | `main`: the parser with every command, ``-v``, ``--version``, an error as one line and its exit code |
| `arguments` | what every command's parser shares: ``-v``, ``--storage``, ``--study``, the numeric argument types; a command on one study (`study_command`) and the study it loads |
| `training` | what ``run`` and ``worker`` share: their options (defined once), the study file loaded and its study opened, the settings both give optimize / work (`run_arguments`) |
| `run` | ``rfopt run``: a study file's study here or on a Ray cluster, and the summary it ends with |
| `worker` | ``rfopt worker``: a study's worker on one device, or one per device through `launcher` |
| `launcher` | the worker processes ``rfopt worker --devices a,b`` starts (each the user's own command line on one device), and each one's end with the process that started it |
| `status` | ``rfopt status``: the studies in a storage, or one study's leaderboard and what trains now |
| `ops` | ``rfopt pause``, ``resume``, ``stop``, ``halt``, ``cancel``, ``withdraw`` |
| `clone` | ``rfopt clone`` |
| `confirm` | ``rfopt confirm``: replicates of the best configs with new seeds |
| `dashboard` | ``rfopt dashboard`` |

``python -m rfopt.cli`` is the ``rfopt`` command (`__main__`).
"""

from .program import main

__all__ = ["main"]
