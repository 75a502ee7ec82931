"""train_until_checkpoint retries: a failed interval restores the last
checkpoint and resumes exactly."""

import os

import pytest
from mlflow.tracking import MlflowClient
from process_helpers import settled_task_runs

from prefect_jax.flows import train_and_evaluate
from prefect_jax.training.names import JOB_TAG
from prefect_jax.training.specs import CheckpointSpec, EvalSpec, RetrySpec, TrainSpec
from prefect_jax.training.storage import JobStorage

pytestmark = [pytest.mark.usefixtures("prefect_server"), pytest.mark.slow]


def _run(tmp_path, mlflow_uri, program, job, **options):
    params = dict(
        program=program,
        job=job,
        storage=str(tmp_path / "storage"),
        train_spec=TrainSpec(max_steps=40, log_every_steps=10),
        checkpoint_spec=CheckpointSpec(every_steps=20),
        mlflow_tracking_uri=mlflow_uri,
        return_state=True,
    )
    return train_and_evaluate(**{**params, **options})


def _mlflow_run(mlflow_uri, tmp_path, job):
    client = MlflowClient(mlflow_uri)
    exp = client.get_experiment_by_name("prefect-jax")
    job_dir = JobStorage(str(tmp_path / "storage"), job).job_dir
    (run,) = client.search_runs(
        [exp.experiment_id], filter_string=f"tags.`{JOB_TAG}` = '{job_dir}'"
    )
    return run


def test_a_transient_failure_is_retried_from_the_checkpoint_and_ends_exactly(tmp_path, mlflow_uri):
    clean = _run(tmp_path, mlflow_uri, "prefect_jax.examples.digits:tiny", "clean").result()
    state = _run(tmp_path, mlflow_uri, "programs:transient", "flaky")
    assert state.is_completed()
    flaky = state.result()
    assert flaky["state_fingerprint"] == clean["state_fingerprint"]
    runs = {
        r.name: r
        for r in settled_task_runs(
            state.state_details.flow_run_id, "train 0 to 20", "train 20 to 40"
        )
    }
    assert runs["train 20 to 40"].run_count == 2 and runs["train 20 to 40"].state.is_completed()
    assert runs["train 0 to 20"].run_count == 1


def test_task_retries_are_not_counted_as_reruns_without_progress(tmp_path, mlflow_uri):
    """Two retries of one interval restore the same step twice in one flow run: no rerun, so
    the rerun budget (TrainSpec.max_reruns_without_progress) is not spent on them."""
    import json

    state = _run(tmp_path, mlflow_uri, "programs:transient_twice", "flaky2")
    assert state.is_completed()
    runs = {r.name: r for r in settled_task_runs(state.state_details.flow_run_id, "train 20 to 40")}
    assert runs["train 20 to 40"].run_count == 3
    attempts = json.load(open(tmp_path / "storage" / "flaky2" / "attempts.json"))
    assert attempts["step"] == 20 and attempts["reruns_without_progress"] == 0, attempts


def test_a_retry_spec_without_retries_does_not_retry_a_transient_failure(tmp_path, mlflow_uri):
    state = _run(
        tmp_path, mlflow_uri, "programs:transient", "flaky", retry_spec=RetrySpec(retries=0)
    )
    assert state.is_failed()
    runs = {r.name: r for r in settled_task_runs(state.state_details.flow_run_id, "train 20 to 40")}
    assert runs["train 20 to 40"].run_count == 1 and runs["train 20 to 40"].state.is_failed()


def test_a_permanent_failure_fails_the_flow_and_the_mlflow_run(tmp_path, mlflow_uri):
    state = _run(tmp_path, mlflow_uri, "programs:permanent", "broken")
    assert state.is_failed()
    with pytest.raises(TypeError, match="injected failure producing batch 5"):
        state.result()
    assert _mlflow_run(mlflow_uri, tmp_path, "broken").info.status == "FAILED"
    runs = {r.name: r for r in settled_task_runs(state.state_details.flow_run_id, "train 0 to 20")}
    assert runs["train 0 to 20"].run_count == 1  # not retried: a retry cannot fix it
    assert not (tmp_path / "storage" / "broken" / "lease.json").exists()


def test_training_data_that_ends_is_not_retried_and_the_error_says_to_repeat_it(
    tmp_path, mlflow_uri
):
    """A `train_data` not repeated ends (here an IterDataset, after 25 batches): the
    StopIteration was retried twice and reached the user bare; it is a program error naming the
    step and the fix."""
    from prefect_jax.training.program import ProgramError

    state = _run(tmp_path, mlflow_uri, "programs:finite", "finite")
    assert state.is_failed()
    with pytest.raises(
        ProgramError, match=r"train_data\(seed\) ended before step 26.*\.repeat\(\)"
    ):
        state.result()
    runs = {r.name: r for r in settled_task_runs(state.state_details.flow_run_id, "train 20 to 40")}
    assert runs["train 20 to 40"].run_count == 1
    storage = JobStorage(str(tmp_path / "storage"), "finite")
    assert storage.list_int_names(storage.checkpoint_dir) == [20]  # (what was saved stays)


def test_training_data_of_fewer_batches_than_max_steps_is_refused_before_training(
    tmp_path, mlflow_uri
):
    """A MapDataset knows its length: 25 batches for max_steps=40 is refused as the data
    iterator is made, not found an interval later, and nothing is trained or retried."""
    from prefect_jax.training.program import ProgramError

    state = _run(tmp_path, mlflow_uri, "programs:finite_map", "short")
    assert state.is_failed()
    with pytest.raises(
        ProgramError,
        match=r"train_data\(seed\) has 25 batches, fewer than max_steps=40, so it would end at "
        r"step 25: it must never end .*\.repeat\(\)",
    ):
        state.result()
    runs = settled_task_runs(state.state_details.flow_run_id)
    assert [r.name for r in runs if r.name.startswith("train")] == []
    assert all(r.run_count == 1 for r in runs), [(r.name, r.run_count) for r in runs]
    storage = JobStorage(str(tmp_path / "storage"), "short")
    assert storage.list_int_names(storage.checkpoint_dir) == []


