"""Prefect flows: `train_and_evaluate` (TF's local mode), and the roles it splits into:
`train` (the trainer), `evaluate` (the continuous evaluator) and `export`.

Every parameter is JSON-able (a program import path, names, a URL and pydantic specs), so
the flow deploys as is: ``prefect deploy`` or ``train_and_evaluate.serve(...)``.

Example:
    ```python
    from prefect_jax.flows import train_and_evaluate
    from prefect_jax.training.specs import CheckpointSpec, EvalSpec, TrainSpec

    summary = train_and_evaluate(
        program="prefect_jax.examples.digits:program",
        job="digits",
        storage="/tmp/prefect-jax",
        train_spec=TrainSpec(max_steps=1000),
        checkpoint_spec=CheckpointSpec(every_steps=200),
        eval_spec=EvalSpec(),
    )
    print(summary["eval"])
    ```
"""

# No `from __future__ import annotations` here: `serve` sends the flow to its child process
# with cloudpickle, which copies only the globals the function's code uses; string
# annotations would leave TrainSpec & co. unresolvable there and every served run would fail
# parameter validation (tests/test_deployment_rerun.py).
import enum
import functools
import itertools
import inspect
from typing import Any

from prefect import Flow, flow, get_run_logger
from prefect.artifacts import create_progress_artifact, update_progress_artifact
from prefect.futures import PrefectFuture
from prefect.states import State
from pydantic import BaseModel

from prefect_jax.tasks import (
    evaluate_if_new, export, process_tag, publisher, restore_or_init, train_until_checkpoint, ui_refresh_secs,
)
from prefect_jax.training.preemption import deliver_lost_notices
from prefect_jax.training.specs import CheckpointSpec, EvalSpec, JobConfig, TrainSpec


class _NotPlainJSON(Exception):
    pass


def _plain_json(value: Any) -> Any:
    """`value` as FastAPI's `jsonable_encoder` (Prefect's `Flow.serialize_parameters`) makes it, for
    the values these flows take: strings, numbers, booleans, None, enums, pydantic models (the specs)
    and lists and dicts of them. Anything else raises `_NotPlainJSON`: Prefect's path takes it (a
    future or a state, which it records as a placeholder; a value that does not serialize)."""
    if isinstance(value, (PrefectFuture, State)):
        raise _NotPlainJSON
    if isinstance(value, BaseModel):
        return _plain_json(value.model_dump(mode="json", by_alias=True))
    if isinstance(value, enum.Enum):
        return value.value
    if value is None or isinstance(value, (str, int, float)):
        return value
    if isinstance(value, dict) and all(type(k) is str for k in value):  # jsonable_encoder encodes other keys
        # jsonable_encoder drops keys that start with "_sa" (SQLAlchemy's state): so does this.
        return {k: _plain_json(v) for k, v in value.items() if not k.startswith("_sa")}
    if isinstance(value, (list, tuple)):
        return [_plain_json(v) for v in value]
    raise _NotPlainJSON


class _Flow(Flow):
    """Prefect's `Flow`, but a new flow run's parameters are serialized without importing FastAPI.

    Prefect's `serialize_parameters` calls FastAPI's `jsonable_encoder`, and the first call imports
    FastAPI's whole application stack (0.07-0.2 s on these two cores) on the way to every flow run of a
    fresh process: a run, a rerun after preemption. These flows' parameters are strings, numbers
    and pydantic specs, which `_plain_json` encodes exactly as `jsonable_encoder` does (checked in
    tests/test_flows_parameters.py against it); any other value still goes through Prefect's."""

    def serialize_parameters(self, parameters: dict[str, Any]) -> dict[str, Any]:
        if self.ismethod or self.isclassmethod:  # Prefect's skips the bound object: leave those to it
            return super().serialize_parameters(parameters)
        plain, rest = {}, {}
        for key, value in parameters.items():
            try:
                plain[key] = _plain_json(value)
            except (_NotPlainJSON, TypeError, ValueError, RecursionError):  # pydantic's errors are ValueErrors
                rest[key] = value
        serialized = super().serialize_parameters(rest) if rest else {}
        return {k: plain[k] if k in plain else serialized[k] for k in parameters if k in plain or k in serialized}

    def with_options(self, *args: Any, **kwargs: Any) -> "_Flow":
        new = super().with_options(*args, **kwargs)
        new.__class__ = _Flow
        return new

    @property
    def parameters(self):
        """The flow's parameter schema (Prefect's `ParameterSchema`), built at its first read
        where the flow was declared without it (`_parameter_schemas_on_demand`)."""
        try:
            return self.__dict__["parameters"]
        except KeyError:
            from prefect.utilities.callables import parameter_schema

            schema = self.__dict__["parameters"] = parameter_schema(self.fn)
            return schema

    @parameters.setter
    def parameters(self, value) -> None:
        self.__dict__["parameters"] = value


_DECLARING_FLOWS = "_prefect_jax_declaring_flows"  # a module global: True while the module declares its flows


