"""The commands that run a flow in this process: ``demo``, ``run`` (`train_and_evaluate`), the
roles ``train``, ``evaluate`` and ``export``, and ``automations create``."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from prefect_jax.cli import console, startup
from prefect_jax.cli.server import early_server, prefect_backend
from prefect_jax.cli.spec_flags import (
    program_params_from_args,
    specs_from_args,
    unread_flags_given,
)

DEMO_PROGRAM = "prefect_jax.examples.digits:program"
DEMO_JOB = "digits"
_TRAINS = ("train_and_evaluate", "train")  # the roles that train (a progress bar, max_steps)


def _run_flow(
    args: argparse.Namespace,
    program: str,
    job: str,
    storage: str,
    tracking_uri: str,
    role: str = "train_and_evaluate",
) -> dict[str, Any]:
    """Run the flow of `role` in this process (progress bar for the roles that train)."""
    # Through the start-up's imports, until `startup.freeze_startup_objects` (which says why).
    with startup.collector_off():
        from prefect_jax.training.facade import warm_up_tracking
        from prefect_jax.training.names import REGISTERING_FLOWS

        # MLflow's import, in its worker process, beside the imports below (and, where this
        # process will register exports, what logging a model needs: JAX on the worker's CPU).
        # Decided from the flags, before the specs' import (a third of a second): the flows'
        # rule, `eval_specs.flow_registers_exports`, on the values the EvalSpec will hold.
        registers = (
            {"export": "export_flow"}.get(role, role) in REGISTERING_FLOWS
            and bool(args.exporters)
            and args.registered_model != ""
        )
        warm_up_tracking(tracking_uri, registry=registers)
        specs = specs_from_args(args)  # bad values: refused before anything starts
        program_params_from_args(args)  # a malformed --program-param(s) too
        if unread := unread_flags_given(args):
            print(unread, file=sys.stderr)
        server = early_server()  # the embedded server's start-up, beside the imports below too
        try:
            return _run_flow_with(args, program, job, storage, tracking_uri, role, specs, server)
        finally:
            if server is not None:  # stopped already unless something failed before it was used
                server.stop()


def _run_flow_with(
    args, program, job, storage, tracking_uri, role, specs, server
) -> dict[str, Any]:
    from prefect_jax import flows

    train_spec, eval_spec, checkpoint_spec = specs
    common = dict(
        program=program,
        job=job,
        storage=storage,
        train_spec=train_spec,
        eval_spec=eval_spec,
        checkpoint_spec=checkpoint_spec,
        mlflow_tracking_uri=tracking_uri,
        mlflow_experiment=args.mlflow_experiment,
        mlflow_optional=args.mlflow_optional,
    )
    program_params = program_params_from_args(args)
    if program_params is not None:  # (left out otherwise: a flow without it still runs)
        common["program_params"] = program_params
    if role in _TRAINS:
        flow = flows.train_and_evaluate if role == "train_and_evaluate" else flows.train
        kwargs = dict(
            common,
            checkpoint_path=_absolute(args.checkpoint_path),
            compilation_cache_dir=args.compilation_cache,
        )
    elif role == "evaluate":
        flow, kwargs = (
            flows.evaluate,
            dict(
                common,
                compilation_cache_dir=args.compilation_cache,
                every_checkpoint=not args.newest_only,
                once=args.once,
                wait_for_first_checkpoint_secs=_first_checkpoint_wait(args),
                poll_secs=args.poll_secs,
                idle_timeout_secs=args.idle_timeout_secs,
            ),
        )
    else:
        flow, kwargs = flows.export_flow, dict(common, step=args.step)
        kwargs.update(
            wait_for_checkpoint=args.wait_for_checkpoint,
            max_wait_secs=args.max_wait_secs,
            recovery_wait_secs=args.recovery_wait_secs,
        )
    from prefect_jax.blocks import names_a_block

    check = dict(
        program=program,
        job=job,
        storage=storage,
        # (a step past it is refused for a trainer alone: the roles that do not train follow
        # the trainer's own, recorded in its steps: `flows.config.following_the_trainer`)
        max_steps=args.max_steps if role in (*_TRAINS, "evaluate") else None,
        checkpoint_path=args.checkpoint_path if role in _TRAINS else None,
        eval_spec=eval_spec,
        tracking_uri=tracking_uri,
        mlflow_optional=args.mlflow_optional,
        compilation_cache=args.compilation_cache if role != "export" else None,
        program_params=program_params,
        # its compile begins once the checks pass
        train_spec=train_spec if role in _TRAINS else None,
        # (a trainer alone: its evaluator checks the metrics its spec names; an export reads
        # evaluations, makes none)
        evaluates=role in ("train_and_evaluate", "evaluate"),
        # an export with nothing to export, refused before its flow run (unless it waits)
        exports_now=role == "export" and not args.wait_for_checkpoint,
        export_step=args.step if role == "export" else None,
    )
    blocks = names_a_block(storage) or names_a_block(tracking_uri)
    if not blocks:
        # Refused in a fraction of a second (a server started early is stopped unused).
        _preflight(**check)
    from prefect_jax.training.facade import joins_as_secondary

    if role in _TRAINS and joins_as_secondary():
        with prefect_backend(server):  # process 1+ of several: a child flow run of process 0's
            startup.freeze_startup_objects()
            return flows.run_as_process(flow=flow, parameters=kwargs)
    with prefect_backend(server):
        if blocks:
            _preflight(**check)  # the blocks are read from the server
        import prefect

        from prefect_jax.tasks import process_tag
        from prefect_jax.training.names import JOB_RUN_TAG, OWN_TAG

        # Tagged from its creation: a run killed before its first task is still found by the
        # job, and the process tag lets the next run prove it dead (see mark_dead_local_runs).
        tags = prefect.tags(OWN_TAG, f"{JOB_RUN_TAG}{job}", process_tag())
        bar = console.progress_bar(not args.no_progress and role in _TRAINS, args.max_steps)
        with tags, bar:
            startup.freeze_startup_objects()
            return flow(**kwargs)


def _first_checkpoint_wait(args) -> float:
    """The evaluator's wait for a first checkpoint: as given; else none with --once, else 3600."""
    from prefect_jax.training.specs import FIRST_CHECKPOINT_WAIT_SECS

    given = args.wait_for_first_checkpoint_secs
    return given if given is not None else 0.0 if args.once else FIRST_CHECKPOINT_WAIT_SECS