def test_an_endless_eval_data_read_whole_is_refused_not_run_until_killed(tmp_path, mlflow_uri):
    """eval_data().repeat() with eval steps None: the evaluation never ended, and logged nothing.
    A command refuses it before any work, a flow before training; a resumed job's evaluation, not
    retried, its step kept; with a number of eval batches (TF's EvalSpec.steps) it evaluates."""
    from programs import EndlessThenBatched

    from prefect_jax.training.errors import EndlessEvalDataError
    from prefect_jax.training.evaluation import refuse_endless_eval_data
    from prefect_jax.training.facade import preflight

    endless = r"eval_data\(\) never ends .* give a number of eval batches \(--eval-steps N"
    with pytest.raises(EndlessEvalDataError, match=endless):
        preflight("programs:endless_eval", "e", str(tmp_path / "storage"), eval_spec=EvalSpec())
    with pytest.raises(EndlessEvalDataError, match=endless):  # (a length over the batch size)
        refuse_endless_eval_data(EndlessThenBatched().eval_data(), None)
    state = _run(tmp_path, mlflow_uri, "programs:endless_eval", "endless")
    assert state.is_failed()
    with pytest.raises(EndlessEvalDataError, match=endless):
        state.result()
    storage = JobStorage(str(tmp_path / "storage"), "endless")
    assert not os.path.exists(storage.checkpoint_dir) or not os.listdir(storage.checkpoint_dir)
    # A job trained without it (steps=2), resumed with it: its first evaluation, not retried.
    params = dict(
        eval_spec=EvalSpec(steps=2), train_spec=TrainSpec(max_steps=20, log_every_steps=10)
    )
    assert _run(tmp_path, mlflow_uri, "programs:endless_eval", "endless", **params).is_completed()
    state = _run(tmp_path, mlflow_uri, "programs:endless_eval", "endless")
    with pytest.raises(EndlessEvalDataError, match=endless):
        state.result()
    runs = settled_task_runs(state.state_details.flow_run_id)
    (evaluation,) = [r for r in runs if r.name == "evaluate 40"]
    assert evaluation.run_count == 1 and evaluation.state.is_failed()
    assert storage.list_int_names(storage.checkpoint_dir) == [20, 40]


def test_an_eval_step_of_means_found_by_the_evaluation_is_not_retried(tmp_path, mlflow_uri):
    """An eval_step returning means, in a program that declares its metric names (so nothing
    traces it before training): its first evaluation fails the run, naming the fix, and the
    evaluate task is not retried (every retry returns the same means)."""
    from prefect_jax.training.errors import EvalOutputError

    state = _run(tmp_path, mlflow_uri, "programs:mean_eval_named", "means")
    assert state.is_failed()
    with pytest.raises(EvalOutputError, match=r"each metric must be a \(sum, count\) pair"):
        state.result()
    runs = {r.name: r for r in settled_task_runs(state.state_details.flow_run_id)}
    (evaluation,) = [r for r in runs.values() if r.name.startswith("evaluate")]
    assert evaluation.run_count == 1


def test_out_of_memory_is_not_retried_and_the_run_is_told_what_to_change(
    tmp_path, mlflow_uri, caplog
):
    """The same step in the same process needs the same memory: two retries would each restore
    and fail again (on a GPU, minutes each)."""
    with caplog.at_level("ERROR"):
        state = _run(tmp_path, mlflow_uri, "programs:out_of_memory", "oom")
    assert state.is_failed()
    with pytest.raises(RuntimeError, match="^RESOURCE_EXHAUSTED: Out of memory"):
        state.result()
    runs = {r.name: r for r in settled_task_runs(state.state_details.flow_run_id, "train 20 to 40")}
    assert runs["train 20 to 40"].run_count == 1
    assert "Lower the batch size" in caplog.text and "--no-device-copy" in caplog.text


def test_a_nan_loss_before_any_checkpoint_says_a_rerun_starts_from_init():
    """It said "the newest checkpoint is step None ... a rerun resumes from that checkpoint"."""
    from prefect_jax.training.errors import NonFiniteLossError

    said = str(NonFiniteLossError(19, {"loss": float("nan")}, None))
    assert "(the means logged from it: loss=nan)" in said, said
    assert said.endswith("no step of the job is committed: a rerun starts from init."), said
    warm = str(NonFiniteLossError(19, {"loss": float("nan")}, None, warm_started=True))
    assert warm.endswith("a rerun warm-starts again (checkpoint_path)."), warm


def test_a_nan_loss_stops_at_its_step_without_retry_or_checkpoint(tmp_path, mlflow_uri):
    from prefect_jax.training.errors import NonFiniteLossError

    state = _run(tmp_path, mlflow_uri, "programs:diverges_at_33", "nan")
    assert state.is_failed()
    with pytest.raises(
        NonFiniteLossError,
        match="non-finite training metric at step 33 .*resumes from its newest checkpoint, step 20",
    ):
        state.result()
    committed = sorted(p.name for p in (tmp_path / "storage" / "nan" / "checkpoints").iterdir())
    assert committed == ["20"]
    runs = {r.name: r for r in settled_task_runs(state.state_details.flow_run_id, "train 20 to 40")}
    assert runs["train 20 to 40"].run_count == 1
