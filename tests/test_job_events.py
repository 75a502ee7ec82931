"""A job's events name its storage and job, so a deployment trigger starts the evaluator of that
job only; the evaluator deployment keeps up with its trainer in one run.

Found when the job was attacked: the evaluator's trigger matched ``prefect-jax.job.digits``, so a
local demo job called ``digits`` (another storage) started the deployed evaluator; and the
evaluator deployment ran with ``once: true``, one flow run (one process start) per checkpoint.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path

import pytest
import yaml
from deployment_helpers import ROOT, PrefectServerProcess, _base_env

from prefect_jax.deployments import job_resource_id
from prefect_jax.tasks import CHECKPOINT_EVENT, job_resource
from prefect_jax.training.specs import JobConfig

TINY = "prefect_jax.examples.digits:tiny"


def _evaluator() -> dict:
    deployments = {
        d["name"]: d for d in yaml.safe_load((ROOT / "prefect.yaml").read_text())["deployments"]
    }
    return deployments["digits-evaluator"]


def _config(job: str, storage: str) -> JobConfig:
    return JobConfig(program=TINY, job=job, storage=storage, train={"max_steps": 10})


def test_same_named_jobs_on_two_storages_have_different_resource_ids(tmp_path):
    ours, theirs = (
        _config("digits", "/var/lib/prefect-jax"),
        _config("digits", str(tmp_path / "demo")),
    )
    assert job_resource(ours)["prefect.resource.id"] != job_resource(theirs)["prefect.resource.id"]
    assert job_resource(ours) == {
        "prefect.resource.id": job_resource_id("digits", "/var/lib/prefect-jax"),
        "prefect.resource.name": "digits",
        "prefect-jax.storage": "/var/lib/prefect-jax",
    }
    rid = job_resource_id("digits", "/var/lib/prefect-jax")
    assert rid.startswith("prefect-jax.job.digits.") and not set("*?[]!") & set(
        rid
    )  # no glob characters
    # The same storage written differently, or with rotated secrets, is the same job.
    assert {
        job_resource_id("digits", s)
        for s in ("/var/lib/prefect-jax/", "file:///var/lib/prefect-jax")
    } == {rid}
    assert job_resource_id("j", "s3://AKIAEXAMPLE:one@bucket/p") == job_resource_id(
        "j", "s3://AKIAEXAMPLE:two@bucket/p"
    )
    assert (
        job_resource_id("j", "s3://bucket/p")
        != job_resource_id("j", "s3://bucket/q")
        != job_resource_id("k", "s3://bucket/q")
    )
    assert "secret" not in job_resource_id("j", "gs://secret@bucket/p")  # a hash, never the URL


def test_the_evaluator_trigger_matches_the_digits_job_it_deploys():
    evaluator = _evaluator()
    params = evaluator["parameters"]
    (trigger,) = evaluator["triggers"]
    assert trigger["match"] == {
        "prefect.resource.id": job_resource_id(params["job"], params["storage"])
    }


def _covers(trigger_spec: dict, config: JobConfig) -> bool:
    """Whether the Prefect server's own trigger evaluation fires `trigger_spec` on a committed
    checkpoint event of `config`'s job."""
    from prefect.events import DeploymentEventTrigger
    from prefect.server.events.schemas.automations import EventTrigger
    from prefect.server.events.schemas.events import Event

    deployment_trigger = DeploymentEventTrigger(**trigger_spec)
    deployment_trigger.set_deployment_id(uuid.uuid4())
    automation = deployment_trigger.as_automation()  # as `prefect deploy` makes it
    trigger = EventTrigger.model_validate(automation.trigger.model_dump(mode="json"))
    event = Event(
        occurred=datetime.now(UTC),
        event=CHECKPOINT_EVENT,
        resource=job_resource(config),
        payload={"step": 500},
        id=uuid.uuid4(),
    )
    return trigger.covers(event.receive())


def test_the_trigger_does_not_fire_for_a_same_named_job_on_another_storage(tmp_path):
    evaluator = _evaluator()
    (trigger,) = evaluator["triggers"]
    params = evaluator["parameters"]
    assert _covers(trigger, _config(params["job"], params["storage"]))
    assert not _covers(
        trigger, _config(params["job"], str(tmp_path / "prefect-jax-demo"))
    )  # `prefect-jax demo`
    assert not _covers(trigger, _config("digits-nightly", params["storage"]))


def test_the_evaluator_deployment_keeps_up_in_one_run():
    evaluator = _evaluator()
    assert "once" not in evaluator["parameters"], (
        "one run evaluates every checkpoint, not one run per checkpoint"
    )
    assert evaluator["parameters"]["idle_timeout_secs"] > 0
    assert evaluator["concurrency_limit"] == {
        "limit": 1,
        "collision_strategy": "CANCEL_NEW",
    }  # no pile of runs


