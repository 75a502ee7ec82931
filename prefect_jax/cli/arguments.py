"""The flags of the commands that run a flow (``run`` and the roles ``train``, ``evaluate``,
``export``): the specs' fields, the program and its params, storage, MLflow and the waits, each
with the help a user reads in ``prefect-jax <command> --help``."""

from __future__ import annotations

import argparse

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


def seconds(zero: bool):
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


# What only a trainer reads, and what only an evaluator reads: not listed in `--help` of a role
# that does not use them (still accepted: one command line serves every role of a job).
_TRAINING_ONLY = frozenset(
    {
        "--checkpoint-every-steps",
        "--checkpoint-every-secs",
        "--keep-last",
        "--keep-every-steps",
        "--keep-every-secs",
        "--no-backups",
        "--device-copy",
        "--log-every-steps",
        "--steps-per-dispatch",
        "--train-hook",
        "--checkpoint-path",
    }
)
_EVALUATION_ONLY = frozenset(
    {
        "--eval-steps",
        "--throttle-secs",
        "--start-delay-secs",
        "--early-stopping-steps",
        "--early-stopping-metric",
        "--early-stopping-mode",
        "--early-stopping-min-delta",
        "--early-stopping-min-steps",
        "--eval-hook",
    }
)


def add_training_args(
    p: argparse.ArgumentParser,
    max_steps: int,
    every: int,
    trains: bool = True,
    evaluates: bool = True,
) -> None:
    """The specs' flags. Each defaults to its spec field's default, written again here so that
    `prefect-jax --help` imports no pydantic (test_cli checks that they agree), but `max_steps`
    and the checkpoint cadence `every`: TrainSpec's max_steps has none, and CheckpointSpec's
    every_steps suits long steps, the command's a demo's. The parsed args carry `flag_of_dest`,
    each flag as typed by its dest (``train_hooks``: ``--train-hook``), for errors to name.
    `trains`: False for a role that does not train, whose --max-steps says it follows the
    trainer's (and whose help leaves the trainer's flags out); `evaluates`: False for the train
    and export roles (whose help leaves the evaluator's out). The args also carry
    `unread_flags`: ``{dest: (flag, default, the roles that read it)}`` of the flags left out,
    still accepted (one command line serves every role of a job), and warned of where given
    (`spec_flags.unread_flags_given`)."""
    flag_of_dest: dict[str, str] = {}
    unread_flags: dict[str, tuple[str, object, str]] = {}
    unused = (set() if trains else _TRAINING_ONLY) | (set() if evaluates else _EVALUATION_ONLY)

    def add(*flags, **options) -> None:
        if flags[0] in unused:
            options["help"] = argparse.SUPPRESS
        action = p.add_argument(*flags, **options)
        flag_of_dest[action.dest] = action.option_strings[0]
        if flags[0] in unused:
            readers = "run, train" if flags[0] in _TRAINING_ONLY else "run, evaluate"
            unread_flags[action.dest] = (flags[0], action.default, readers)

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
    add(
        "--exports-to-keep",
        type=_steps_or_none("to keep every one", "exports", 5),
        default=5,
        metavar="N|none",
        help="exports the latest and best exporters keep, each (TF's exports_to_keep; default "
        "%(default)s); 'none' keeps every one",
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
        "--early-stopping-steps",
        type=number(int, "a number of steps", "1000"),
        default=None,
        metavar="N",
        help="stop the job once the eval metric's best value is N global steps old (TF's "
        "stop_if_no_decrease_hook max_steps_without_decrease); the evaluator asks, the trainer "
        "stops at its next checkpoint",
    )
    add(
        "--early-stopping-metric",
        default=None,
        metavar="NAME",
        help="the eval metric early stopping watches (default loss)",
    )
    add(
        "--early-stopping-mode",
        choices=["min", "max"],
        default=None,
        help="'min' if lower is better (the default), 'max' if higher",
    )
    add(
        "--early-stopping-min-delta",
        type=number(float, "a number", "0.001"),
        default=None,
        metavar="X",
        help="smaller changes do not count as improvement (default 0)",
    )
    add(
        "--early-stopping-min-steps",
        type=number(int, "a global step", "500"),
        default=None,
        metavar="N",
        help="evaluations before this step are left out (TF's min_steps; default 0)",
    )
    add(
        "--eval-hook",
        dest="eval_hooks",
        action="append",
        default=[],
        metavar="PKG.MOD:NAME",
        help="an eval hook by import path (TF's _ContinuousEvalListener): before_eval(), "
        "after_eval(result), should_stop_job(result); a class is instantiated; repeatable",
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
    p.set_defaults(flag_of_dest=flag_of_dest, unread_flags=unread_flags)
