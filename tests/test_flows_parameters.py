"""The flows' parameters as Prefect sees them: plain Prefect flows, whose parameter schema is
Prefect's own wherever it is read (no override of Prefect's internals: docs/upstream.md)."""

import json
import pathlib
import subprocess
import sys

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


@pytest.mark.parametrize("flow", FLOWS, ids=lambda f: f.name)
def test_every_flow_takes_program_params(flow):
    assert "program_params" in flow.parameters.properties


@pytest.mark.slow
def test_program_params_reach_the_program_mlflow_and_checkpoints_and_a_change_is_refused(
    tmp_path, mlflow_uri, prefect_server
):
    """`program_params` as a flow parameter: the program is built with them, MLflow has them as
    ``program.<field>`` and the checkpoints record them; a rerun of the job with another value is
    refused before it trains, its checkpoints kept."""
    from mlflow.tracking import MlflowClient

    from prefect_jax.training.checkpoint_dirs import committed_steps, read_meta_file
    from prefect_jax.training.program_params import ProgramParamsMismatchError
    from prefect_jax.training.specs import CheckpointSpec, TrainSpec

    def run(max_steps, **params):
        return flows.train_and_evaluate(
            program="programs:typed_digits",
            program_params=params,
            job="typed",
            storage=str(tmp_path / "storage"),
            train_spec=TrainSpec(max_steps=max_steps, log_every_steps=10),
            checkpoint_spec=CheckpointSpec(every_steps=10),
            mlflow_tracking_uri=mlflow_uri,
        )

    summary = run(20, width=16, learning_rate=0.01)
    logged = MlflowClient(mlflow_uri).get_run(summary["mlflow_run_id"]).data.params
    assert logged["program.width"] == "16" and logged["program.learning_rate"] == "0.01"
    assert logged["program.max_steps"] == "20"  # filled from the train spec
    assert "16, 16" in logged["program_config.hidden"]  # the program was built with them
    recorded = read_meta_file(summary["checkpoint_dir"], 20)["program_params"]
    assert recorded["values"] == {
        "learning_rate": 0.01,
        "width": 16,
        "max_steps": 20,
        "read_threads": 0,
    }
    with pytest.raises(
        ProgramParamsMismatchError, match=r"learning_rate: saved 0\.01, given 0\.02"
    ):
        run(40, width=16, learning_rate=0.02)
    assert committed_steps(summary["checkpoint_dir"]) == [10, 20]
    # The same params (and more steps, read by another number of threads): resumed.
    resumed = run(30, width=16, learning_rate=0.01, read_threads=2)
    assert resumed["final_step"] == 30
    # The evaluator and the exporter build the program with the params its trainer was given
    # (width 16: the default's 32 would not even restore); given others, they are refused.
    from prefect_jax.training import live
    from prefect_jax.training.specs import EvalSpec, LatestExporter

    live.drop_all(close=False)
    role = dict(
        program="programs:typed_digits",
        job="typed",
        storage=str(tmp_path / "storage"),
        train_spec=TrainSpec(max_steps=1000),
        eval_spec=EvalSpec(name="again", exporters=[LatestExporter()]),
        mlflow_tracking_uri=mlflow_uri,
    )
    from prefect_jax.training.facade import preflight

    preflight("programs:typed_digits", "typed", role["storage"], 1000)  # (the evaluate command's)
    preflight("programs:typed_digits", "typed", role["storage"], None, evaluates=False)  # export
    with pytest.raises(ProgramParamsMismatchError, match=r"width: saved 16, given 8"):
        preflight(
            "programs:typed_digits", "typed", role["storage"], None, program_params={"width": 8}
        )
    evaluated = flows.evaluate(**role, once=True)
    assert evaluated["last_step"] == 30 and evaluated["stopped"].startswith("evaluated the final")
    assert evaluated["eval"] == resumed["eval"]  # (the same model, evaluated again)
    assert set(flows.export_flow(**role)) == {"latest"}
    # Its own params go on top (an exempt one, its reading threads, is never taken: its own).
    assert set(flows.export_flow(**role, program_params={"read_threads": 1})) == {"latest"}
    with pytest.raises(ProgramParamsMismatchError, match=r"width: saved 16, given 8"):
        flows.export_flow(**role, program_params={"width": 8})


