"""Several JAX processes train one job: joining them, and running process k > 0 as a child flow
run of process 0's."""

# No `from __future__ import annotations`: see prefect_jax/flows/__init__.py.
from typing import Any

from prefect_jax.flows.tags import _OWN_TAGS, _RUN_TAG_PREFIXES
from prefect_jax.tasks import process_tag
from prefect_jax.training.names import OWN_TAG


def join_processes() -> None:
    """Several JAX processes train this job (`prefect_jax.training.cluster`, from the environment):
    join them, and, in process 0, tell the others this flow run, whose children they run
    (`run_as_process`). One process: nothing (JAX is not even imported)."""
    from prefect.runtime import flow_run

    from prefect_jax.training import cluster

    if cluster.initialize() is not None and cluster.process_index() == 0:
        cluster.publish("flow_run", str(flow_run.id))


_TRAINING_FLOWS = ("train_and_evaluate", "train")


def run_as_process(
    parent_flow_run_id: str | None = None, flow=None, parameters: dict[str, Any] | None = None
) -> Any:
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
    from uuid import UUID, uuid4

    from prefect import Task
    from prefect.client.orchestration import get_client
    from prefect.flow_engine import run_flow
    from prefect.states import Completed, Crashed, Failed, Running

    from prefect_jax.training import cluster

    if cluster.initialize() is None or cluster.process_index() == 0:
        raise ValueError(
            "run_as_process is for the JAX processes other than process 0 of a job: set "
            "PREFECT_JAX_NUM_PROCESSES, PREFECT_JAX_PROCESS_ID (1 or more) and "
            "PREFECT_JAX_COORDINATOR_ADDRESS, or run it in pod 1+ of an indexed job"
        )
    index = cluster.process_index()
    parent_id = (
        parent_flow_run_id or os.environ.get("PREFECT__FLOW_RUN_ID") or cluster.lookup("flow_run")
    )
    with get_client(sync_client=True) as client:
        parent = client.read_flow_run(UUID(str(parent_id)))
        if flow is None:
            name = client.read_flow(parent.flow_id).name
            if name not in _TRAINING_FLOWS:
                raise ValueError(
                    f"flow run {parent_id} runs flow {name!r}: only {_TRAINING_FLOWS} train in "
                    "several processes"
                )
            from prefect_jax import flows

            flow = getattr(flows, name)
        parameters = dict(parent.parameters) if parameters is None else parameters
        link = Task(name=f"process {index}", fn=lambda: None)
        link.task_key = f"prefect_jax.flows.run_as_process.{index}"
        link_run = client.create_task_run(
            task=link,
            flow_run_id=parent.id,
            dynamic_key=f"{index}-{parent.run_count}",
            name=f"process {index}",
            state=Running(),
        )
        # The job's tags; not the parent's process and MLflow-run tags, which name process 0 and
        # its run.
        tags = [
            t for t in parent.tags if t not in _OWN_TAGS and not t.startswith(_RUN_TAG_PREFIXES)
        ]
        child = _create_child_flow_run(
            client,
            flow,
            name=f"{parent.name}-process-{index}",
            parameters=parameters,
            parent_task_run_id=link_run.id,
            tags=[*tags, OWN_TAG, process_tag(), f"jax-process:{index}"],
            idempotency_key=str(uuid4()),
        )
    # The flow's own flow_run_name template would rename the child as its parent on start.
    try:
        state = run_flow(
            flow.with_options(flow_run_name=child.name),
            flow_run=child,
            parameters=parameters,
            return_type="state",
        )
    except (
        BaseException
    ) as exc:  # a SIGTERM (TerminationSignal) or an interrupt: Prefect re-raises those
        _end_link(link_run.id, Crashed(message=f"process {index}: {type(exc).__name__}: {exc}"))
        raise
    _end_link(
        link_run.id,
        Completed()
        if state.is_completed()
        else Failed(message=f"process {index}: {state.message}"),
    )
    return state.result()


def _end_link(task_run_id, state) -> None:
    from prefect.client.orchestration import get_client

    try:
        with get_client(sync_client=True) as client:
            client.set_task_run_state(task_run_id, state, force=True)
    except Exception as exc:  # noqa: BLE001 - the child's own state says what happened
        import logging

        logging.getLogger("prefect_jax.flows").warning(
            "could not end the process task run: %r", exc
        )


def _create_child_flow_run(
    client, flow, *, name, parameters, parent_task_run_id, tags, idempotency_key
):
    """`client.create_flow_run`, with an idempotency key, which that method does not take
    (Prefect 3.8.8). Prefect's client sends a POST again when it loses the response (a read
    timeout, a dropped connection after the server committed): without a key the server makes a
    second flow run, left Pending under the parent in the UI. The key is one call's, so the
    resend gets back the run the server already made, and a pod that starts again gets a run of
    its own. The link task run needs none: the server keys a task run by its dynamic key."""
    from prefect.client.schemas.actions import FlowCreate, FlowRunCreate
    from prefect.client.schemas.objects import Flow, FlowRun, FlowRunPolicy
    from prefect.states import Pending, to_state_create

    flow_id = Flow.model_validate(
        client.request(
            "POST", "/flows/", json=FlowCreate(name=flow.name).model_dump(mode="json")
        ).json()
    ).id
    create = FlowRunCreate(
        flow_id=flow_id,
        flow_version=flow.version,
        name=name,
        parameters=parameters,
        tags=list(tags),
        parent_task_run_id=parent_task_run_id,
        state=to_state_create(Pending()),
        empirical_policy=FlowRunPolicy(
            retries=flow.retries, retry_delay=int(flow.retry_delay_seconds or 0)
        ),
        idempotency_key=idempotency_key,
    )
    response = client.request(
        "POST", "/flow_runs/", json=create.model_dump(mode="json", exclude_unset=True)
    )
    child = FlowRun.model_validate(response.json())
    child.parameters = parameters  # the Python objects, as `create_flow_run` returns them
    return child
