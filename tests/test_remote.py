"""Checkpoint steps on fsspec URLs Orbax cannot write: upload with a
commit marker, download, restore.

Against a real S3 API (moto's server on 127.0.0.1, in a subprocess), with real Orbax steps.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import traceback
import uuid

import grain
import jax
import numpy as np
import pytest
from s3_server import closed_port, isolate_aws_env, storage_options

from prefect_jax.training.checkpoint_dirs import committed_steps, is_committed
from prefect_jax.training.checkpoints import Checkpoints, CheckpointSpec
from prefect_jax.training.names import COMMIT_MARKER
from prefect_jax.training.redaction import redact_options, redact_url
from prefect_jax.training.remote import RemoteSteps
from prefect_jax.training.remote_errors import (
    RemoteConfigError,
    RemoteUnreachableError,
    transfer_may_succeed_again,
)
from prefect_jax.training.trees import state_fingerprint
from prefect_jax.training.uploader import AsyncUploader

pytestmark = pytest.mark.timeout(180)

BUCKET = "ckpt"
SECRET = "wJalrXUtnFEMI-K7MDENG-bPxRfiCY-SECRET"
TOKEN = "FwoGZXIvYXdzEJr-SESSION-TOKEN-0123456789"


@pytest.fixture(scope="module")
def s3(s3_server):
    """moto's S3 server on loopback with one bucket, for this module; AWS env isolated."""
    with pytest.MonkeyPatch.context() as mp:
        env = dict(os.environ)
        isolate_aws_env(env)
        for name in set(os.environ) - set(env):
            mp.delenv(name)
        for name, value in env.items():
            if os.environ.get(name) != value:
                mp.setenv(name, value)
        s3_server.create_bucket(BUCKET)
        yield s3_server


@pytest.fixture
def url(s3):
    """A fresh checkpoint directory URL in the bucket."""
    return f"s3://{BUCKET}/{uuid.uuid4().hex[:8]}/job/checkpoints"


@pytest.fixture
def remote(s3, url):
    return RemoteSteps(url, s3.storage_options)


def make_step(directory: str, step: int, state: dict, consumed: int = 3) -> tuple[str, dict]:
    """A real Orbax step (state + Grain iterator position + meta) under
    `directory`; returns (step dir, state)."""
    ckpt = Checkpoints(directory, CheckpointSpec(every_steps=1))
    it = iter(grain.MapDataset.range(100).to_iter_dataset())
    for _ in range(consumed):
        next(it)
    ckpt.save(step, state, it, {"note": "test"})
    ckpt.close()
    step_dir = os.path.join(directory, str(step))
    assert is_committed(step_dir)
    return step_dir, state


