"""Automatic reruns after preemption: a Prefect automation that retries crashed trainer runs.

When a flow run of the trainer deployment enters Crashed (its node was preempted, its
process killed), the automation sets that same flow run to ``AwaitingRetry``, exactly what
the UI's Retry button does; a worker (or ``serve``) picks it up again, and the run resumes
at the newest committed checkpoint.

The budget lives with the job, not the automation: the trainer records the step each run
starts at (``<job>/attempts.json``), and after `TrainSpec.max_reruns_without_progress`
reruns in a row that start at the same step it fails (Failed, not Crashed) with an error
saying so, which this automation does not react to.

Example:
    ```python
    from prefect_jax.deployments.automations import create_rerun_automation

    create_rerun_automation("train/digits-trainer")
    ```
"""

from __future__ import annotations

from uuid import UUID

RERUN_MESSAGE = (
    "Rerun after a crash (prefect-jax automation): resumes at the last committed checkpoint"
)


def rerun_automation(deployment_id: UUID | str, deployment_name: str, name: str | None = None):
    """The automation object (not yet saved) that retries crashed runs of one deployment."""
    from prefect.automations import Automation
    from prefect.client.schemas.objects import StateType
    from prefect.events.actions import ChangeFlowRunState
    from prefect.events.schemas.automations import EventTrigger, Posture

    return Automation(
        name=name or f"prefect-jax: rerun crashed {deployment_name}",
        description=(
            f"Sets crashed flow runs of deployment {deployment_name} to AwaitingRetry (as the UI's "
            "Retry button does), so they resume from their last checkpoint. The job's trainer "
            "stops the loop after max_reruns_without_progress reruns that make no progress."
        ),
        trigger=EventTrigger(
            expect={"prefect.flow-run.Crashed"},
            match={"prefect.resource.id": "prefect.flow-run.*"},
            match_related={"prefect.resource.id": f"prefect.deployment.{deployment_id}"},
            posture=Posture.Reactive,
            threshold=1,
        ),
        actions=[
            ChangeFlowRunState(
                state=StateType.SCHEDULED, name="AwaitingRetry", message=RERUN_MESSAGE, force=True
            )
        ],
    )


def create_rerun_automation(deployment_name: str, name: str | None = None) -> UUID:
    """Create (or replace, by name) the rerun automation for a deployment ``"flow/deployment"``:
    afterwards exactly one automation has its name, so a crashed run is set to AwaitingRetry once.

    Raises:
        ValueError: the deployment does not exist on the Prefect server in use.
    """
    from prefect.client.orchestration import get_client
    from prefect.events.schemas.automations import AutomationCore
    from prefect.exceptions import ObjectNotFound

    with get_client(sync_client=True) as client:
        try:
            deployment = client.read_deployment_by_name(deployment_name)
        except ObjectNotFound as exc:
            raise ValueError(
                f"deployment {deployment_name!r} not found on the Prefect server: deploy it first "
                "(uv run prefect deploy --all), and name it as 'flow-name/deployment-name'"
            ) from exc
        automation = rerun_automation(deployment.id, deployment_name, name)
        # (owner_resource: unset, which the server's update refuses as None)
        spec = AutomationCore(**automation.model_dump(exclude={"id", "owner_resource"}))
        created = client.create_automation(spec)
        # One of the name is kept: the least id, which every call racing this one (or a create
        # that Prefect's client sent again after losing its response: a second automation would
        # set each crashed run to AwaitingRetry twice) keeps too, so none deletes the last;
        # nothing is deleted before the create, so a crash is never left without one. The one
        # kept gets this call's spec (a PUT: safe to send again); one that a racing call deleted
        # meanwhile (it saw a lesser id) is looked for again.
        for _ in range(10):
            named = sorted(
                (a.id for a in client.read_automations_by_name(automation.name)), key=str
            )
            kept = named[0] if named else created
            for extra in named[1:]:
                _unless_gone(client.delete_automation, extra)
            if _unless_gone(client.update_automation, kept, spec):
                return kept
    return kept


def _unless_gone(call, automation_id, *args) -> bool:
    """`call` on an automation; False where it is gone (a racing call deleted it: the sync
    client raises its 404 as an HTTP status error, not `ObjectNotFound`)."""
    from prefect.exceptions import PrefectHTTPStatusError

    try:
        call(automation_id, *args)
    except PrefectHTTPStatusError as exc:
        if exc.response.status_code != 404:
            raise
        return False
    return True