def test_the_prefect_yaml_bytelm_deployment_carries_valid_program_params():
    """prefect.yaml's example passes program_params: the flow's validation accepts them and the
    program is built with them (``prefect deploy --all`` is tests/test_prefect_yaml_deploy.py's)."""
    import yaml

    from prefect_jax.training.program import load_program

    root = pathlib.Path(__file__).parent.parent
    spec = yaml.safe_load((root / "prefect.yaml").read_text())
    (deployment,) = [d for d in spec["deployments"] if d["name"] == "bytelm-tiny"]
    params = flows.train_and_evaluate.validate_parameters(deployment["parameters"])
    assert params["program_params"] == {"preset": "tiny", "grad_accum": 2, "learning_rate": 0.003}
    max_steps = params["train_spec"].max_steps
    program = load_program(params["program"], params["program_params"], max_steps)
    assert program.cfg.grad_accum == 2 and program.cfg.decay_steps == max_steps == 2000


ROLE_MODULES = {n: m for n, m in flows._WHERE.items() if ".roles." in m}
"""Each flow's module (a flow added to the package's table is covered below as well)."""

# How a process comes to the flow: asked of the package; its module imported first (then the
# package attribute must still be the flow, not the module); and as ``prefect deploy`` and a
# worker's flow run load the entrypoint ``prefect_jax/flows/__init__.py:<flow>``, a second
# execution of the package's file under another module name.
WAYS = {
    "asked": "flow = getattr(flows, NAME)",
    "module first": "importlib.import_module(MODULE); flow = getattr(flows, NAME)",
    "entrypoint": (
        "from prefect.flows import load_flow_from_entrypoint\n"
        "flow = load_flow_from_entrypoint(flows.__file__ + ':' + NAME)\n"
        "assert flow is getattr(flows, NAME), 'the entrypoint loads another flow object'"
    ),
}


