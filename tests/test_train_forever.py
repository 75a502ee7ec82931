"""``TrainSpec(max_steps=None)``: TF's train-until-stopped. No final step: the job ends on a stop
request (or a preemption, or a cancel), the evaluator keeps waiting for new checkpoints, the
`FinalExporter` exports nothing, and a rerun resumes exactly where the stopped run ended."""

from __future__ import annotations

import os

import pytest

from prefect_jax.training.policy import CheckpointPolicy
from prefect_jax.training.specs import (
    CheckpointSpec,
    EvalSpec,
    FinalExporter,
    JobConfig,
    LatestExporter,
    TrainSpec,
)
from tests.test_evaluator import Clock, Job, _evaluator


def test_the_cadence_of_a_job_without_max_steps_has_no_end():
    policy = CheckpointPolicy.for_training(CheckpointSpec(every_steps=200), None)
    assert [policy.next_boundary(s) for s in (0, 199, 200, 10**6)] == [200, 200, 400, 10**6 + 200]
    assert policy.is_off_cadence(250) and not policy.is_off_cadence(400)  # (a SIGTERM's step)
    by_time = CheckpointPolicy.for_training(CheckpointSpec(every_steps=None, every_secs=60), None)
    assert by_time.next_boundary(10**6) > 10**12  # the interval ends when the time cadence says
    # The train task's name and log line say so, not a step 2**62 away.
    from prefect_jax.tasks.train import _end_step

    assert (_end_step(by_time, 10**6), _end_step(policy, 199)) == (None, 200)
    # A policy opened for retention only still has no cadence to give.
    with pytest.raises(ValueError, match="decides retention only"):
        CheckpointPolicy.from_spec(CheckpointSpec()).next_boundary(0)


def test_max_steps_none_is_tf_s_train_forever_and_the_command_says_none():
    from prefect_jax.cli import build_parser

    assert TrainSpec(max_steps=None).max_steps is None
    assert not TrainSpec(max_steps=None).is_final(10**9) and TrainSpec(max_steps=5).is_final(5)
    with pytest.raises(ValueError, match=r"max_steps=0 must be a positive.*or None to train until"):
        TrainSpec(max_steps=0)
    base = ["train", "--program", "p.m:x", "--job", "j", "--storage", "/s", "--max-steps"]
    assert build_parser().parse_args([*base, "none"]).max_steps is None
    assert build_parser().parse_args([*base, "300"]).max_steps == 300
    with pytest.raises(SystemExit):
        build_parser().parse_args([*base, "forever"])


def test_the_evaluator_of_a_job_without_max_steps_never_sees_a_final_step():
    """TF's evaluator of a job that trains forever waits for new checkpoints until it is stopped:
    the newest step is no final one (the throttle applies to it), and only the idle timeout (or a
    stop request, `once`, the flow run's end) ends it."""
    clock = Clock()
    job = Job(clock, committed=[10], appear={20: 7.0, 100: 12.0})
    evaluator = _evaluator(job, clock, max_steps=None, throttle_secs=6.0, idle_timeout_secs=30.0)
    assert evaluator.wait_for_first_checkpoint() == 10
    stopped = evaluator.run()
    assert evaluator.evaluated == [10, 20, 100]
    assert [at for _, at in job.asked] == [0.0, 10.0, 16.0]  # 100 waited for the throttle too
    assert "30" in stopped and "final" not in stopped

    clock = Clock()
    job = Job(clock, committed=[10, 20])
    asked = _evaluator(job, clock, max_steps=None, stop_request=lambda: {"reason": "enough"})
    assert asked.run() == "the job was asked to stop: enough"
    # A stop request is how such a job ends: its checkpoints are evaluated and exported first
    assert asked.evaluated == [10, 20] and job.exported == [10, 20]


def _config(tmp_path, mlflow_uri, job: str, max_steps: int | None) -> JobConfig:
    return JobConfig(
        program="prefect_jax.examples.digits:tiny",
        job=job,
        storage=str(tmp_path / "storage"),
        train=TrainSpec(max_steps=max_steps, log_every_steps=10),
        checkpoint=CheckpointSpec(every_steps=20, keep_last=None),
        eval=EvalSpec(
            exporters=[LatestExporter(), FinalExporter()],
            hooks=["tests.programs:StopJobAtEnvStep"],
            registered_model="",
        ),
        mlflow_tracking_uri=mlflow_uri,
    )