def _parameter_schemas_on_demand() -> bool:
    """These flows' parameter schemas are built when first read, not as the module is imported.

    Prefect's `Flow.__init__` builds a JSON schema of the function's parameters (pydantic's JSON
    schema of the specs) and stores it as `Flow.parameters`, which nothing on the way to a flow
    run reads: `prefect deploy`, `serve` and `to_deployment` build the schema again from the
    flow (`prefect.utilities.callables.parameter_schema(flow)`). Every process that runs one of
    these flows imports all four (the command, each rerun after a preemption, a worker's flow
    run), so it paid for four schemas to use none: ~60 ms of the flows' import after the
    program's on these two CPUs (0.55 s against 0.61 s, 6 alternated runs).

    Prefect's `parameter_schema`, as `prefect.flows` calls it, now returns None for a function
    declared while its module's `_DECLARING_FLOWS` global is set (this module sets it around its
    four ``@flow``s, each of which `_json_parameters` then makes a `_Flow` without a schema);
    `_Flow` builds Prefect's own at its first read of `parameters`. Any other flow, and any
    `Flow` made later over these functions (`with_options`, Prefect's infrastructure-bound
    copies), gets Prefect's schema at once, as before. A signature Prefect cannot describe
    would now fail at its first read (a deployment's creation), not at import. The wrapper is
    installed once per process; each execution of this module (Prefect loads a file entrypoint
    as a module of its own) declares with its own flag. Returns whether it applied: not where
    `prefect.flows` has no `parameter_schema` (tests/test_flows_parameters.py also fails if
    `Flow.__init__` stops calling it)."""
    from prefect import flows as prefect_flows

    original = getattr(prefect_flows, "parameter_schema", None)
    if original is None or getattr(original, "_prefect_jax", False):
        return original is not None

    @functools.wraps(original)
    def parameter_schema(fn):
        if (getattr(fn, "__globals__", None) or {}).get(_DECLARING_FLOWS) is True:
            return None  # (removed at once by `_json_parameters`)
        return original(fn)

    parameter_schema._prefect_jax = True
    prefect_flows.parameter_schema = parameter_schema
    return True


def _flow_runs_end_without_heartbeat_join() -> bool:
    """A flow run of these flows ends without waiting for its heartbeat thread to wake.

    Prefect's sync flow engine (`prefect/flow_engine.py` `_send_heartbeats`, Prefect 3.8 and 3.9)
    runs a heartbeat thread that sleeps in whole seconds and, as the run ends, joins it: every
    run's end waits for the rest of that second (0-1 s, 0.5 s on average; a third of the flow's
    extra loop time over the plain loop in BENCHMARKS.md, seen as flow wall times that end at
    the same fraction of a second). Its async engine passes ``join_on_exit=False``: the thread,
    a daemon, sees the stop at its next tick and returns without emitting. The same for these
    flows (the `_Flow` class); any other flow keeps Prefect's behaviour. Heartbeats themselves
    are unchanged. Returns whether it applied: it does not where Prefect's function is gone or
    takes no ``join_on_exit`` (tests/test_flow.py fails on the pinned Prefect if so)."""
    import contextlib

    from prefect import flow_engine

    original = getattr(flow_engine, "_send_heartbeats", None)
    if original is None or getattr(original, "_prefect_jax", False):
        return original is not None
    try:
        if "join_on_exit" not in inspect.signature(original).parameters:
            return False
    except (TypeError, ValueError):
        return False

    @contextlib.contextmanager
    def _send_heartbeats(engine, join_on_exit: bool = True):
        if isinstance(getattr(engine, "flow", None), _Flow):
            join_on_exit = False
        with original(engine, join_on_exit=join_on_exit):
            yield

    _send_heartbeats._prefect_jax = True
    _send_heartbeats.__wrapped__ = original
    flow_engine._send_heartbeats = _send_heartbeats
    return True


HEARTBEAT_JOIN_SKIPPED = _flow_runs_end_without_heartbeat_join()
SCHEMAS_ON_DEMAND = _parameter_schemas_on_demand()


def _json_parameters(f: Flow) -> _Flow:
    """Make a `@flow` a `_Flow` (placed above ``@flow``, which ``prefect deploy`` reads from the source),
    its parameter schema built at its first read where it was declared without one."""
    f.__class__ = _Flow
    if f.__dict__.get("parameters", False) is None:
        del f.__dict__["parameters"]
    return f


_OWN_TAGS = ("prefect-jax",)
_RUN_TAG_PREFIXES = ("process:", "mlflow-run:")  # name one flow run: its process, its MLflow run
_OWN_TAG_PREFIXES = ("job:", *_RUN_TAG_PREFIXES)


def _task_tags():
    """The tags context for this flow's task runs: the caller's, less the ones prefect-jax puts on
    its flow runs (``prefect-jax``, ``job:``, ``process:``, ``mlflow-run:``), which name the flow run.

    Prefect gives every task run the tags in context, and a task run with tags asks the server's
    concurrency service for slots on each of them (`prefect/task_engine.py`): a round trip through
    Prefect's event-loop thread per task run, which stalled ~2 s now and then on two CPUs. A tag a
    person set (a tag-based concurrency limit on the GPU tasks, say) stays and is honoured."""
    from prefect.context import TagsContext

    current = TagsContext.get().current_tags
    keep = {t for t in current if t not in _OWN_TAGS and not t.startswith(_OWN_TAG_PREFIXES)}
    return TagsContext(current_tags=keep)


