"""What the command prints: a live progress bar while it trains, and its summary at the end
(aligned lines for people, or one JSON object as the last line on stdout with ``--json``)."""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Iterator
from typing import Any

from prefect_jax.training.names import (
    MLFLOW_UI_URL_DEFAULT,
    MLFLOW_UI_URL_ENV,
    PREFECT_UI_URL_LOCAL,
)


@contextlib.contextmanager
def _logs_above(console) -> Iterator[None]:
    """Log lines printed above a live progress bar, not glued onto it: Prefect's console handlers
    print through the bar's console, other stderr handlers write through rich's redirected
    stderr."""
    import logging

    from prefect.logging.handlers import PrefectConsoleHandler

    loggers = [logging.getLogger()] + [
        lg for lg in logging.Logger.manager.loggerDict.values() if isinstance(lg, logging.Logger)
    ]
    swapped: list[tuple[logging.Handler, str, Any]] = []
    for handler in {h for lg in loggers for h in lg.handlers}:
        if isinstance(handler, PrefectConsoleHandler):
            swapped.append((handler, "console", handler.console))
            handler.console = console
        elif isinstance(handler, logging.StreamHandler) and handler.stream in (
            sys.__stderr__,
            sys.__stdout__,
        ):
            swapped.append((handler, "stream", handler.stream))
            handler.setStream(sys.stderr)  # rich's proxy while the bar is live
    try:
        yield
    finally:
        for handler, attr, old in swapped:
            if attr == "console":
                handler.console = old
            else:
                handler.setStream(old)


@contextlib.contextmanager
def progress_bar(enabled: bool, max_steps: int | None) -> Iterator[None]:
    """A live progress bar on stderr while training runs in this process (no total for a job
    that trains until stopped), where stderr is a terminal. Elsewhere (a worker's or a CI's
    captured log) rich would draw it only once, as the command ends, in 80 columns, cutting the
    line to a few letters and part of the metrics; each interval's log line says the same in
    full. rich's ``TTY_COMPATIBLE=1`` (or ``FORCE_COLOR``) shows it anyway."""
    from rich.console import Console

    console = Console(stderr=True)
    if not (enabled and console.is_terminal):
        yield
        return
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    from prefect_jax.training.facade import on_progress

    with (
        Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[metrics]}"),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            console=console,
            transient=False,
        ) as progress,
        _logs_above(progress.console),
    ):
        # Until the first step is known: starting Prefect, restoring, compiling.
        task_id = progress.add_task(
            "starting", total=max_steps, metrics="(Prefect, restore, compile)"
        )

        def update(step: int, max_steps: int, metrics: dict) -> None:
            text = " ".join(f"{k}={float(v):.4g}" for k, v in sorted(metrics.items()))
            progress.update(
                task_id, description="training", completed=step, total=max_steps, metrics=text
            )

        remove = on_progress(update)
        try:
            yield
        finally:
            remove()


def emit(summary: dict[str, Any], as_json: bool) -> None:
    """Print a command's summary: one JSON object (`as_json`), or a line per key and then the
    ``browse`` lines."""
    if as_json:
        print(json.dumps(summary, sort_keys=True, default=str))
        return
    for key, value in summary.items():
        if key == "browse":
            continue
        if key == "goodput":
            from prefect_jax.training.facade import describe_goodput

            value = describe_goodput(value)
        print(f"{key:>20}: {value}")
    if summary.get("browse"):
        print()  # (a blank line before them on a terminal; none in the JSON's list)
    for line in summary.get("browse", []):
        print(line)


def browse_lines(summary: dict[str, Any]) -> list[str]:
    """Where to look at a finished job's results: MLflow, the registered model, Prefect's UI
    (where the command ran its own server), and `status`."""
    uri = summary["mlflow_tracking_uri"]
    run_url = summary.get("mlflow_run_url") or (
        os.environ.get(MLFLOW_UI_URL_ENV) or MLFLOW_UI_URL_DEFAULT
    )
    lines = ["Browse the results:"]
    missing = summary.get("mlflow_missing")
    if missing:  # (--mlflow-optional) no MLflow UI or model to point at: say why instead
        lines.append(f"  MLflow:  {missing}")
    elif str(uri).startswith(("http://", "https://")):  # a tracking server: its own UI
        lines.append(f"  MLflow:  open {run_url}")
    else:
        lines.append(
            f"  MLflow:  uv run mlflow ui --backend-store-uri {uri}   (then open {run_url})"
        )
    # (a `train` role's job exports nothing itself: no model to load until its evaluator exports)
    exported = [name for name, steps in (summary.get("exports") or {}).items() if steps]
    if summary.get("registry_missing") and not missing:  # (exported, MLflow refused them)
        lines.append(f"  Serve:   {summary['registry_missing']}")
    elif summary.get("registered_model") and exported and not missing:
        from prefect_jax.training.registry import alias_for

        alias = alias_for("best" if "best" in exported else exported[0])
        lines.append(
            f"  Serve:   mlflow.pyfunc.load_model('models:/{summary['registered_model']}@{alias}')"
            f"   (with MLFLOW_TRACKING_URI={uri})"
        )
    # (PREFECT_JAX_EMBEDDED_API: the launcher's embedded server.)
    if not os.environ.get("PREFECT_API_URL") or os.environ.get("PREFECT_JAX_EMBEDDED_API"):
        lines.append(f"  Prefect: uv run prefect server start   (then open {PREFECT_UI_URL_LOCAL})")
    job, storage = summary["job"], summary["storage"]
    lines.append(f"  Status:  uv run prefect-jax status --job {job} --storage {storage}")
    return lines
