"""`create_rerun_automation` on a real Prefect server: one automation per name, whatever was there.

(What the automation does to a crashed run: tests/test_worker_rerun.py and test_roles_deployed.py.)
"""

import pytest

from prefect_jax.deployments.automations import create_rerun_automation, rerun_automation


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


def test_creating_it_again_leaves_one_automation_even_where_there_were_several(deployment):
    """A second automation of the name (left by an older call, or by a POST that Prefect's client
    sent again after losing its response) would set each crashed run to AwaitingRetry twice."""
    from prefect.client.orchestration import get_client

    name = "prefect-jax: rerun crashed train/automation-test"
    with get_client(sync_client=True) as client:
        deployment_id = client.read_deployment_by_name(deployment).id
    for _ in range(2):
        rerun_automation(deployment_id, deployment).create()
    assert len(_named(name)) == 2

    first = create_rerun_automation(deployment)
    assert [a.id for a in _named(name)] == [first]  # (the call's own: nothing raced it)
    again = create_rerun_automation(deployment)
    (only,) = _named(name)
    assert only.id == again != first
    assert only.trigger.match_related.root == {
        "prefect.resource.id": f"prefect.deployment.{deployment_id}"
    }


def test_a_deployment_that_does_not_exist_is_named_with_the_fix(prefect_server):
    with pytest.raises(ValueError, match=r"'train/nowhere' not found .*prefect deploy --all"):
        create_rerun_automation("train/nowhere")
