"""Prefect tasks over the engine: restore_or_init, train_until_checkpoint, evaluate_if_new, export.

Each task passes small references (the JSON-able `JobConfig`, a step, an `EvalResult`),
never arrays. The live train state stays in this process between tasks of one flow run
(see `prefect_jax.training.live`); a retry or another process restores
from storage.

Example:
    ```python
    from prefect import flow
    from prefect_jax.tasks import restore_or_init, train_until_checkpoint, evaluate_if_new
    from prefect_jax.training.specs import JobConfig, TrainSpec

    @flow
    def my_loop(config: JobConfig):
        step = restore_or_init(config)["step"]
        while step < config.train.max_steps:
            step = train_until_checkpoint(config, step)
            evaluate_if_new(config, step)
    ```
"""

from __future__ import annotations

import atexit
import os
import contextvars
import logging
import math
import queue
import re
import threading
import time
from typing import Any, Callable

from prefect import get_run_logger, task
from prefect.artifacts import create_link_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE
from prefect.runtime import flow_run, task_run

from prefect_jax.training.specs import JobConfig
from prefect_jax.training.preemption import deliver_lost_notices
from prefect_jax.training.redaction import redact_url
from prefect_jax.training.storage import JobStorage

# A SIGTERM whose handler's exception Python drops is sent again. Here, at import: a worker's flow
# run (these flows', or a user's own of these tasks) loads its flow before Prefect's engine puts
# its SIGTERM bridge in place.
deliver_lost_notices()


def artifact_key(*parts: str) -> str:
    """Prefect artifact keys allow lowercase letters, digits and dashes only."""
    return re.sub(r"-+", "-", re.sub(r"[^a-z0-9-]", "-", "-".join(parts).lower())).strip("-")[:100]


UI_REFRESH_SECS = 2.0


def ui_refresh_secs() -> float:
    """The shortest time between two refreshes of one artifact that only shows the latest state
    (the progress bar, the results table): `PREFECT_JAX_UI_REFRESH_SECS`, default 2; 0 refreshes
    at every change. Raises ValueError, naming the value and the fix, on anything else (a word,
    a negative number, NaN, infinity)."""
    raw = os.environ.get("PREFECT_JAX_UI_REFRESH_SECS", str(UI_REFRESH_SECS))
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not (value >= 0 and math.isfinite(value)):  # (NaN too)
        raise ValueError(f"PREFECT_JAX_UI_REFRESH_SECS={raw!r} is not a finite number of seconds >= 0: "
                         "set it to e.g. 2, or 0 to refresh Prefect's artifacts at every change")
    return value


