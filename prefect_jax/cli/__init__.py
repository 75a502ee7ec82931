"""The ``prefect-jax`` command: ``demo``, ``run``, the roles ``train``, ``evaluate`` and
``export``, ``process``, ``status`` and ``automations``.

``demo`` and ``run`` execute the `train_and_evaluate` flow in this process; ``train``,
``evaluate`` and ``export`` the flows of TensorFlow's chief and evaluator roles. With
``PREFECT_API_URL`` set they report to that server; otherwise they start an embedded
Prefect server for the duration of the command (the runs land in Prefect's default
database, so ``prefect server start`` shows them afterwards) and stop it cleanly, logs
and events flushed, however the command ends.

With ``--json`` the last line on stdout is one JSON object: the summary, or where the command
is refused or terminated ``{"error": <its error line>, "exit_code": <its exit code>}``.

This module parses the command line and dispatches; the commands live beside it: `arguments`
(the roles' flags), `commands` (the flows run in this process), `launch` (several processes),
`status`, `server` (the Prefect API), `console` (what is printed) and `startup` (the process's
own start-up).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import traceback

from prefect_jax.cli import commands, launch, status
from prefect_jax.cli.arguments import add_training_args, number
from prefect_jax.cli.role_arguments import ROLES, add_role
from prefect_jax.deployments.automations import (
    CRASH_WINDOW_SECS,
    MAX_CRASHES,
    check_deployment_name,
)
from prefect_jax.training.cluster_config import DEFAULT_PORT

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


def _deployment_name(value: str) -> str:
    """``--deployment``'s parser: refused as the flag's value, before any server starts."""
    try:
        return check_deployment_name(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``prefect-jax``: one subcommand each, its function in ``fn``."""
    # No prefix matching (--max-step is not --max-steps): a typo is an error, never a guess.
    parser = argparse.ArgumentParser(
        prog="prefect-jax", description="Train JAX models reliably on Prefect.", allow_abbrev=False
    )
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_SubcommandParser)
    parser.subcommands = sub.choices  # {name: its parser} (`_flags_of_roles`)

    demo = sub.add_parser(
        "demo",
        help="train the digits example on embedded defaults",
        description="Train the digits example (a Flax NNX MLP on scikit-learn's digits) on "
        "embedded defaults: a temporary Prefect server of its own (or PREFECT_API_URL's), and "
        "SQLite MLflow and local checkpoints under --workdir. Run it again and it resumes: "
        "nothing is repeated.",
    )
    demo.add_argument(
        "--workdir",
        default="./prefect-jax-demo",
        help="where checkpoints and MLflow go (default ./prefect-jax-demo)",
    )
    add_training_args(demo, max_steps=1000, every=200)
    demo.set_defaults(fn=commands.cmd_demo)

    for name in ROLES:
        add_role(sub, name)

    process = sub.add_parser(
        "process",
        help="one pod of a multi-process work pool: process 0 runs the flow run, the others "
        "join it",
        description=launch.cmd_process.__doc__.split("\n\n")[0].replace("``", "'"),
    )
    process.add_argument(
        "--processes",
        type=number(int, "a number of processes", "2"),
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
        type=number(int, "a port", str(DEFAULT_PORT)),
        default=DEFAULT_PORT,
        help="process 0's coordinator port (default %(default)s)",
    )
    process.add_argument(  # (not dest "command": the subcommand's name, which errors show)
        "worker_command",
        metavar="command",
        nargs=argparse.REMAINDER,
        help="-- and the worker's command for process 0",
    )
    process.set_defaults(fn=launch.cmd_process)

    job_status = sub.add_parser(
        "status",
        help="committed, evaluated and exported steps of a job",
        description="A job's committed, evaluated and exported steps, its goodput, program "
        "params, registered model and any damaged records, read from its storage (and MLflow); no "
        "Prefect server needed, unless --storage names a block.",
    )
    job_status.add_argument("--job", required=True, help="the job's name, as given to run")
    job_status.add_argument("--storage", required=True, help="as for run")
    job_status.add_argument("--json", action="store_true", help="one JSON object instead of text")
    job_status.set_defaults(fn=status.cmd_status)

    automations = sub.add_parser("automations", help="Prefect automations for training jobs")
    automations_sub = automations.add_subparsers(dest="automations_command", required=True)
    create = automations_sub.add_parser(
        "create",
        help="rerun crashed runs of a trainer deployment automatically (they resume from their "
        "checkpoint)",
    )
    create.add_argument(
        "--deployment",
        required=True,
        type=_deployment_name,
        help="the trainer deployment, 'flow-name/deployment-name'",
    )
    create.add_argument(
        "--name",
        default=None,
        help="automation name (default: 'prefect-jax: rerun crashed <deployment>')",
    )
    # (--no-brake silently won; the brake's defaults are None here, so that argparse, which tells
    # a flag given by its value not being the default object, sees `--max-crashes 10` too)
    brake = create.add_mutually_exclusive_group()
    brake.add_argument(
        "--max-crashes",
        type=number(int, "a number of crash reports", "10"),
        default=None,
        help="the brake: pause the rerun automation after this many crash reports of one "
        f"run of the deployment within --crash-window-secs (default {MAX_CRASHES}; a process "
        "worker reports each crash twice)",
    )
    create.add_argument(
        "--crash-window-secs",
        type=number(float, "a number of seconds", "3600"),
        default=None,
        help=f"the brake's window (default {CRASH_WINDOW_SECS:g})",
    )
    brake.add_argument(
        "--no-brake",
        action="store_true",
        help="rerun every crash, however many (no brake; deletes one made before)",
    )
    create.set_defaults(fn=commands.cmd_automations_create)
    return parser