def _registers_exports(flow: str, eval_spec) -> bool:
    """Whether flow function `flow` registers exports in the MLflow registry with `eval_spec` (an
    `EvalSpec`, its dict as a deployment passes it, or None): the flows that evaluate or export,
    with exporters and a registered model (`EvalSpec.registered_model` "" is none)."""
    if flow not in ("train_and_evaluate", "evaluate", "export_flow") or eval_spec is None:
        return False
    try:
        return EvalSpec.model_validate(eval_spec).registers_exports
    except Exception:  # noqa: BLE001 - not an eval spec: the flow's own validation says why
        return False


def _untagged_tasks(fn):
    """Run a flow's body with `_task_tags` (its signature kept, for Prefect's parameters)."""

    @functools.wraps(fn)
    def body(*args, **kwargs):
        from prefect_jax.training.tracking import warm_up

        deliver_lost_notices()  # (again: someone may have replaced the hook since the import)
        # A deployment's flow run too: MLflow imports in its worker while the program imports here
        # (and, where the flow registers exports, what logging a model needs).
        arguments = inspect.signature(fn).bind_partial(*args, **kwargs).arguments
        warm_up(arguments.get("mlflow_tracking_uri"), registry=_registers_exports(fn.__name__, arguments.get("eval_spec")))
        with _task_tags():
            return fn(*args, **kwargs)

    return body


def _config_from(parameters: dict[str, Any]) -> JobConfig | None:
    try:
        return _job_config(**{k: parameters[k] for k in _CONFIG_ARGS if k in parameters}, check_settings=False)
    except Exception:  # noqa: BLE001 - a hook must not raise over bad parameters
        return None


def _close_mlflow_run(status: str):
    def hook(flow, flow_run, state):
        import sys

        # Prefect may run this hook in a worker or `serve` process that never trained: do not
        # import jax, Orbax and MLflow there just to find nothing (it delays the rerun).
        live = sys.modules.get("prefect_jax.training.live")
        if live is None:
            return

        ended = status
        preemption = sys.modules.get("prefect_jax.training.preemption")
        if status == "FAILED" and preemption is not None and preemption.received_signal():
            # A SIGTERM that landed while Prefect was creating a task run makes Prefect's crash
            # handling fail ("Task run is not set"): the run was terminated, not failed.
            ended = "KILLED"
            _report_terminated(flow_run.id, state)
        config = _config_from(flow_run.parameters)
        if config is not None:
            # Let a checkpoint in flight commit (no step lost), close the MLflow run, free the lease.
            live.finish_live(config, ended)
            if ended == "KILLED":
                signum = preemption.received_signal() if preemption is not None else None
                _publish_preempted_goodput(config, live.live_trainer(config), flow_run.id, signum)

    return hook


def _hook_logger(flow_run_id):
    """The flow run's logger (its logs in the UI) where a state hook runs: outside the run's context."""
    from prefect.logging.loggers import flow_run_logger

    return flow_run_logger(flow_run_id=flow_run_id)


PREEMPTED_ARTIFACT_SECS = 10.0  # the longest a SIGTERMed run's exit waits to publish its goodput


def _publish_preempted_goodput(config: JobConfig, trainer, flow_run_id, signum: int | None) -> None:
    """A run this process trained and a SIGTERM (or Ctrl-C, or a crash) stopped: its flow run
    gets the job's goodput so far, as a finished run does, so that the Crashed run in the UI says
    what the preemptions cost (the trainer wrote its attempt's end to the ledger before handing
    the signal on). Within `PREEMPTED_ARTIFACT_SECS`: the exit of a preempted machine must not
    wait on an API that does not answer (the checkpoint, the lease and MLflow are done by now)."""
    attempt = trainer.job.goodput.attempt if trainer is not None and trainer.job.is_primary else None
    if not attempt or attempt.get("ended") != "preempted":
        return
    import contextvars
    import signal

    from prefect_jax.training.trainer import _within  # (imported: this process trained)

    how = f"stopped by {signal.Signals(signum).name} after step {attempt['step']}" if signum else \
        f"interrupted (its newest checkpoint is step {attempt['step']})"  # fmt: skip
    lead = f"This run was {how}: a rerun resumes from its newest committed step. So far: "
    publish = functools.partial(_publish_goodput, config, trainer.goodput(), lead, flow_run_id)
    if not _within(functools.partial(contextvars.copy_context().run, publish), PREEMPTED_ARTIFACT_SECS):
        _hook_logger(flow_run_id).warning("the goodput artifact was not published within %.0fs: gave up", PREEMPTED_ARTIFACT_SECS)


def _report_terminated(flow_run_id, state) -> None:
    """Mark the flow run Crashed, as Prefect does a run its SIGTERM ends (and as automations that
    rerun crashed runs expect)."""
    from prefect.client.orchestration import get_client
    from prefect.states import Crashed

    message = f"Execution was aborted by a termination signal (SIGTERM); Prefect reported: {state.message}"
    try:
        with get_client(sync_client=True) as client:
            client.set_flow_run_state(flow_run_id, Crashed(message=message), force=True)
    except Exception as exc:  # noqa: BLE001 - the run stays Failed; nothing is lost
        _hook_logger(flow_run_id).warning("could not mark the terminated run Crashed: %r", exc)


