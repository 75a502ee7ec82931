"""A flow run's parameters, as sent to the API: the same as Prefect's own serialization, without
the ~0.2 s import of FastAPI that Prefect's `jsonable_encoder` costs a fresh process (issue 13)."""

import enum
import json
import pathlib
import subprocess
import sys
import textwrap
import uuid

import pydantic
import pytest
from prefect import Flow
from prefect.states import Completed

from prefect_jax import flows
from prefect_jax.training.specs import (
    BestExporter,
    CheckpointSpec,
    EarlyStopping,
    EvalSpec,
    FinalExporter,
    LatestExporter,
    TrainSpec,
)

FLOWS = [flows.train_and_evaluate, flows.train, flows.evaluate, flows.export_flow]


class Colour(enum.Enum):
    RED = "red"


class Level(int, enum.Enum):
    HIGH = 3


class Key(str, enum.Enum):
    A = "a"


class Unserializable(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(arbitrary_types_allowed=True)
    thing: object = object()


def _self_containing_list():
    loop: list = [1]
    loop.append(loop)
    return loop


def _prefects(flow, parameters):
    """Prefect's own `Flow.serialize_parameters` (FastAPI's `jsonable_encoder`)."""
    return Flow.serialize_parameters(flow, parameters)


CASES = {
    "the command's defaults": dict(
        program="prefect_jax.examples.digits:program", job="digits", storage="/tmp/x", train_spec=TrainSpec(max_steps=10),
        eval_spec=EvalSpec(), checkpoint_spec=CheckpointSpec(), mlflow_tracking_uri=None, mlflow_experiment="prefect-jax",
        checkpoint_path=None, compilation_cache_dir="job",
    ),
    "every spec field set": dict(
        program="p:q", job="j", storage="s3://bucket/root",
        train_spec=TrainSpec(max_steps=5000, seed=7, log_every_steps=10, steps_per_dispatch=10, check_finite=False,
                             sigterm_grace_secs=12.5, lease_timeout_secs=90.0, max_reruns_without_progress=None),
        eval_spec=EvalSpec(steps=3, name="val", start_delay_secs=1.5, throttle_secs=60, hooks=["a.b:c"],
                           exporters=[LatestExporter(keep=None), BestExporter(metric="accuracy", mode="max", keep=2),
                                      FinalExporter()],
                           early_stopping=EarlyStopping(metric="accuracy", mode="max", max_steps_without_improvement=400,
                                                        min_delta=1e-3),
                           registered_model="digits-mlp"),
        checkpoint_spec=CheckpointSpec(every_steps=None, every_secs=300.0, keep_last=None, keep_every_steps=1000,
                                       keep_until_evaluated=False),
        mlflow_tracking_uri="http://127.0.0.1:5000", compilation_cache_dir=None,
    ),
    "plain values, enums, tuples and dicts": dict(
        a=True, b=0, c=-1.5, d=float("inf"), e="", f=None, g=(1, "x", None), h=[{"k": [1, 2]}],
        i={"_sa_state": 1, "kept": Colour.RED}, j=Colour.RED, k=Level.HIGH, l={},
    ),
    "values only Prefect's encoder takes": dict(
        path=pathlib.PurePosixPath("/a/b"), id=uuid.UUID(int=5), s={3}, by_int={1: "one"}, spec=TrainSpec(max_steps=1),
        obj=object(),
    ),
    "values Prefect records as placeholders": dict(
        state=Completed(data="s3://bucket/x"), bad_model=Unserializable(), loop=_self_containing_list(),
        enum_keys={Key.A: 1}, ok="kept",
    ),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("flow", FLOWS, ids=lambda f: f.name)
def test_a_flow_runs_parameters_are_serialized_as_prefect_serializes_them(flow, case):
    parameters = CASES[case]
    ours = flow.serialize_parameters(parameters)
    theirs = _prefects(flow, parameters)
    assert list(ours) == list(theirs)
    # `repr` tells an int from a float and True from 1, and compares inf and nan as written.
    assert repr(ours) == repr(theirs)
    assert type(flow).serialize_parameters is not Flow.serialize_parameters


def test_with_options_keeps_the_serialization():
    parameters = CASES["every spec field set"]
    copy = flows.train_and_evaluate.with_options(flow_run_name="x")
    assert type(copy) is type(flows.train_and_evaluate)
    assert copy.flow_run_name == "x" and copy.name == "train_and_evaluate"
    assert repr(copy.serialize_parameters(parameters)) == repr(_prefects(copy, parameters))


def test_a_fresh_process_serializes_the_commands_parameters_without_importing_fastapi():
    """The saving itself: what the command's flow run sends, in a process that has imported the
    flows as the command does, leaves FastAPI unimported (Prefect's own path imports it)."""
    code = textwrap.dedent(
        """
        import json, sys
        from prefect_jax import flows
        from prefect_jax.training.specs import CheckpointSpec, EvalSpec, LatestExporter, TrainSpec
        parameters = dict(program="p:q", job="j", storage="/tmp/x", train_spec=TrainSpec(max_steps=10),
                          eval_spec=EvalSpec(exporters=[LatestExporter()]), checkpoint_spec=CheckpointSpec())
        before = "fastapi" in sys.modules
        out = flows.train_and_evaluate.serialize_parameters(parameters)
        ours = "fastapi" in sys.modules
        flows.Flow.serialize_parameters(flows.train_and_evaluate, parameters)
        print(json.dumps([before, ours, "fastapi" in sys.modules, out]))
        """
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    before, ours, prefects, out = json.loads(run.stdout.strip().splitlines()[-1])
    assert (before, ours, prefects) == (False, False, True)  # Prefect's own path imports it: the check can fail
    assert out["eval_spec"]["exporters"][0]["kind"] == "latest"


def _is_prefects_own(flow) -> bool:
    from prefect.utilities.callables import ParameterSchema, parameter_schema

    schema = flow.parameters
    return isinstance(schema, ParameterSchema) and schema == parameter_schema(flow.fn) == parameter_schema(flow)


@pytest.mark.parametrize("flow", FLOWS, ids=lambda f: f.name)
def test_a_flows_parameter_schema_read_is_prefects_own(flow):
    """Read from the flow, a copy (`with_options`), Prefect's infrastructure-bound copy (which
    copies the flow's attributes), and the flow loaded from its file as ``prefect deploy`` and a
    worker load a file entrypoint (a second execution of the module, in a process that has it)."""
    from prefect.flows import bind_flow_to_infrastructure, load_flow_from_entrypoint
    from prefect.workers.process import ProcessWorker

    path = pathlib.Path(flows.__file__)
    copies = [flow, flow.with_options(flow_run_name="x"), bind_flow_to_infrastructure(flow, "pool", ProcessWorker),
              load_flow_from_entrypoint(f"{path}:{flow.fn.__name__}")]  # fmt: skip
    for f in copies:
        assert _is_prefects_own(f), f
        assert set(f.parameters.properties) >= {"program", "job", "storage"}


def test_a_fresh_process_builds_no_parameter_schema_as_it_imports_the_flows():
    """The saving itself (~60 ms of every flow run's process start here): importing the flows
    builds none of their four schemas; a flow's is built at its first read, once; copies made
    before that read (`with_options`; Prefect's infrastructure-bound copy; a pickled flow, as
    `serve` sends one: a first form of this change recursed there) each have Prefect's own; a
    flow of someone else's still gets Prefect's at its declaration."""
    code = textwrap.dedent(
        """
        import json, pickle
        import cloudpickle
        import prefect.utilities.callables as callables
        built = []
        generate = callables.generate_parameter_schema
        def counting(*args, **kwargs):
            built.append(1)
            return generate(*args, **kwargs)
        callables.generate_parameter_schema = counting
        from prefect import flow
        from prefect.flows import bind_flow_to_infrastructure
        from prefect.workers.process import ProcessWorker
        from prefect_jax import flows
        at_import = len(built)
        @flow
        def someone_elses(x: int) -> int:
            return x
        theirs = len(built) - at_import
        schema = flows.train_and_evaluate.parameters
        again = flows.train_and_evaluate.parameters
        read = len(built)
        own = callables.parameter_schema(flows.train.fn)
        copies = [flows.train.with_options(name="x"), bind_flow_to_infrastructure(flows.train, "pool", ProcessWorker),
                  pickle.loads(cloudpickle.dumps(flows.train))]
        print(json.dumps([flows.SCHEMAS_ON_DEMAND, at_import, theirs, read, schema is again, sorted(schema.properties),
                          [type(c.parameters).__name__ for c in copies], [c.parameters == own for c in copies]]))
        """
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    applied, at_import, theirs, read, same, properties, types, equal = json.loads(run.stdout.strip().splitlines()[-1])
    assert applied and at_import == 0 and theirs == 1  # the counter counts: someone else's flow was built
    assert read == 2 and same  # train_and_evaluate's, at its first read only
    assert "train_spec" in properties
    assert types == ["ParameterSchema"] * 3 and equal == [True] * 3
