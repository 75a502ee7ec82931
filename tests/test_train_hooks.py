"""Train hooks (TF's `TrainSpec.hooks`, as Levanter's `trainer.add_hook(fn, every=N)`): declared
by import path, called every N steps, after each checkpoint and at the end, and never a change to
the trajectory: a job with hooks, interrupted and resumed, ends in the state of one without."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from prefect_jax.training.program import ProgramError
from prefect_jax.training.specs import TrainHook, TrainSpec
from prefect_jax.training.trainer import Trainer

HOOK = "tests.programs:record_train_hook"


def _train(config, until: int | None = None) -> Trainer:
    trainer = Trainer(config)
    trainer.restore_or_init()
    while trainer.step < (until or config.train.max_steps):
        trainer.train_until_checkpoint()
    if until is None:
        trainer.finish()
    return trainer


def _calls(path) -> list[tuple[str, int]]:
    return [(c["event"], c["step"]) for c in map(json.loads, path.read_text().splitlines())]


def test_hooks_are_called_every_n_steps_at_each_checkpoint_and_at_the_end(
    job_config, tmp_path, monkeypatch
):
    """TF runs TrainSpec.hooks around training; here `every=15` sees steps 15 and 30 with the
    metrics logged there, `checkpoint` each cadence checkpoint, `end` the final step once; and
    the state reached is bit for bit the one a job without hooks reaches (hooks observe only),
    also across a restart between two checkpoints."""
    calls = tmp_path / "calls.jsonl"
    monkeypatch.setenv("PREFECT_JAX_TEST_HOOK_FILE", str(calls))
    plain = _train(job_config(job="plain"))
    expected = plain.fingerprint()
    plain.close()

    hooks = [f"{HOOK}@every=15", f"{HOOK}@checkpoint,end"]
    config = job_config(job="hooked", hooks=hooks)
    first = _train(config, until=20)  # an attempt that ends at its first checkpoint
    first.close()
    assert _calls(calls) == [("step", 15), ("checkpoint", 20)]
    resumed = _train(config)
    assert resumed.fingerprint() == expected
    resumed.close()
    assert _calls(calls) == [
        ("step", 15),
        ("checkpoint", 20),
        ("step", 30),
        ("checkpoint", 40),
        ("end", 40),
    ]
    lines = [json.loads(line) for line in calls.read_text().splitlines()]
    assert all("loss" in c["metrics"] for c in lines)
    assert {(c["job"], c["max_steps"], c["process"]) for c in lines} == {("hooked", 40, 0)}


def test_a_hook_that_requests_a_stop_ends_the_job_at_that_intervals_checkpoint(
    tmp_path, mlflow_uri
):
    """TF's run_context.request_stop() from a hook (StopAtStepHook): a hook at step 25 asks; the
    interval's checkpoint (40) is committed and evaluated, within the throttle too (the job's
    last, as TF's local mode evaluates its last checkpoint at the end; the probe's was
    THROTTLED, never evaluated nor exported), and the job ends there, stopped, its stop request
    durable (a rerun trains no further)."""
    from prefect_jax.flows import train_and_evaluate
    from prefect_jax.training.evaluation import EvalRecords
    from prefect_jax.training.exporters import list_exports
    from prefect_jax.training.specs import CheckpointSpec, EvalSpec, LatestExporter
    from prefect_jax.training.storage import JobStorage

    params = dict(
        program="prefect_jax.examples.digits:tiny",
        job="stops",
        storage=str(tmp_path / "storage"),
        train_spec=TrainSpec(
            max_steps=100, log_every_steps=5, hooks=["tests.programs:stop_at_25@every=5"]
        ),
        checkpoint_spec=CheckpointSpec(every_steps=20),
        eval_spec=EvalSpec(throttle_secs=600, exporters=[LatestExporter()]),
        mlflow_tracking_uri=mlflow_uri,
    )
    summary = train_and_evaluate(**params)
    assert summary["final_step"] == 40, summary
    assert summary["stopped"] == "train hook at step 25: step 25 reached", summary
    assert summary["eval"]["accuracy"] > 0  # the last checkpoint evaluated before the end
    js = JobStorage(params["storage"], "stops")
    assert EvalRecords(js, "eval").steps() == [20, 40]
    assert list_exports(js)["latest"] == [20, 40]
    stop = json.load(open(js.path("stop.json")))
    assert (stop["step"], stop["by"]) == (25, "train hook")
    assert train_and_evaluate(**params)["final_step"] == 40  # a rerun trains no further


def test_a_stop_asked_while_a_step_is_evaluated_has_that_step_evaluated_as_the_last(
    tmp_path, mlflow_uri, monkeypatch
):
    """A person's stop that lands while step 40's evaluation runs (THROTTLED: it is not the
    job's last yet) ends the job at 40 on the loop's next read: 40 is evaluated then, as the
    job's last (a review found it left unevaluated)."""
    from prefect_jax.flows import task_loop, train_and_evaluate
    from prefect_jax.training import control
    from prefect_jax.training import trainer as trainer_module
    from prefect_jax.training.evaluation import EvalRecords
    from prefect_jax.training.specs import CheckpointSpec, EvalSpec
    from prefect_jax.training.storage import JobStorage

    monkeypatch.setattr(trainer_module, "STOP_ANSWER_SECS", 0.0)  # (each ask reads the file)
    evaluate_and_export = task_loop._evaluate_and_export

    def evaluating(config, step, last, on_new=None):
        if step == 40 and not last:
            control.request_stop(JobStorage(config.storage, config.job), "enough", step)
        return evaluate_and_export(config, step, last, on_new)

    monkeypatch.setattr(task_loop, "_evaluate_and_export", evaluating)
    summary = train_and_evaluate(
        program="prefect_jax.examples.digits:tiny",
        job="asked",
        storage=str(tmp_path / "storage"),
        train_spec=TrainSpec(max_steps=100, log_every_steps=10),
        checkpoint_spec=CheckpointSpec(every_steps=20),
        eval_spec=EvalSpec(throttle_secs=600),
        mlflow_tracking_uri=mlflow_uri,
    )
    assert (summary["final_step"], summary["stopped"]) == (40, "enough"), summary
    assert EvalRecords(JobStorage(str(tmp_path / "storage"), "asked"), "eval").steps() == [20, 40]


def test_hook_strings_and_refusals_name_the_hook_and_the_fix():
    spec = TrainSpec(max_steps=10, hooks=["a.b:f", "a.b:g@every=5,end"])
    assert spec.hooks == [
        TrainHook(path="a.b:f", at_checkpoint=True, at_end=True),
        TrainHook(path="a.b:g", every=5, at_end=True),
    ]
    assert TrainSpec.model_validate_json(spec.model_dump_json()) == spec  # a deployment carries it
    with pytest.raises(ValidationError, match=r"'a\.b:f@often'.*'often' is not a time.*@every=N"):
        TrainSpec(max_steps=10, hooks=["a.b:f@often"])
    with pytest.raises(ValidationError, match=r"every=0 must be 1 or more"):
        TrainSpec(max_steps=10, hooks=["a.b:f@every=0"])
    with pytest.raises(ValidationError, match=r"'nomodule' is not an import path"):
        TrainSpec(max_steps=10, hooks=["nomodule"])
    with pytest.raises(ValidationError, match=r"'a\.b:f' is never called"):
        TrainSpec(max_steps=10, hooks=[{"path": "a.b:f"}])


def test_a_hook_that_does_not_load_is_refused_when_the_trainer_starts(job_config):
    config = job_config(hooks=["tests.programs:no_such_hook@every=5"])
    with pytest.raises(
        ProgramError,
        match=r"train hook path 'tests\.programs:no_such_hook': module 'tests\.programs' has no "
        r"attribute 'no_such_hook' \(names it defines: ",
    ):
        Trainer(config)


def test_the_command_s_train_hook_flag_is_the_spec_s_hooks():
    from prefect_jax.cli import build_parser
    from prefect_jax.cli.spec_flags import specs_from_args

    args = build_parser().parse_args(
        ["train", "--program", "p.m:x", "--job", "j", "--storage", "/s"]
        + ["--train-hook", f"{HOOK}@every=10", "--train-hook", HOOK]
    )
    train, _, _ = specs_from_args(args)
    assert [(h.path, h.every, h.at_checkpoint, h.at_end) for h in train.hooks] == [
        (HOOK, 10, False, False),
        (HOOK, None, True, True),
    ]
