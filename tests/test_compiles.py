"""The train step compiles once per process: the compile done ahead of time (overlapping the
restore) is the one the loop finds, from the first step to the last; with a warm persistent
compilation cache a rerun compiles nothing, also on another machine when the cache is on object
storage. Each run is a fresh process, as a rerun is."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import threading
import uuid

import pytest
from process_helpers import TESTS_DIR
from s3_server import closed_port, isolate_aws_env, storage_options

pytestmark = pytest.mark.slow


def _run(*args: str, env: dict | None = None) -> dict:
    proc = subprocess.run(
        [sys.executable, "count_compiles.py", *args],
        capture_output=True,
        text=True,
        cwd=TESTS_DIR,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_train_step_compiles_once_per_run_and_not_at_all_from_a_warm_cache(
    tmp_path, mlflow_uri
):
    first = _run(str(tmp_path / "a"), mlflow_uri)
    assert (first["start"], first["end"], first["compiled"]) == (0, 40, 1)
    rerun = _run(str(tmp_path / "a"), mlflow_uri)
    assert (rerun["start"], rerun["end"], rerun["compiled"]) == (40, 80, 1)
    # The program's train step is traced once per process: the background compile, the
    # metrics' structure and the loop's calls share that trace (a model's trace is seconds on
    # a restart's way to its first step).
    assert (first["traced"], rerun["traced"]) == (1, 1)

    cache = str(tmp_path / "compile-cache")
    cold = _run(str(tmp_path / "b"), mlflow_uri, cache)
    assert cold["cache_miss"] == 1 and cold["cache_hit"] == 0
    warm = _run(str(tmp_path / "b"), mlflow_uri, cache)
    assert warm["start"] == 40 and warm["cache_miss"] == 0 and warm["cache_hit"] >= 1


class _HeldEvalTrace:
    """Mixed into the tiny digits program: the trace of its eval step waits for `gate` (300 s at
    most: only a failing run waits that out), as a real model's eval-step compile takes seconds
    on a cold start."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.gate, self.held = threading.Event(), threading.Event()
        self.traced_on: list[str] = []  # the thread of each trace of the eval step
        self.gate_timed_out = None  # (None: no trace passed the gate yet)

    def eval_step(self, state, batch):
        self.traced_on.append(threading.current_thread().name)
        self.held.set()
        self.gate_timed_out = not self.gate.wait(300)
        return super().eval_step(state, batch)


@pytest.mark.parametrize("beside", [False, True], ids=["after", "beside"])
def test_the_first_step_waits_for_the_train_step_compile_only(job_config, monkeypatch, beside):
    """The background compile does the train step, then the eval step (on a CPU), or both at
    once on threads of their own (on an accelerator, here stood in for): either way the
    training starts once the train step is done, while the eval step's compile goes on beside
    it, and the evaluation after it finds that compile (one trace of the eval step, on the
    compile's thread)."""
    from prefect_jax.examples.digits import DigitsProgram
    from prefect_jax.training import compiled_steps

    monkeypatch.setattr(compiled_steps, "eval_compiles_beside_train_step", lambda: beside)
    from prefect_jax.training.evaluation import EvalStatus
    from prefect_jax.training.trainer import Trainer

    program = type("HeldEvalDigits", (_HeldEvalTrace, DigitsProgram), {})(
        hidden=(32, 32), learning_rate=3e-3, batch_size=32, dropout=0.1
    )
    trainer = Trainer(job_config(max_steps=40, every_steps=20), program=program)
    try:
        trainer.restore_or_init()
        trainer.train_until_checkpoint()
        assert trainer.step == 20
        # Trained while the eval step's trace was held (joining the whole compile would have
        # waited the gate out: True).
        assert program.gate_timed_out is None
        assert program.held.wait(60)  # the compile's thread is in the eval step's trace now
        program.gate.set()
        assert trainer.evaluate_if_new().status is EvalStatus.EVALUATED
        compiled_on = "prefect-jax-compile-eval" if beside else "prefect-jax-compile"
        assert program.traced_on == [compiled_on]
    finally:
        program.gate.set()
        trainer.close()


