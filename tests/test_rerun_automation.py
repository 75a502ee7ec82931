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


def test_a_deployment_that_does_not_exist_is_named_with_the_fix(prefect_server):
    with pytest.raises(ValueError, match=r"'train/nowhere' not found .*prefect deploy --all"):
        create_rerun_automation("train/nowhere")


def test_a_brake_that_cannot_trip_is_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"max_crashes=0, within_secs=3600: .*--no-brake"):
        create_rerun_automation("train/anything", max_crashes=0)
