"""``rfopt clone TRIAL --set FIELD=VALUE [--warm-start]``: enqueue a copy of a trial with changed settings, validated
before anything is written (`rfopt.engine.trials.clones`)."""

from __future__ import annotations

import argparse
import textwrap
from typing import Any

from .arguments import load_study, study_command


def register(commands: Any) -> None:
    clone = study_command(
        commands,
        "clone",
        help="enqueue a copy of a trial with changed settings",
        description="Enqueue a copy of a trial with some settings changed (validated before anything is written). "
        "A running `rfopt run` of the study picks it up when a slot frees; otherwise the next run does.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=textwrap.dedent(
            """\
            examples:
              rfopt clone 3 --study demo --set learning_rate=2e-6 --warm-start
              rfopt clone 3 --study demo --set lora_r=8 --set lora_alpha=16
            """
        ),
    )
    clone.add_argument("trial", type=int, help="the parent trial's number")
    clone.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                       help="a GRPOConfig field (learning_rate, reward_weights), a LoRA field (lora_r, lora_alpha, "
                       "peft_config.<field>), model or reward_funcs; repeat for several")
    clone.add_argument("--warm-start", action="store_true",
                       help="start from the parent's latest checkpoint (its weights; a fresh LR schedule over the "
                       "remaining steps) instead of from scratch")
    clone.set_defaults(handler=clone_trial)


def clone_trial(args: argparse.Namespace) -> int:
    from rfopt.config.overrides import parse_assignments
    from rfopt.engine.trials.clones import clone_in_study

    overrides = parse_assignments(args.set)
    study = load_study(args)
    made = clone_in_study(study.optuna, args.trial, overrides, warm_start=args.warm_start)
    print(made.describe(args.trial, args.warm_start))
    return 0