_CONFIG_ARGS = (
    "program",
    "job",
    "storage",
    "train_spec",
    "eval_spec",
    "checkpoint_spec",
    "mlflow_tracking_uri",
    "mlflow_experiment",
    "compilation_cache_dir",
)


def _job_config(
    program: str,
    job: str,
    storage: str,
    train_spec: TrainSpec | dict,
    eval_spec: EvalSpec | dict | None = None,
    checkpoint_spec: CheckpointSpec | dict | None = None,
    mlflow_tracking_uri: str | None = None,
    mlflow_experiment: str = "prefect-jax",
    compilation_cache_dir: str | None = None,
    check_settings: bool = True,
) -> JobConfig:
    from prefect_jax.blocks import resolve_storage

    if check_settings:  # (not in a state hook: it must find the job to close its MLflow run)
        ui_refresh_secs()  # a bad PREFECT_JAX_UI_REFRESH_SECS fails here, before anything runs
    url, options = resolve_storage(storage)
    return JobConfig(
        program=program,
        job=job,
        storage=url,
        storage_options=options,
        train=train_spec,
        eval=eval_spec or EvalSpec(),
        checkpoint=checkpoint_spec or CheckpointSpec(),
        mlflow_tracking_uri=mlflow_tracking_uri,
        mlflow_experiment=mlflow_experiment,
        compilation_cache_dir=compilation_cache_dir,
    )


def _progress(step: int, max_steps: int, job: str) -> dict[str, Any]:
    return {"progress": 100.0 * min(step, max_steps) / max_steps, "description": f"training {job}: step {step} of {max_steps}"}


def _progress_artifact(step: int, max_steps: int, job: str):
    """The flow run's progress artifact: a rerun of the same flow run (the UI's Retry) updates the
    one its earlier attempt made instead of adding a second; else a new one."""
    from prefect.runtime import flow_run

    if flow_run.id and flow_run.run_count > 1:
        try:
            from prefect.client.orchestration import get_client
            from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterType

            with get_client(sync_client=True) as client:
                earlier = client.read_artifacts(artifact_filter=ArtifactFilter(
                    flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run.id]), type=ArtifactFilterType(any_=["progress"]),
                ), limit=1)  # fmt: skip
            if earlier:
                return update_progress_artifact(earlier[0].id, **_progress(step, max_steps, job))
        except Exception as exc:  # noqa: BLE001 - a second artifact is better than no training
            get_run_logger().warning("could not find this flow run's progress artifact: %r", exc)
    return create_progress_artifact(**_progress(step, max_steps, job))


def _start_progress(progress: dict[str, Any], step: int, max_steps: int, job: str) -> None:
    progress["id"] = _progress_artifact(step, max_steps, job)


_progress_keys = itertools.count()


def _update_progress(progress: dict[str, Any], step: int, max_steps: int, job: str) -> None:
    if progress.get("id") is not None:  # else its creation failed, and was logged
        update_progress_artifact(progress["id"], **_progress(step, max_steps, job))


def _evaluate_and_export(config: JobConfig, step: int) -> None:
    result = evaluate_if_new(config, step)
    if config.eval.exporters:  # no task run per interval for exporters that are not there
        export(config, result)


def _train_loop(config: JobConfig, step: int, evaluate: bool) -> tuple[int, str | None]:
    """Train (and, in local mode, evaluate and export) until max_steps or a stop request."""
    from prefect_jax.training.live import get_trainer

    max_steps = config.train.max_steps
    trainer = get_trainer(config)
    # The live trainer's view of a stop request: with several processes, process 0's, in all of them.
    stop_requested = trainer.stop_requested
    # With several processes, process 0 evaluates and exports: no task runs elsewhere that only say so.
    evaluate = evaluate and trainer.job.is_primary
    # Made and updated on the publisher's thread, in order: no HTTP round trip before training;
    # updated at most every PREFECT_JAX_UI_REFRESH_SECS, and at the end.
    progress: dict[str, Any] = {}
    key = ("progress", next(_progress_keys))
    publisher.submit(_start_progress, progress, step, max_steps, config.job)
    if evaluate and step > 0:
        # A crash between a checkpoint and its evaluation leaves that step unevaluated.
        _evaluate_and_export(config, step)
    try:
        while step < max_steps:
            stop = stop_requested()
            if stop is not None:
                return step, stop.get("reason")
            step = train_until_checkpoint(config, step)
            publisher.refresh(key, _update_progress, progress, step, max_steps, config.job)
            if evaluate:
                _evaluate_and_export(config, step)
        stop = stop_requested()
        return step, stop.get("reason") if stop else None
    finally:
        publisher.flush()


def _join_processes() -> None:
    """Several JAX processes train this job (`prefect_jax.training.cluster`, from the environment):
    join them, and, in process 0, tell the others this flow run, whose children they run
    (`run_as_process`). One process: nothing (JAX is not even imported)."""
    from prefect.runtime import flow_run

    from prefect_jax.training import cluster

    if cluster.initialize() is not None and cluster.process_index() == 0:
        cluster.publish("flow_run", str(flow_run.id))


_TRAINING_FLOWS = ("train_and_evaluate", "train")