class _Publisher:
    """Prefect API calls that only refresh what people see (artifacts), made in order by one
    background thread, so a training loop never waits on an HTTP round trip for them.

    Each call runs in a copy of the caller's context, so an artifact is still linked to the
    flow and task run that asked for it. Failures are logged, never raised: the UI may lag,
    training does not stop. Flows `flush` before they return.

    `refresh` is for calls that a later call of the same key makes stale (a progress update, the
    results table with every row): one runs at most every `ui_refresh_secs()` per key (sooner
    only at `flush`); one that comes sooner is held, replaced by any later one of its key, and
    runs when the time is up or at `flush`. After a flush the next call of a key runs at once.
    With checkpoints seconds apart, the Prefect server records a fraction of the artifact
    versions and events it would otherwise (each costs it ~4-10 ms of CPU), and the UI, which
    polls, shows the same.
    """

    def __init__(self):
        self._queue: queue.Queue = queue.Queue()  # (key or None, call), in order of submission
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._held: dict[Any, tuple] = {}  # key -> its newest call that has had its turn, not run yet
        self._last_run: dict[Any, float] = {}  # key -> when its last call ran (monotonic)
        self._hurry = 0  # flushes under way: held calls run at once
        self._warned = False

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> None:
        self._put(None, (contextvars.copy_context(), fn, args, kwargs))

    def refresh(self, key: Any, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> None:
        """Like `submit`, for a call that only refreshes what the next call of `key` refreshes
        too (see the class). It never runs before a call submitted ahead of it."""
        self._put(key, (contextvars.copy_context(), fn, args, kwargs))

    def _put(self, key: Any, call: tuple | None) -> None:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._work, name="prefect-jax-publish", daemon=True)
                self._thread.start()
        self._queue.put((key, call))

    def _due_in(self, key: Any, now: float) -> float:
        """Seconds until `key`'s held call may run (<= 0: now)."""
        if self._hurry:
            return 0.0
        last = self._last_run.get(key)
        return -1.0 if last is None else last + self._refresh_secs() - now

    def _refresh_secs(self) -> float:
        try:
            return ui_refresh_secs()
        except ValueError as exc:  # (the flows check it before training; tasks in a user's flow get this)
            if not self._warned:
                self._warned = True
                logging.getLogger("prefect_jax.tasks").warning("%s; refreshing every %s s", exc, UI_REFRESH_SECS)
            return UI_REFRESH_SECS

    def _work(self) -> None:
        clients: dict[str, Any] = {}  # this thread's own Prefect clients, by API URL, open for its life
        while True:
            now = time.monotonic()
            wait = min((self._due_in(key, now) for key in self._held), default=None)
            try:
                key, call = self._queue.get(timeout=None if wait is None else min(max(wait, 0.0), threading.TIMEOUT_MAX))
            except queue.Empty:
                key, call, got = None, None, False
            else:
                got = True
            try:
                if call is not None and key is None:
                    self._run(clients, call)
                elif call is not None:
                    self._held[key] = call  # replaces an older one of its key
                self._run_held(clients)
            finally:
                if got:
                    self._queue.task_done()

    def _run_held(self, clients: dict[str, Any]) -> None:
        """Run every held call whose key's time is up (all of them during a flush)."""
        while True:
            now = time.monotonic()
            due = next((key for key in self._held if self._due_in(key, now) <= 0), None)
            if due is None:
                return
            self._last_run[due] = now
            try:
                self._run(clients, self._held[due])
            finally:
                del self._held[due]  # (after it ran: `flush` waits for held calls)

    @staticmethod
    def _run(clients: dict[str, Any], call: tuple) -> None:
        context, fn, args, kwargs = call
        try:
            context.run(_with_own_client, clients, fn, args, kwargs)
        except Exception as exc:  # noqa: BLE001 - the UI may lag; training goes on
            logging.getLogger("prefect_jax.tasks").warning("could not publish %s: %r", getattr(fn, "__name__", fn), exc)

    def flush(self, timeout: float = 60.0) -> bool:
        """Run every held call now and wait until every submitted call has run (at most
        `timeout` seconds); True if all did."""
        deadline = time.monotonic() + timeout
        with self._lock:
            self._hurry += 1
        try:
            if self._held:
                self._put(None, None)  # wakes the thread to run them
            while (self._queue.unfinished_tasks or self._held) and time.monotonic() < deadline:
                time.sleep(0.01)
            done = not (self._queue.unfinished_tasks or self._held)
            if done:
                self._last_run.clear()  # the next flow run's first refresh shows at once
            return done
        finally:
            with self._lock:
                self._hurry -= 1


