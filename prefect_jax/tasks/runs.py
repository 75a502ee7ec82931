"""The flow runs and task runs of a job in Prefect: links between a flow run and its MLflow run,
tags, and marking Crashed what a dead trainer left Running."""

from __future__ import annotations

import contextvars
import os
import time

from prefect import get_run_logger
from prefect.runtime import flow_run, task_run

from prefect_jax.tasks.publish import publisher
from prefect_jax.tasks.run_link import publish_link, tag_flow_run
from prefect_jax.training.names import (
    FLOW_RUN_ID_TAG,
    FLOW_RUN_TAG_PREFIX,
    FLOW_RUN_URL_TAG,
    JOB_RUN_TAG,
    OWN_TAG,
    PREFECT_UI_URL_ENV,
    PROCESS_RUN_TAG,
)
from prefect_jax.training.specs import JobConfig


def current_flow_run_tags() -> dict[str, str]:
    run_id = flow_run.id
    if not run_id:
        return {}
    url = prefect_flow_run_url()
    return {FLOW_RUN_ID_TAG: str(run_id), **({FLOW_RUN_URL_TAG: url} if url else {})}


_marked_takeovers: set[str] = (
    set()
)  # lease tokens of dead holders whose runs were marked (once per process)


def mark_taken_over(trainer) -> None:
    """After the trainer took over the lease of a dead holder (SIGKILLed, its machine lost), mark
    what it left Running in Prefect as Crashed (in the background; failures are warnings): its
    flow run (unless it is this one, retried) and that flow run's unfinished task runs, except
    this attempt's own. Also closes the dead flow run's progress artifact."""
    taken = trainer.job.lease.taken_over
    if not taken or not taken.get("flow_run_id") or taken.get("token") in _marked_takeovers:
        return
    _marked_takeovers.add(taken.get("token"))
    current = (str(flow_run.id) if flow_run.id else None, flow_run.run_count, task_run.id)
    publisher.submit(_mark_crashed, dict(taken), *current)


def process_tag() -> str:
    """The tag the command gives the flow runs it runs in this process."""
    import socket

    return f"{PROCESS_RUN_TAG}{socket.gethostname()}:{os.getpid()}"


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
    from prefect.client.schemas.filters import (
        FlowRunFilter,
        FlowRunFilterState,
        FlowRunFilterStateType,
        FlowRunFilterTags,
    )
    from prefect.client.schemas.objects import StateType
    from prefect.client.schemas.sorting import FlowRunSort

    from prefect_jax.training.local_processes import process_alive

    host = socket.gethostname()
    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(
                tags=FlowRunFilterTags(all_=[f"{JOB_RUN_TAG}{job}"]),
                state=FlowRunFilterState(
                    type=FlowRunFilterStateType(any_=[StateType.RUNNING, StateType.PENDING])
                ),
            ),
            sort=FlowRunSort.EXPECTED_START_TIME_DESC,
            limit=50,
        )
    for run in runs:
        tag = next((t for t in run.tags if t.startswith(PROCESS_RUN_TAG)), None)
        if str(run.id) == current_flow_run or tag is None:
            continue
        run_host, _, pid = tag[len(PROCESS_RUN_TAG) :].rpartition(":")
        if run_host != host or not pid.isdigit() or process_alive(int(pid)):
            continue
        taken = {
            "flow_run_id": str(run.id),
            "host": run_host,
            "pid": int(pid),
            "reason": "its process is gone",
        }
        _mark_crashed(taken, current_flow_run, 0, None)


