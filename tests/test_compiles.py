"""The train step compiles once per process: the compile done ahead of time (overlapping the
restore) is the one the loop finds, from the first step to the last; with a warm persistent
compilation cache a rerun compiles nothing, also on another machine when the cache is on object
storage. Each run is a fresh process, as a rerun is."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import uuid

import pytest
from process_helpers import TESTS_DIR
from s3_server import closed_port, isolate_aws_env, storage_options

pytestmark = pytest.mark.slow


def _run(*args: str, env: dict | None = None) -> dict:
    proc = subprocess.run([sys.executable, "count_compiles.py", *args], capture_output=True, text=True, cwd=TESTS_DIR,
                          timeout=300, env=env)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_train_step_compiles_once_per_run_and_not_at_all_from_a_warm_cache(tmp_path, mlflow_uri):
    first = _run(str(tmp_path / "a"), mlflow_uri)
    assert (first["start"], first["end"], first["compiled"]) == (0, 40, 1)
    rerun = _run(str(tmp_path / "a"), mlflow_uri)
    assert (rerun["start"], rerun["end"], rerun["compiled"]) == (40, 80, 1)

    cache = str(tmp_path / "compile-cache")
    cold = _run(str(tmp_path / "b"), mlflow_uri, cache)
    assert cold["cache_miss"] == 1 and cold["cache_hit"] == 0
    warm = _run(str(tmp_path / "b"), mlflow_uri, cache)
    assert warm["start"] == 40 and warm["cache_miss"] == 0 and warm["cache_hit"] >= 1


def test_a_cache_on_object_storage_follows_the_job_to_another_machine(tmp_path, mlflow_uri, s3_server):
    """The job's cache on S3 ("job": under its storage). Its first node is lost in the first
    interval, before any checkpoint (SIGKILL, no clean end): the train step it compiled is in
    storage already, and the rerun, on a machine whose local directories are elsewhere, loads
    it. (JAX given the S3 URL itself ignores the storage options and caches nothing; given a
    local mirror at another path, its keys would differ by that path.)"""
    env = dict(os.environ)
    isolate_aws_env(env)
    bucket = s3_server.create_bucket("compiles")
    storage, options = f"{bucket}/{uuid.uuid4().hex[:8]}", json.dumps(s3_server.storage_options)
    proc = subprocess.run([sys.executable, "count_compiles.py", storage, mlflow_uri, "job", options, "lost"], capture_output=True,
                          text=True, cwd=TESTS_DIR, timeout=300, env=dict(env, PREFECT_JAX_CACHE_DIR=str(tmp_path / "a")))  # fmt: skip
    lost = json.loads(proc.stdout.strip().splitlines()[-1])
    assert proc.returncode == -9 and (lost["start"], lost["lost_at"], lost["cache_miss"], lost["cache_hit"]) == (0, 10, 1, 0), (lost, proc.stderr[-2000:])
    stored = s3_server.filesystem().ls(f"{storage}/compiles/compile-cache", detail=False)
    assert any(p.rsplit("/", 1)[-1].startswith("jit_step-") for p in stored), stored

    rerun = _run(storage, mlflow_uri, "job", options, env=dict(env, PREFECT_JAX_CACHE_DIR=str(tmp_path / "b")))
    assert (rerun["start"], rerun["end"], rerun["cache_miss"]) == (0, 40, 0) and rerun["cache_hit"] >= 1


def test_an_unreachable_cache_is_skipped_with_a_warning(tmp_path, caplog):
    """Storage that does not answer costs the cache, not the job: nothing copied, a warning."""
    from prefect_jax.training.compile_cache import CompileCacheMirror

    mirror = CompileCacheMirror("s3://compiles/gone/compile-cache", str(tmp_path / "local"),
                                storage_options(f"http://127.0.0.1:{closed_port()}"))  # fmt: skip
    (tmp_path / "local").mkdir(exist_ok=True)
    (tmp_path / "local" / "jit_step-0-cache").write_bytes(b"entry")
    with caplog.at_level(logging.WARNING, logger="prefect_jax.compile_cache"):
        assert mirror.pull() == []
        assert mirror.flush(timeout=120) and mirror.pushed == []
    messages = [r.getMessage() for r in caplog.records]
    assert any("could not be read" in m for m in messages) and any("could not copy" in m for m in messages), messages
    assert sorted(os.listdir(tmp_path / "local")) == ["jit_step-0-cache"]  # no temporary files left
    assert (tmp_path / "local" / "jit_step-0-cache").read_bytes() == b"entry"


def test_an_entry_written_while_it_is_copied_is_copied_again(tmp_path, monkeypatch):
    """JAX writes an entry in place: one that changed while it was copied is not counted as
    stored, and the next push copies it whole."""
    import fsspec

    from prefect_jax.training.compile_cache import CompileCacheMirror

    memory = fsspec.filesystem("memory")
    entry = tmp_path / "jit_step-1-cache"
    entry.write_bytes(b"first part")

    class JaxStillWriting:
        def put(self, local, remote):
            memory.put(local, remote)
            entry.write_bytes(b"first part, and the rest")  # the write goes on after the copy read it

    url = f"memory://race-{uuid.uuid4().hex[:8]}/compile-cache"
    mirror = CompileCacheMirror(url, str(tmp_path))
    monkeypatch.setattr(CompileCacheMirror, "fs", property(lambda self: JaxStillWriting()))
    assert mirror.flush(timeout=30) and mirror.pushed == []
    assert memory.cat(f"{url}/jit_step-1-cache") == b"first part"
    monkeypatch.setattr(CompileCacheMirror, "fs", property(lambda self: memory))
    assert mirror.flush(timeout=30) and mirror.pushed == ["jit_step-1-cache"]
    assert memory.cat(f"{url}/jit_step-1-cache") == b"first part, and the rest"
    assert mirror.flush(timeout=30) and mirror.pushed == ["jit_step-1-cache"]  # nothing new: nothing copied


def test_where_the_cache_is(tmp_path, monkeypatch):
    """Local directories as they are; a URL mirrored under PREFECT_JAX_CACHE_DIR, with the job's
    storage options only where the URL is on the job's storage protocol."""
    from prefect_jax.training.compile_cache import locate
    from prefect_jax.training.storage import JobStorage

    monkeypatch.setenv("PREFECT_JAX_CACHE_DIR", str(tmp_path / "machine"))
    local, s3 = JobStorage(str(tmp_path / "jobs"), "j"), JobStorage("s3://b/jobs", "j", {"key": "k"})
    assert locate("job", local) == (str(tmp_path / "jobs" / "j" / "compile-cache"), None, {})
    assert locate(f"file://{tmp_path}/c/", s3) == (f"{tmp_path}/c", None, {})
    url, mirror, options = locate("job", s3)
    assert (url, options) == ("s3://b/jobs/j/compile-cache", {"key": "k"})
    assert mirror.startswith(str(tmp_path / "machine")) and mirror == s3.staging_dir("compile-cache")
    assert locate("s3://other/cache/", s3)[1:] == (locate("s3://other/cache", s3)[1], {"key": "k"})
    url, mirror, options = locate("gs://other/cache", s3)
    assert url == "gs://other/cache" and mirror.startswith(str(tmp_path / "machine")) and options == {}
    assert mirror != locate("s3://other/cache", s3)[1]