@pytest.mark.slow
@pytest.mark.usefixtures("prefect_server")
def test_a_job_without_max_steps_trains_until_stopped_and_resumes_exactly(
    tmp_path, mlflow_uri, monkeypatch
):
    """train_and_evaluate with max_steps=None: stopped by a stop request after two checkpoints
    it ends Completed at that step, with no final evaluation required and no `final` export;
    with the request removed, the rerun resumes there and is stopped again, in the state an
    uninterrupted finite job reaches at that step."""
    from prefect_jax.flows import train_and_evaluate
    from prefect_jax.training.control import stop_path
    from prefect_jax.training.storage import JobStorage
    from prefect_jax.training.trainer import Trainer

    config = _config(tmp_path, mlflow_uri, "forever", None)
    params = dict(
        program=config.program,
        job=config.job,
        storage=config.storage,
        train_spec=config.train,
        eval_spec=config.eval,
        checkpoint_spec=config.checkpoint,
        mlflow_tracking_uri=mlflow_uri,
    )
    monkeypatch.setenv("PREFECT_JAX_TEST_STOP_AT", "40")
    first = train_and_evaluate(**params)
    assert first["final_step"] == 40 and first["stopped"]
    assert set(first["exports"]) == {"latest"}  # no final step: the FinalExporter waits
    js = JobStorage(config.storage, config.job)
    os.remove(stop_path(js))  # the person who stopped it lets it go on

    monkeypatch.setenv("PREFECT_JAX_TEST_STOP_AT", "80")
    second = train_and_evaluate(**params)
    assert second["final_step"] == 80 and second["stopped"]
    assert set(second["exports"]) == {"latest"}

    finite = _config(tmp_path / "finite", mlflow_uri, "finite", 80)
    trainer = Trainer(finite.model_copy(update={"eval": EvalSpec()}))
    trainer.restore_or_init()
    while trainer.step < 80:
        trainer.train_until_checkpoint()
    assert trainer.fingerprint() == second["state_fingerprint"]
    trainer.finish()
    trainer.close()


@pytest.mark.slow
def test_a_command_without_max_steps_is_preempted_resumed_and_stopped(
    tmp_path, prefect_server, mlflow_uri
):
    """``prefect-jax run --max-steps none``: SIGTERM checkpoints the step in flight (exit 143);
    the rerun resumes there and trains on until a stop request, ending at the next boundary,
    bit for bit where an uninterrupted job of that many steps ends; nothing is a final step."""
    import json
    import signal

    from process_helpers import start_run, status, wait_until

    from prefect_jax.training.checkpoint_dirs import committed_steps
    from prefect_jax.training.control import request_stop
    from prefect_jax.training.storage import JobStorage
    from tests.test_preemption import _uninterrupted_fingerprint

    storage = str(tmp_path / "storage")
    ckpt = os.path.join(storage, "ever", "checkpoints")
    args = ["--program", "programs:big", "--job", "ever", "--storage", storage]
    args += ["--max-steps", "none", "--checkpoint-every-steps", "100", "--keep-last", "10"]
    args += ["--exporters", "latest", "final", "--registered-model", ""]
    args += ["--mlflow-tracking-uri", mlflow_uri, "--json", "--no-progress"]
    proc = start_run(args, prefect_server, tmp_path / "1.log")
    wait_until(lambda: 200 in committed_steps(ckpt), 300, "step 200 to commit", proc)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 143
    at = committed_steps(ckpt)[-1]
    assert at >= 200

    proc = start_run(args, prefect_server, tmp_path / "2.log")
    boundary = (at // 100 + 1) * 100
    wait_until(lambda: boundary in committed_steps(ckpt), 300, f"step {boundary}", proc)
    request_stop(JobStorage(storage, "ever"), "enough", by="the test")
    assert proc.wait(timeout=300) == 0, (tmp_path / "2.log").read_text()[-3000:]
    summary = json.loads((tmp_path / "2.log").read_text().strip().splitlines()[-1])
    end = summary["final_step"]
    assert end % 100 == 0 and end >= boundary and summary["stopped"] == "enough"
    assert "final" not in status("ever", storage)["exports"]
    assert summary["state_fingerprint"] == _uninterrupted_fingerprint(
        tmp_path, mlflow_uri, max_steps=end, every=100
    )


def test_an_interval_with_no_end_step_trains_until_asked_to_stop():
    """max_steps=None with a time-only cadence: the interval's target is `policy.NO_END` (past any
    step count the compiled step's int32 guard holds); it trains and logs until `stop()` says."""
    from prefect_jax.training.loop import Loop
    from prefect_jax.training.policy import NO_END
    from prefect_jax.training.program import load_program

    spec = TrainSpec(max_steps=None, log_every_steps=10)
    loop = Loop(load_program("prefect_jax.examples.digits:tiny"), spec)
    calls = iter(range(1, 100))
    interval = loop.run(
        loop.place(loop.init_state()),
        0,
        loop.fresh_iter(),
        target=NO_END,
        stop=lambda: next(calls) >= 25,  # asked after each step
    )
    assert interval.step == 25
    assert [s for s, *_ in interval.logged] == [10, 20]  # log points, no end step among them
