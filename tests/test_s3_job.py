"""A job on s3:// (moto's S3 server on loopback): trains, survives
SIGKILL mid-upload, resumes exactly.

Orbax cannot write s3://: steps are staged locally, uploaded in the background, and count once
their commit marker (written last) is there. The rerun uses a fresh local cache, as a new node
would after preemption, so it restores by downloading.
"""

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest
from conftest import TINY, straight_fingerprint
from process_helpers import job_args
from s3_server import ACCESS_KEY, ISOLATED_AWS_ENV, SECRET_KEY, UNSET_AWS_ENV, StorageCalls

from prefect_jax.training.specs import CheckpointSpec, JobConfig, TrainSpec
from prefect_jax.training.trainer import Trainer

pytestmark = pytest.mark.slow

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
PROGRAM, MAX_STEPS, EVERY = "programs:big", 500, 100
MARKER = "_PREFECT_JAX_COMMITTED"


@pytest.fixture(scope="module")
def s3(s3_server):
    s3_server.create_bucket("jobs")
    return s3_server


def _env(s3, cache_dir, api_url):
    env = {k: v for k, v in os.environ.items() if k not in UNSET_AWS_ENV and k != "PREFECT_API_URL"}
    env.update(ISOLATED_AWS_ENV)
    env.update(
        AWS_ACCESS_KEY_ID=ACCESS_KEY,
        AWS_SECRET_ACCESS_KEY=SECRET_KEY,
        FSSPEC_S3_ENDPOINT_URL=s3.endpoint_url,  # the endpoint from fsspec's own configuration
        PREFECT_JAX_CACHE_DIR=str(cache_dir),
        PREFECT_API_URL=api_url,
        PREFECT_LOGGING_LEVEL="INFO",
        PYTHONPATH=os.pathsep.join([TESTS_DIR, env.get("PYTHONPATH", "")]),
    )
    return env


def _cli(*args):
    return [sys.executable, "-m", "prefect_jax.cli", *args]


def _run_args(mlflow_uri):
    args = job_args(PROGRAM, "s3job", "s3://jobs/team", MAX_STEPS, EVERY, mlflow_uri)
    return ["run", *args, "--keep-last", "10"]


def test_s3_job_survives_sigkill_mid_upload_and_resumes_exactly(
    s3, tmp_path, prefect_server, mlflow_uri
):
    fs = s3.filesystem()
    prefix = "jobs/team/s3job/checkpoints"

    def remote():
        try:
            names = [p.rsplit("/", 1)[-1] for p in fs.ls(prefix, detail=False, refresh=True)]
        except FileNotFoundError:
            return {}
        return {int(n): fs.exists(f"{prefix}/{n}/{MARKER}") for n in names if n.isdigit()}

    log1 = open(tmp_path / "1.log", "w")
    proc = subprocess.Popen(
        _cli(*_run_args(mlflow_uri)),
        stdout=log1,
        stderr=subprocess.STDOUT,
        env=_env(s3, tmp_path / "cache-1", prefect_server),
        cwd=TESTS_DIR,
    )
    killed_mid_upload = None
    deadline = time.monotonic() + 300
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            steps = remote()
            partial = [s for s, done in steps.items() if not done]
            if partial and any(steps.values()):
                proc.send_signal(signal.SIGKILL)
                killed_mid_upload = partial[0]
                break
            time.sleep(0.01)
    finally:
        if proc.poll() is None and killed_mid_upload is None:
            proc.kill()
        proc.wait(timeout=60)
    assert killed_mid_upload is not None, (
        "never caught an upload in progress:\n" + (tmp_path / "1.log").read_text()[-3000:]
    )
    after_kill = remote()
    assert after_kill.get(killed_mid_upload) is False, "the step killed mid-upload must not count"

    status = subprocess.run(
        _cli("status", "--job", "s3job", "--storage", "s3://jobs/team", "--json"),
        capture_output=True,
        text=True,
        env=_env(s3, tmp_path / "cache-1", prefect_server),
        cwd=TESTS_DIR,
    )
    assert status.returncode == 0, status.stderr[-2000:]
    committed = json.loads(status.stdout.splitlines()[-1])["committed_steps"]
    assert killed_mid_upload not in committed and committed == sorted(
        s for s, done in after_kill.items() if done
    )

    # A new node: empty local cache; resumes from the newest uploaded step.
    rerun = subprocess.run(
        _cli(*_run_args(mlflow_uri)),
        capture_output=True,
        text=True,
        env=_env(s3, tmp_path / "cache-2", prefect_server),
        cwd=TESTS_DIR,
        timeout=600,
    )
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    summary = json.loads(rerun.stdout.splitlines()[-1])
    assert summary["final_step"] == MAX_STEPS
    assert summary["checkpoint_dir"] == "s3://jobs/team/s3job/checkpoints"
    assert f"job s3job at step {committed[-1]} (restored)" in rerun.stderr

    expected = straight_fingerprint(PROGRAM, MAX_STEPS, EVERY, tmp_path / "local", mlflow_uri)
    assert summary["state_fingerprint"] == expected

    final = remote()
    assert all(final.values()) and MAX_STEPS in final
    evaluated = json.loads(
        subprocess.run(
            _cli("status", "--job", "s3job", "--storage", "s3://jobs/team", "--json"),
            capture_output=True,
            text=True,
            env=_env(s3, tmp_path / "cache-3", prefect_server),
            cwd=TESTS_DIR,
        ).stdout.splitlines()[-1]
    )["evaluated_steps"]
    assert evaluated["eval"][-1] == MAX_STEPS
    assert not fs.exists("jobs/team/s3job/lease.json")