def _mark_crashed(
    taken: dict, current_flow_run: str | None, run_count: int, current_task_run: str | None
) -> None:
    from uuid import UUID

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        ArtifactFilter,
        ArtifactFilterFlowRunId,
        ArtifactFilterType,
        FlowRunFilter,
        FlowRunFilterId,
        TaskRunFilter,
        TaskRunFilterState,
        TaskRunFilterStateType,
    )
    from prefect.client.schemas.objects import StateType
    from prefect.states import Crashed

    logger = get_run_logger()
    dead, same = UUID(str(taken["flow_run_id"])), str(taken["flow_run_id"]) == current_flow_run
    who = f"host {taken.get('host')}, pid {taken.get('pid')}"
    message = (
        f"its trainer ({who}) was lost ({taken.get('reason')}): flow run {current_flow_run} "
        "took over the job"
    )
    unfinished = [
        StateType.SCHEDULED,
        StateType.PENDING,
        StateType.RUNNING,
        StateType.PAUSED,
        StateType.CANCELLING,
    ]
    with get_client(sync_client=True) as client:
        if not same:
            previous = client.read_flow_run(dead)
            if previous.state is not None and previous.state.type in (
                StateType.PENDING,
                StateType.RUNNING,
                StateType.CANCELLING,
            ):
                client.set_flow_run_state(dead, Crashed(message=message), force=True)
                logger.warning("marked flow run %s (%s) Crashed: %s", previous.name, dead, message)
            for artifact in client.read_artifacts(
                artifact_filter=ArtifactFilter(
                    flow_run_id=ArtifactFilterFlowRunId(any_=[dead]),
                    type=ArtifactFilterType(any_=["progress"]),
                )
            ):
                from prefect.artifacts import update_progress_artifact

                update_progress_artifact(
                    artifact.id,
                    float(artifact.data or 0),
                    f"{artifact.description or ''} (killed: {message})",
                )
        task_runs = client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[dead])),
            task_run_filter=TaskRunFilter(
                state=TaskRunFilterState(type=TaskRunFilterStateType(any_=unfinished))
            ),
        )
        for run in task_runs:
            if str(run.id) == str(current_task_run) or (
                same and run.flow_run_run_count == run_count
            ):
                continue  # this attempt's own
            if same and current_task_run is not None and _made_after(run.id, current_task_run):
                # This attempt's next task run, made since (its attempt number is not set while
                # it is Pending).
                continue
            client.set_task_run_state(run.id, Crashed(message=message), force=True)
            logger.warning(
                "marked task run %r (%s, attempt %d of flow run %s) Crashed",
                run.name,
                run.id,
                run.flow_run_run_count,
                dead,
            )


def crash_left_task_runs(flow_run_id, before, message: str) -> list[str]:
    """Mark Crashed the task runs of flow run `flow_run_id` still unfinished whose state began no
    later than `before` (the flow run's Crashed state: a rerun of the same flow run may already
    have started its own task runs since). For a flow run's crash hook, which Prefect's runner
    runs in the worker or `serve` process when the flow-run process died (a SIGKILL runs no
    handler there, so its task run would stay Running until a rerun takes the job over). Returns
    the names marked."""
    from uuid import UUID

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        FlowRunFilter,
        FlowRunFilterId,
        TaskRunFilter,
        TaskRunFilterState,
        TaskRunFilterStateType,
    )
    from prefect.client.schemas.objects import StateType
    from prefect.states import Crashed

    unfinished = [StateType.PENDING, StateType.RUNNING, StateType.PAUSED, StateType.CANCELLING]
    marked = []
    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[UUID(str(flow_run_id))])),
            task_run_filter=TaskRunFilter(
                state=TaskRunFilterState(type=TaskRunFilterStateType(any_=unfinished))
            ),
        )
        for run in runs:
            began = run.state.timestamp if run.state is not None else None
            if before is not None and began is not None and began > before:
                continue  # a rerun's own
            client.set_task_run_state(run.id, Crashed(message=message), force=True)
            marked.append(run.name)
    return marked


def _made_after(run_id, other_id) -> bool:
    """Whether task run `run_id` was made after `other_id`: Prefect's client makes task run ids as
    UUIDv7 (time first), in the process that runs the tasks."""
    from uuid import UUID

    a, b = UUID(str(run_id)), UUID(str(other_id))
    return a.version == 7 and b.version == 7 and a.int > b.int


def prefect_flow_run_url() -> str | None:
    """This flow run in the Prefect UI. A command that ran its own embedded server names the UI of
    ``prefect server start`` (``PREFECT_JAX_PREFECT_UI_URL``), where its runs are found
    afterwards."""
    run_id = flow_run.id
    if not run_id:
        return None
    from prefect.settings import PREFECT_UI_URL

    base = os.environ.get(PREFECT_UI_URL_ENV) or PREFECT_UI_URL.value()
    return f"{base.rstrip('/')}/runs/flow-run/{run_id}" if base else None