def run_as_process(parent_flow_run_id: str | None = None, flow=None, parameters: dict[str, Any] | None = None) -> Any:
    """Process k > 0 of a job trained by several JAX processes: run this process's part of
    process 0's flow run, as a child flow run of it (``<parent name>-process-<k>``, shown under
    the parent in the UI, through a ``process <k>`` task run there).

    Every process runs the same flow body, so they make the same collective calls in the same
    order; where a decision could differ (a stop request, a preemption notice, a checkpoint due
    by time) process 0's or the union is used. Process 0 alone evaluates, exports, holds the
    lease and writes MLflow.

    Args:
        parent_flow_run_id: process 0's flow run (default: the one process 0 published, or
            ``PREFECT__FLOW_RUN_ID``, which a Kubernetes indexed job gives every pod).
        flow: the flow (default: the parent's, `train_and_evaluate` or `train`).
        parameters: its parameters (default: the parent's).

    Returns:
        The child flow run's result (the flow's summary).
    """
    import os
    from uuid import UUID

    from prefect import Task
    from prefect.client.orchestration import get_client
    from prefect.flow_engine import run_flow
    from prefect.states import Completed, Crashed, Failed, Running

    from prefect_jax.training import cluster

    if cluster.initialize() is None or cluster.process_index() == 0:
        raise ValueError(
            "run_as_process is for the JAX processes other than process 0 of a job: set PREFECT_JAX_NUM_PROCESSES, "
            "PREFECT_JAX_PROCESS_ID (1 or more) and PREFECT_JAX_COORDINATOR_ADDRESS, or run it in pod 1+ of an indexed job"
        )
    index = cluster.process_index()
    parent_id = parent_flow_run_id or os.environ.get("PREFECT__FLOW_RUN_ID") or cluster.lookup("flow_run")
    with get_client(sync_client=True) as client:
        parent = client.read_flow_run(UUID(str(parent_id)))
        if flow is None:
            name = client.read_flow(parent.flow_id).name
            if name not in _TRAINING_FLOWS:
                raise ValueError(f"flow run {parent_id} runs flow {name!r}: only {_TRAINING_FLOWS} train in several processes")
            flow = globals()[name]
        parameters = dict(parent.parameters) if parameters is None else parameters
        link = Task(name=f"process {index}", fn=lambda: None)
        link.task_key = f"prefect_jax.flows.run_as_process.{index}"
        link_run = client.create_task_run(
            task=link, flow_run_id=parent.id, dynamic_key=f"{index}-{parent.run_count}", name=f"process {index}", state=Running()
        )
        # The job's tags; not the parent's process and MLflow-run tags, which name process 0 and its run.
        tags = [t for t in parent.tags if t not in _OWN_TAGS and not t.startswith(_RUN_TAG_PREFIXES)]
        child = client.create_flow_run(
            flow, name=f"{parent.name}-process-{index}", parameters=parameters, parent_task_run_id=link_run.id,
            tags=[*tags, "prefect-jax", process_tag(), f"jax-process:{index}"],
        )  # fmt: skip
    # The flow's own flow_run_name template would rename the child as its parent on start.
    try:
        state = run_flow(flow.with_options(flow_run_name=child.name), flow_run=child, parameters=parameters, return_type="state")
    except BaseException as exc:  # a SIGTERM (TerminationSignal) or an interrupt: Prefect re-raises those
        _end_link(link_run.id, Crashed(message=f"process {index}: {type(exc).__name__}: {exc}"))
        raise
    _end_link(link_run.id, Completed() if state.is_completed() else Failed(message=f"process {index}: {state.message}"))
    return state.result()


def _end_link(task_run_id, state) -> None:
    from prefect.client.orchestration import get_client

    try:
        with get_client(sync_client=True) as client:
            client.set_task_run_state(task_run_id, state, force=True)
    except Exception as exc:  # noqa: BLE001 - the child's own state says what happened
        import logging

        logging.getLogger("prefect_jax.flows").warning("could not end the process task run: %r", exc)


def _summary(config: JobConfig, stopped: str | None) -> dict[str, Any]:
    from prefect_jax.training.exporters import list_exports
    from prefect_jax.training.live import get_trainer

    trainer = get_trainer(config)
    if trainer.state is None:
        trainer.restore_or_init()
    trainer.finish("FINISHED")
    publisher.flush()  # the MLflow link, queued once MLflow answered (finish waited for that)
    final = trainer.records.get(trainer.step)
    goodput = trainer.goodput()
    if trainer.job.is_primary:  # the others keep no ledger
        _publish_goodput(config, goodput)
    return {
        "job": config.job,
        "final_step": trainer.step,
        "eval": final.metrics if final else {},
        "checkpoint_dir": trainer.checkpoints.directory,
        "mlflow_tracking_uri": trainer.tracker.tracking_uri,
        "mlflow_run_id": trainer.tracker.run_id,
        "mlflow_run_url": trainer.tracker.run_url(),
        "registered_model": trainer.registered_model if config.eval.exporters else None,
        "exports": list_exports(trainer.storage),
        "state_fingerprint": trainer.fingerprint(),
        "stopped": stopped,
        "goodput": goodput,
    }