def test_the_training_thread_asks_object_storage_little_per_interval_and_at_a_restore(
    s3, tmp_path, prefect_server, mlflow_uri, monkeypatch
):
    """Each request to object storage that the training thread waits for is a round trip (tens of
    ms on S3) in every interval. Counted per kind in the flow's intervals (its restore and end
    aside), 6 intervals on moto's S3: the stop request is read once an interval (the flow asks,
    then its train task, at the same step), the lease once (a pending evaluation's record verified
    it a moment before the save), each with one GET (not a HEAD, or a HEAD and a LIST where the
    file is missing, first), and no interval lists the checkpoints or asks a step's marker (its
    upload, in this process, committed it). A rerun's restore lists them twice, not six times."""
    from prefect_jax.flows import train_and_evaluate
    from prefect_jax.training import trainer as trainer_module

    block = s3.save_block("requests-test", "s3://jobs/requests")
    # (a pending evaluation recorded from the loop, once its save's upload landed, reads the lease
    # then, and the save reads it again: counted apart, as on a slow machine that is most saves)
    counted = StorageCalls(parts=("train_loop", "restore_trainer", "record_if_landed"))
    counted.install(monkeypatch.setattr)
    # The flow's ask and its train task's, at one step, are one read however slow the machine is
    # between them (the answer's lifetime has its own test: test_evaluate)
    monkeypatch.setattr(trainer_module, "STOP_ANSWER_SECS", 60.0)
    calls, restoring, requests = (
        counted.calls["train_loop"],
        counted.calls["restore_trainer"],
        counted.requests,
    )
    monkeypatch.setenv("PREFECT_JAX_CACHE_DIR", str(tmp_path / "cache"))
    # Each upload takes 0.5 s longer, as a larger step to a distant bucket would: what the job asks
    # of the storage must not grow with it (the commit announcer polled every 0.2 s meanwhile).
    from prefect_jax.training.remote import RemoteSteps

    upload = RemoteSteps.upload
    monkeypatch.setattr(
        RemoteSteps, "upload", lambda self, *a, **kw: (time.sleep(0.5), upload(self, *a, **kw))[1]
    )
    intervals, every = 6, 10
    summary = train_and_evaluate(
        program="prefect_jax.examples.digits:tiny",
        job="j",
        storage=block,
        train_spec=TrainSpec(max_steps=intervals * every, log_every_steps=every),
        checkpoint_spec=CheckpointSpec(every_steps=every),
        mlflow_tracking_uri=mlflow_uri,
    )
    assert summary["final_step"] == intervals * every
    shown = sorted(calls.items(), key=lambda kv: -kv[1])
    assert intervals <= calls[("_cat_file", "stop.json")] <= intervals + 3, (
        shown
    )  # (was two reads an interval)
    # Fencing: read before each interval's checkpoint (by the save, or by the
    # pending record just before it).
    # (the lease is read with its ETag, what its compare-and-set writes over: `lease_file`,
    # `object_preconditions`)
    assert intervals <= calls[("_get_with_etag", "lease.json")] <= intervals + 3, (
        shown
    )  # (was two an interval)
    from_loop = counted.calls["record_if_landed"]
    assert from_loop[("_get_with_etag", "lease.json")] <= intervals, from_loop
    assert not [c for c in calls if c[1] == "stop.json" and c[0] != "_cat_file"], shown
    assert not [c for c in calls if c[1] == "lease.json" and c[0] != "_get_with_etag"], shown
    # Each read is one GET: no HEAD first (nor a LIST where the file is missing), in any thread.
    seen = sorted(requests.items(), key=lambda kv: -kv[1])
    assert requests[("GetObject", "stop.json")] >= intervals, seen
    assert not [r for r in requests if r[1] == "stop.json" and r[0] != "GetObject"], seen
    assert not [
        r for r in requests if r[1] == "lease.json" and r[0] in ("HeadObject", "ListObjectsV2")
    ], seen
    assert not [c for c in calls if c[0] in ("_ls", "_find") and c[1] == "checkpoints"], (
        shown
    )  # (was one or two an interval)
    # The live step's eval record is not read while its save is in flight: none can exist yet.
    record_reads = sum(
        n for (kind, name), n in calls.items() if kind == "_cat_file" and name[:1].isdigit()
    )
    assert record_reads <= 1, shown  # (was one an interval)
    # A step this process uploaded is known to be committed: no request on the training thread.
    assert not [c for c in calls if c[1] == MARKER], shown  # (was one HEAD an interval)
    # In the background too (the uploader, its retention, the commit announcer), a marker is asked
    # once per step, by its upload (is it there already?), with one GET, not a HEAD (and a LIST
    # where it is missing). The announcer waits on the uploader; polling every 0.2 s, it made 43
    # requests here. Retention lists the steps with their markers at once, where it asked each
    # step's marker. (The code before: 48 HEADs and LISTs of markers here.)
    assert not [
        r for r in requests if r[1] == MARKER and r[0] in ("HeadObject", "ListObjectsV2")
    ], seen
    assert requests[("GetObject", MARKER)] <= intervals + 1, seen

    # A rerun on a new machine (an empty local stage) lists the committed steps twice: before it
    # takes the lease and once it holds it (was 6 times, each a LIST and a HEAD per step).
    restoring.clear()
    monkeypatch.setenv("PREFECT_JAX_CACHE_DIR", str(tmp_path / "another-machine"))
    summary = train_and_evaluate(
        program="prefect_jax.examples.digits:tiny",
        job="j",
        storage=block,
        train_spec=TrainSpec(max_steps=(intervals + 1) * every, log_every_steps=every),
        checkpoint_spec=CheckpointSpec(every_steps=every),
        mlflow_tracking_uri=mlflow_uri,
    )
    assert summary["final_step"] == (intervals + 1) * every
    shown = sorted(restoring.items(), key=lambda kv: -kv[1])
    assert restoring[("_find", "checkpoints")] == 2, (
        shown
    )  # (each names every step's files: their markers too)
    assert not [c for c in restoring if c[1] == "checkpoints" and c[0] != "_find"], shown
    assert restoring[("_cat_file", MARKER)] <= 2, (
        shown
    )  # (was one per step and listing: keep_last is 3)