def _preflight(
    *,
    program: str,
    job: str,
    storage: str,
    max_steps: int | None,
    checkpoint_path: str | None = None,
    eval_spec=None,
    tracking_uri: str | None = None,
    mlflow_optional: bool = False,
    compilation_cache: str | None = None,
    program_params: dict[str, Any] | None = None,
    train_spec=None,
    evaluates: bool = True,
    exports_now: bool = False,
    export_step: int | None = None,
) -> None:
    """Refuse what the flow would refuse, before it starts: one clear error line, and no failed
    flow run with a traceback in front of it. The flow checks the same things again (a
    deployment's runs do not come through here). With `train_spec`, the compile of the job's
    steps begins once the checks pass, for the flow run's trainer in this process (see
    `prefect_jax.training.head_start`). With `exports_now` (the export role, not waiting), an
    `export_step` (None: the newest evaluated) with no evaluation is refused too."""
    from prefect_jax.blocks import resolve_storage, resolve_tracking
    from prefect_jax.tasks import ui_refresh_secs
    from prefect_jax.training.facade import check_export, preflight

    ui_refresh_secs()
    tracking_uri = resolve_tracking(tracking_uri, None)[0]
    preflight(
        program,
        job,
        storage,
        max_steps,
        resolve=resolve_storage,
        checkpoint_path=checkpoint_path,
        eval_spec=eval_spec,
        tracking_uri=tracking_uri,
        mlflow_optional=mlflow_optional,
        compilation_cache=compilation_cache,
        program_params=program_params,
        train_spec=train_spec,
        evaluates=evaluates,
    )
    if exports_now:
        check_export(job, storage, eval_spec.name, export_step, resolve=resolve_storage)


def cmd_demo(args: argparse.Namespace) -> int:
    """``demo``: the digits example, with its storage and MLflow under ``--workdir``."""
    from prefect_jax.training.facade import make_local_dir

    workdir = os.path.abspath(args.workdir)
    make_local_dir("--workdir", workdir)
    storage = os.path.join(workdir, "storage")
    tracking_uri = args.mlflow_tracking_uri or f"sqlite:///{os.path.join(workdir, 'mlflow.db')}"
    summary = _run_flow(args, DEMO_PROGRAM, DEMO_JOB, storage, tracking_uri)
    summary["storage"] = storage
    summary["browse"] = console.browse_lines(summary)
    console.emit(summary, args.json)
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    """``run`` (train_and_evaluate), and the roles ``train``, ``evaluate``, ``export``."""
    from prefect_jax.training.facade import default_tracking_uri

    if getattr(args, "processes", 1) < 1:
        raise ValueError(
            f"--processes {args.processes}: the number of JAX processes must be 1 or more"
        )
    if getattr(args, "processes", 1) > 1:
        from prefect_jax.cli.launch import launch_processes

        return launch_processes(args)
    tracking_uri = args.mlflow_tracking_uri or default_tracking_uri()
    role = {"run": "train_and_evaluate"}.get(args.command, args.command)
    summary = _run_flow(args, args.program, args.job, args.storage, tracking_uri, role)
    if role == "export":
        summary = {"job": args.job, "exports": summary}
    summary["storage"] = args.storage
    if role in _TRAINS:
        summary["browse"] = console.browse_lines(summary)
    console.emit(summary, args.json)
    return 0


def cmd_automations_create(args: argparse.Namespace) -> int:
    """``automations create``: rerun a trainer deployment's crashed runs automatically."""
    from prefect_jax.deployments.automations import (
        CRASH_WINDOW_SECS,
        MAX_CRASHES,
        create_rerun_automation,
    )

    if args.no_brake and args.crash_window_secs is not None:
        raise ValueError(
            f"--no-brake with --crash-window-secs {args.crash_window_secs:g}: --no-brake makes no "
            "brake, so it has no window; drop one of them"
        )
    max_crashes = MAX_CRASHES if args.max_crashes is None else args.max_crashes
    max_crashes = None if args.no_brake else max_crashes
    window = CRASH_WINDOW_SECS if args.crash_window_secs is None else args.crash_window_secs
    automation_id = create_rerun_automation(args.deployment, args.name, max_crashes, window)
    print(
        json.dumps(
            {
                "automation_id": str(automation_id),
                "deployment": args.deployment,
                "brake": None
                if max_crashes is None
                else {"max_crashes": max_crashes, "within_secs": window},
            }
        )
    )
    return 0


def _absolute(path: str | None) -> str | None:
    """A local path absolute, as storage roots are (`storage.normalize_root`): the flow run's
    parameter, so a rerun from another directory, or the UI's Retry, reads the same step."""
    from prefect_jax.training.storage import normalize_root

    return normalize_root(path) if path else path