def _publish_goodput(config: JobConfig, goodput: dict[str, Any], lead: str = "", flow_run_id=None) -> None:
    """The job's goodput as a table artifact (key ``<job>-goodput``): what preemptions cost, by cause.

    Of the current flow run, or of `flow_run_id` (a state hook runs outside the run's context)."""
    if not goodput:
        return
    from prefect.artifacts import TableArtifact

    from prefect_jax.tasks import artifact_key
    from prefect_jax.training.goodput import as_rows

    description = lead + (
        f"**Goodput of job `{config.job}`: {goodput['goodput']:.1%}** of {goodput['wall_s']:.1f} s of wall time went into "
        f"training steps that were kept, over {goodput['attempts']} attempt(s), {goodput['interrupted']} of them interrupted. "
        "The rows say where the rest went (`prefect-jax status` shows the same; MLflow has it as `goodput/*`)."
    )
    try:
        artifact = TableArtifact(key=artifact_key(config.job, "goodput"), table=as_rows(goodput), description=description)
        if flow_run_id is None:
            artifact.create(_sync=True)
        else:  # outside a run context, where Prefect deprecates `Artifact.create`: its client call, as create makes it
            from prefect.client.orchestration import get_client
            from prefect.client.schemas.actions import ArtifactCreate

            with get_client(sync_client=True) as client:
                client.create_artifact(ArtifactCreate(type=artifact.type, key=artifact.key, description=description,
                                                      flow_run_id=flow_run_id, data=artifact.format(_sync=True)))  # fmt: skip
    except Exception as exc:  # noqa: BLE001 - an artifact must not fail a finished (or preempted) job
        (_hook_logger(flow_run_id) if flow_run_id else get_run_logger()).warning("could not publish the goodput artifact: %r", exc)


# The four flows below are declared without their parameter schemas: `_parameter_schemas_on_demand`.
_prefect_jax_declaring_flows = True


@_json_parameters
@flow(
    name="train_and_evaluate",
    flow_run_name="train-and-evaluate-{job}",
    on_failure=[_close_mlflow_run("FAILED")],
    on_crashed=[_close_mlflow_run("KILLED")],
    validate_parameters=True,
)
@_untagged_tasks
def train_and_evaluate(
    program: str,
    job: str,
    storage: str,
    train_spec: TrainSpec,
    eval_spec: EvalSpec = EvalSpec(),
    checkpoint_spec: CheckpointSpec = CheckpointSpec(),
    mlflow_tracking_uri: str | None = None,
    mlflow_experiment: str = "prefect-jax",
    checkpoint_path: str | None = None,
    compilation_cache_dir: str | None = None,
) -> dict[str, Any]:
    """Train until `train_spec.max_steps`, evaluating and exporting every new checkpoint.

    TensorFlow's `train_and_evaluate` in local mode, as Prefect tasks: restore-or-init,
    then train-until-checkpoint / evaluate-if-new / export until `max_steps` (or until an
    eval hook such as early stopping asks to stop). Running it again on the same job resumes
    at the last committed checkpoint: no step is retrained, no step evaluated twice, and the
    same MLflow run is continued.

    Args:
        program: import path of the program, ``"package.module:attribute"``.
        job: job name; files live under ``<storage>/<job>/``.
        storage: storage root: a local directory or any fsspec URL (``s3://``, ``gs://``...), or
            ``"jax-checkpoint-storage/<block name>"`` for a saved `CheckpointStorage` block.
        train_spec: how long to train.
        eval_spec: how to evaluate, the exporters, early stopping.
        checkpoint_spec: checkpoint cadence and retention.
        mlflow_tracking_uri: MLflow tracking URI (default: ``MLFLOW_TRACKING_URI`` or
            ``sqlite:///mlflow.db``).
        mlflow_experiment: MLflow experiment name.
        checkpoint_path: warm-start a new job from this checkpoint step directory (ignored
            once the job has checkpoints of its own).
        compilation_cache_dir: JAX persistent compilation cache directory, or ``"job"`` for
            one under the job's storage: a resumed run does not recompile.

    Returns:
        A summary: ``job``, ``final_step``, ``eval`` (final metrics), ``checkpoint_dir``,
        ``mlflow_tracking_uri``, ``mlflow_run_id``, ``exports``, ``state_fingerprint``,
        ``stopped`` (why the job stopped early, or None).
    """
    config = _job_config(
        program, job, storage, train_spec, eval_spec, checkpoint_spec, mlflow_tracking_uri, mlflow_experiment,
        compilation_cache_dir,
    )  # fmt: skip
    _join_processes()
    step = restore_or_init(config, checkpoint_path=checkpoint_path)["step"]
    step, stopped = _train_loop(config, step, evaluate=True)
    summary = _summary(config, stopped)
    get_run_logger().info("job %s done at step %d: %s%s", job, summary["final_step"], summary["eval"],
                          f" (stopped: {stopped})" if stopped else "")  # fmt: skip
    return summary