def _digits_job_on_s3(s3, job: str, mlflow_uri: str, **checkpoint) -> JobConfig:
    """The tiny digits program's job at ``s3://jobs/<job>``: 30 steps, a checkpoint every 10."""
    return JobConfig(
        program="prefect_jax.examples.digits:tiny",
        job=job,
        storage=f"s3://jobs/{job}",
        storage_options=s3.storage_options,
        train=TrainSpec(max_steps=30, log_every_steps=10),
        mlflow_tracking_uri=mlflow_uri,
        checkpoint=CheckpointSpec(every_steps=10, **checkpoint),
    )


def _preempted_after_step_20(config: JobConfig, tmp_path, monkeypatch) -> str:
    """`config`'s job trained to step 20 on a first machine (its own local stage), committed,
    then gone: a new machine reruns it. The fingerprint of step 20's state."""
    monkeypatch.setenv("PREFECT_JAX_CACHE_DIR", str(tmp_path / "first-machine"))
    trainer = Trainer(config)
    try:
        trainer.restore_or_init()
        while trainer.step < 20:
            trainer.train_until_checkpoint()
        trainer.job.wait_committed()
        return trainer.fingerprint()
    finally:
        trainer.close()


def test_a_step_this_process_uploaded_is_known_committed_until_retention_removes_it(
    s3, tmp_path, monkeypatch, mlflow_uri
):
    """On object storage the trainer's commit checks ask nothing for a step its own uploader
    committed, and retention makes it forget a step before the step stops counting: the commit
    announcer tells the listeners of each step once its upload is done, and never of one that is
    gone."""
    monkeypatch.setenv("PREFECT_JAX_CACHE_DIR", str(tmp_path / "cache"))
    config = _digits_job_on_s3(s3, "known", mlflow_uri, keep_last=1, keep_until_evaluated=False)
    trainer = Trainer(config)
    announced: list[int] = []
    trainer.job.commit_listeners.append(announced.append)
    trainer.restore_or_init()
    while trainer.step < 30:
        trainer.train_until_checkpoint()
        trainer.job.wait_committed()  # (each step's upload, retention and announcement done)
    job = trainer.job
    assert announced == [10, 20, 30] and job.committed_steps() == [30]
    asked: list[int] = []
    is_committed = job.remote.is_committed
    monkeypatch.setattr(
        job.remote, "is_committed", lambda step: (asked.append(step), is_committed(step))[1]
    )
    assert job.is_committed(30) and asked == []  # uploaded here: known without a request
    assert not job.is_committed(10) and asked == [
        10
    ]  # removed by retention: forgotten, so asked (and gone)
    trainer.finish()