def test_the_evaluator_waits_out_its_idle_timeout_while_the_trainer_holds_the_lease(
    job_config, mlflow_uri
):
    """A trainer between checkpoints (its lease fresh) keeps the evaluator going past
    `idle_timeout_secs`; once the lease is gone, the evaluator stops idle."""
    from prefect_jax.flows import evaluate
    from prefect_jax.training import live
    from prefect_jax.training.storage import JobStorage
    from prefect_jax.training.trainer import Trainer

    # A trainer of 100 steps at its step 40 (its steps record the 100 the evaluator follows).
    config = job_config(max_steps=100, every_steps=20)
    trainer = Trainer(config)
    trainer.restore_or_init()
    while trainer.step < 40:
        trainer.train_until_checkpoint()
    trainer.close()
    live.drop_all(close=False)
    js = JobStorage(config.storage, config.job)
    lease = {
        "token": "t",
        "flow_run_id": None,
        "host": "another-node",
        "pid": 1,
        "heartbeat": time.time(),
        "timeout_secs": 120,
    }
    js.write_json(js.path("lease.json"), lease)  # a trainer on another node, still going
    params = {
        "program": config.program,
        "job": config.job,
        "storage": config.storage,
        "train_spec": dict(config.train.model_dump(mode="json"), max_steps=100),
        "checkpoint_spec": config.checkpoint.model_dump(mode="json"),
        "mlflow_tracking_uri": mlflow_uri,
        "poll_secs": 0.1,
        "idle_timeout_secs": 0.5,
    }
    result: dict = {}
    thread = threading.Thread(target=lambda: result.update(evaluate(**params)), daemon=True)
    thread.start()
    deadline = time.monotonic() + 120
    while len(js.list_int_names(js.eval_dir("eval"))) < 2:  # it evaluated 20 and 40 ...
        assert thread.is_alive() and time.monotonic() < deadline, result
        time.sleep(0.1)
    time.sleep(3)  # ... and waits six idle timeouts for the trainer's next checkpoint
    assert thread.is_alive(), f"stopped while the trainer was still going: {result}"
    js.fs.rm(js.path("lease.json"))  # the trainer is done (or gone)
    thread.join(60)
    assert not thread.is_alive()
    assert result["evaluated"] == [20, 40] and result["stopped"].startswith("no new checkpoint"), (
        result
    )


def _prefect(api_url: str, home: Path, *args: str) -> subprocess.CompletedProcess:
    env = _base_env(PREFECT_HOME=str(home), PREFECT_API_URL=api_url)
    return subprocess.run(
        [sys.executable, "-m", "prefect", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )


@pytest.mark.slow
def test_deployed_evaluator_cancels_new_runs_and_fires_for_its_own_job_only(tmp_path):
    """``prefect deploy`` of the evaluator from prefect.yaml against a real server: its concurrency
    options read back CANCEL_NEW, and of two committed events of jobs called ``digits``, only the
    one at the deployment's storage makes an evaluator run."""
    import httpx

    server = PrefectServerProcess(tmp_path / "server")
    home = tmp_path / "home"
    try:
        server.wait_healthy()
        api = server.api_url
        created = _prefect(api, home, "work-pool", "create", "cpu", "--type", "process")
        assert created.returncode == 0, created.stdout + created.stderr
        deployed = _prefect(api, home, "--no-prompt", "deploy", "--name", "digits-evaluator")
        assert deployed.returncode == 0, deployed.stdout[-3000:] + deployed.stderr[-3000:]
        deployment = httpx.get(
            f"{api}/deployments/name/evaluate/digits-evaluator", timeout=30
        ).json()
        assert deployment["global_concurrency_limit"]["limit"] == 1, deployment
        assert deployment["concurrency_options"]["collision_strategy"] == "CANCEL_NEW"
        assert "once" not in deployment["parameters"]

        params = _evaluator()["parameters"]

        def emit(storage: str, step: int) -> None:
            event = {
                "id": str(uuid.uuid4()),
                "occurred": datetime.now(UTC).isoformat(),
                "event": CHECKPOINT_EVENT,
                "resource": job_resource(_config(params["job"], storage)),
                "payload": {"step": step},
            }
            response = httpx.post(f"{api}/events", json=[event], timeout=30)
            assert response.status_code == 204, response.text

        def runs() -> list[dict]:
            body = {"deployments": {"id": {"any_": [deployment["id"]]}}}
            return httpx.post(f"{api}/flow_runs/filter", json=body, timeout=30).json()

        emit(str(tmp_path / "prefect-jax-demo"), 100)  # the local demo job called digits
        emit(params["storage"], 500)  # the deployed job
        deadline = time.monotonic() + 60
        while not runs():
            assert time.monotonic() < deadline, (
                "the deployed job's event made no evaluator run:\n" + server.tail()
            )
            time.sleep(0.5)
        time.sleep(5)  # the demo job's event, emitted first, has had its chance too
        assert len(runs()) == 1, runs()
    finally:
        server.stop()


def test_one_thread_tells_the_commit_listeners_of_each_step_in_order_in_the_savers_context():
    """`Job.save` hands each step to one announcer thread (a thread started per save cost the
    training thread a thread start every interval): steps are announced in order, each in the
    context it was saved in (the listener emits a Prefect event with the saver's settings), a
    failing listener call does not stop the next ones, and the thread ends when idle."""
    import contextvars

    from prefect_jax.training.announcer import Announcer

    saver = contextvars.ContextVar("saver", default="nobody")
    seen = []

    def announce(step: int) -> None:
        seen.append((step, saver.get(), threading.current_thread()))
        if step == 2:
            raise RuntimeError("a listener failed")

    announcer = Announcer(announce)
    announcer.IDLE_SECS = 0.3
    for step in (1, 2, 3):
        saver.set(f"saver of {step}")
        announcer.submit(step)
    assert announcer.wait(timeout=10)
    assert [(s, who) for s, who, _ in seen] == [
        (1, "saver of 1"),
        (2, "saver of 2"),
        (3, "saver of 3"),
    ]
    assert len({id(t) for _, _, t in seen}) == 1  # one thread for all three
    deadline = time.monotonic() + 10
    while announcer._thread is not None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert announcer._thread is None and not seen[-1][2].is_alive()  # idle: it ended
    announcer.submit(4)  # and the next save starts one again
    assert announcer.wait(timeout=10) and seen[-1][0] == 4
