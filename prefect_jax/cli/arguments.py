"""The flags of the commands that run a flow (``run`` and the roles ``train``, ``evaluate``,
``export``): the specs' fields, the program and its params, storage, MLflow and the waits, each
with the help a user reads in ``prefect-jax <command> --help``."""

from __future__ import annotations

import argparse

from prefect_jax.cli import commands
from prefect_jax.training.names import DEFAULT_EXPERIMENT, EXPORTER_KINDS


def _steps_or_none(none_means: str, what: str = "steps", example: int = 1000):
    """A flag's parser for a number of `what` or ``none`` (the spec's None: `none_means`)."""

    def parse(value: str) -> int | None:
        if value.strip().lower() == "none":
            return None
        try:
            return int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{value!r} is not a number of {what}: give one, e.g. {example}, or 'none' "
                f"{none_means}"
            ) from None

    return parse


def number(kind: type, what: str, example: str):
    """A flag's parser for an int or float (`kind`), `what` being what it is ("a number of
    seconds"): a word gets a message that says so with an example, not argparse's "invalid float
    value"; the range is the spec's to check (its refusal names the flag too)."""

    def parse(value: str) -> int | float:
        try:
            return kind(value)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{value!r} is not {what}: give one, e.g. {example}"
            ) from None

    return parse


def _seconds(zero: bool):
    """A wait flag's parser: seconds, 0 or more (`zero`), else more than 0 (a period: 0 spins);
    the flows' parameters refuse the same (`flows.config.WaitSecs`, `PeriodSecs`)."""

    def parse(value: str) -> float:
        try:
            secs = float(value)
        except ValueError:
            secs = float("nan")
        if not (secs >= 0 if zero else secs > 0) or secs == float("inf"):
            raise argparse.ArgumentTypeError(
                f"{value!r} is not a number of seconds {'>= 0' if zero else '> 0'}: give one, "
                f"e.g. {'0' if zero else '10'}"
            )
        return secs

    return parse


