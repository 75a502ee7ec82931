"""The flows' parameters as Prefect sees them: plain Prefect flows, whose parameter schema is
Prefect's own wherever it is read (no override of Prefect's internals: docs/upstream.md)."""

import pathlib

import pytest
from prefect import Flow

from prefect_jax import flows

FLOWS = [flows.train_and_evaluate, flows.train, flows.evaluate, flows.export_flow]


@pytest.mark.parametrize("flow", FLOWS, ids=lambda f: f.name)
def test_the_flows_are_prefects_own_flows(flow):
    assert type(flow) is Flow
    assert "retry_spec" in flow.parameters.properties


def _is_prefects_own(flow) -> bool:
    from prefect.utilities.callables import ParameterSchema, parameter_schema

    schema = flow.parameters
    return isinstance(schema, ParameterSchema) and schema == parameter_schema(
        flow.fn
    ) == parameter_schema(flow)


@pytest.mark.parametrize("flow", FLOWS, ids=lambda f: f.name)
def test_a_flows_parameter_schema_read_is_prefects_own(flow):
    """Read from the flow, a copy (`with_options`), Prefect's infrastructure-bound copy (which
    copies the flow's attributes), and the flow loaded from its file as ``prefect deploy`` and a
    worker load a file entrypoint (a second execution of the module, in a process that has it)."""
    from prefect.flows import bind_flow_to_infrastructure, load_flow_from_entrypoint
    from prefect.workers.process import ProcessWorker

    path = pathlib.Path(flows.__file__)
    copies = [
        flow,
        flow.with_options(flow_run_name="x"),
        bind_flow_to_infrastructure(flow, "pool", ProcessWorker),
        load_flow_from_entrypoint(f"{path}:{flow.fn.__name__}"),
    ]
    for f in copies:
        assert _is_prefects_own(f), f
        assert set(f.parameters.properties) >= {"program", "job", "storage"}