def _with_own_client(clients: dict[str, Any], fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """Run `fn` (in a copy of its caller's context: the runs it is about) with the publisher's own
    Prefect client rather than the caller's: by the time it runs, the caller's may be closed (a sync
    task run in an async flow, or outside any flow, closes the client it opened when it ends)."""
    from prefect.context import AsyncClientContext, SyncClientContext
    from prefect.settings import PREFECT_API_URL

    no_client = SyncClientContext.__var__.set(None), AsyncClientContext.__var__.set(None)
    try:
        url = PREFECT_API_URL.value()
        if url not in clients:
            own = SyncClientContext()  # (made while no client is in the context: a new one)
            own.client.__enter__()
            clients[url] = own
        SyncClientContext.__var__.set(clients[url])
        return fn(*args, **kwargs)
    finally:
        SyncClientContext.__var__.reset(no_client[0])
        AsyncClientContext.__var__.reset(no_client[1])


publisher = _Publisher()
atexit.register(publisher.flush, 15.0)  # flows flush before returning; this covers tasks used in other flows


def _run_tags() -> dict[str, str]:
    run_id = flow_run.id
    if not run_id:
        return {}
    url = prefect_flow_run_url()
    return {"prefect.flow_run_id": str(run_id), **({"prefect.flow_run_url": url} if url else {})}


CHECKPOINT_EVENT = "prefect-jax.checkpoint.committed"
EVAL_EVENT = "prefect-jax.eval.completed"
EXPORT_EVENT = "prefect-jax.export.completed"


def job_resource(config: JobConfig) -> dict[str, str]:
    """The Prefect event resource of a job: ``prefect-jax.job.<job>.<hash of storage + job>``
    (`prefect_jax.deployments.job_resource_id`), with the job as its name and its storage as a label."""
    from prefect_jax.deployments import job_resource_id

    return {
        "prefect.resource.id": job_resource_id(config.job, config.storage),
        "prefect.resource.name": config.job,
        "prefect-jax.storage": redact_url(JobStorage(config.storage, config.job).root),
    }


def emit(event: str, config: JobConfig, payload: dict[str, Any]) -> None:
    """Emit a prefect-jax event about a job (best effort: an events outage never stops training)."""
    from prefect.events import emit_event

    try:
        # The step as a resource label too: the UI's event details show labels, the payload only under Raw.
        step = {"prefect-jax.step": str(payload["step"])} if payload.get("step") is not None else {}
        emit_event(event=event, resource={**job_resource(config), **step}, payload=payload)
    except Exception as exc:  # noqa: BLE001
        get_run_logger().warning("could not emit %s: %r", event, exc)


def _take_the_lease_before_jax(config: JobConfig):
    """Before this process starts JAX, in a flow run of one JAX process: take the job's lease
    (`lease.take_early`; the trainer made next adopts it) and return it, or None (no flow run, a
    trainer of the job is live here already, or the job has several JAX processes, whose process
    0 takes it once JAX has joined them). If another live process on this host trains the job for
    this same flow run (Prefect started the run twice), this waits for it to end first
    (`Lease.wait_for_duplicate`), without JAX: on a GPU that process holds the device's memory.
    Taken this early, the lease also makes a second start of this flow run that comes while this
    process is still starting up wait before its own JAX start, not after it."""
    import sys

    from prefect_jax.training.cluster import from_env, joined
    from prefect_jax.training.live import live_trainer
    from prefect_jax.training.storage import JobStorage

    run_id = _run_tags().get("prefect.flow_run_id")
    if not run_id or live_trainer(config) is not None:
        return None
    try:
        if from_env() is not None:
            return None
    except ValueError:  # a malformed cluster: the trainer's own start names the variable
        return None
    jax = sys.modules.get("jax")  # (asked without starting its backend, which would take a GPU's memory)
    if joined() is not None or (jax is not None and jax.distributed.is_initialized()):  # the caller joined processes itself
        return None
    from prefect_jax.training.lease import take_early

    storage = JobStorage(config.storage, config.job, config.storage_options)
    storage.check_writable()  # as the trainer does first: a refused write is named as such, not as the lease's
    return take_early(storage, run_id, config.train.lease_timeout_secs)


def _trainer_holding_the_lease(config: JobConfig):
    """The job's trainer for the restore task, its lease taken before JAX started (see
    `_take_the_lease_before_jax`); a lease so taken is given back if making the trainer fails."""
    lease = None
    try:
        lease = _take_the_lease_before_jax(config)
        return _trainer(config)
    except BaseException:
        from prefect_jax.training.lease import release_early
        from prefect_jax.training.storage import JobStorage

        try:  # (a lease in the registry that `lease` does not name yet: a signal came in between)
            job_dir = JobStorage(config.storage, config.job, config.storage_options).job_dir
        except Exception:  # noqa: BLE001 - the storage itself is what failed: nothing was taken
            job_dir = None
        release_early(job_dir, lease)
        raise


def _trainer(config: JobConfig):
    from prefect_jax.training.live import get_trainer

    trainer = get_trainer(config, run_tags=_run_tags())
    if not trainer.commit_listeners:
        from prefect.events import emit_event

        resource = job_resource(config)

        def announce(step: int) -> None:  # runs in a background thread once the step is committed
            emit_event(
                event=CHECKPOINT_EVENT,
                resource={**resource, "prefect-jax.step": str(step)},
                payload={"step": step, "checkpoint_dir": trainer.checkpoints.directory, "max_steps": config.train.max_steps},
            )

        trainer.commit_listeners.append(announce)
    return trainer


_marked_takeovers: set[str] = set()  # lease tokens of dead holders whose runs were marked (once per process)


def mark_taken_over(trainer) -> None:
    """After the trainer took over the lease of a dead holder (SIGKILLed, its machine lost), mark
    what it left Running in Prefect as Crashed (in the background; failures are warnings): its
    flow run (unless it is this one, retried) and that flow run's unfinished task runs, except
    this attempt's own. Also closes the dead flow run's progress artifact."""
    taken = trainer.lease.taken_over
    if not taken or not taken.get("flow_run_id") or taken.get("token") in _marked_takeovers:
        return
    _marked_takeovers.add(taken.get("token"))
    current = (str(flow_run.id) if flow_run.id else None, flow_run.run_count, task_run.id)
    publisher.submit(_mark_crashed, dict(taken), *current)


PROCESS_TAG = "process:"  # process:<host>:<pid> of a flow run the command runs in its own process


def process_tag() -> str:
    """The tag the command gives the flow runs it runs in this process."""
    import socket

    return f"{PROCESS_TAG}{socket.gethostname()}:{os.getpid()}"


def mark_dead_local_runs(config: JobConfig) -> None:
    """Mark Crashed the job's flow runs (and their unfinished task runs) still Running or Pending
    whose process, on this host, is gone: a command killed before it took the job's lease (at
    flow start, say) left nobody else to do it. Only runs that carry a `process_tag` are looked
    at, and only a process this host can prove dead counts. In the background."""
    if flow_run.id:
        publisher.submit(_mark_dead_local_runs, config.job, str(flow_run.id))


def _mark_dead_local_runs(job: str, current_flow_run: str) -> None:
    import socket

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterState, FlowRunFilterStateType, FlowRunFilterTags
    from prefect.client.schemas.objects import StateType
    from prefect.client.schemas.sorting import FlowRunSort

    from prefect_jax.training.lease import process_alive

    host = socket.gethostname()
    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(
                tags=FlowRunFilterTags(all_=[f"job:{job}"]),
                state=FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType.RUNNING, StateType.PENDING])),
            ),
            sort=FlowRunSort.EXPECTED_START_TIME_DESC,
            limit=50,
        )
    for run in runs:
        tag = next((t for t in run.tags if t.startswith(PROCESS_TAG)), None)
        if str(run.id) == current_flow_run or tag is None:
            continue
        run_host, _, pid = tag[len(PROCESS_TAG) :].rpartition(":")
        if run_host != host or not pid.isdigit() or process_alive(int(pid)):
            continue
        taken = {"flow_run_id": str(run.id), "host": run_host, "pid": int(pid), "reason": "its process is gone"}
        _mark_crashed(taken, current_flow_run, 0, None)


