"""The ``prefect-jax`` command: ``demo``, ``run``, the roles ``train``, ``evaluate`` and
``export``, ``process``, ``status`` and ``automations``.

``demo`` and ``run`` execute the `train_and_evaluate` flow in this process; ``train``,
``evaluate`` and ``export`` the flows of TensorFlow's chief and evaluator roles. With
``PREFECT_API_URL`` set they report to that server; otherwise they start an embedded
Prefect server for the duration of the command (the runs land in Prefect's default
database, so ``prefect server start`` shows them afterwards) and stop it cleanly, logs
and events flushed, however the command ends.

With ``--json`` the last line on stdout is one JSON object.

This module parses the command line and dispatches; the commands live beside it: `commands`
(the flows run in this process), `launch` (several processes), `status`, `server` (the
Prefect API), `console` (what is printed) and `startup` (the process's own start-up).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

from prefect_jax.cli import commands, launch, status
from prefect_jax.training.names import DEFAULT_EXPERIMENT

__all__ = ["build_parser", "entry", "main"]

_ROLES = ("demo", "run", "train", "evaluate", "export")  # the commands that run a flow here


def _quiet_env() -> None:
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    os.environ.setdefault("GIT_PYTHON_REFRESH", "quiet")


def _exit_on_sigterm(signum, frame):
    """SIGTERM ends the command through its finally blocks (the embedded server stops, logs flush).

    During a flow run Prefect's own handler takes over and, once the run is marked Crashed,
    hands the signal back here.
    """
    from prefect_jax.training.facade import note_signal

    note_signal(signum)  # (an import it breaks may fail otherwise: `main` still says why)
    raise SystemExit(128 + signum)


def _max_steps(value: str) -> int | None:
    """``--max-steps``: a number of steps, or ``none`` (TF's max_steps=None: until stopped)."""
    if value.strip().lower() == "none":
        return None
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{value!r} is not a number of steps: give one, e.g. 1000, or 'none' to train until "
            "stopped"
        ) from None