def small_state(seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {
        "key": jax.random.key(seed),
        "params": {
            "w": rng.standard_normal((16, 8), dtype=np.float32),
            "b": np.zeros(8, np.float32),
        },
        "step": np.asarray(seed, np.int32),
    }


def big_state() -> dict:
    """About 50 MiB of random arrays."""
    rng = np.random.default_rng(1)
    return {
        "w": rng.standard_normal((3, 2048, 2048), dtype=np.float32),
        "v": rng.standard_normal((1024, 512), dtype=np.float32),
    }


def restore(step_dir: str, state: dict):
    """Restore a (downloaded) step with Orbax, read-only; returns
    (state, meta, next iterator element)."""
    parent, name = os.path.split(step_dir)
    ckpt = Checkpoints(parent, read_only=True)
    it = iter(grain.MapDataset.range(100).to_iter_dataset())
    try:
        restored, meta = ckpt.restore(int(name), jax.eval_shape(lambda: state), it)
    finally:
        ckpt.close()
    return restored, meta, next(it)


# -- round trip ---------------------------------------------------------------------------------


def test_upload_then_download_restores_the_same_state(remote, tmp_path, s3):
    step_dir, state = make_step(str(tmp_path / "stage"), 7, small_state(7), consumed=3)

    assert remote.committed_steps() == []
    assert remote.upload(7, step_dir) is True
    assert remote.committed_steps() == [7]
    assert remote.latest_committed() == 7
    fs = s3.filesystem()
    assert fs.exists(f"{remote.root}/7/{COMMIT_MARKER}")
    marker = json.loads(fs.cat_file(f"{remote.root}/7/{COMMIT_MARKER}"))
    assert marker["step"] == 7 and "state/_METADATA" in marker["files"]

    cache = tmp_path / "cache" / "checkpoints"
    path = remote.download(7, str(cache))
    assert path == str(cache / "7")
    assert os.listdir(cache) == ["7"]  # no temporary sibling left behind
    assert committed_steps(str(cache)) == [7]  # Orbax's commit rule holds for the copy

    restored, meta, next_item = restore(path, state)
    assert state_fingerprint(restored) == state_fingerprint(state)
    assert jax.dtypes.issubdtype(restored["key"].dtype, jax.dtypes.prng_key)
    assert meta["step"] == 7 and meta["note"] == "test"
    assert next_item == 3  # the iterator resumes after the 3 elements consumed before the save


def test_upload_is_idempotent_and_download_reuses_the_cached_copy(remote, tmp_path):
    step_dir, _ = make_step(str(tmp_path / "stage"), 5, small_state(5))
    assert remote.upload(5, step_dir) is True
    assert remote.upload(5, step_dir) is False  # already committed: left alone
    first = remote.download(5, str(tmp_path / "cache"))
    inode = os.stat(os.path.join(first, "_CHECKPOINT_METADATA")).st_ino
    assert remote.download(5, str(tmp_path / "cache")) == first
    assert os.stat(os.path.join(first, "_CHECKPOINT_METADATA")).st_ino == inode  # not fetched again

    assert (
        remote.upload(5, step_dir, overwrite=True) is True
    )  # a new upload id: the cached copy is stale
    again = remote.download(5, str(tmp_path / "cache"))
    assert again == first and os.stat(os.path.join(again, "_CHECKPOINT_METADATA")).st_ino != inode
    assert sorted(os.listdir(tmp_path / "cache")) == ["5"]


def test_a_copy_of_the_same_upload_put_in_place_during_a_download_is_kept(
    remote, tmp_path, monkeypatch
):
    """Two processes download one step into one local stage (a second command of the job started
    beside the first): the one that ends second keeps the copy already in place, which the first
    may be restoring from, instead of replacing it with its own."""
    import shutil

    step_dir, _ = make_step(str(tmp_path / "stage"), 5, small_state(5))
    remote.upload(5, step_dir)
    other = remote.download(5, str(tmp_path / "elsewhere"))  # the other process's copy
    stage = tmp_path / "cache"
    get = remote.fs.get

    landed = {}

    def get_while_the_other_lands(rpaths, lpaths, **kw):
        get(rpaths, lpaths, **kw)
        shutil.copytree(other, stage / "5")  # (its rename lands while this one downloads)
        landed["inode"] = os.stat(stage / "5" / "_CHECKPOINT_METADATA").st_ino

    monkeypatch.setattr(remote.fs, "get", get_while_the_other_lands)
    path = remote.download(5, str(stage))
    monkeypatch.undo()
    assert path == str(stage / "5")
    assert os.stat(stage / "5" / "_CHECKPOINT_METADATA").st_ino == landed["inode"]
    assert sorted(os.listdir(stage)) == ["5"]  # its own copy removed, nothing aside


def test_a_step_uploaded_without_its_marker_is_not_listed_and_is_replaced(remote, tmp_path, s3):
    step_dir, state = make_step(str(tmp_path / "stage"), 10, small_state(10))
    fs = s3.filesystem()
    # An upload that stopped before the marker: some files, plus junk an old attempt left.
    fs.put_file(
        os.path.join(step_dir, "_CHECKPOINT_METADATA"), f"{remote.root}/10/_CHECKPOINT_METADATA"
    )
    fs.pipe_file(f"{remote.root}/10/state/stale-from-an-old-attempt", b"x" * 10)

    assert remote.step_names() == [10]
    assert remote.committed_steps() == []
    with pytest.raises(
        FileNotFoundError, match=r"step 10 is not committed in s3://ckpt/.*committed steps: \[\]"
    ):
        remote.download(10, str(tmp_path / "cache"))
    assert not (tmp_path / "cache" / "10").exists()

    assert remote.upload(10, step_dir) is True
    assert remote.committed_steps() == [10]
    assert not fs.exists(f"{remote.root}/10/state/stale-from-an-old-attempt")
    restored, _, _ = restore(remote.download(10, str(tmp_path / "cache")), state)
    assert state_fingerprint(restored) == state_fingerprint(state)


def test_delete_removes_the_marker_then_the_files(remote, tmp_path, s3):
    for step in (1, 2, 3):
        step_dir, _ = make_step(str(tmp_path / "stage"), step, small_state(step))
        remote.upload(step, step_dir)
    assert remote.committed_steps() == [1, 2, 3]
    remote.delete(1)
    remote.delete(1)  # deleting twice is fine
    remote.delete(99)  # so is deleting a step that never was
    assert remote.committed_steps() == [2, 3]
    assert not s3.filesystem().exists(f"{remote.root}/1")

    s3.filesystem().rm_file(f"{remote.root}/3/{COMMIT_MARKER}")  # 3 is now an uncommitted leftover
    s3.filesystem().pipe_file(f"{remote.root}/4/", b"")  # a "directory" key some tools write, alone
    assert remote.delete_uncommitted() == [3, 4]
    assert remote.step_names() == [2] and remote.committed_steps() == [2]


def test_a_listing_not_under_the_directory_falls_back_to_asking_step_by_step(
    remote, tmp_path, monkeypatch, caplog
):
    """Retention, the restore's sweep and `committed_steps` read one listing of every step's files
    on an object store; where its paths are not under the directory as the filesystem names it (a
    backend's own form), the steps are listed and their markers asked one by one, as before."""
    for step in (1, 2):
        step_dir, _ = make_step(str(tmp_path / "stage"), step, small_state(step))
        remote.upload(step, step_dir)
    assert remote._step_files() is not None
    monkeypatch.setattr(
        remote.fs, "find", lambda path, **kw: [f"elsewhere/{p}" for p in ("1/x", "2/y")]
    )
    with caplog.at_level("WARNING", logger="prefect_jax.remote"):
        assert remote.committed_steps() == [1, 2] and remote.step_names() == [1, 2]
    assert "not a path under it: listing its steps one by one" in caplog.text
    assert remote.retain(lambda steps: steps[-1:]) == [1] and remote.committed_steps() == [2]


def test_retention_lists_once_and_forgets_each_step_before_it_stops_counting(remote, tmp_path, s3):
    for step in (1, 2, 3):
        step_dir, _ = make_step(str(tmp_path / "stage"), step, small_state(step))
        remote.upload(step, step_dir)
    told = []

    def deleting(step: int) -> None:  # (the uploader forgets it: still committed at this point)
        told.append((step, remote.is_committed(step)))

    assert remote.retain(lambda steps: steps[-1:], but=2, deleting=deleting) == [1]
    assert told == [(1, True)]
    assert remote.committed_steps() == [2, 3]
    assert not s3.filesystem().find(f"{remote.root}/1")  # every file, in bulk from the one listing


def test_memory_and_local_urls_work_too(tmp_path):
    """The same commit rule on other fsspec protocols (memory:// is per process)."""
    step_dir, state = make_step(str(tmp_path / "stage"), 4, small_state(4))
    for url in (f"memory://prefect-jax-{uuid.uuid4().hex[:6]}/ck", str(tmp_path / "local-remote")):
        remote = RemoteSteps(url)
        assert remote.committed_steps() == []
        remote.upload(4, step_dir)
        assert remote.committed_steps() == [4]
        restored, _, nxt = restore(
            remote.download(4, str(tmp_path / "cache" / uuid.uuid4().hex[:6])), state
        )
        assert state_fingerprint(restored) == state_fingerprint(state) and nxt == 3
        assert remote.retain(lambda steps: [], but=4) == [] and remote.retain(lambda steps: []) == [
            4
        ]
        assert remote.committed_steps() == [] and remote.step_names() == []


# -- a process killed mid-upload -------------------------------------------------------------------

CHILD = textwrap.dedent(
    """
    import asyncio, json, sys
    import s3fs
    from prefect_jax.training.remote import RemoteSteps

    url, step, step_dir = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    options = json.loads(sys.stdin.read())
    original = s3fs.S3FileSystem._put_file

    async def put_file(self, lpath, rpath, *args, **kwargs):
        import os
        # The big array file: stop here and wait to be killed.
        if os.path.getsize(lpath) > 8 * 2**20:
            print("PAUSED", flush=True)
            await asyncio.sleep(3600)
        return await original(self, lpath, rpath, *args, **kwargs)

    s3fs.S3FileSystem._put_file = put_file
    print("UPLOADING", flush=True)
    RemoteSteps(url, options).upload(step, step_dir)
    print("UPLOADED", flush=True)
    """
)


def _start_child(tmp_path, source: str, args: list[str], s3) -> subprocess.Popen:
    """Run `source` as a script with `args`, the storage options on its stdin."""
    script = tmp_path / "child.py"
    script.write_text(source)
    child = subprocess.Popen(
        [sys.executable, str(script), *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    child.stdin.write(json.dumps(s3.storage_options))
    child.stdin.close()
    return child


@pytest.mark.slow
def test_a_process_killed_mid_upload_leaves_no_committed_step(remote, url, s3, tmp_path):
    step_dir, state = make_step(str(tmp_path / "stage"), 20, big_state())
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(step_dir) for f in fs)
    assert size > 40 * 2**20
    child = _start_child(tmp_path, CHILD, [url, "20", step_dir], s3)
    try:
        lines = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            line = child.stdout.readline().strip()
            if not line:
                break
            lines.append(line)
            if line == "PAUSED":
                break
        assert lines[-1:] == ["PAUSED"], (
            lines,
            child.stderr.read() if child.poll() is not None else "",
        )
        fs = s3.filesystem()
        deadline = time.monotonic() + 30
        while not fs.find(f"{remote.root}/20") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert fs.find(f"{remote.root}/20"), "the child uploaded nothing before it was killed"
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    assert child.returncode == -signal.SIGKILL

    uploaded = s3.filesystem().find(f"{remote.root}/20")
    assert uploaded and not any(p.endswith(COMMIT_MARKER) for p in uploaded)
    assert remote.step_names() == [20]
    assert remote.committed_steps() == []  # the torn step does not count

    # The next writer uploads the step again over the torn one; it then restores exactly.
    assert remote.upload(20, step_dir) is True
    assert remote.committed_steps() == [20]
    restored, _, _ = restore(remote.download(20, str(tmp_path / "cache")), state)
    assert state_fingerprint(restored) == state_fingerprint(state)


DOWNLOADING_CHILD = textwrap.dedent(
    """
    import asyncio, json, sys
    import s3fs
    from prefect_jax.training.remote import RemoteSteps

    url, step, stage = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    options = json.loads(sys.stdin.read())
    original = s3fs.S3FileSystem._get_file
    got = []

    async def get_file(self, rpath, lpath, *args, **kwargs):
        if got:  # one file down: stop here and wait to be killed
            print("PAUSED", flush=True)
            await asyncio.sleep(3600)
        got.append(rpath)
        return await original(self, rpath, lpath, *args, **kwargs)

    s3fs.S3FileSystem._get_file = get_file
    RemoteSteps(url, options).download(step, stage)
    """
)


def test_a_download_killed_part_way_is_removed_once_its_process_is_gone(remote, url, s3, tmp_path):
    """A process killed mid-download leaves its hidden copy in the local stage (a step's size
    each time). The writer's cleanup leaves it while its process lives (its lock held), removes
    it once the process is gone, and leaves the steps, this process's own download and other
    files alone; a download it cannot ask (another machine's, or named before locks) goes once it
    is a day old."""
    from prefect_jax.training import leftovers
    from prefect_jax.training.leftovers import download_dir, remove_leftovers

    kernel = leftovers._kernel()
    step_dir, _ = make_step(str(tmp_path / "stage"), 20, small_state(20))
    remote.upload(20, step_dir)
    child = _start_child(tmp_path, DOWNLOADING_CHILD, [url, "20", str(tmp_path / "cache-2")], s3)
    try:
        line = child.stdout.readline().strip()
        assert line == "PAUSED", (line, child.stderr.read() if child.poll() is not None else "")
        partial, lock = sorted(os.listdir(tmp_path / "cache-2"))
        assert partial.startswith(f".20.download-{kernel}-") and lock == f"{partial}.lock"
        assert remove_leftovers(str(tmp_path / "cache-2"), downloads=True) == []  # it still runs
        assert sorted(os.listdir(tmp_path / "cache-2")) == [partial, lock]
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    assert child.returncode == -signal.SIGKILL
    assert remove_leftovers(str(tmp_path / "cache-2"), downloads=True) == [partial]
    assert os.listdir(tmp_path / "cache-2") == []

    stage = tmp_path / "cache"
    remote.download(20, str(stage))  # a committed copy, which stays
    elsewhere, before_locks = f".20.download-elsewhere-{'a' * 12}", f".20.download-{'e' * 12}"
    kept = ["20", "notes", elsewhere, f"{elsewhere}.lock", before_locks]
    old_elsewhere, old_before_locks = (
        f".21.download-elsewhere-{'f' * 12}",
        f".21.download-{'c' * 12}",
    )
    gone = [f".20.stale-{'b' * 12}", old_elsewhere, old_before_locks]
    lone_lock = f".30.download-{kernel}-{'d' * 12}.lock"  # killed after its rename
    for name in kept + gone:
        if name.endswith(".lock"):
            (stage / name).touch()
        else:
            (stage / name).mkdir(exist_ok=True)
    (stage / lone_lock).touch()
    two_days_ago = time.time() - 2 * 86400
    for name in (old_elsewhere, old_before_locks):
        os.utime(stage / name, (two_days_ago, two_days_ago))
    with download_dir(str(stage), 40) as mine:  # (this process's own, as its prefetch's)
        os.makedirs(mine)
        assert remove_leftovers(str(stage), downloads=True) == sorted(gone + [lone_lock])
        assert sorted(os.listdir(stage)) == sorted(
            kept + [os.path.basename(mine), f"{os.path.basename(mine)}.lock"]
        )
        os.rmdir(mine)
    assert sorted(os.listdir(stage)) == sorted(kept)


def test_a_download_whose_new_lock_file_a_cleanup_took_picks_another_name(tmp_path, monkeypatch):
    """Between creating its lock file and locking it, a download's lock is free: another
    process's cleanup may take the file for a killed download's and delete it. The download then
    takes a new name rather than run on under a lock nobody can find."""
    import fcntl

    from prefect_jax.training.leftovers import download_dir

    flock, taken = fcntl.flock, []

    def cleanup_first(f, op):
        if not taken:  # (the other process's cleanup, at that moment)
            taken.append(f.name)
            os.unlink(f.name)
        return flock(f, op)

    monkeypatch.setattr(fcntl, "flock", cleanup_first)
    with download_dir(str(tmp_path), 5) as path:
        monkeypatch.undo()
        assert f"{path}.lock" != taken[0] and os.path.exists(f"{path}.lock")
        with open(f"{path}.lock", "r+") as other, pytest.raises(BlockingIOError):
            fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
    assert os.listdir(tmp_path) == []


# -- the background uploader -----------------------------------------------------------------------


def test_async_uploader_commits_a_step_only_when_its_upload_is_done(remote, tmp_path):
    step_dir, _ = make_step(str(tmp_path / "stage"), 30, big_state())
    local_committed = threading.Event()  # stands in for "Orbax finalized the local save"
    uploaded = []
    with AsyncUploader(remote, on_uploaded=uploaded.append) as uploader:
        uploader.submit(30, step_dir, ready=lambda path: local_committed.is_set())
        assert uploader.pending == [30]
        assert uploader.wait(timeout=0.3) is False  # waits on the local commit
        assert (
            uploader.wait_for(30, timeout=0.1) is False
        )  # (a step's own wait, without asking the storage)
        assert remote.committed_steps() == []
        local_committed.set()
        assert uploader.wait_for(30) is True and remote.is_committed(30)
        assert uploader.committed(30)  # known here, without a request
        uploader.forget([30])  # (retention removed it)
        assert not uploader.committed(30) and uploader.wait_for(30) is False
        assert uploader.wait() is True
        assert remote.committed_steps() == [30]
        assert uploader.pending == [] and uploaded == [30] and uploader.uploaded == [30]


def test_async_uploader_raises_errors_on_the_next_call_and_keeps_going(remote, tmp_path):
    step_dir, _ = make_step(str(tmp_path / "stage"), 40, small_state(40))
    uploader = AsyncUploader(remote, retries=3, backoff_secs=0.01)
    uploader.submit(39, str(tmp_path / "missing"))  # not a directory: permanent, not retried
    with pytest.raises(FileNotFoundError, match="missing is not a directory") as err:
        uploader.wait()
    assert any(
        "while uploading checkpoint step 39" in note for note in getattr(err.value, "__notes__", [])
    )
    assert uploader.wait() is True  # raised once, then forgotten

    uploader.submit(39, str(tmp_path / "missing"))
    assert uploader.wait_for(39) is False  # failed; the failure is still raised once, below
    assert not uploader.pending  # the failure is recorded before the step leaves `pending`
    with pytest.raises(FileNotFoundError):
        uploader.submit(40, step_dir)  # the earlier failure surfaces on submit; 40 was not queued
    uploader.submit(40, step_dir)
    assert uploader.wait_for(40) is True
    uploader.submit(40, step_dir)  # already committed: left alone, and still done
    assert uploader.wait_for(40) is True
    assert uploader.close() is True
    assert remote.committed_steps() == [40]
    with pytest.raises(RuntimeError, match="closed"):
        uploader.submit(41, step_dir)


class FlakyRemote:
    """A RemoteSteps stand-in whose first uploads fail with a transient error."""

    safe_url = "s3://flaky/ck"

    def __init__(self, failures: int, error: BaseException):
        self.failures, self.error, self.calls = failures, error, 0

    def upload(self, step, local_step_dir):
        self.calls += 1
        if self.calls <= self.failures:
            raise self.error
        return True


def test_async_uploader_retries_transient_errors_with_backoff():
    flaky = FlakyRemote(2, OSError("connection reset by peer"))
    with AsyncUploader(flaky, retries=3, backoff_secs=0.01) as uploader:
        uploader.submit(1, "/nowhere")
        assert uploader.wait() is True
    assert flaky.calls == 3

    hopeless = FlakyRemote(10, TimeoutError("read timed out"))
    uploader = AsyncUploader(hopeless, retries=2, backoff_secs=0.01)
    uploader.submit(1, "/nowhere")
    with pytest.raises(TimeoutError):
        uploader.wait()
    assert hopeless.calls == 3  # one try and two retries

    denied = FlakyRemote(10, PermissionError("Access Denied"))
    uploader = AsyncUploader(denied, retries=5, backoff_secs=0.01)
    uploader.submit(1, "/nowhere")
    with pytest.raises(PermissionError):
        uploader.wait()
    assert denied.calls == 1  # not transient: not retried


# -- clear errors, no secrets ----------------------------------------------------------------------


def all_text(exc: BaseException) -> str:
    return "".join(traceback.format_exception(exc)) + repr(exc) + str(getattr(exc, "__notes__", ""))


def test_unknown_protocol_is_a_clear_configuration_error():
    started = time.monotonic()
    with pytest.raises(RemoteConfigError) as err:
        RemoteSteps(f"nosuchproto://user:{SECRET}@bucket/ck", {"secret": SECRET})
    message = str(err.value)
    assert "nosuchproto://***:***@bucket/ck" in message
    assert "knows no protocol 'nosuchproto'" in message and "spelling" in message
    assert SECRET not in all_text(err.value)
    assert isinstance(err.value, ValueError) and not transfer_may_succeed_again(err.value)
    assert time.monotonic() - started < 5


def test_an_unreachable_endpoint_fails_fast_naming_the_redacted_url(url):
    endpoint = f"http://127.0.0.1:{closed_port()}"
    remote = RemoteSteps(
        url, storage_options(endpoint, key="AKIAEXAMPLEACCESSKEY", secret=SECRET, token=TOKEN)
    )
    for call in (
        remote.committed_steps,
        lambda: remote.upload(1, os.path.dirname(__file__)),
        lambda: remote.download(1, "/tmp/never"),
    ):
        started = time.monotonic()
        with pytest.raises(RemoteUnreachableError) as err:
            call()
        assert time.monotonic() - started < 30
        message = str(err.value)
        assert f"cannot reach {url} (endpoint {endpoint})" in message
        assert "check the endpoint URL, the network" in message
        text = all_text(err.value)
        assert SECRET not in text and TOKEN not in text and "AKIAEXAMPLEACCESSKEY" not in text
        assert transfer_may_succeed_again(err.value) and isinstance(err.value, ConnectionError)
    assert SECRET not in repr(remote) and SECRET not in str(remote.storage_options)


def test_an_unreachable_endpoint_in_the_uploader_is_retried_then_raised(url, tmp_path):
    step_dir, _ = make_step(str(tmp_path / "stage"), 2, small_state(2))
    remote = RemoteSteps(url, storage_options(f"http://127.0.0.1:{closed_port()}", secret=SECRET))
    uploader = AsyncUploader(remote, retries=1, backoff_secs=0.01)
    started = time.monotonic()
    uploader.submit(2, step_dir)
    with pytest.raises(RemoteUnreachableError) as err:
        uploader.wait(timeout=60)
    assert time.monotonic() - started < 30
    assert SECRET not in all_text(err.value)


def test_a_missing_bucket_is_named(s3, tmp_path):
    step_dir, _ = make_step(str(tmp_path / "stage"), 1, small_state(1))
    remote = RemoteSteps("s3://no-such-bucket/job/checkpoints", s3.storage_options)
    assert remote.committed_steps() == []  # like a job that has not started
    with pytest.raises(
        RemoteConfigError,
        match=r"under s3://no-such-bucket/job/checkpoints .*bucket or container exists",
    ):
        remote.upload(1, step_dir)
    assert not s3.filesystem().exists("no-such-bucket")  # not created behind the user's back


def test_missing_credentials_say_where_to_put_them(s3, url):
    options = storage_options(s3.endpoint_url)
    del options["key"], options["secret"]
    remote = RemoteSteps(url, options)
    with pytest.raises(RemoteConfigError) as err:
        remote.committed_steps()
    message = str(err.value)
    assert f"no usable credentials for {url}" in message
    assert "AWS_ACCESS_KEY_ID" in message and "anon=True" in message
    assert not transfer_may_succeed_again(err.value)


def test_redaction_helpers():
    assert redact_url("s3://bucket/prefix") == "s3://bucket/prefix"
    assert redact_url(f"s3://AKIAEXAMPLEACCESSKEY:{SECRET}@bucket/p") == "s3://AKIA***:***@bucket/p"
    assert redact_url("https://ghp_abcdefghijklmnop@github.com/x") == "https://***@github.com/x"
    signed = redact_url(f"https://h/o?X-Amz-Signature={SECRET}&X-Amz-Security-Token={TOKEN}&part=2")
    assert SECRET not in signed and TOKEN not in signed and "part=2" in signed
    assert redact_url(f"simplecache::s3://k:{SECRET}@b/p") == "simplecache::s3://***:***@b/p"
    assert redact_url("/local/path") == "/local/path"

    options = {
        "key": "AKIAEXAMPLEACCESSKEY",
        "secret": SECRET,
        "token": TOKEN,
        "client_kwargs": {
            "endpoint_url": f"http://u:{SECRET}@127.0.0.1:9000",
            "aws_secret_access_key": SECRET,
            "region_name": "us-east-1",
        },
        "account_key": SECRET,
        "sas_token": None,
    }
    shown = redact_options(options)
    assert SECRET not in json.dumps(shown) and TOKEN not in json.dumps(shown)
    assert shown["key"] == "AKIA***" and shown["secret"] == "***" and shown["sas_token"] is None
    assert shown["client_kwargs"]["region_name"] == "us-east-1"
    assert (
        shown["client_kwargs"]["endpoint_url"] == "http://***:***@127.0.0.1:9000"
    )  # short user names are hidden too
    assert options["secret"] == SECRET  # the original is untouched