def _mark_crashed(taken: dict, current_flow_run: str | None, run_count: int, current_task_run: str | None) -> None:
    from uuid import UUID

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterType, FlowRunFilter, FlowRunFilterId, TaskRunFilter,
        TaskRunFilterState, TaskRunFilterStateType,
    )  # fmt: skip
    from prefect.client.schemas.objects import StateType
    from prefect.states import Crashed

    logger = get_run_logger()
    dead, same = UUID(str(taken["flow_run_id"])), str(taken["flow_run_id"]) == current_flow_run
    who = f"host {taken.get('host')}, pid {taken.get('pid')}"
    message = f"its trainer ({who}) was lost ({taken.get('reason')}): flow run {current_flow_run} took over the job"
    unfinished = [StateType.SCHEDULED, StateType.PENDING, StateType.RUNNING, StateType.PAUSED, StateType.CANCELLING]
    with get_client(sync_client=True) as client:
        if not same:
            previous = client.read_flow_run(dead)
            if previous.state is not None and previous.state.type in (StateType.PENDING, StateType.RUNNING, StateType.CANCELLING):
                client.set_flow_run_state(dead, Crashed(message=message), force=True)
                logger.warning("marked flow run %s (%s) Crashed: %s", previous.name, dead, message)
            for artifact in client.read_artifacts(artifact_filter=ArtifactFilter(
                flow_run_id=ArtifactFilterFlowRunId(any_=[dead]), type=ArtifactFilterType(any_=["progress"]),
            )):  # fmt: skip
                from prefect.artifacts import update_progress_artifact

                update_progress_artifact(artifact.id, float(artifact.data or 0), f"{artifact.description or ''} (killed: {message})")
        task_runs = client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[dead])),
            task_run_filter=TaskRunFilter(state=TaskRunFilterState(type=TaskRunFilterStateType(any_=unfinished))),
        )
        for run in task_runs:
            if str(run.id) == str(current_task_run) or (same and run.flow_run_run_count == run_count):
                continue  # this attempt's own
            if same and current_task_run is not None and _made_after(run.id, current_task_run):
                continue  # this attempt's next task run, made since (its attempt number is not set while it is Pending)
            client.set_task_run_state(run.id, Crashed(message=message), force=True)
            logger.warning("marked task run %r (%s, attempt %d of flow run %s) Crashed", run.name, run.id, run.flow_run_run_count, dead)


