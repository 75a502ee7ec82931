import json

import pytest
from pydantic import ValidationError

from prefect_jax.training.specs import (
    BestExporter,
    CheckpointSpec,
    EvalSpec,
    FinalExporter,
    JobConfig,
    LatestExporter,
    TrainSpec,
    check_name,
)


@pytest.mark.parametrize(
    "build, field, value, fix",
    [
        (lambda: TrainSpec(max_steps=0), "max_steps", "0", "total number of training steps"),
        (lambda: TrainSpec(max_steps=-5), "max_steps", "-5", "total number of training steps"),
        (
            lambda: TrainSpec(max_steps=10, log_every_steps=0),
            "log_every_steps",
            "0",
            "log every N>=1",
        ),
        (lambda: CheckpointSpec(every_steps=0), "every_steps", "0", "checkpoint every N>=1"),
        (
            lambda: CheckpointSpec(every_secs=-1.0),
            "every_secs",
            "-1.0",
            "positive number of seconds",
        ),
        (lambda: CheckpointSpec(keep_last=0), "keep_last", "0", "keep at least 1"),
        (
            lambda: CheckpointSpec(every_steps=None, every_secs=None),
            "every_steps=None",
            "every_secs=None",
            "set every_steps",
        ),
        (lambda: EvalSpec(steps=0), "steps", "0", "None for the whole eval set"),
        (lambda: EvalSpec(throttle_secs=-1), "throttle_secs", "-1", ">= 0"),
        (lambda: EvalSpec(name="../x"), "eval name", "'../x'", "no '..'"),
        (
            lambda: EvalSpec(name="train"),
            "eval name",
            "'train'",
            "give the evaluation another name",
        ),
        (
            lambda: EvalSpec(name="goodput"),
            "eval name",
            "'goodput'",
            "give the evaluation another name",
        ),
        (
            lambda: EvalSpec(name="system"),
            "eval name",
            "'system'",
            "give the evaluation another name",
        ),
        (lambda: LatestExporter(keep=0), "keep", "0", "keep at least 1"),
        (
            lambda: EvalSpec(export_platforms=["cpu", "gpu"]),
            "export_platforms",
            "['gpu']",
            "'cuda' for NVIDIA GPUs",
        ),
        (
            lambda: EvalSpec(export_platforms=[]),
            "export_platforms",
            "[]",
            "None for the job's platform and cpu",
        ),
        # (a probe of the Python API: these trained, or failed later with another's message)
        (lambda: TrainSpec(max_steps=10, seed=-1), "seed", "-1", "between 0 and 2**32-1"),
        (lambda: TrainSpec(max_steps=10, seed=2**32), "seed", "4294967296", "between 0 and"),
        (
            lambda: TrainSpec(max_steps=10, max_reruns_without_progress=-1),
            "max_reruns_without_progress",
            "-1",
            "0 or more, or None",
        ),
        (lambda: TrainSpec(max_steps=True), "max_steps", "True", "give the number"),
        (lambda: CheckpointSpec(keep_last=False), "keep_last", "False", "give the number"),
        (
            lambda: CheckpointSpec(every_steps=None, every_secs=float("nan")),
            "every_secs",
            "nan",
            "finite number",
        ),
        (lambda: CheckpointSpec(keep_every_secs=float("inf")), "keep_every_secs", "inf", "finite"),
        (
            lambda: TrainSpec(max_steps=10, sigterm_grace_secs=float("nan")),
            "grace",
            "nan",
            "finite",
        ),
    ],
)
def test_bad_values_are_refused_naming_field_value_and_fix(build, field, value, fix):
    with pytest.raises(ValidationError) as err:
        build()
    message = str(err.value)
    assert field in message and value in message and fix in message


def test_duplicate_exporter_names_are_refused():
    with pytest.raises(ValidationError, match=r"share the name\(s\) \['latest'\]"):
        EvalSpec(exporters=[LatestExporter(), LatestExporter(keep=2)])


