"""`create_rerun_automation` on a real Prefect server: one automation per name, whatever was there.

(What the automation does to a crashed run: tests/test_worker_rerun.py and test_roles_deployed.py.)
"""

import pytest

from prefect_jax.deployments.automations import create_rerun_automation, rerun_automation

NAME = "prefect-jax: rerun crashed train/automation-test"  # (the name the function gives it)


@pytest.fixture(scope="module")
def deployment(prefect_server):
    """A deployment of the `train` flow, registered only (nothing runs it)."""
    from prefect_jax.flows import train

    train.to_deployment(name="automation-test").apply()
    return "train/automation-test"


def _named(name: str) -> list:
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return client.read_automations_by_name(name)


def _stale(name: str):
    """An automation of `name` left from before: its trigger names another deployment."""
    import uuid

    stale = rerun_automation(uuid.uuid4(), "train/gone", name)
    stale.description = "stale"
    return stale.create().id


def test_creating_it_again_leaves_one_automation_with_this_spec(deployment):
    """A second automation of the name (left by an older call, or by a POST that Prefect's client
    sent again after losing its response) would set each crashed run to AwaitingRetry twice. The
    one kept (the least id) may be an older one: it is given this call's spec."""
    from prefect.client.orchestration import get_client

    name = NAME
    with get_client(sync_client=True) as client:
        deployment_id = client.read_deployment_by_name(deployment).id
    kept_an_older_one = False
    for _ in range(20):  # until the least id was an older one (2 in 3 each round)
        # Each round starts from none of the name: the one kept last round would otherwise
        # stay the least id (a low one outlasts every later pair, and the test drew it).
        with get_client(sync_client=True) as client:
            for automation in client.read_automations_by_name(name):
                client.delete_automation(automation.id)
        stale = {_stale(name), _stale(name)}
        kept = create_rerun_automation(deployment)
        (only,) = _named(name)
        assert only.id == kept
        assert only.trigger.match_related.root == {
            "prefect.resource.id": f"prefect.deployment.{deployment_id}"
        }
        assert only.description != "stale"
        kept_an_older_one = kept in stale
        if kept_an_older_one:
            break
    assert kept_an_older_one


def test_calls_racing_each_other_leave_exactly_one(deployment):
    """Each call creates its own, then keeps the least id of the name: every caller keeps the same
    one, and none deletes the last."""
    from concurrent.futures import ThreadPoolExecutor

    name = NAME
    for _ in range(3):
        with ThreadPoolExecutor(4) as pool:
            kept = set(pool.map(lambda _: create_rerun_automation(deployment), range(4)))
        (only,) = _named(name)
        assert only.id in kept
        (brake,) = _named(f"{name}: brake")  # pauses the one that stayed, not one deleted
        assert [action.automation_id for action in brake.actions] == [only.id]


def test_the_brake_counts_each_run_apart(deployment):
    """Judged by the Prefect server's own trigger code: crash reports of one run share a
    bucket, another run of the deployment (a sweep preempted at once) has its own."""
    import uuid

    from prefect.server.events.schemas.automations import EventTrigger
    from prefect.server.events.schemas.events import ReceivedEvent
    from prefect.types._datetime import now

    create_rerun_automation(deployment, max_crashes=4)
    (brake,) = _named(f"{NAME}: brake")
    trigger = EventTrigger(**brake.trigger.model_dump())
    deployment_id = _named(NAME)[0].trigger.match_related.root["prefect.resource.id"]

    def crashed(run_id):
        return ReceivedEvent(
            occurred=now("UTC"),
            event="prefect.flow-run.Crashed",
            resource={"prefect.resource.id": f"prefect.flow-run.{run_id}"},
            related=[{"prefect.resource.id": deployment_id, "prefect.resource.role": "deployment"}],
            id=uuid.uuid4(),
        )

    one, again, other = crashed(run := uuid.uuid4()), crashed(run), crashed(uuid.uuid4())
    assert trigger.threshold == 4 and all(trigger.covers(e) for e in (one, again, other))
    assert trigger.bucketing_key(one) == trigger.bucketing_key(again)
    assert trigger.bucketing_key(one) != trigger.bucketing_key(other)


def test_no_brake_deletes_the_one_made_before(deployment):
    create_rerun_automation(deployment)
    assert len(_named(f"{NAME}: brake")) == 1
    kept = create_rerun_automation(deployment, max_crashes=None)
    assert _named(f"{NAME}: brake") == [] and [a.id for a in _named(NAME)] == [kept]


def test_a_deployment_that_does_not_exist_is_named_with_the_fix(prefect_server):
    with pytest.raises(ValueError, match=r"'train/nowhere' not found .*prefect deploy --all"):
        create_rerun_automation("train/nowhere")


def test_a_deployment_setting_a_parameter_its_flow_does_not_take_is_refused(prefect_server):
    """``checkpoint_specs:`` in prefect.yaml: `prefect deploy` takes it, each run crashes before
    its flow starts, and the automation would rerun each crash until its brake (the platform
    probe saw 4 starts of one run with --max-crashes 3). Refused here, naming the fix."""
    from prefect_jax.flows import train

    spec = {"max_steps": 10}
    train.to_deployment(
        name="typo-test", parameters={"train_spec": spec, "checkpoint_specs": {"every_steps": 5}}
    ).apply()
    with pytest.raises(ValueError) as refused:
        create_rerun_automation("train/typo-test")
    assert str(refused.value).startswith(
        "deployment 'train/typo-test' sets 'checkpoint_specs' (did you mean 'checkpoint_spec'?), "
        "which its flow does not take (it takes program, job, storage, "
    ), refused.value
    assert "fix the deployment's parameters (prefect.yaml) and deploy again" in str(refused.value)
    assert _named("prefect-jax: rerun crashed train/typo-test") == []


def test_a_brake_that_cannot_trip_is_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"max_crashes=0, within_secs=3600: .*--no-brake"):
        create_rerun_automation("train/anything", max_crashes=0)


def test_the_command_makes_the_automation_and_its_brake_with_the_default_brake(
    deployment, prefect_server
):
    """`prefect-jax automations create`: the brake's defaults are filled in by the command (its
    flags default to None, so that --no-brake beside either is refused: test_cli)."""
    import json
    import uuid

    from process_helpers import run_cli

    proc = run_cli(
        "automations", "create", "--deployment", deployment, PREFECT_API_URL=prefect_server
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = json.loads(proc.stdout.strip().splitlines()[-1])
    assert said["brake"] == {"max_crashes": 10, "within_secs": 3600.0}, said
    (brake,) = _named(f"{NAME}: brake")
    assert brake.trigger.threshold == 10 and brake.trigger.within.total_seconds() == 3600
    assert [a.id for a in _named(NAME)] == [uuid.UUID(said["automation_id"])]