def _made_after(run_id, other_id) -> bool:
    """Whether task run `run_id` was made after `other_id`: Prefect's client makes task run ids as
    UUIDv7 (time first), in the process that runs the tasks."""
    from uuid import UUID

    a, b = UUID(str(run_id)), UUID(str(other_id))
    return a.version == 7 and b.version == 7 and a.int > b.int


def prefect_flow_run_url() -> str | None:
    """This flow run in the Prefect UI. A command that ran its own embedded server names the UI of
    ``prefect server start`` (``PREFECT_JAX_PREFECT_UI_URL``), where its runs are found afterwards."""
    run_id = flow_run.id
    if not run_id:
        return None
    from prefect.settings import PREFECT_UI_URL

    base = os.environ.get("PREFECT_JAX_PREFECT_UI_URL") or PREFECT_UI_URL.value()
    return f"{base.rstrip('/')}/runs/flow-run/{run_id}" if base else None


def link_runs(config: JobConfig, trainer) -> None:
    """Each side names the other: the flow run gets a link artifact to the job's MLflow run and the
    tags ``prefect-jax``, ``job:<job>`` and ``mlflow-run:<id>``; the MLflow run gets the flow run's
    URL (tag ``prefect.flow_run_url``). In the background: the UI may lag, training does not.

    The job's tags go out at once; the link and the run's tag once MLflow has started the run
    (its store may take seconds to open), so that the progress artifacts queued meanwhile on the
    publisher are not held up behind it."""
    flow_url, flow_run_id = prefect_flow_run_url(), flow_run.id
    if flow_url:  # queued after the MLflow thread's start of the run
        trainer.tracker.set_tags({"prefect.flow_run_url": flow_url, "prefect.flow_run_id": str(flow_run_id)})
    tracker = trainer.tracker
    if flow_run_id:
        publisher.submit(_tag_flow_run, str(flow_run_id), ["prefect-jax", f"job:{config.job}"])

    def link() -> None:  # on the publisher's thread, once MLflow has answered
        mlflow_url, run_id = tracker.run_url(), tracker.run_id
        if mlflow_url:
            create_link_artifact(
                link=mlflow_url, link_text=f"MLflow run of {config.job}", key=artifact_key(config.job, "mlflow-run"),
                description=f"The MLflow run of job {config.job}: params, train and eval curves, exports ({tracker.tracking_uri})",
            )  # fmt: skip
        if flow_run_id and run_id:
            _tag_flow_run(str(flow_run_id), [f"mlflow-run:{run_id}"])

    context = contextvars.copy_context()  # this flow and task run, for the link artifact
    tracker.when_started(lambda: context.run(publisher.submit, link))


def _tag_flow_run(flow_run_id: str, tags: list[str]) -> None:
    from uuid import UUID

    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        current = client.read_flow_run(UUID(flow_run_id)).tags or []
        client.update_flow_run(UUID(flow_run_id), tags=sorted(set(current) | set(tags)))