def test_a_head_start_downloads_the_newest_step_and_the_restore_reads_that_copy(
    s3, tmp_path, monkeypatch, mlflow_uri, request
):
    """A rerun on a new machine (an empty local stage): the command's head start begins the
    download of the newest committed step before the flow run starts; the restore, begun while
    that download is still under way, waits for it instead of downloading the step beside it,
    reads that copy and resumes at its step with its state."""
    import threading

    from prefect_jax.training import head_start, leftovers, step_prefetch
    from prefect_jax.training.program import load_program_with_params
    from prefect_jax.training.remote import RemoteSteps
    from prefect_jax.training.storage import JobStorage

    config = _digits_job_on_s3(s3, "prefetched", mlflow_uri)
    saved = _preempted_after_step_20(config, tmp_path, monkeypatch)

    monkeypatch.setenv("PREFECT_JAX_CACHE_DIR", str(tmp_path / "new-machine"))
    storage = JobStorage(config.storage, config.job, config.storage_options)
    # What killed processes of this machine left in its stage: a download cut short (its lock
    # file no longer held), a copy moved aside, a save's temporary directory. The restore removes
    # them, and not the prefetch's download in flight beside it.
    cut_short = f".20.download-{leftovers._kernel()}-{'c' * 12}"
    for name in (cut_short, f".10.stale-{'d' * 12}", "30.orbax-checkpoint-tmp"):
        os.makedirs(os.path.join(storage.checkpoint_dir, name, "state"))
    open(os.path.join(storage.checkpoint_dir, f"{cut_short}.lock"), "w").close()
    # The prefetch's download, its lock taken, is held until the restore's cleanup is done, then
    # until the restore downloads the step itself (as it would without waiting for the prefetch)
    # or 3 s pass.
    in_flight, cleaned, restore_downloads = (threading.Event() for _ in range(3))
    downloaders: list[str] = []
    prefetch_locks: list[str] = []
    download, download_into = RemoteSteps.download, RemoteSteps._download_into

    def held_download(self, step, local_dir):
        downloaders.append(threading.current_thread().name)
        if threading.current_thread().name != step_prefetch.THREAD_NAME:
            restore_downloads.set()
        return download(self, step, local_dir)

    def held_download_into(self, tmp, *args):
        if threading.current_thread().name == step_prefetch.THREAD_NAME:
            prefetch_locks.append(f"{tmp}.lock")
            in_flight.set()
            cleaned.wait(60)
            restore_downloads.wait(3)
        return download_into(self, tmp, *args)

    monkeypatch.setattr(RemoteSteps, "download", held_download)
    monkeypatch.setattr(RemoteSteps, "_download_into", held_download_into)
    request.addfinalizer(lambda: setattr(head_start, "_begun", None))
    program, params = load_program_with_params(config.program, None, config.train.max_steps)
    assert head_start.begin(config.program, program, params, None, config.train, storage, None)
    rerun = Trainer(config)
    try:
        prepare_restore = rerun.job.prepare_restore

        def restore_begins():
            assert in_flight.wait(60)
            try:
                return prepare_restore()
            finally:
                assert os.path.exists(prefetch_locks[0])  # (the prefetch's, kept)
                cleaned.set()

        monkeypatch.setattr(rerun.job, "prepare_restore", restore_begins)
        assert rerun.restore_or_init() == 20
        assert rerun.fingerprint() == saved
        # the restore found the prefetch's copy: it downloaded nothing itself
        assert downloaders == [step_prefetch.THREAD_NAME], downloaders
        assert sorted(os.listdir(storage.checkpoint_dir)) == ["20"]
        rerun.train_until_checkpoint()
        assert rerun.step == 30
    finally:
        rerun.close()