def _add_training_args(p: argparse.ArgumentParser, max_steps: int, every: int) -> None:
    add = p.add_argument
    add(
        "--max-steps",
        type=_max_steps,
        default=max_steps,
        metavar="N|none",
        help=f"train until this global step (default {max_steps}); 'none' trains until stopped "
        "(a stop request, a preemption, a cancel), as TF's max_steps=None",
    )
    add(
        "--checkpoint-every-steps",
        type=int,
        default=every,
        help=f"checkpoint cadence in steps (default {every})",
    )
    add("--checkpoint-every-secs", type=float, default=None, help="also checkpoint every N seconds")
    add("--keep-last", type=int, default=3, help="keep the newest N checkpoints (default 3)")
    add(
        "--keep-every-steps", type=int, default=None, help="also keep checkpoints at multiples of N"
    )
    add(
        "--no-backups",
        dest="backups",
        action="store_false",
        help="never write backups (resume-only checkpoints between the cadence's, written once "
        "attempts of the job were killed without notice)",
    )
    add("--seed", type=int, default=0, help="init and data-order seed (default 0)")
    add(
        "--log-every-steps",
        type=int,
        default=50,
        help="train metrics to MLflow every N steps (default 50)",
    )
    add(
        "--steps-per-dispatch",
        type=int,
        default=1,
        help="run K steps per call into the device, as one lax.scan (default 1)",
    )
    add("--eval-steps", type=int, default=None, help="eval batches (default: the whole eval set)")
    add("--eval-name", default="eval", help="eval name (default 'eval')")
    add("--throttle-secs", type=float, default=0.0, help="minimum seconds between evaluations")
    add(
        "--exporters",
        nargs="*",
        choices=["latest", "best", "final"],
        default=["latest", "best", "final"],
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
        type=float,
        default=0.0,
        help="the evaluator waits this long before its first evaluation (EvalSpec's; default 0)",
    )
    add(
        "--sigterm-grace-secs",
        type=float,
        default=25.0,
        help="on SIGTERM, seconds to commit the step in flight",
    )
    add(
        "--lease-timeout-secs",
        type=float,
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
    add("--mlflow-tracking-uri", default=None, help="MLflow tracking URI")
    add(
        "--mlflow-optional",
        action="store_true",
        help="a tracking URI MLflow cannot use or reach is a warning, not an error: train anyway "
        "(the summary counts what did not reach MLflow)",
    )
    add(
        "--mlflow-experiment",
        default=DEFAULT_EXPERIMENT,
        help=f"MLflow experiment (default {DEFAULT_EXPERIMENT})",
    )
    add("--json", action="store_true", help="print one JSON object as the last line on stdout")
    add("--no-progress", action="store_true", help="no progress bar")


_ROLE_HELP = {
    "run": "train any program with train_and_evaluate: train, evaluate and export every checkpoint",
    "train": "the trainer role: train and checkpoint until max_steps (an evaluator runs elsewhere)",
    "evaluate": "the evaluator role: evaluate each new committed checkpoint of a job once, and "
    "export",
    "export": "run the exporters on an evaluated step of a job (default: the newest)",
}


def _add_role(sub, name: str) -> None:
    role = sub.add_parser(name, help=_ROLE_HELP[name], description=_ROLE_HELP[name])
    add = role.add_argument
    add("--program", required=True, help="program import path, 'package.module:attribute'")
    add(
        "--program-param",
        dest="program_param",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a program parameter (repeatable); VALUE is read as JSON, else as a string, e.g. "
        "--program-param preset=tiny --program-param batch_size=32",
    )
    add(
        "--program-params",
        default=None,
        metavar="JSON",
        help="program parameters as one JSON object ('--program-param's win on the same key)",
    )
    add("--job", required=True, help="job name")
    add(
        "--storage",
        required=True,
        help="storage root: a directory, an fsspec URL (s3://, gs://...) or "
        "jax-checkpoint-storage/<block>",
    )
    _add_training_args(role, max_steps=1000, every=200)
    if name == "evaluate":
        add("--once", action="store_true", help="stop when nothing new is left to evaluate")
        add(
            "--newest-only",
            action="store_true",
            help="evaluate only the newest checkpoint, not every one",
        )
        add(
            "--poll-secs",
            type=float,
            default=10.0,
            help="how often to look for new checkpoints (default 10)",
        )
        add(
            "--idle-timeout-secs",
            type=float,
            default=None,
            help="stop after this long without a new checkpoint",
        )
        add(
            "--wait-for-first-checkpoint-secs",
            "--max-wait-secs",
            dest="wait_for_first_checkpoint_secs",
            type=float,
            default=3600.0,
            help="give up waiting for a first checkpoint after this long (TF's max_wait_secs)",
        )
    if name == "export":
        add(
            "--step",
            type=int,
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
            type=float,
            default=7200.0,
            help="with --wait-for-checkpoint, give up after this long (default 7200)",
        )
        add(
            "--recovery-wait-secs",
            type=float,
            default=30.0,
            help="with --wait-for-checkpoint, look again every this many seconds (default 30)",
        )
    if name in ("run", "train"):
        add(
            "--processes",
            type=int,
            default=1,
            metavar="N",
            help="train as N JAX processes on this machine (data parallel, one job; default 1). "
            "On a cluster, set PREFECT_JAX_NUM_PROCESSES & co. per process instead (see the "
            "README)",
        )
    role.set_defaults(fn=commands.cmd_run)


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``prefect-jax``: one subcommand each, its function in ``fn``."""
    # No prefix matching (--max-step is not --max-steps): a typo is an error, never a guess.
    parser = argparse.ArgumentParser(
        prog="prefect-jax", description="Train JAX models reliably on Prefect.", allow_abbrev=False
    )
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_SubcommandParser)

    demo = sub.add_parser("demo", help="train the digits example on embedded defaults")
    demo.add_argument(
        "--workdir",
        default="./prefect-jax-demo",
        help="where checkpoints and MLflow go (default ./prefect-jax-demo)",
    )
    _add_training_args(demo, max_steps=1000, every=200)
    demo.set_defaults(fn=commands.cmd_demo)

    for name in _ROLE_HELP:
        _add_role(sub, name)

    process = sub.add_parser(
        "process",
        help="one pod of a multi-process work pool: process 0 runs the flow run, the others "
        "join it",
        description=launch.cmd_process.__doc__.split("\n\n")[0].replace("``", "'"),
    )
    process.add_argument(
        "--processes",
        type=int,
        default=None,
        metavar="N",
        help="how many JAX processes train the job (default: from the "
        "environment, e.g. Vertex's CLUSTER_SPEC)",
    )
    process.add_argument(
        "--service", default=None, help="the indexed job's headless service (process 0's address)"
    )
    process.add_argument(
        "--coordinator-port",
        type=int,
        default=8476,
        help="process 0's coordinator port (default 8476)",
    )
    process.add_argument(
        "command", nargs=argparse.REMAINDER, help="-- and the worker's command for process 0"
    )
    process.set_defaults(fn=launch.cmd_process)

    job_status = sub.add_parser("status", help="committed, evaluated and exported steps of a job")
    job_status.add_argument("--job", required=True)
    job_status.add_argument("--storage", required=True, help="as for run")
    job_status.add_argument("--json", action="store_true")
    job_status.set_defaults(fn=status.cmd_status)

    automations = sub.add_parser("automations", help="Prefect automations for training jobs")
    automations_sub = automations.add_subparsers(dest="automations_command", required=True)
    create = automations_sub.add_parser(
        "create",
        help="rerun crashed runs of a trainer deployment automatically (they resume from their "
        "checkpoint)",
    )
    create.add_argument(
        "--deployment", required=True, help="the trainer deployment, 'flow-name/deployment-name'"
    )
    create.add_argument(
        "--name",
        default=None,
        help="automation name (default: 'prefect-jax: rerun crashed <deployment>')",
    )
    create.set_defaults(fn=commands.cmd_automations_create)
    return parser


class _SubcommandParser(argparse.ArgumentParser):
    """A subcommand's parser: no abbreviations, and its own usage on an error (an unknown flag
    included), not the top-level one."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def parse_known_args(self, args=None, namespace=None):
        namespace, extras = super().parse_known_args(args, namespace)
        flags = [a for a in extras if a.startswith("-")]
        if flags:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return namespace, extras