@pytest.mark.parametrize("way", sorted(WAYS))
@pytest.mark.parametrize("name", sorted(ROLE_MODULES))
def test_a_fresh_process_declares_only_the_flow_it_asks_for(name, way):
    """Each ``@flow`` builds its parameters' JSON schemas as it is declared (docs/upstream.md 2):
    a process that runs one flow (a command, a rerun, a worker's flow run) declares that one."""
    code = f"""
import importlib, json, sys
from prefect import Flow
from prefect_jax import flows
NAME, MODULE = {name!r}, {ROLE_MODULES[name]!r}
{WAYS[way]}
from prefect_jax.flows import {name} as again
print(json.dumps({{
    "flow": type(flow) is Flow and flow.fn.__name__ == NAME and again is getattr(flows, NAME),
    "modules": sorted(m for m in sys.modules if m.startswith("prefect_jax.flows.roles.")),
}}))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result == {"flow": True, "modules": [ROLE_MODULES[name]]}


def test_the_packages_names_are_its_flows_table():
    assert (
        sorted(flows.__all__)
        == sorted(flows._WHERE)
        == sorted(n for n in dir(flows) if n in flows._WHERE)
    )


def test_no_module_of_the_flows_makes_its_annotations_strings():
    """`serve` sends a flow to its child process with cloudpickle, which copies only the globals
    the function's code uses: string annotations (``from __future__ import annotations``) would
    leave the flows' parameter types unresolvable there, and every served run would fail its
    parameter validation (tests/test_deployment_rerun.py shows it end to end, slowly)."""
    import ast

    root = pathlib.Path(flows.__file__).parent
    modules = sorted(root.rglob("*.py"))
    assert len(modules) >= 10, modules  # the package and its roles, not an empty glob

    def makes_strings(path: pathlib.Path) -> bool:
        return any(
            isinstance(node, ast.ImportFrom)
            and node.module == "__future__"
            and any(alias.name == "annotations" for alias in node.names)
            for node in ast.walk(ast.parse(path.read_text()))
        )

    assert [str(p.relative_to(root)) for p in modules if makes_strings(p)] == []


@pytest.mark.slow
def test_a_flow_runs_storage_of_an_unknown_protocol_is_one_line_naming_the_fix_not_retried(
    tmp_path, mlflow_uri, prefect_server
):
    """A deployment's run does not come through the command's checks: its storage URL was checked
    as the restore task took the lease, and an unknown protocol was fsspec's 40-line traceback
    (a walkthrough's finding). It is the command's one line now, naming the flow's parameter
    (not the command's flag), and no retry runs it again."""
    from prefect_jax.training.remote_errors import RemoteConfigError
    from prefect_jax.training.specs import TrainSpec

    with pytest.raises(RemoteConfigError) as raised:
        flows.train_and_evaluate(
            program="programs:tiny",
            job="j",
            storage="s4://bucket/prefix",
            train_spec=TrainSpec(max_steps=10),
            mlflow_tracking_uri=mlflow_uri,
        )
    message = str(raised.value)
    assert message.startswith("storage s4://bucket/prefix: "), message
    assert "knows no protocol 's4'" in message and "--storage" not in message, message
    assert "spelling" in message and raised.value.__cause__ is None, message


@pytest.mark.slow
def test_a_run_refused_for_its_program_params_leaves_no_job_folder(
    tmp_path, mlflow_uri, prefect_server
):
    """A deployment's run given a bad program param is refused as its trainer is made, after the
    restore task took the job's lease (its folder made): that folder, left empty, was a job that
    `prefect-jax status` listed (a walkthrough's finding)."""
    import os

    from prefect_jax.training.program_params import ProgramParamsError
    from prefect_jax.training.specs import TrainSpec

    with pytest.raises(ProgramParamsError, match="width"):
        flows.train_and_evaluate(
            program="programs:typed_digits",
            program_params={"width": "wide"},
            job="refused",
            storage=str(tmp_path / "storage"),
            train_spec=TrainSpec(max_steps=10),
            mlflow_tracking_uri=mlflow_uri,
        )
    assert not os.path.exists(tmp_path / "storage" / "refused")


@pytest.mark.parametrize(
    "flow, wait, value, said",
    [
        ("evaluate", "poll_secs", -1, "poll_secs: Input should be greater than 0"),
        ("evaluate", "poll_secs", 0, "poll_secs: Input should be greater than 0"),
        ("evaluate", "poll_secs", float("inf"), "poll_secs: Input should be a finite number"),
        ("evaluate", "idle_timeout_secs", -1, "greater than or equal to 0"),
        ("evaluate", "wait_for_first_checkpoint_secs", -5, "greater than or equal to 0"),
        ("export_flow", "max_wait_secs", -1, "max_wait_secs: Input should be greater than or"),
        ("export_flow", "recovery_wait_secs", 0, "recovery_wait_secs: Input should be greater"),
    ],
)
def test_a_roles_wait_that_is_negative_is_refused_by_the_flow_and_its_schema(
    flow, wait, value, said
):
    """(A probe: a negative wait was taken as 0, or failed in time.sleep after the evaluations;
    a poll of 0 spins.) The deployment's schema says so too, for the UI's form."""
    from prefect.exceptions import ParameterTypeError
    from prefect.utilities.callables import parameter_schema

    role = getattr(flows, flow)
    given = {"program": "p:q", "job": "j", "storage": "/s", "train_spec": {"max_steps": 10}}
    with pytest.raises(ParameterTypeError, match=said):
        role.validate_parameters({**given, wait: value})
    schema = json.dumps(parameter_schema(role.fn).properties[wait])
    assert '"minimum": 0' in schema or '"exclusiveMinimum": 0' in schema


@pytest.mark.parametrize(
    "role, flag, value",
    [
        ("evaluate", "--poll-secs", "0"),
        ("evaluate", "--idle-timeout-secs", "-1"),
        ("evaluate", "--max-wait-secs", "-3"),
        ("export", "--max-wait-secs", "nan"),
        ("export", "--recovery-wait-secs", "soon"),
    ],
)
def test_the_commands_refuse_the_same_waits_as_their_flag(role, flag, value, capsys):
    from prefect_jax.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(
            [role, "--program", "p:q", "--job", "j", "--storage", "/s", flag, value]
        )
    err = capsys.readouterr().err
    assert f"{flag}: {value!r} is not a number of seconds" in err and "argument --" in err, err


@pytest.mark.parametrize("where", ["a file", "foo://bucket/cache"])
def test_a_compilation_cache_that_cannot_be_used_is_refused_before_any_work(
    where, tmp_path, mlflow_uri
):
    """(A probe: a file there failed the first task with a raw FileExistsError; an unknown
    protocol only logged warnings, and the job trained uncached.)"""
    from prefect_jax.training.preflight import BadInputError
    from prefect_jax.training.specs import TrainSpec

    cache = where
    if where == "a file":
        cache = str(tmp_path / "cache")
        (tmp_path / "cache").write_text("not a folder")
    with pytest.raises(BadInputError, match=f"^compilation_cache_dir {cache}: ") as refused:
        flows.train_and_evaluate.fn(
            program="programs:tiny",
            job="j",
            storage=str(tmp_path / "s"),
            train_spec=TrainSpec(max_steps=10),
            mlflow_tracking_uri=mlflow_uri,
            compilation_cache_dir=cache,
        )
    fix = "give compilation_cache_dir a directory" if where == "a file" else "knows no protocol"
    assert fix in str(refused.value)
    assert not (tmp_path / "s").exists()  # nothing of the job was made


@pytest.mark.parametrize("flow", ["train_and_evaluate", "train", "evaluate", "export_flow"])
def test_a_program_object_for_the_program_is_refused_naming_the_import_path_to_give(flow):
    """(A probe: pydantic said only "Input should be a valid string".)"""
    from prefect.exceptions import ParameterTypeError
    from prefect.utilities.callables import parameter_schema

    from prefect_jax.examples.digits import tiny

    role = getattr(flows, flow)
    given = {"job": "j", "storage": "/s", "train_spec": {"max_steps": 10}}
    with pytest.raises(ParameterTypeError, match="is not an import path: give the program as"):
        role.validate_parameters({**given, "program": tiny})
    assert role.validate_parameters({**given, "program": "p:q"})["program"] == "p:q"
    assert parameter_schema(role.fn).properties["program"]["type"] == "string"


@pytest.mark.parametrize("flow", ["train_and_evaluate", "train"])
def test_a_train_hook_in_its_string_form_passes_the_deployments_schema(flow):
    """docs/program.md shows a hook as "pkg.mod:fn@every=100" in a deployment's JSON; the
    server's validation of the parameters against the flow's schema refused it (422: "is not of
    type 'object'"). It is validated as the server does (Prefect's own `validate`)."""
    from prefect.utilities.callables import parameter_schema
    from prefect.utilities.schema_tools.validation import ValidationError, validate

    schema = parameter_schema(getattr(flows, flow).fn).model_dump_for_openapi()
    hooks = ["tests.hooks:slow@every=1", {"path": "tests.hooks:slow", "at_end": True}]
    given = {"program": "p:q", "job": "j", "storage": "/s"}
    validate(
        {**given, "train_spec": {"max_steps": 10, "hooks": hooks}}, schema, raise_on_error=True
    )
    with pytest.raises(ValidationError):
        validate(
            {**given, "train_spec": {"max_steps": 10, "hooks": [5]}}, schema, raise_on_error=True
        )