def test_a_download_that_comes_back_short_is_raised_and_no_step_is_passed_over(
    s3, tmp_path, monkeypatch, mlflow_uri
):
    """A rerun on a new machine whose download of the newest step comes back the wrong size (a
    copy cut short) raises it for the task's retries to download again, rather than falling back
    to the step before and training over the newest; once the download succeeds, it resumes
    there."""
    from prefect_jax.training.errors import RestoreFailedError, is_transient
    from prefect_jax.training.storage import JobStorage

    config = _digits_job_on_s3(s3, "short", mlflow_uri)
    saved = _preempted_after_step_20(config, tmp_path, monkeypatch)
    storage = JobStorage(config.storage, config.job, config.storage_options)
    step_url = f"{storage.remote_checkpoint_url}/20"

    fs = s3.filesystem()
    files = [f for f in fs.find(step_url) if fs.size(f) > 64]
    whole = fs.cat_file(files[0])
    fs.pipe_file(files[0], whole[: len(whole) // 2])  # what the next download brings back
    monkeypatch.setenv("PREFECT_JAX_CACHE_DIR", str(tmp_path / "new-machine"))
    trainer = Trainer(config)
    with pytest.raises(RestoreFailedError, match="its download failed") as err:
        trainer.restore_or_init()
    trainer.close()
    assert f"{step_url} did not restore" in str(err.value) and is_transient(err.value)
    assert trainer.job.remote.committed_steps() == [10, 20]

    fs.pipe_file(files[0], whole)  # the next download comes back whole
    trainer = Trainer(config)
    try:
        assert trainer.restore_or_init() == 20
        assert trainer.fingerprint() == saved
    finally:
        trainer.close()


@pytest.mark.parametrize("then", ["retried", "sigterm"])
def test_the_final_steps_upload_that_s3_refuses_fails_its_train_task_which_retries_it(
    s3, tmp_path, prefect_server, mlflow_uri, then
):
    """S3 throttles (503 SlowDown) every write of the final step until the train task that saved
    it has failed and is retried: the failure is that task's (Prefect's retry trains the interval
    again and uploads it), not the flow's end, which no retry covers. The job finishes with its
    final step committed and evaluated, as an uninterrupted run. A SIGTERM while the task waits
    for that upload (`then="sigterm"`) ends the command within its grace, the lease freed, and a
    rerun finishes the job."""
    from fault_proxy import SLOW_DOWN, FaultProxy

    job = f"slow-{then}"
    final_step = f"/jobs/refused/{job}/checkpoints/20/"
    refusing = threading.Event()
    refusing.set()

    def refuse(method, path):
        refused = method in ("PUT", "POST") and final_step in path and refusing.is_set()
        return SLOW_DOWN if refused else None

    proxy = FaultProxy(s3.endpoint_url, refuse=refuse)
    env = _env(s3, tmp_path / "cache", prefect_server)
    env["FSSPEC_S3_ENDPOINT_URL"] = proxy.uri
    if then == "retried":  # botocore sends each request once (s3fs's and the uploader's
        env["AWS_MAX_ATTEMPTS"] = "1"  # retries still run: 20 s; botocore's too: minutes)
    args = job_args(TINY, job, "s3://jobs/refused", 20, 10, mlflow_uri, "--sigterm-grace-secs", "5")
    log = tmp_path / "run.log"
    retried = re.compile(r"Task run 'train 10 to 20' - Task run failed .* Retry 1/2 will start")
    terminated_at = None
    try:
        with open(log, "w") as out:
            proc = subprocess.Popen(
                _cli("run", *args), stdout=out, stderr=subprocess.STDOUT, env=env, cwd=TESTS_DIR
            )
            deadline = time.monotonic() + 400
            while proc.poll() is None and time.monotonic() < deadline:
                text = log.read_text()
                if then == "retried" and refusing.is_set() and retried.search(text):
                    refusing.clear()  # S3 takes writes again: the retried task's upload lands
                if then == "sigterm" and terminated_at is None and "retry 1 of 4" in text:
                    proc.send_signal(signal.SIGTERM)  # the train task waits for the upload
                    terminated_at = time.monotonic()
                time.sleep(0.2)
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=60)
    finally:
        proxy.close()
    text = log.read_text()
    refused = sum(
        n for (m, p), n in proxy.requests.items() if m in ("PUT", "POST") and final_step in p
    )
    assert refused > 0, proxy.requests
    fs = s3.filesystem()
    if then == "sigterm":
        assert terminated_at is not None, text[-4000:]
        assert proc.returncode == 143, text[-4000:]
        # the grace (5 s) and the run's end, not the retries of the upload (minutes)
        assert time.monotonic() - terminated_at < 25, text[-4000:]
        assert not fs.exists(f"jobs/refused/{job}/lease.json")
        assert not fs.exists(f"jobs/refused/{job}/checkpoints/20/{MARKER}")
        rerun = subprocess.run(
            _cli("run", *args),
            capture_output=True,
            text=True,
            env=env | {"FSSPEC_S3_ENDPOINT_URL": s3.endpoint_url},
            cwd=TESTS_DIR,
            timeout=300,
        )
        assert rerun.returncode == 0, rerun.stderr[-4000:]
        text = rerun.stdout
    else:
        assert proc.returncode == 0, text[-4000:]
        assert not refusing.is_set(), "the train task was never retried:\n" + text[-4000:]
    summary = json.loads(text.strip().splitlines()[-1])
    assert summary["final_step"] == 20 and summary["eval"]
    assert fs.exists(f"jobs/refused/{job}/checkpoints/20/{MARKER}")