def retry_if_transient(task, task_run, state) -> bool:
    """Retry I/O errors, timeouts and preemptions; fail at once on a bad program, a checkpoint
    that does not fit, a NaN loss or a job held by another trainer. With several JAX processes,
    never: a task retried in one process alone would wait forever for the others (the group's
    rerun resumes them all from the newest committed step)."""
    from prefect_jax.training import cluster
    from prefect_jax.training.errors import is_transient

    if cluster.several():
        get_run_logger().error("not retrying: this job trains in %d JAX processes, which are rerun together", cluster.process_count())
        return False

    exc = _failure(state)
    transient = exc is None or is_transient(exc)
    if not transient:
        get_run_logger().error("not retrying %s: %s", type(exc).__name__, exc)
    return transient


def retry_unless_lost(task, task_run, state) -> bool:
    """Retry (evaluations and exports: process 0's own work), unless another JAX process of the
    job went away: the job's processes are rerun together, from the newest committed step."""
    from prefect_jax.training import cluster

    if not cluster.several():
        return True
    exc = _failure(state)
    if exc is not None and cluster.lost_a_process(exc):
        get_run_logger().error("not retrying: %s", exc)
        return False
    return True


def _failure(state) -> BaseException | None:
    """The exception a failed task run's `state` holds, if any."""
    try:
        exc = state.result(raise_on_failure=False)
    except BaseException as err:  # noqa: BLE001 - result() itself may raise the stored exception
        exc = err
    return exc if isinstance(exc, BaseException) else None


