"""Automatic reruns after preemption: a Prefect automation that retries crashed trainer runs.

When a flow run of the trainer deployment enters Crashed (its node was preempted, its
process killed), the automation sets that same flow run to ``AwaitingRetry``, exactly what
the UI's Retry button does; a worker (or ``serve``) picks it up again, and the run resumes
at the newest committed checkpoint.

The budget lives with the job, not the automation: the trainer records the step each run
starts at (``<job>/attempts.json``, once it holds the job's lease), and after
`TrainSpec.max_reruns_without_progress` reruns in a row that start at the same step it fails
(Failed, not Crashed) with an error saying so, which this automation does not react to.

A run that crashes before the trainer gets that far (an image that cannot be pulled, a command
or entrypoint that fails to start) never reaches that budget: a second automation, the brake,
pauses the rerun automation once one flow run of the deployment was reported Crashed
`max_crashes` times within `within_secs` (each run counted apart: a sweep of jobs preempted
together does not trip it). Crashed runs then stay Crashed until a person fixes the cause and
runs the same create call again, which enables the rerun automation and re-arms the brake (the
UI's toggle enables it too, but leaves the brake blind to the run that tripped it until its
window ends: Prefect opens a fired trigger's next window, for that run, where the last one ends).

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
# The brake's defaults: far more crashes than spot preemptions cause (a process worker reports a
# SIGKILLed run twice), and a crash loop reaches them in minutes (a worker polls every 10 s).
MAX_CRASHES, CRASH_WINDOW_SECS = 10, 3600.0


def _crashes_of(deployment_id: UUID | str, threshold: int = 1, within_secs: float = 0.0):
    """The trigger: `threshold` Crashed reports of one flow run of the deployment within
    `within_secs` (counted per flow run: `for_each` its resource id)."""
    from datetime import timedelta

    from prefect.events.schemas.automations import EventTrigger, Posture

    return EventTrigger(
        expect={"prefect.flow-run.Crashed"},
        match={"prefect.resource.id": "prefect.flow-run.*"},
        match_related={"prefect.resource.id": f"prefect.deployment.{deployment_id}"},
        for_each={"prefect.resource.id"},
        posture=Posture.Reactive,
        threshold=threshold,
        within=timedelta(seconds=within_secs),
    )


def rerun_automation(deployment_id: UUID | str, deployment_name: str, name: str | None = None):
    """The automation object (not yet saved) that retries crashed runs of one deployment."""
    from prefect.automations import Automation
    from prefect.client.schemas.objects import StateType
    from prefect.events.actions import ChangeFlowRunState

    return Automation(
        name=name or f"prefect-jax: rerun crashed {deployment_name}",
        description=(
            f"Sets crashed flow runs of deployment {deployment_name} to AwaitingRetry (as the UI's "
            "Retry button does), so they resume from their last checkpoint. The job's trainer "
            "stops the loop after max_reruns_without_progress reruns that make no progress; "
            "the brake automation pauses this one after too many crashes."
        ),
        trigger=_crashes_of(deployment_id),
        actions=[
            ChangeFlowRunState(
                state=StateType.SCHEDULED, name="AwaitingRetry", message=RERUN_MESSAGE, force=True
            )
        ],
    )


def brake_automation(
    deployment_id: UUID | str,
    rerun_name: str,
    rerun_id: UUID,
    max_crashes: int = MAX_CRASHES,
    within_secs: float = CRASH_WINDOW_SECS,
):
    """The automation object (not yet saved) that pauses the rerun automation `rerun_id` once
    one run of the deployment was reported Crashed `max_crashes` times within `within_secs`."""
    from prefect.automations import Automation
    from prefect.events.actions import PauseAutomation

    return Automation(
        name=f"{rerun_name}: brake",
        description=(
            f"Pauses the automation '{rerun_name}' after {max_crashes} crash reports of one "
            f"run of its deployment within {within_secs:g} s: runs that crash before their "
            "trainer counts them (an image or command that fails to start) are not rerun "
            "forever. Fix the cause, then run `prefect-jax automations create` again (it "
            "enables that automation and re-arms this one)."
        ),
        trigger=_crashes_of(deployment_id, max_crashes, within_secs),
        actions=[PauseAutomation(source="selected", automation_id=rerun_id)],
    )


def check_deployment_name(name: str) -> str:
    """`name` if it is a deployment's name as Prefect reads one, ``"flow-name/deployment-name"``
    (`read_deployment_by_name` splits it at its one ``/``); checked before a server is asked, or
    started by the command.

    Raises:
        ValueError: naming `name` and the form to give.
    """
    flow, _, deployment = name.partition("/")
    if not flow.strip() or not deployment.strip() or "/" in deployment or name != name.strip():
        raise ValueError(
            f"deployment {name!r} is not 'flow-name/deployment-name': name it by its flow's name "
            "and its own, as `uv run prefect deployment ls` lists it (e.g. 'train/digits-trainer')"
        )
    return name


def create_rerun_automation(
    deployment_name: str,
    name: str | None = None,
    max_crashes: int | None = MAX_CRASHES,
    within_secs: float = CRASH_WINDOW_SECS,
) -> UUID:
    """Create (or replace, by name) the rerun automation for a deployment ``"flow/deployment"``,
    enabled, and its brake (`brake_automation`; where `max_crashes` is None, none, and one left
    from an earlier call is deleted): afterwards exactly one automation has each name, so a
    crashed run is set to AwaitingRetry once, and the brake pauses the one kept. Returns the
    rerun automation's id.

    Raises:
        ValueError: the deployment's name is not ``"flow/deployment"``, or it does not exist on
            the Prefect server in use, or the brake's numbers are not positive.
    """
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    check_deployment_name(deployment_name)
    if max_crashes is not None and (max_crashes < 1 or within_secs <= 0):
        raise ValueError(
            f"max_crashes={max_crashes}, within_secs={within_secs:g}: the brake pauses reruns "
            "after max_crashes >= 1 crashes within within_secs > 0 seconds (--max-crashes, "
            "--crash-window-secs); --no-brake for none"
        )
    with get_client(sync_client=True) as client:
        try:
            deployment = client.read_deployment_by_name(deployment_name)
        except ObjectNotFound as exc:
            raise ValueError(
                f"deployment {deployment_name!r} not found on the Prefect server: deploy it first "
                "(uv run prefect deploy --all), and name it as 'flow-name/deployment-name'"
            ) from exc
        refuse_unknown_parameters(deployment, deployment_name)
        rerun = rerun_automation(deployment.id, deployment_name, name)
        kept = _create_or_replace(client, rerun)
        brake_name = f"{rerun.name}: brake"
        if max_crashes is None:
            for left in client.read_automations_by_name(brake_name):
                _unless_gone(client.delete_automation, left.id)
            return kept
        for _ in range(10):
            brake = brake_automation(deployment.id, rerun.name, kept, max_crashes, within_secs)
            _create_or_replace(client, brake)
            # A racing call may have deleted `kept` (it saw a lesser id) after this call chose
            # it: the brake must pause the one that stays, so it is pointed again until the
            # least id of the name is the one it names.
            named = _ids_named(client, rerun.name)
            if not named or named[0] == kept:
                break
            kept = named[0]
    return kept


def refuse_unknown_parameters(deployment, deployment_name: str) -> None:
    """Refuse a deployment whose parameters name one its flow does not take (``checkpoint_specs:``
    in prefect.yaml): ``prefect deploy`` accepts it (the flow's schema allows other names), and
    each run of it crashes before its flow starts (Prefect's SignatureMismatchError), which the
    rerun automation would rerun until its brake stops it.

    Raises:
        ValueError: naming each unknown parameter, the likely one meant and the fix.
    """
    import difflib

    taken = list((deployment.parameter_openapi_schema or {}).get("properties") or {})
    unknown = [k for k in deployment.parameters or {} if taken and k not in taken]
    if not unknown:
        return
    said = []
    for key in unknown:
        close = difflib.get_close_matches(key, taken, n=1)
        said.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    raise ValueError(
        f"deployment {deployment_name!r} sets {', '.join(said)}, which its flow does not take "
        f"(it takes {', '.join(taken)}): each run of it would crash before training, and the "
        "rerun automation would rerun it; fix the deployment's parameters (prefect.yaml) and "
        "deploy again"
    )


def _create_or_replace(client, automation) -> UUID:
    """Save `automation` as the one automation of its name (and enabled); returns its id."""
    from prefect.events.schemas.automations import AutomationCore

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
        named = _ids_named(client, automation.name)
        kept = named[0] if named else created
        for extra in named[1:]:
            _unless_gone(client.delete_automation, extra)
        if _unless_gone(client.update_automation, kept, spec):
            return kept
    return kept


def _ids_named(client, name: str) -> list[UUID]:
    """The ids of the automations named `name`, least first (the one every caller keeps)."""
    return sorted((a.id for a in client.read_automations_by_name(name)), key=str)


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