def test_a_finished_jobs_rerun_compiles_no_train_step(job_config):
    """A rerun of a job already at its final step trains nothing: it starts no background compile
    of the train step (its end would wait for it: seconds of a real model's compile, to say there
    is nothing to do), and still evaluates and exports as before."""
    from conftest import train_and_close

    from prefect_jax.training.trainer import Trainer

    config = job_config(max_steps=20, every_steps=20)
    train_and_close(config)
    rerun = Trainer(config)
    try:
        assert rerun.restore_or_init() == 20
        assert not rerun.loop.compiling.started
        assert rerun.evaluate_if_new().metrics  # the final step's evaluation, compiled on demand
        rerun.finish()
    finally:
        rerun.close()


def test_a_cache_on_object_storage_follows_the_job_to_another_machine(
    tmp_path, mlflow_uri, s3_server
):
    """The job's cache on S3 ("job": under its storage). Its first node is lost in the first
    interval, before any checkpoint (SIGKILL, no clean end): the train step it compiled is in
    storage already, and the rerun, on a machine whose local directories are elsewhere, loads
    it. (JAX given the S3 URL itself ignores the storage options and caches nothing; given a
    local mirror at another path, its keys would differ by that path.)"""
    env = dict(os.environ)
    isolate_aws_env(env)
    bucket = s3_server.create_bucket("compiles")
    storage, options = f"{bucket}/{uuid.uuid4().hex[:8]}", json.dumps(s3_server.storage_options)
    proc = subprocess.run(
        [sys.executable, "count_compiles.py", storage, mlflow_uri, "job", options, "lost"],
        capture_output=True,
        text=True,
        cwd=TESTS_DIR,
        timeout=300,
        env=dict(env, PREFECT_JAX_CACHE_DIR=str(tmp_path / "a")),
    )
    lost = json.loads(proc.stdout.strip().splitlines()[-1])
    assert proc.returncode == -9 and (
        lost["start"],
        lost["lost_at"],
        lost["cache_miss"],
        lost["cache_hit"],
    ) == (0, 10, 1, 0), (lost, proc.stderr[-2000:])
    stored = s3_server.filesystem().ls(f"{storage}/compiles/compile-cache", detail=False)
    assert any(p.rsplit("/", 1)[-1].startswith("jit_step-") for p in stored), stored

    # Its copy in takes 3 s longer than usual: the trainer sets up meanwhile, and
    # waits for it before compiling.
    rerun = _run(
        storage,
        mlflow_uri,
        "job",
        options,
        "slow-pull",
        env=dict(env, PREFECT_JAX_CACHE_DIR=str(tmp_path / "b")),
    )
    assert (rerun["start"], rerun["end"], rerun["cache_miss"]) == (0, 40, 0) and rerun[
        "cache_hit"
    ] >= 1


def test_an_unreachable_cache_is_skipped_with_a_warning(tmp_path, caplog, monkeypatch):
    """Storage that does not answer, or stops answering half way through a copy, costs the cache,
    not the job: nothing copied, no temporary files left, a warning without the secret."""
    from prefect_jax.training.compile_cache_mirror import CompileCacheMirror

    options = storage_options(f"http://127.0.0.1:{closed_port()}")
    local = tmp_path / "local"
    local.mkdir()
    (local / "jit_step-0-cache").write_bytes(_entry())
    mirror = CompileCacheMirror("s3://compiles/gone/compile-cache", str(local), options)
    with caplog.at_level(logging.WARNING, logger="prefect_jax.compile_cache"):
        assert mirror.pull() == []
        assert mirror.flush(timeout=120) and mirror.pushed == []
    messages = [r.getMessage() for r in caplog.records]
    assert any("could not be read" in m for m in messages) and any(
        "could not copy" in m for m in messages
    ), messages

    class CutOff:  # lists, then fails half way through the copy
        def ls(self, url, detail=False):
            return [f"{url}/jit_step-9-cache"]

        def get(self, remote, local_paths):
            with open(local_paths[0], "wb") as f:
                f.write(b"part of it")
            raise ConnectionError(f"connection reset (signed with {options['secret']})")

    monkeypatch.setattr(CompileCacheMirror, "fs", property(lambda self: CutOff()))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="prefect_jax.compile_cache"):
        assert mirror.pull() == []
    assert "connection reset" in caplog.text and options["secret"] not in caplog.text, caplog.text
    assert sorted(os.listdir(local)) == ["jit_step-0-cache"]  # no temporary files left
    assert (local / "jit_step-0-cache").read_bytes() == _entry()