@_json_parameters
@flow(
    name="train",
    flow_run_name="train-{job}",
    on_failure=[_close_mlflow_run("FAILED")],
    on_crashed=[_close_mlflow_run("KILLED")],
    validate_parameters=True,
)
@_untagged_tasks
def train(
    program: str,
    job: str,
    storage: str,
    train_spec: TrainSpec,
    eval_spec: EvalSpec = EvalSpec(),
    checkpoint_spec: CheckpointSpec = CheckpointSpec(),
    mlflow_tracking_uri: str | None = None,
    mlflow_experiment: str = "prefect-jax",
    checkpoint_path: str | None = None,
    compilation_cache_dir: str | None = None,
) -> dict[str, Any]:
    """The trainer role: train and checkpoint until `max_steps`; evaluation is someone else's.

    Emits ``prefect-jax.checkpoint.committed`` (resource ``prefect-jax.job.<job>.<hash>`` of storage +
    job, see `prefect_jax.deployments.job_resource_id`; the step in the payload) for each committed
    checkpoint (not for backups, which nobody evaluates: `CheckpointSpec.backups`), so an
    evaluator deployment can be triggered by events instead of polling. Stops
    early when the job is asked to stop (``<job>/stop.json``, written by the evaluator's
    early-stopping hook). Parameters as `train_and_evaluate`
    (`eval_spec` is recorded in MLflow params and used by nobody else here).
    """
    if (checkpoint_spec := CheckpointSpec.model_validate(checkpoint_spec)).keep_until_evaluated is None:
        # The evaluator runs elsewhere: retention keeps the steps it has not reached yet.
        checkpoint_spec = checkpoint_spec.model_copy(update={"keep_until_evaluated": True})
    config = _job_config(
        program, job, storage, train_spec, eval_spec, checkpoint_spec, mlflow_tracking_uri, mlflow_experiment,
        compilation_cache_dir,
    )  # fmt: skip
    _join_processes()
    step = restore_or_init(config, checkpoint_path=checkpoint_path)["step"]
    step, stopped = _train_loop(config, step, evaluate=False)
    summary = _summary(config, stopped)
    get_run_logger().info("trainer of %s done at step %d%s", job, summary["final_step"], f" (stopped: {stopped})" if stopped else "")
    return summary


def _trainer_alive(js) -> bool:
    """Whether a trainer holds the job's lease with a fresh heartbeat (it is still going)."""
    import socket
    import time

    from prefect_jax.training.lease import Lease, process_alive

    try:
        current = Lease(js).read()
    except Exception:  # noqa: BLE001 - unreadable: as if no trainer, the idle timeout decides
        return False
    if not current:
        return False
    pid = str(current.get("pid", ""))
    if current.get("host") == socket.gethostname() and pid.isdigit() and not process_alive(int(pid)):
        return False  # a trainer on this host that was killed: its lease is stale
    return time.time() - float(current.get("heartbeat", 0)) <= float(current.get("timeout_secs", 120.0))