def main(argv: list[str] | None = None) -> int:
    """Run ``prefect-jax ARGV``; its exit code. Bad input is one error line (exit 2), a job its
    user must act on one too (exit 1); a command ended by SIGTERM says so (exit 143)."""
    _quiet_env()
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    from prefect_jax.training import facade

    if args.command in _ROLES:
        signal.signal(signal.SIGTERM, _exit_on_sigterm)
        facade.deliver_lost_notices()
    try:
        return args.fn(args)
    except BaseException as exc:
        if isinstance(exc, (SystemExit, KeyboardInterrupt, GeneratorExit)):
            raise
        # Any other error (an Exception, or such as pyo3's `PanicException`, a BaseException: seen
        # when a SIGTERM's SystemExit broke pydantic-core's import of `datetime`).
        signum = facade.received_signal()
        if signum is not None:
            # Terminated: whatever error the signal caused on its way out is not the story.
            print(
                f"prefect-jax {args.command}: terminated by signal {signum}; the newest committed "
                f"step is kept: run the same command again to resume ({type(exc).__name__}: {exc})",
                file=sys.stderr,
            )
            return 128 + signum
        if isinstance(exc, facade.REFUSALS):
            print(f"prefect-jax {args.command}: error: {exc}", file=sys.stderr)
            return 1
        if isinstance(exc, (ValueError, FileNotFoundError)):
            print(f"prefect-jax {args.command}: error: {exc}", file=sys.stderr)
            return 2
        raise


def entry() -> None:
    """The ``prefect-jax`` console script: `main`, then a quick exit.

    A process that imported JAX, Orbax, MLflow and Prefect spends a noticeable time in Python's
    own teardown after its work is done: freeing every module and XLA's client, one object at a
    time. A rerun after a preemption waits for it. So, once `main` returns, this does what a
    normal exit does that matters (wait for non-daemon threads, run the atexit handlers: log,
    Prefect and MLflow flushes; flush stdout and stderr) and then ends the process without the
    teardown. An uncaught exception exits the usual way, with its traceback.

    Terminated by SIGTERM (exit 143), the process does not wait for its background threads
    either: the step in flight was committed (or abandoned) within ``sigterm_grace_secs``
    already, and what MLflow's thread had not written yet (a run still being created, metrics)
    is written by the rerun from the checkpoints and eval records, as after a SIGKILL."""
    try:
        code = main()
    except SystemExit as exc:
        # argparse's exits, and SIGTERM handed back by Prefect (`_exit_on_sigterm`).
        if not isinstance(exc.code, int):
            raise
        code = exc.code
    import atexit
    import threading

    shutdown = getattr(threading, "_shutdown", None)  # what the interpreter calls first at exit
    if shutdown is None:  # pragma: no cover - another Python: the usual exit
        sys.exit(code)
    from prefect_jax.training.facade import set_exit_code

    # A process of several that lost another exits from its atexit handler: with this code.
    set_exit_code(code)
    if code != 128 + signal.SIGTERM:
        shutdown()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