def _entry(size: int = 1000) -> bytes:
    """A cache entry as JAX writes one (compressed as JAX compresses them)."""
    from jax._src.compilation_cache import compress_executable

    return compress_executable(b"an executable" * size)


def test_only_whole_entries_are_copied(tmp_path, caplog):
    """JAX writes an entry in place: one it is still writing is not copied (a later push copies
    it whole). One cut short in storage (a copy cut off on a file system whose writes are not
    atomic) is not copied in: it is compiled here, and copied over the cut one."""
    import fsspec

    from prefect_jax.training.compile_cache_mirror import CompileCacheMirror

    memory = fsspec.filesystem("memory")
    url = f"memory://whole-{uuid.uuid4().hex[:8]}/compile-cache"
    whole = _entry()
    here = tmp_path / "here"
    here.mkdir()
    (here / "jit_step-1-cache").write_bytes(whole[: len(whole) // 2])  # JAX is writing it
    mirror = CompileCacheMirror(url, str(here))
    assert (
        mirror.flush(timeout=30)
        and mirror.pushed == []
        and not memory.exists(f"{url}/jit_step-1-cache")
    )
    (here / "jit_step-1-cache").write_bytes(whole)
    assert mirror.flush(timeout=30) and mirror.pushed == ["jit_step-1-cache"]
    assert memory.cat(f"{url}/jit_step-1-cache") == whole
    assert mirror.flush(timeout=30) and mirror.pushed == [
        "jit_step-1-cache"
    ]  # nothing new: nothing copied

    memory.pipe(f"{url}/jit_eval-2-cache", whole[:-9])
    there = tmp_path / "there"
    other = CompileCacheMirror(url, str(there))
    with caplog.at_level(logging.WARNING, logger="prefect_jax.compile_cache"):
        assert other.pull() == ["jit_step-1-cache"]
    assert "cut short" in caplog.text and "jit_eval-2-cache" in caplog.text, caplog.text
    assert sorted(os.listdir(there)) == [
        "jit_step-1-atime",
        "jit_step-1-cache",
    ]  # JAX's eviction reads -atime
    (there / "jit_eval-2-cache").write_bytes(whole)  # compiled here
    assert other.flush(timeout=30) and other.pushed == ["jit_eval-2-cache"]
    assert memory.cat(f"{url}/jit_eval-2-cache") == whole


def test_a_slow_copy_in_is_waited_for_until_its_time_is_up(tmp_path, caplog, monkeypatch):
    """The copy in runs while the trainer sets up; `wait_pulled` waits for it until its time is
    up, then gives up once (a warning; JAX compiles what has not arrived) and never waits again."""
    import fsspec

    from prefect_jax.training.compile_cache_mirror import CompileCacheMirror

    memory = fsspec.filesystem("memory")
    url = f"memory://slow-{uuid.uuid4().hex[:8]}/compile-cache"
    memory.pipe(f"{url}/jit_step-6-cache", _entry())
    release = threading.Event()

    class Slow:
        def ls(self, path, detail=False):
            release.wait(30)
            return memory.ls(path, detail=False)

        def get(self, remote, local):
            memory.get(remote, local)

    monkeypatch.setattr(CompileCacheMirror, "fs", property(lambda self: Slow()))
    mirror = CompileCacheMirror(url, str(tmp_path / "a"))
    mirror.start_pull(timeout=0.3)
    with caplog.at_level(logging.WARNING, logger="prefect_jax.compile_cache"):
        assert mirror.wait_pulled() == [] and mirror.wait_pulled() == []
    assert caplog.text.count("still copying") == 1, caplog.text
    release.set()
    mirror._puller.join(30)
    assert os.listdir(tmp_path / "a") != [] and mirror.pulled == [
        "jit_step-6-cache"
    ]  # it went on in the background

    release.clear()
    other = CompileCacheMirror(url, str(tmp_path / "b"))
    other.start_pull(timeout=30)
    threading.Timer(0.3, release.set).start()
    assert other.wait_pulled() == ["jit_step-6-cache"]  # waited for


def test_a_flush_inside_a_push_returns(tmp_path):
    """A SIGTERM handler flushes on the main thread. Trainers list entries with the signal
    deferred, but should a handler run inside `push_async` (holding its lock), its flush returns
    within its time limit instead of waiting on itself, and the copy goes on after."""
    from prefect_jax.training.compile_cache_mirror import CompileCacheMirror

    (tmp_path / "jit_step-4-cache").write_bytes(_entry())
    mirror = CompileCacheMirror(
        f"memory://sigterm-{uuid.uuid4().hex[:8]}/compile-cache", str(tmp_path)
    )
    done = []

    def handler_inside_push():
        with mirror._lock:  # as push_async holds it
            done.append(mirror.flush(timeout=0.5))  # the copy needs the lock: not done yet

    thread = threading.Thread(target=handler_inside_push, daemon=True)
    thread.start()
    thread.join(30)
    assert done == [False]
    assert mirror.wait(30) and mirror.pushed == ["jit_step-4-cache"]


def test_the_process_exit_waits_for_copies_under_way(tmp_path):
    """The evaluate and export flows end the process right after their last push: the exit
    waits for the copy (here a slow one) instead of dropping it with the daemon thread."""
    script = """
import sys, time
from prefect_jax.training.compile_cache_mirror import CompileCacheMirror

mirror = CompileCacheMirror("file://" + sys.argv[1], sys.argv[2])
put = mirror._put
mirror._put = lambda batch: (time.sleep(2), put(batch))
mirror.push_async()
"""
    remote, local = tmp_path / "remote", tmp_path / "local"
    remote.mkdir()
    local.mkdir()
    (local / "jit_export-5-cache").write_bytes(_entry())
    proc = subprocess.run(
        [sys.executable, "-c", script, str(remote), str(local)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (remote / "jit_export-5-cache").read_bytes() == _entry()


def test_a_local_cache_is_found_where_the_job_is_moved(tmp_path):
    """A job's local cache copied to another folder (storage mounted elsewhere on the next node)
    is still found on a CPU: XLA's GPU-only caches are off there, so the keys name no path."""
    script = """
import os, sys
import jax
from prefect_jax.training.compile_cache import open_compilation_cache
from prefect_jax.training.storage import JobStorage

open_compilation_cache("job", JobStorage(sys.argv[1], "j"))
jax.jit(lambda x: x * 2 + 1)(1.0).block_until_ready()
print(jax.config.jax_persistent_cache_enable_xla_caches)
"""
    env = {k: v for k, v in os.environ.items() if k != "JAX_PERSISTENT_CACHE_ENABLE_XLA_CACHES"}
    env["JAX_PLATFORMS"] = "cpu"  # (on a GPU the autotune cache is kept, its path in the keys)

    def run(root) -> list[str]:
        proc = subprocess.run(
            [sys.executable, "-c", script, str(root)],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert proc.stdout.split() == ["none"]
        return sorted(os.listdir(root / "j" / "compile-cache"))

    written = run(tmp_path / "first")
    assert written
    shutil.copytree(tmp_path / "first", tmp_path / "moved")
    assert run(tmp_path / "moved") == written  # every compile found: nothing new written


def test_a_process_whose_jax_cache_is_open_keeps_it(tmp_path):
    """JAX opens one compilation cache per process: a job asking for another one gets a warning,
    and neither a mirror nor a change to JAX's settings."""
    script = """
import json, sys
import jax
from prefect_jax.training.compile_cache import (
    enable_compilation_cache, open_compilation_cache, open_jax_cache_dir,
)
from prefect_jax.training.storage import JobStorage

enable_compilation_cache(sys.argv[1])
jax.jit(lambda x: x + 1)(1.0).block_until_ready()
xla = jax.config.jax_persistent_cache_enable_xla_caches
mirror = open_compilation_cache("memory://another/compile-cache", JobStorage(sys.argv[2], "j"))
print(json.dumps([
    open_jax_cache_dir(),
    mirror is None,
    jax.config.jax_compilation_cache_dir,
    xla == jax.config.jax_persistent_cache_enable_xla_caches,
]))
"""
    first = str(tmp_path / "first")
    proc = subprocess.run(
        [sys.executable, "-c", script, first, str(tmp_path / "jobs")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == [first, True, first, True]
    assert (
        "JAX opens one per process" in proc.stderr
        and "memory://another/compile-cache is not used" in proc.stderr
    ), proc.stderr[-3000:]


def test_where_the_cache_is(tmp_path, monkeypatch):
    """Local directories as they are; a URL mirrored under PREFECT_JAX_CACHE_DIR, with the job's
    storage options only where the URL is on the job's storage protocol."""
    from prefect_jax.training.compile_cache import locate
    from prefect_jax.training.storage import JobStorage

    monkeypatch.setenv("PREFECT_JAX_CACHE_DIR", str(tmp_path / "machine"))
    local, s3 = (
        JobStorage(str(tmp_path / "jobs"), "j"),
        JobStorage("s3://b/jobs", "j", {"key": "k"}),
    )
    assert locate("job", local) == (str(tmp_path / "jobs" / "j" / "compile-cache"), None, {})
    assert locate(f"file://{tmp_path}/c/", s3) == (f"{tmp_path}/c", None, {})
    assert locate(f"local://{tmp_path}/c", s3) == (f"{tmp_path}/c", None, {})
    url, mirror, options = locate("job", s3)
    assert (url, options) == ("s3://b/jobs/j/compile-cache", {"key": "k"})
    assert mirror.startswith(str(tmp_path / "machine")) and mirror == s3.staging_dir(
        "compile-cache"
    )
    assert locate("s3://other/cache/", s3)[1:] == (locate("s3://other/cache", s3)[1], {"key": "k"})
    assert locate("s3a://other/cache", s3)[2] == {
        "key": "k"
    }  # the same file system (s3fs), another spelling
    url, mirror, options = locate("gs://other/cache", s3)
    assert (
        url == "gs://other/cache" and mirror.startswith(str(tmp_path / "machine")) and options == {}
    )
    assert mirror != locate("s3://other/cache", s3)[1]


def test_the_command_keeps_its_cache_with_the_job_on_a_storage_block(
    tmp_path, prefect_server, mlflow_uri, s3_server, monkeypatch
):
    """The users' path: `prefect-jax run --storage jax-checkpoint-storage/<block>
    --compilation-cache job`, the credentials only in the block. The first run's compiles are in
    the bucket when the command has exited (its flow ends through `finish`, its process without
    Python's teardown), and a second run, on a machine whose local directories are elsewhere,
    loads the train step instead of compiling it."""
    s3_server.create_bucket("cli-compiles")
    job = f"cached-{uuid.uuid4().hex[:6]}"
    block = s3_server.save_block("compile-cache-test", "s3://cli-compiles/team")
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    isolate_aws_env(env)
    env.update(PREFECT_API_URL=prefect_server, JAX_LOG_COMPILES="1", JAX_EXPLAIN_CACHE_MISSES="1")

    def run(machine: str, steps: int) -> subprocess.CompletedProcess:
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "prefect_jax.cli",
                "run",
                "--program",
                "prefect_jax.examples.digits:tiny",
                "--job",
                job,
                "--storage",
                block,
                "--max-steps",
                str(steps),
                "--checkpoint-every-steps",
                "20",
                "--compilation-cache",
                "job",
                "--mlflow-tracking-uri",
                mlflow_uri,
                "--json",
                "--no-progress",
            ],
            capture_output=True,
            text=True,
            timeout=600,
            env=dict(env, PREFECT_JAX_CACHE_DIR=str(tmp_path / machine)),
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc

    first = run("a", 40)
    assert "PERSISTENT COMPILATION CACHE MISS for 'jit_step'" in first.stderr, first.stderr[-3000:]
    stored = [
        p.rsplit("/", 1)[-1]
        for p in s3_server.filesystem().ls(f"cli-compiles/team/{job}/compile-cache", detail=False)
    ]
    assert any(n.startswith("jit_step-") for n in stored) and any(
        n.startswith("jit_eval_step-") for n in stored
    ), stored
    second = run("b", 80)
    assert json.loads(second.stdout.splitlines()[-1])["final_step"] == 80
    assert "Persistent compilation cache hit for 'jit_step'" in second.stderr, second.stderr[-3000:]
    assert "PERSISTENT COMPILATION CACHE MISS for 'jit_step'" not in second.stderr


def test_a_commands_compile_begins_before_its_flow_run_and_its_trainer_takes_it_over(
    tmp_path, prefect_server, mlflow_uri
):
    """`prefect-jax run` of one process begins the compile of the job's steps once its checks
    pass, before Prefect's flow run starts, and the flow run's trainer takes that compile and its
    program over: the program (a factory's: a new one per load) is made once and its train step
    traced once, on the compile's thread, for a new job and for its rerun (a restart after a
    preemption), with typed program params and the job's compilation cache. Made twice: no head
    start was made or taken; traced twice: the trainer compiled its own beside it."""
    events = tmp_path / "events"

    def run(max_steps: int) -> dict:
        proc = subprocess.run(
            [sys.executable, "-m", "prefect_jax.cli", "run"]
            + ["--program", "programs:counts_loads_and_traces", "--program-param", "width=16"]
            + ["--job", "head-start", "--storage", str(tmp_path / "s")]
            + ["--max-steps", str(max_steps), "--checkpoint-every-steps", "20"]
            + ["--compilation-cache", "job", "--mlflow-tracking-uri", mlflow_uri]
            + ["--exporters", "--json", "--no-progress"],
            capture_output=True,
            text=True,
            timeout=300,
            env=dict(
                os.environ,
                PREFECT_API_URL=prefect_server,
                PREFECT_JAX_TEST_EVENTS=str(events),
                PYTHONPATH=os.pathsep.join([TESTS_DIR, os.getcwd()]),
            ),
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])

    assert run(20)["final_step"] == 20
    assert events.read_text().splitlines() == ["load", "trace prefect-jax-compile"]
    events.unlink()
    assert run(40)["final_step"] == 40  # the rerun restores step 20
    assert events.read_text().splitlines() == ["load", "trace prefect-jax-compile"]
    assert os.listdir(tmp_path / "s" / "head-start" / "compile-cache")


def test_a_head_start_is_taken_over_by_its_own_job_only(job_config, request):
    """A head start is adopted by the trainer of the same job and train spec, once; a trainer of
    another spec makes its own loop. (None is made beside a live trainer of the job: the
    preflight asks, test_serving.)"""
    from prefect_jax.training import head_start
    from prefect_jax.training.program import load_program_with_params
    from prefect_jax.training.storage import JobStorage
    from prefect_jax.training.trainer import Trainer

    config = job_config(max_steps=40, every_steps=20)
    storage = JobStorage(config.storage, config.job)
    # (none left for a later test, whatever fails here)
    request.addfinalizer(lambda: setattr(head_start, "_begun", None))

    def begin(train) -> bool:
        program, params = load_program_with_params(config.program, None, train.max_steps)
        return head_start.begin(config.program, program, params, None, train, storage, None)

    assert begin(config.train)
    begun = head_start._begun.loop
    trainer = Trainer(config)
    try:
        assert trainer.loop is begun and head_start._begun is None
        trainer.restore_or_init()
        trainer.train_until_checkpoint()
        assert trainer.step == 20
    finally:
        trainer.close()

    assert begin(config.train.model_copy(update={"max_steps": 60}))
    begun = head_start._begun.loop
    other = Trainer(config)
    try:
        assert other.loop is not begun and head_start._begun is None
    finally:
        other.close()
    begun.compiling.join()