LINK_WAIT_SECS = 60.0  # the longest a trainer's restore waits for its first MLflow run


def link_runs(config: JobConfig, tracker, trains: bool = True, wait_secs: float = 0.0) -> None:
    """Each side names the other: the flow run gets a link artifact to the job's MLflow run and the
    tags ``prefect-jax``, ``job:<job>`` and ``mlflow-run:<id>``; the MLflow run gets a tag
    ``prefect.flow_run.<flow run id>`` (its URL) for every flow run that wrote to it, trainer,
    evaluator or export, and ``prefect.flow_run_url`` / ``prefect.flow_run_id`` where `trains`
    (`restore_or_init` passes False: the trainer's flow re-points them once it trains, with
    `Job.name_this_flow_run`, so a no-op run of a finished job does not). In the background: the
    UI may lag, training does not.

    The job's tags go out at once, and so does the link where the run's id is known before MLflow
    answers (a rerun: its checkpoints name the run); else the link and the run's tag follow once
    MLflow has started the run (its store may take seconds to open), so that the progress
    artifacts queued meanwhile on the publisher are not held up behind it. One link artifact per
    flow run, however often it is started.

    `wait_secs` > 0 (a trainer's restore, before its first step): where the run is not known yet
    (a job's first run), wait that long at most for MLflow to start the run (not at all for a
    store that did not answer the start-up check, ``--mlflow-optional``) and for the link and the
    tag to be in Prefect, so that a run killed in its first interval is linked too. Where MLflow
    has not answered by then, the link artifact says so (pointing at the MLflow UI) and is
    updated in place once MLflow answers."""
    flow_url, flow_run_id = prefect_flow_run_url(), flow_run.id
    if flow_url:  # queued after the MLflow thread's start of the run
        newest = {FLOW_RUN_URL_TAG: flow_url, FLOW_RUN_ID_TAG: str(flow_run_id)}
        tracker.set_tags(
            {**(newest if trains else {}), f"{FLOW_RUN_TAG_PREFIX}{flow_run_id}": flow_url}
        )
    if flow_run_id:
        publisher.submit(tag_flow_run, str(flow_run_id), [OWN_TAG, f"{JOB_RUN_TAG}{config.job}"])
    if not tracker.enabled:  # another process of the job writes its MLflow run
        return
    context = contextvars.copy_context()  # this flow and task run, for the link artifact

    def linked() -> None:  # on the publisher's thread, once MLflow has answered
        run_id = tracker.run_id_if_known()
        if run_id:
            publish_link(config, tracker, flow_run_id, tracker.run_url(), run_id)

    known = tracker.known_run_url()
    if known:
        # A rerun (its checkpoints name the run): the link goes out at once and lands while the
        # first step compiles; the wait is for a first run's, whose id MLflow has yet to make.
        # MLflow 3.17's UI sends the run-id-only route to its GenAI view: the run's route in
        # its experiment replaces it once MLflow answers.
        publish_link(config, tracker, flow_run_id, known, tracker.requested_run_id)
        tracker.when_started(lambda: context.run(publisher.submit, linked))
        return
    if wait_secs > 0:
        # (a store the start-up check found unusable has no tracker: returned above)
        deadline = time.monotonic() + wait_secs  # one bound for MLflow's answer and Prefect's
        answered = tracker.wait_started(wait_secs)
        run_id = tracker.run_id_if_known()
        left = max(1.0, deadline - time.monotonic())
        if answered and run_id:
            publish_link(config, tracker, flow_run_id, tracker.run_url(), run_id, left)
            return
        publish_link(config, tracker, flow_run_id, None, None, left)  # says it is coming
    tracker.when_started(lambda: context.run(publisher.submit, linked))


def link_live_job(config: JobConfig) -> None:
    """`link_runs` for a flow run (an evaluator's, an export's) whose work joined the job's MLflow
    run through this process's live trainer; only the job's tags where none joined it."""
    from prefect_jax.training.live import live_trainer

    trainer = live_trainer(config)
    if trainer is not None and trainer.job.tracker.started:
        link_runs(config, trainer.job.tracker, trains=False)
    elif flow_run.id:  # the job's tags at least
        publisher.submit(tag_flow_run, str(flow_run.id), [OWN_TAG, f"{JOB_RUN_TAG}{config.job}"])
