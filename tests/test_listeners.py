"""TF's eval listener and throttle through the flows: a `_ContinuousEvalListener` ported
unchanged through the `evaluate` flow and through local mode (`train_and_evaluate`), and the
throttled middle evaluation of local mode."""

import pytest
from programs import StopAfterTwo

from prefect_jax.flows import evaluate, train, train_and_evaluate
from prefect_jax.training.specs import CheckpointSpec, EvalSpec, LatestExporter, TrainSpec
from prefect_jax.training.storage import JobStorage

pytestmark = pytest.mark.usefixtures("prefect_server")

AFTER_40 = (
    "eval listener StopAfterTwo.after_eval returned False after step 40: no more evaluations "
    "(TF's _ContinuousEvalListener; return True to keep evaluating)"
)


def _params(tmp_path, mlflow_uri, job, max_steps=80, **eval_kw):
    return dict(
        program="prefect_jax.examples.digits:tiny",
        job=job,
        storage=str(tmp_path / "storage"),
        train_spec=TrainSpec(max_steps=max_steps, log_every_steps=10),
        checkpoint_spec=CheckpointSpec(every_steps=20, keep_last=None),
        eval_spec=EvalSpec(**eval_kw),
        mlflow_tracking_uri=mlflow_uri,
    )


def _records(params) -> list[int]:
    from prefect_jax.training.evaluation import EvalRecords

    return EvalRecords(JobStorage(params["storage"], params["job"]), "eval").steps()


def test_a_tf_listener_ported_ends_the_evaluator_after_its_false(tmp_path, mlflow_uri):
    """TF's `run_evaluator`: `after_eval(eval_result)` answering False ends the continuous
    evaluation, after that evaluation's exports. The listener is TF's shape (`before_eval(self)`,
    `after_eval(self, eval_result)`), named by import path; the trainer is not stopped."""
    StopAfterTwo.seen.clear()
    StopAfterTwo.paths.clear()
    params = _params(
        tmp_path,
        mlflow_uri,
        "listen-eval",
        hooks=["programs:StopAfterTwo"],
        exporters=[LatestExporter()],
    )
    assert train(**params)["final_step"] == 80

    from prefect_jax.training import live

    live.drop_all(close=False)  # the evaluator is another process: no live state
    result = evaluate(**params, poll_secs=0.1)
    assert result["evaluated"] == [20, 40] and result["stopped"] == AFTER_40
    assert result["exports"] == {"latest": [20, 40]}
    assert StopAfterTwo.seen == [20, 40] and _records(params) == [20, 40]
    checkpoints = tmp_path / "storage" / "listen-eval" / "checkpoints"
    assert StopAfterTwo.paths == [f"{checkpoints}/20", f"{checkpoints}/40"]
    assert not (tmp_path / "storage" / "listen-eval" / "stop.json").exists()


def test_a_tf_listener_in_local_mode_ends_the_evaluations_and_training_goes_on(
    tmp_path, mlflow_uri
):
    """TF's `_ContinuousEvalListener` in `train_and_evaluate`: `after_eval` answering False ends
    the evaluations (and exports) of the job; here training goes on to max_steps (prefect-jax's
    choice: the job's checkpoints are those of a trainer beside an evaluator that stopped)."""
    StopAfterTwo.seen.clear()
    params = _params(
        tmp_path,
        mlflow_uri,
        "listen-local",
        hooks=["programs:StopAfterTwo"],
        exporters=[LatestExporter()],
    )
    summary = train_and_evaluate(**params)
    assert summary["final_step"] == 80 and summary["stopped"] is None
    assert summary["evaluation_stopped"] == AFTER_40
    assert summary["eval"] == {} and summary["exports"] == {"latest": [20, 40]}
    assert StopAfterTwo.seen == [20, 40] and _records(params) == [20, 40]


def test_local_mode_throttles_the_middle_evaluation_but_never_the_final(tmp_path, mlflow_uri):
    """TF's local mode (`_NewCheckpointListenerForEvaluate`): a checkpoint less than
    `throttle_secs` after the last evaluation is not evaluated; the final one always is."""
    params = _params(tmp_path, mlflow_uri, "throttled", max_steps=60, throttle_secs=3600)
    summary = train_and_evaluate(**params)
    assert summary["final_step"] == 60 and set(summary["eval"]) == {"accuracy", "loss"}
    assert _records(params) == [20, 60]  # 40 came within the hour after 20: THROTTLED


def test_a_listener_that_raises_fails_the_evaluator_naming_it_and_is_not_retried_past(
    tmp_path, mlflow_uri
):
    """A retry would find the step recorded and never call the listener on it again, then end
    Completed: the evaluator fails instead, once, naming the listener, its error and the step."""
    from prefect_jax.training.errors import EvalHookError

    params = _params(
        tmp_path, mlflow_uri, "raising", max_steps=40, hooks=["programs:RaisingListener"]
    )
    assert train(**params)["final_step"] == 40

    from prefect_jax.training import live

    live.drop_all(close=False)
    with pytest.raises(EvalHookError) as raised:
        evaluate(**params, poll_secs=0.1)
    assert str(raised.value).startswith(
        "eval hook RaisingListener.after_eval raised KeyError: 'checkpoint_step' (step 20, its "
        "evaluation recorded); fix the hook and run the job again"
    )
    assert _records(params) == [20]  # recorded once; not evaluated on by a retry
