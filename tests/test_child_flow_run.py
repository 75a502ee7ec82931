"""Process k > 0's child flow run (`run_as_process`) is created with an idempotency key, so a
POST that Prefect's client sends again after a lost response gets back the run already made
instead of leaving a second one Pending under the parent. On a real Prefect server."""

from uuid import uuid4


def test_a_resent_create_gets_back_the_child_already_made(prefect_server):
    from prefect.client.orchestration import get_client

    from prefect_jax import flows
    from prefect_jax.flows.processes import _create_child_flow_run

    params = {"program": "prefect_jax.examples.digits:tiny", "max_steps": 3}
    with get_client(sync_client=True) as client:
        plain = client.create_flow_run(flows.train, name="plain", parameters=params, tags=["a"])
        link = client.create_task_run(
            task=_link(), flow_run_id=plain.id, dynamic_key="1-1", name="p1"
        )

        def create(key):
            return _create_child_flow_run(
                client,
                flows.train,
                name="plain-process-1",
                parameters=params,
                parent_task_run_id=link.id,
                tags=["a", "jax-process:1"],
                idempotency_key=key,
            )

        key = str(uuid4())
        first, resent, another = create(key), create(key), create(str(uuid4()))
        assert resent.id == first.id  # the server's answer to the resend: the same run
        assert another.id != first.id  # a new call (a pod started again) makes its own
        stored = client.read_flow_run(first.id)
    # what Prefect's own create_flow_run would have made, but for the key
    assert stored.state.is_pending() and stored.name == "plain-process-1"
    assert stored.parent_task_run_id == link.id and stored.parameters == params
    assert sorted(stored.tags) == ["a", "jax-process:1"]
    assert (stored.flow_id, stored.flow_version) == (plain.flow_id, plain.flow_version)
    assert stored.empirical_policy.retries == plain.empirical_policy.retries
    assert stored.idempotency_key == key and first.parameters is params


def _link():
    from prefect import Task

    return Task(name="process 1", fn=lambda: None)