@_json_parameters
@flow(name="evaluate", flow_run_name="evaluate-{job}", validate_parameters=True)
@_untagged_tasks
def evaluate(
    program: str,
    job: str,
    storage: str,
    train_spec: TrainSpec,
    eval_spec: EvalSpec = EvalSpec(),
    checkpoint_spec: CheckpointSpec = CheckpointSpec(),
    mlflow_tracking_uri: str | None = None,
    mlflow_experiment: str = "prefect-jax",
    compilation_cache_dir: str | None = None,
    every_checkpoint: bool = True,
    once: bool = False,
    wait_for_first_checkpoint_secs: float = 3600.0,
    poll_secs: float = 10.0,
    idle_timeout_secs: float | None = None,
) -> dict[str, Any]:
    """The continuous evaluator role (TF's evaluator task), on the same job as a `train` run.

    Waits `eval_spec.start_delay_secs`; waits for the job's first committed checkpoint up to
    `wait_for_first_checkpoint_secs` (TF's `wait_for_session`) and then fails with a clear
    error; evaluates every newly committed step exactly once (or only the newest, with
    `every_checkpoint=False`), never sooner than `eval_spec.throttle_secs` after the last
    evaluation; runs the exporters after each evaluation; stops once it has evaluated a step
    at or past `max_steps` (with the final export), when an eval hook asks the job to stop,
    when `once` is set and nothing new is left, or after `idle_timeout_secs` without a new
    checkpoint while no trainer holds the job's lease (a live trainer is waited for: one
    event-triggered run keeps up with it, checking for new steps every `poll_secs`). Evaluated
    steps are recorded durably under ``<job>/evals/<name>/``, so a restarted evaluator never evaluates a step twice.

    Returns:
        ``job``, ``evaluated`` (steps evaluated by this run), ``last_step``, ``eval`` (its
        metrics), ``stopped`` (why), ``exports``.
    """
    import time

    from prefect_jax.training.checkpoints import wait_for_new_checkpoint
    from prefect_jax.training.remote import job_committed_steps, job_step_is_backup
    from prefect_jax.training.control import stop_requested
    from prefect_jax.training.evaluation import EvalRecords, EvalStatus
    from prefect_jax.training.exporters import list_exports
    from prefect_jax.training.storage import JobStorage

    logger = get_run_logger()
    config = _job_config(
        program, job, storage, train_spec, eval_spec, checkpoint_spec, mlflow_tracking_uri, mlflow_experiment,
        compilation_cache_dir,
    )  # fmt: skip
    max_steps = config.train.max_steps
    js = JobStorage(config.storage, config.job, config.storage_options)
    records = EvalRecords(js, config.eval.name)
    ckpt_dir = js.remote_checkpoint_url or js.checkpoint_dir
    if config.eval.start_delay_secs:
        logger.info("waiting start_delay_secs=%g before the first evaluation", config.eval.start_delay_secs)
        time.sleep(config.eval.start_delay_secs)
    first = wait_for_new_checkpoint(
        lambda: job_committed_steps(js), None, wait_for_first_checkpoint_secs, poll_secs, logger.info
    )
    if first is None:
        raise TimeoutError(
            f"no committed checkpoint of job {job!r} in {ckpt_dir} after {wait_for_first_checkpoint_secs:g}s: "
            "is the trainer running, and does it use the same storage and job name? "
            "Raise wait_for_first_checkpoint_secs for slow starts."
        )
    from prefect_jax.training.live import get_trainer, land_mlflow_writes

    # An evaluator killed after writing eval records may not have logged them to MLflow yet.
    checked = get_trainer(config).reconcile_eval_metrics(first)
    logger.info("checked %d recorded evaluations against MLflow", checked)
    if config.eval.exporters and records.steps():
        # ... nor written the exports of its newest evaluation (exporters keep what exists).
        export(config, records.get(records.steps()[-1]))
    evaluated: list[int] = []
    resume_only: set[int] = set()  # preemption checkpoints and backups: never evaluated
    regular: set[int] = set()  # steps known not to be backups
    last_eval_at: float | None = None
    last_new_at = time.monotonic()
    stopped: str | None = None
    last = None
    while stopped is None:
        done = set(records.steps())
        if any(s >= max_steps for s in done):
            stopped = f"evaluated the final step ({max(done)} >= max_steps={max_steps})"
            break
        request = stop_requested(js)
        if request is not None:
            stopped = f"the job was asked to stop: {request.get('reason')}"
            break
        pending = [s for s in job_committed_steps(js) if s not in done and s not in resume_only]
        for step in pending:  # backups are resume-only: no task run for them
            if step not in regular:
                (resume_only if job_step_is_backup(js, step) else regular).add(step)
        pending = [s for s in pending if s not in resume_only]
        if pending and not every_checkpoint:
            pending = pending[-1:]
        if not pending:
            if once:
                stopped = "nothing new to evaluate (once=True)"
                break
            if idle_timeout_secs is not None and time.monotonic() - last_new_at > idle_timeout_secs:
                if _trainer_alive(js):  # a trainer is still going (between checkpoints, restoring, compiling)
                    time.sleep(poll_secs)
                    continue
                stopped = f"no new checkpoint for {idle_timeout_secs:g}s (idle_timeout_secs)"
                break
            time.sleep(poll_secs)
            continue
        last_new_at = time.monotonic()
        for step in pending:
            if last_eval_at is not None and step < max_steps:
                wait = config.eval.throttle_secs - (time.monotonic() - last_eval_at)
                if wait > 0:
                    time.sleep(wait)
            result = evaluate_if_new(config, step, force=True)
            if result.status is EvalStatus.EVALUATED:
                last_eval_at = time.monotonic()
                evaluated.append(step)
                last = result
                if config.eval.exporters:
                    export(config, result)
                if result.stop_reason:
                    stopped = result.stop_reason
                    break
            elif result.status is EvalStatus.PREEMPTION_CHECKPOINT:
                resume_only.add(step)
            elif result.status is EvalStatus.MISSING_CHECKPOINT:
                logger.warning("step %d was deleted by retention before it could be evaluated", step)
            if not every_checkpoint:
                break
        last_new_at = time.monotonic()  # idle counts from the end of the work, however long it took
    land_mlflow_writes(config)
    publisher.flush()
    logger.info("evaluator of %s stops: %s", job, stopped)
    return {
        "job": job,
        "evaluated": evaluated,
        "last_step": last.step if last else None,
        "eval": last.metrics if last else {},
        "stopped": stopped,
        "exports": list_exports(js),
    }


@_json_parameters
@flow(name="export", flow_run_name="export-{job}", validate_parameters=True)
@_untagged_tasks
def export_flow(
    program: str,
    job: str,
    storage: str,
    train_spec: TrainSpec,
    eval_spec: EvalSpec = EvalSpec(),
    checkpoint_spec: CheckpointSpec = CheckpointSpec(),
    mlflow_tracking_uri: str | None = None,
    mlflow_experiment: str = "prefect-jax",
    step: int | None = None,
) -> dict[str, str]:
    """Run the eval spec's exporters on an evaluated step (default: the newest evaluated one).

    Exports already written are kept as they are. Returns ``{exporter: export dir}``.
    """
    from prefect_jax.training.evaluation import EvalRecords
    from prefect_jax.training.live import land_mlflow_writes
    from prefect_jax.training.storage import JobStorage

    config = _job_config(program, job, storage, train_spec, eval_spec, checkpoint_spec, mlflow_tracking_uri, mlflow_experiment)
    records = EvalRecords(JobStorage(config.storage, config.job, config.storage_options), config.eval.name)
    steps = records.steps()
    if step is None and not steps:
        raise ValueError(f"job {job!r} has no evaluated step yet (eval name {config.eval.name!r}): evaluate it first")
    chosen = steps[-1] if step is None else step
    result = records.get(chosen)
    if result is None:
        raise ValueError(f"step {chosen} of job {job!r} was not evaluated ({config.eval.name!r} has {steps}): evaluate it first")
    exported = export(config, result)
    land_mlflow_writes(config)  # the model versions too
    return exported


_prefect_jax_declaring_flows = False

__all__ = ["evaluate", "export_flow", "train", "train_and_evaluate"]