def add_training_args(
    p: argparse.ArgumentParser, max_steps: int, every: int, trains: bool = True
) -> None:
    """The specs' flags. Each defaults to its spec field's default, written again here so that
    `prefect-jax --help` imports no pydantic (test_cli checks that they agree), but `max_steps`
    and the checkpoint cadence `every`: TrainSpec's max_steps has none, and CheckpointSpec's
    every_steps suits long steps, the command's a demo's. The parsed args carry `flag_of_dest`,
    each flag as typed by its dest (``train_hooks``: ``--train-hook``), for errors to name.
    `trains`: False for a role that does not train, whose --max-steps says it follows the
    trainer's."""
    flag_of_dest: dict[str, str] = {}

    def add(*flags, **options) -> None:
        action = p.add_argument(*flags, **options)
        flag_of_dest[action.dest] = action.option_strings[0]

    add(
        "--max-steps",
        type=_steps_or_none("to train until stopped"),
        default=max_steps,
        metavar="N|none",
        help=f"train until this global step (default {max_steps}); 'none' trains until stopped "
        "(a stop request, a preemption, a cancel), as TF's max_steps=None"
        if trains
        else "the job's final step (for the final evaluation and export) where its steps do not "
        "record their trainer's; they do, and this role follows it",
    )
    add(
        "--checkpoint-every-steps",
        type=_steps_or_none("to checkpoint by time only (with --checkpoint-every-secs)"),
        default=every,
        metavar="N|none",
        help=f"checkpoint cadence in steps (default {every}); 'none' checkpoints by time only, "
        "as TF's save_checkpoints_secs alone",
    )
    add(
        "--checkpoint-every-secs",
        type=number(float, "a number of seconds", "600"),
        default=None,
        help="also (or, with --checkpoint-every-steps none, only) checkpoint every N seconds",
    )
    add(
        "--keep-last",
        type=_steps_or_none("to keep every checkpoint", "checkpoints", 3),
        default=3,
        metavar="N|none",
        help="keep the newest N checkpoints (default %(default)s); 'none' keeps every one",
    )
    add(
        "--keep-every-steps",
        type=number(int, "a whole number of steps", "10000"),
        default=None,
        help="also keep checkpoints at multiples of N",
    )
    add(
        "--keep-every-secs",
        type=number(float, "a number of seconds", "36000"),
        default=None,
        help="also keep the oldest checkpoint of each N-second window, for good (TF's "
        "keep_checkpoint_every_n_hours x 3600)",
    )
    add(
        "--no-backups",
        dest="backups",
        action="store_false",
        help="never write backups (resume-only checkpoints between the cadence's, written once "
        "attempts of the job were killed without notice)",
    )
    add(
        "--device-copy",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="at each save, copy the state on its devices and save the copy on a thread "
        "(default: on for one process on a GPU or TPU where, at the first save, a copy fits "
        "beside the peak use of device memory; --device-copy copies whatever the memory)",
    )
    add(
        "--seed",
        type=number(int, "a seed (a whole number)", "0"),
        default=0,
        help="init and data-order seed (default %(default)s)",
    )
    add(
        "--log-every-steps",
        type=number(int, "a whole number of steps", "50"),
        default=50,
        help="train metrics to MLflow every N steps (default %(default)s)",
    )
    add(
        "--steps-per-dispatch",
        type=number(int, "a whole number of steps", "8"),
        default=1,
        help="run K steps per call into the device, as one lax.scan (default %(default)s)",
    )
    add(
        "--eval-steps",
        type=_steps_or_none("for the whole eval set", "eval batches", 100),
        default=None,
        metavar="N|none",
        help="eval batches (default, or 'none': the whole eval set)",
    )
    add("--eval-name", default="eval", help="eval name (default '%(default)s')")
    add(
        "--throttle-secs",
        type=number(float, "a number of seconds", "600"),
        default=0.0,
        help="minimum seconds between evaluations",
    )
    add(
        "--exporters",
        nargs="*",
        choices=list(EXPORTER_KINDS),
        default=list(EXPORTER_KINDS),
        help="exporters to run after each evaluation (default: latest best final)",
    )
    add(
        "--registered-model",
        default=None,
        metavar="NAME",
        help="MLflow registered model the exports become versions of, aliases @best @final "
        "@newest (default: <job>-<hash of its storage>, unique to the job and its storage; "
        "'' for none)",
    )
    add(
        "--export-platforms",
        type=lambda v: [name.strip() for name in v.split(",") if name.strip()],
        default=None,
        metavar="P,P",
        help="platforms the exported model runs on, of cpu,cuda,rocm,tpu, or 'all' (default: the "
        "one the job runs on and cpu; a warning names those serve() does not lower for)",
    )
    add("--best-metric", default=None, help="metric the best exporter compares (default loss)")
    add("--best-mode", choices=["min", "max"], default=None, help="'min' or 'max' (default min)")
    add(
        "--best-compare-fn",
        default=None,
        metavar="PKG.MOD:FN",
        help="the best exporter's compare_fn(best_eval_result, current_eval_result) -> bool, by "
        "import path (TF's BestExporter compare_fn); instead of --best-metric/--best-mode",
    )
    add(
        "--train-hook",
        dest="train_hooks",
        action="append",
        default=[],
        metavar="PKG.MOD:FN[@every=N,checkpoint,end]",
        help="a train hook by import path (TF's TrainSpec.hooks), called with a read-only view "
        "every N steps, after each checkpoint, at the end (no '@': checkpoint,end); repeatable",
    )
    add(
        "--start-delay-secs",
        type=number(float, "a number of seconds", "120"),
        default=0.0,
        help="the evaluate role waits this long before its first evaluation (EvalSpec's; "
        "default %(default)g); run, like TF's local mode, does not wait",
    )
    add(
        "--sigterm-grace-secs",
        type=number(float, "a number of seconds", "25"),
        default=25.0,
        help="on SIGTERM, seconds to commit the step in flight",
    )
    add(
        "--lease-timeout-secs",
        type=number(float, "a number of seconds", "120"),
        default=120.0,
        help="take over a job lease silent this long",
    )
    add(
        "--compilation-cache",
        default=None,
        metavar="DIR|job",
        help="JAX persistent compilation cache directory or URL ('job': under the job's "
        "storage), so reruns skip compiling",
    )
    add(
        "--checkpoint-path",
        default=None,
        help="warm-start a new job from this checkpoint step directory",
    )
    add(
        "--mlflow-tracking-uri",
        default=None,
        help="MLflow tracking URI, or prefect-jax-mlflow-tracking/<block> (its URI, and its "
        "experiment unless --mlflow-experiment is given)",
    )
    add(
        "--mlflow-optional",
        action="store_true",
        help="a tracking URI MLflow cannot use or reach is a warning, not an error: train anyway "
        "(the summary counts what did not reach MLflow)",
    )
    add(
        "--mlflow-experiment",
        default=None,
        help=f"MLflow experiment (default: the tracking block's experiment, else "
        f"{DEFAULT_EXPERIMENT})",
    )
    add(
        "--json",
        action="store_true",
        help="print one JSON object as the last line on stdout (refused or terminated: "
        '{"error": ..., "exit_code": ...})',
    )
    add(
        "--no-progress",
        action="store_true",
        help="no progress bar (there is none where stderr is not a terminal)",
    )
    p.set_defaults(flag_of_dest=flag_of_dest)


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
    ``add_argument``), read by `commands.program_params_from_args`."""
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
    add_training_args(role, max_steps=1000, every=200, trains=name in ("run", "train"))
    if name == "evaluate":
        add("--once", action="store_true", help="stop when nothing new is left to evaluate")
        add(
            "--newest-only",
            action="store_true",
            help="evaluate only the newest checkpoint, not every one",
        )
        add(
            "--poll-secs",
            type=_seconds(zero=False),
            default=10.0,
            help="how often to look for new checkpoints (default %(default)g)",
        )
        add(
            "--idle-timeout-secs",
            type=_seconds(zero=True),
            default=None,
            help="stop after this long without a new checkpoint",
        )
        add(
            "--wait-for-first-checkpoint-secs",
            "--max-wait-secs",
            dest="wait_for_first_checkpoint_secs",
            type=_seconds(zero=True),
            default=3600.0,
            help="give up waiting for a first checkpoint after this long (TF's max_wait_secs)",
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
            type=_seconds(zero=True),
            default=7200.0,
            help="with --wait-for-checkpoint, give up after this long (default %(default)g)",
        )
        add(
            "--recovery-wait-secs",
            type=_seconds(zero=False),
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
