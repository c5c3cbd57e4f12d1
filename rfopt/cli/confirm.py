"""``rfopt confirm --top K --seeds N``: enqueue replicates of a study's best configs, each trained again with new
seeds (`rfopt.engine.trials.replicates`), for a run of the study to train."""

from __future__ import annotations

import argparse
import textwrap
from typing import Any

from .arguments import load_study, positive_int, study_command


def register(commands: Any) -> None:
    confirm = study_command(
        commands,
        "confirm",
        help="train the best configs again with new seeds",
        description="Enqueue replicates of the study's best configs: each config trained again with new seeds, as new "
        "Optuna trials linked to their original (the same Optuna params; the seed in its config). A running `rfopt "
        "run` of the study picks them up when a slot frees; otherwise rerun the study's `rfopt run` command. They run "
        "to their end, never pruned (unless --prune). Asked again, only the missing replicates are made. The "
        "leaderboard then shows each config's runs, their mean and its standard error across seeds, and which config "
        "wins across seeds.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=textwrap.dedent(
            """\
            examples:
              rfopt confirm --study arithmetic --top 2 --seeds 2   # then: rfopt run arithmetic
              rfopt confirm --study demo --top 1 --seeds 4
            """
        ),
    )
    confirm.add_argument("--top", type=positive_int, default=3, metavar="K",
                         help="how many of the best configs to replicate, as the leaderboard ranks them (default: "
                         "%(default)s)")
    confirm.add_argument("--seeds", type=positive_int, default=2, metavar="N",
                         help="replicates of each config, beside its original run (default: %(default)s)")
    confirm.add_argument("--prune", action="store_true",
                         help="let the run's pruner judge the replicates at rungs as any trial (default: they run to "
                         "their end)")
    confirm.set_defaults(handler=confirm_study)


def confirm_study(args: argparse.Namespace) -> int:
    from rfopt.engine.trials.replicates import confirm

    study = load_study(args)
    made = confirm(study.optuna, args.top, args.seeds, prune=args.prune)
    for replicate in made:
        print(replicate.describe())
    if not made:
        print(f"nothing to enqueue: each of the {args.top} best configs has its {args.seeds} replicates already")
    print("a running `rfopt run` of the study trains them when a slot frees; otherwise rerun the study's `rfopt run` "
          "command. `rfopt status --study NAME` then shows each config across its seeds")
    return 0