def test_exporters_take_one_exporter_an_iterable_or_none_as_tf_eval_spec_does():
    """TF's `EvalSpec(exporters=...)`: one exporter, an iterable of them, or None."""
    latest, best = LatestExporter(), BestExporter(metric="loss", mode="min")
    assert EvalSpec(exporters=latest).exporters == [latest]
    assert EvalSpec(exporters=(latest, best)).exporters == [latest, best]
    assert EvalSpec(exporters=iter([best])).exporters == [best]
    assert EvalSpec(exporters=None).exporters == []
    # A deployment's JSON may carry one exporter too.
    spec = EvalSpec.model_validate_json('{"exporters": {"kind": "final"}}')
    assert spec.exporters == [FinalExporter()]


@pytest.mark.parametrize(
    "value, named", [("latest", "exporters='latest'"), (3, "exporters=3"), ([1], "exporters[0]=1")]
)
def test_what_is_not_an_exporter_is_refused_naming_the_value_and_the_fix(value, named):
    with pytest.raises(ValidationError) as err:
        EvalSpec(exporters=value)
    assert named in str(err.value)
    assert "give LatestExporter(), BestExporter(metric=..., mode=...) or FinalExporter()" in str(
        err.value
    )


def test_unknown_fields_are_refused_naming_the_nearest_field():
    with pytest.raises(ValidationError, match="TrainSpec has no field 'max_step': did you mean "):
        TrainSpec(max_step=10)
    with pytest.raises(ValidationError) as refused:
        CheckpointSpec.model_validate({"every_step": 10})  # (as a deployment's JSON gives it)
    assert "has no field 'every_step': did you mean 'every_steps'? its fields are" in str(
        refused.value
    )
    with pytest.raises(ValidationError, match="has no field 'zzz': its fields are steps, name"):
        EvalSpec(zzz=1)
    # a bool is still a bool where the field takes one, and the string forms still parse
    assert TrainSpec(max_steps=10, check_finite=False).check_finite is False
    assert TrainSpec(max_steps=10, hooks=["os:getcwd@every=2"]).hooks[0].every == 2


@pytest.mark.parametrize("name", ["..", "a/b", "/abs", "a\\b", "", "x..y", "-lead"])
def test_names_that_escape_the_job_are_refused(name):
    with pytest.raises(ValueError, match="not a valid name"):
        check_name("job", name)


def test_specs_round_trip_through_json_with_exporter_kinds():
    config = JobConfig(
        program="m:p",
        job="j-1",
        storage="/tmp/x",
        train=TrainSpec(max_steps=10),
        eval=EvalSpec(
            exporters=[
                LatestExporter(keep=2),
                BestExporter(metric="accuracy", mode="max"),
                FinalExporter(),
            ]
        ),
        checkpoint=CheckpointSpec(every_steps=5, keep_every_steps=10),
    )
    again = JobConfig.model_validate(json.loads(config.model_dump_json()))
    assert again == config
    assert [type(e) for e in again.eval.exporters] == [LatestExporter, BestExporter, FinalExporter]


def test_the_exporter_kinds_named_once_are_the_exporter_classes_kinds():
    """`names.EXPORTER_KINDS` (the command's --exporters choices, the specs' JSON check) lists
    the kinds of the exporter classes the specs' union takes, in order."""
    from typing import get_args

    from prefect_jax.training.eval_specs import ExporterSpec
    from prefect_jax.training.names import EXPORTER_KINDS

    classes = get_args(get_args(ExporterSpec)[0])
    assert tuple(cls.model_fields["kind"].default for cls in classes) == EXPORTER_KINDS


def test_job_config_refuses_bad_job_name():
    with pytest.raises(ValidationError, match="job '../evil' is not a valid name"):
        JobConfig(program="m:p", job="../evil", storage="/tmp/x", train=TrainSpec(max_steps=1))


def test_build_specs_makes_the_named_exporters_and_refuses_an_unknown_name():
    """The facade's exporters by name (the command's --exporters): an unknown name is refused,
    naming it, rather than dropped (a job that would never export what its caller asked)."""
    from prefect_jax.training.facade import build_specs

    _, evaluation, _ = build_specs({"max_steps": 100}, {}, {}, ["latest", "best", "final"])
    assert [e.name for e in evaluation.exporters] == ["latest", "best", "final"]
    refused = "exporter 'newest': not an exporter; give one of latest, best, final"
    with pytest.raises(ValueError, match=refused):
        build_specs({"max_steps": 100}, {}, {}, ["latest", "newest"])