def _flags_of_roles() -> dict[str, list[str]]:
    """Each subcommand's flags, by subcommand (for a flag given to the wrong one)."""
    return {name: _flags_of(sub) for name, sub in build_parser().subcommands.items()}


def _flags_of(parser: argparse.ArgumentParser) -> list[str]:
    """`parser`'s option strings (argparse lists them only in its `_actions`)."""
    return [o for action in parser._actions for o in action.option_strings]


class _SubcommandParser(argparse.ArgumentParser):
    """A subcommand's parser: no abbreviations, and its own usage on an error (an unknown flag
    included), not the top-level one."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def parse_known_args(self, args=None, namespace=None):
        given = list(sys.argv[1:] if args is None else args)
        self.given = given[: given.index("--")] if "--" in given else given  # (for `error`)
        namespace, extras = super().parse_known_args(args, namespace)
        if any(a.startswith("-") for a in extras):
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return namespace, extras

    def error(self, message: str):
        """One usage line, then the error: argparse's whole usage (30 lines for `run`) buried the
        one line that says what is wrong; each unknown flag given with what it likely meant
        (`flag_hints`: argparse names none where a required flag is missing too). With
        ``--json``, the error object too, as a refused command prints it (`_say_error`)."""
        from prefect_jax.cli.flag_hints import hints_for

        given = getattr(self, "given", [])
        hints = hints_for(given, _flags_of(self), self.prog.rsplit(" ", 1)[-1], _flags_of_roles)
        message = f"{message}; {hints}" if hints else message
        if "--json" in given:
            import json

            print(json.dumps({"error": message, "exit_code": 2}), flush=True)
        self.exit(
            2,
            f"usage: {self.prog} [flags]   ({self.prog} --help lists them)\n"
            f"{self.prog}: error: {message}\n",
        )


def main(argv: list[str] | None = None) -> int:
    """Run ``prefect-jax ARGV``; its exit code. Bad input is one error line (exit 2), a job its
    user must act on one too (exit 1); a command ended by SIGTERM says so (exit 143)."""
    _quiet_env()
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    from prefect_jax.training import facade

    facade.forget_resumes_at()  # (what an earlier command in this process ended with)
    if args.command in _ROLES:
        signal.signal(signal.SIGTERM, _exit_on_sigterm)
        facade.deliver_lost_notices()
    try:
        return args.fn(args)
    except BaseException as exc:
        signum = facade.received_signal()
        if isinstance(exc, SystemExit) and signum is not None and exc.code == 128 + signum:
            _say_terminated(args, signum)  # (Prefect's crash lines are the last else)
            raise
        if isinstance(exc, KeyboardInterrupt) and args.command in _ROLES:
            # (a trainer's SIGINT checkpoints the step in flight first: docs/preemption.md)
            return _say_error(
                args, f"interrupted (Ctrl-C); {_how_to_go_on(args.command)}", 130, kind=""
            )
        if isinstance(exc, (SystemExit, KeyboardInterrupt, GeneratorExit)):
            raise
        # Any other error (an Exception, or such as pyo3's `PanicException`, a BaseException: seen
        # when a SIGTERM's SystemExit broke pydantic-core's import of `datetime`).
        if signum is not None:
            # Terminated: whatever error the signal caused on its way out is not the story.
            _say_terminated(args, signum, f" ({type(exc).__name__}: {exc})")
            return 128 + signum
        from prefect_jax.training.remote_errors import RemoteUnreachableError

        if isinstance(exc, (*facade.REFUSALS, RemoteUnreachableError)):
            return _say_error(args, str(exc), 1)
        if isinstance(exc, (ValueError, FileNotFoundError)):
            return _say_error(args, str(exc), 2)
        if getattr(args, "json", False):  # the traceback, then the object a script reads
            traceback.print_exc()
            return _say_error(args, f"{type(exc).__name__}: {exc}", 1)
        raise


def _say_error(args: argparse.Namespace, message: str, code: int, kind: str = "error: ") -> int:
    """The command's last line on stderr, ``prefect-jax <command>: error: <message>``; with
    ``--json`` also as the last line on stdout (a script reading it gets an object either way).
    Returns `code`."""
    print(f"prefect-jax {args.command}: {kind}{message}", file=sys.stderr)
    if getattr(args, "json", False):
        import json

        print(json.dumps({"error": message, "exit_code": code}), flush=True)
    return code


def _how_to_go_on(command: str | None = None) -> str:
    """What a stopped `command`'s last line says of the job: the step it resumes at, where this
    process's trainer said (its preemption notice's checkpoint), and the command that does."""
    from prefect_jax.training import facade

    where = facade.resumes_at()
    if where is None and command in ("evaluate", "export"):  # (they commit no step)
        return "the evaluations and exports recorded are kept: run the same command again to go on"
    if where is None:  # (no trainer in this process said: a notice in the start)
        return "the newest committed step is kept: run the same command again to resume"
    if where[0] is None:
        return "no step was committed yet: run the same command again to start from step 0"
    return f"step {where[0]} is committed: run the same command again to resume there"


def _say_terminated(args: argparse.Namespace, signum: int, detail: str = "") -> None:
    message = f"terminated by signal {signum}; {_how_to_go_on(args.command)}{detail}"
    _say_error(args, message, 128 + signum, kind="")


def entry() -> None:
    """The ``prefect-jax`` console script: `main`, then a quick exit.

    A process that imported JAX, Orbax, MLflow and Prefect spends a noticeable time in Python's
    own teardown after its work is done: freeing every module and XLA's client, one object at a
    time. A rerun after a preemption waits for it. So, once `main` returns, this does what a
    normal exit does that matters (wait for non-daemon threads, run the atexit handlers: log,
    Prefect and MLflow flushes; flush stdout and stderr) and then ends the process without the
    teardown.

    Terminated by SIGTERM (exit 143), the process does not wait for its background threads
    either: the step in flight was committed (or abandoned) within ``sigterm_grace_secs``
    already, and what MLflow's thread had not written yet (a run still being created, metrics)
    is written by the rerun from the checkpoints and eval records, as after a SIGKILL.

    An error `main` does not turn into an exit code (a Ctrl-C too) prints its traceback and
    exits the same way (1; 130 for a Ctrl-C), not through the interpreter's own exit: a SIGTERM
    there, while it waits for a background XLA compile, would leave the compile running into the
    interpreter's teardown, which aborts the process (SIGABRT). A SIGTERM or a Ctrl-C while this
    waits for the threads ends the wait (exit 143 or 130)."""
    # A program in the working directory imports, as with `python -m` (a console script's path
    # starts at its own folder instead).
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        code = main()
    except SystemExit as exc:
        # argparse's exits, and SIGTERM handed back by Prefect (`_exit_on_sigterm`).
        if not isinstance(exc.code, int):
            raise
        code = exc.code
    except BaseException as exc:  # noqa: BLE001 - reported as the interpreter would, then the exit
        sys.excepthook(type(exc), exc, exc.__traceback__)
        code = 128 + signal.SIGINT if isinstance(exc, KeyboardInterrupt) else 1
    import atexit
    import threading

    shutdown = getattr(threading, "_shutdown", None)  # what the interpreter calls first at exit
    if shutdown is None:  # pragma: no cover - another Python: the usual exit
        sys.exit(code)
    from prefect_jax.training.facade import set_exit_code

    # A process of several that lost another exits from its atexit handler: with this code.
    set_exit_code(code)
    if code != 128 + signal.SIGTERM:
        try:
            shutdown()
        except SystemExit as exc:  # `_exit_on_sigterm`: terminated while it waited
            code = exc.code if isinstance(exc.code, int) else 128 + signal.SIGTERM
            set_exit_code(code)
        except KeyboardInterrupt:
            code = 128 + signal.SIGINT
            set_exit_code(code)
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
