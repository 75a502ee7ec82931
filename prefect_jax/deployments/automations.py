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
        for old in client.read_automations_by_name(automation.name):
            client.delete_automation(old.id)
        created = client.create_automation(AutomationCore(**automation.model_dump(exclude={"id"})))
        # Prefect's client sends a POST again when its response is lost, which the server may
        # have acted on: a second automation would set each crashed run to AwaitingRetry twice,
        # and the second could reschedule a rerun already started. One of the name is kept, the
        # same one (the least id) by calls racing each other, so that none deletes the last.
        named = sorted((a.id for a in client.read_automations_by_name(automation.name)), key=str)
        for extra in named[1:]:
            client.delete_automation(extra)
    return named[0] if named else created