def _train_run_name() -> str:
    params = task_run.parameters
    config, start = params["config"], params["from_step"]
    if isinstance(config, dict):
        config = JobConfig.model_validate(config)
    every, max_steps = config.checkpoint.every_steps, config.train.max_steps
    end = min(max_steps, (start // every + 1) * every) if every else max_steps
    return f"train {start} to {end}"  # no arrow: the run graph drops it ("train 200400")


@task(
    name="restore_or_init",
    task_run_name="restore or init {config.job}",
    cache_policy=NO_CACHE,
    retries=2,
    retry_delay_seconds=2,
    retry_condition_fn=retry_if_transient,
)
def restore_or_init(
    config: JobConfig,
    checkpoint_path: str | None = None,
    wait_for_checkpoint: bool = False,
    max_wait_secs: float = 7200,
    recovery_wait_secs: float = 30,
) -> dict[str, Any]:
    """Resume the job from its latest committed checkpoint, or from `checkpoint_path`, or init.

    Mirrors `SessionManager.prepare_session`: a job that has checkpoints resumes from its
    newest committed one; a new job starts from `checkpoint_path` (warm start) when given,
    else from `init`. With `wait_for_checkpoint`, waits up to `max_wait_secs` for a first
    checkpoint, logging every `recovery_wait_secs`.

    The job's MLflow run is found or created on a background thread while the checkpoint is
    restored, the first step compiles and training starts; the task does not wait for it.

    Returns:
        ``{"step": int, "mlflow_run_id": str | None (None while MLflow is still opening), "checkpoint_dir": str}``
    """
    logger = get_run_logger()
    trainer = _trainer_holding_the_lease(config)
    step = trainer.restore_or_init(
        checkpoint_path=checkpoint_path,
        wait_for_checkpoint=wait_for_checkpoint,
        max_wait_secs=max_wait_secs,
        recovery_wait_secs=recovery_wait_secs,
    )
    mark_taken_over(trainer)
    mark_dead_local_runs(config)
    # MLflow opens on its own thread: training does not wait for it (a checkpoint saved before
    # the run id is known is found by the job tag; see Trainer.save).
    run_id = trainer.tracker.run_id_if_known()
    link_runs(config, trainer)
    mlflow_run = run_id or "opening (its link is added to this flow run once MLflow answers)"
    logger.info("job %s at step %d (%s); MLflow run %s", config.job, step, "restored" if step else "initialised", mlflow_run)
    return {"step": step, "mlflow_run_id": run_id, "checkpoint_dir": trainer.checkpoints.directory}


@task(
    name="train_until_checkpoint",
    task_run_name=_train_run_name,
    cache_policy=NO_CACHE,
    retries=2,
    retry_delay_seconds=2,
    retry_condition_fn=retry_if_transient,
)
def train_until_checkpoint(config: JobConfig, from_step: int) -> int:
    """Train from `from_step` to the next checkpoint boundary and save (asynchronously).

    If this process does not hold the live state at `from_step` (a retry after a failure,
    another worker), the newest committed checkpoint is restored first. Transient failures
    (I/O, preemption) are retried from there; permanent ones (a bad program, a shape
    mismatch, a NaN/Inf loss, a job leased by another trainer) fail at once.

    Returns:
        The step reached (and checkpointed).
    """
    logger = get_run_logger()
    trainer = _trainer(config)
    stop = trainer.stop_requested()
    if stop is not None:
        logger.warning("not training: the job was asked to stop (%s)", stop.get("reason"))
        return from_step
    if trainer.state is None or trainer.step != from_step:
        restored = trainer.restore_or_init()
        mark_taken_over(trainer)
        logger.info("live state not at step %d here: restored step %d from storage", from_step, restored)
    logger.info("training from step %d to %d", trainer.step, trainer.next_boundary())
    step = trainer.train_until_checkpoint()
    metrics = ", ".join(f"{k}={v:.4g}" for k, v in sorted(trainer.last_train_metrics.items()))
    logger.info("step %d checkpointed (%s)", step, metrics)
    return step


@task(
    name="evaluate_if_new",
    task_run_name="evaluate {step}",
    cache_policy=NO_CACHE,
    retries=1,
    retry_delay_seconds=2,
    retry_condition_fn=retry_unless_lost,
)
def evaluate_if_new(config: JobConfig, step: int | None = None, force: bool = False):
    """Evaluate `step` unless it was evaluated before (durable record); publish a table artifact.

    Returns:
        An `EvalResult` (EVALUATED, NO_NEW_CHECKPOINT, MISSING_CHECKPOINT or THROTTLED).
    """
    from prefect_jax.training.evaluation import EvalStatus, as_row

    logger = get_run_logger()
    trainer = _trainer(config)
    # This task run's context: the record may come later, from another task run (see `recorded`).
    evaluating = contextvars.copy_context()

    key = artifact_key(config.job, config.eval.name, "results")

    def results_table(step: int) -> None:
        """On the publisher's thread, only for a version that is published (not one a newer
        replaced): every recorded step up to `step` (listing the records is a storage round trip)."""
        create_table_artifact(
            key=key,
            table=[as_row(r) for r in trainer.records.all() if r.step <= step],
            description=f"{config.eval.name} results of job {config.job} by global step",
        )

    def publish(result) -> None:
        # Its newest version holds every row: at most every PREFECT_JAX_UI_REFRESH_SECS.
        publisher.refresh(("table", key), results_table, result.step)
        emit(EVAL_EVENT, config, {"step": result.step, "eval_name": result.name, "metrics": result.metrics,
                                  "is_final": result.is_final, "stop_reason": result.stop_reason})

    def recorded(result) -> None:
        """Once the step is committed and its evaluation recorded: here, or (the live step's save
        still in flight) later, from the next train task run's loop or the export task run. The
        results artifact and the event belong to this evaluate task run either way (the Prefect
        UI shows them on it), so they are made in its context."""
        evaluating.copy().run(publish, result)

    result = trainer.evaluate_if_new(step, force=force, on_recorded=recorded)
    if result.status is EvalStatus.EVALUATED:
        metrics = ", ".join(f"{k}={v:.4g}" for k, v in sorted(result.metrics.items()))
        when = f" (recorded once step {result.step} commits: training goes on)" if result.pending_commit else ""
        logger.info("%s at step %d: %s%s", config.eval.name, result.step, metrics, when)
    else:
        logger.info("%s of step %s: %s", config.eval.name, step, result.status.value)
    return result


@task(
    name="export",
    task_run_name="export {result.step}",
    cache_policy=NO_CACHE,
    retries=1,
    retry_delay_seconds=2,
    retry_condition_fn=retry_unless_lost,
)
def export(config: JobConfig, result) -> dict[str, str]:
    """Run the eval spec's exporters on an evaluated result; returns ``{exporter: export dir}``."""
    logger = get_run_logger()
    written = _trainer(config).export(result)
    for name, path in written.items():
        logger.info("exporter %s: %s", name, path)
    if written:
        emit(EXPORT_EVENT, config, {"step": result.step, "exports": written})
    return written


__all__ = ["evaluate_if_new", "export", "publisher", "restore_or_init", "train_until_checkpoint"]
