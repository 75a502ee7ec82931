"""The subcommands that run a flow (``run`` and the roles ``train``, ``evaluate``, ``export``):
each with its own flags beside the specs' (`arguments.add_training_args`), and the program's
params."""

from __future__ import annotations

from prefect_jax.cli import commands
from prefect_jax.cli.arguments import add_training_args, number, seconds

ROLE_HELP = {
    "run": "train any program with train_and_evaluate: train, evaluate and export every checkpoint",
    "train": "the trainer role: train and checkpoint until max_steps (an evaluator runs elsewhere)",
    "evaluate": "the evaluator role: evaluate each new committed checkpoint of a job once, and "
    "export",
    "export": "run the exporters on an evaluated step of a job (default: the newest)",
}
ROLES = tuple(ROLE_HELP)  # the subcommands `add_role` makes


def add_program_params(add) -> None:
    """``--program-param KEY=VALUE`` and ``--program-params JSON`` on a parser (``add`` is its
    ``add_argument``), read by `spec_flags.program_params_from_args`."""
    add(
        "--program-param",
        dest="program_param",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a program parameter (repeatable); VALUE is read as JSON, else as a string, e.g. "
        "--program-param preset=tiny --program-param batch_size=32 (evaluate and export take "
        "those the job's trainer was given, recorded in its newest step, under these)",
    )
    add(
        "--program-params",
        default=None,
        metavar="JSON",
        help="program parameters as one JSON object ('--program-param's win on the same key)",
    )


def add_role(sub, name: str) -> None:
    """The subcommand `name` (a key of `ROLE_HELP`), with its flags, run by `commands.cmd_run`."""
    role = sub.add_parser(name, help=ROLE_HELP[name], description=ROLE_HELP[name])
    add = role.add_argument
    add("--program", required=True, help="program import path, 'package.module:attribute'")
    add_program_params(add)
    add("--job", required=True, help="job name")
    add(
        "--storage",
        required=True,
        help="storage root: a directory, an fsspec URL (s3://, gs://...) or "
        "jax-checkpoint-storage/<block>",
    )
    trains = name in ("run", "train")
    evaluates = name in ("run", "evaluate")
    add_training_args(role, max_steps=1000, every=200, trains=trains, evaluates=evaluates)
    if name == "evaluate":
        add("--once", action="store_true", help="stop when nothing new is left to evaluate")
        add(
            "--newest-only",
            action="store_true",
            help="evaluate only the newest checkpoint, not every one",
        )
        add(
            "--poll-secs",
            type=seconds(zero=False),
            default=10.0,
            help="how often to look for new checkpoints (default %(default)g)",
        )
        add(
            "--idle-timeout-secs",
            type=seconds(zero=True),
            default=None,
            help="stop after this long without a new checkpoint",
        )
        add(
            "--wait-for-first-checkpoint-secs",
            "--max-wait-secs",
            dest="wait_for_first_checkpoint_secs",
            type=seconds(zero=True),
            default=None,
            help="give up waiting for a first checkpoint after this long (TF's max_wait_secs; "
            "default 3600, and 0 with --once: a job with nothing committed has nothing to "
            "evaluate once)",
        )
    if name == "export":
        add(
            "--step",
            type=number(int, "a whole number of steps", "1000"),
            default=None,
            help="the evaluated step to export (default: the newest)",
        )
        add(
            "--wait-for-checkpoint",
            action="store_true",
            help="wait for an evaluated step with a committed checkpoint instead of failing at "
            "once (TF's recover_session wait_for_checkpoint)",
        )
        add(
            "--max-wait-secs",
            type=seconds(zero=True),
            default=7200.0,
            help="with --wait-for-checkpoint, give up after this long (default %(default)g)",
        )
        add(
            "--recovery-wait-secs",
            type=seconds(zero=False),
            default=30.0,
            help="with --wait-for-checkpoint, look again every this many seconds "
            "(default %(default)g)",
        )
    if name in ("run", "train"):
        add(
            "--processes",
            type=number(int, "a number of processes", "2"),
            default=1,
            metavar="N",
            help="train as N JAX processes on this machine (data parallel, one job; default "
            "%(default)s). "
            "On a cluster, set PREFECT_JAX_NUM_PROCESSES & co. per process instead (see "
            "docs/multiprocess.md)",
        )
    role.set_defaults(fn=commands.cmd_run)
