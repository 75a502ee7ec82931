"""The lease's compare-and-set (`prefect_jax.training.lease_file`): on a local path (a lock), on
S3 (a moto server on loopback: ``If-Match`` / ``If-None-Match``) and on GCS (fake-gcs-server on
loopback: ``ifGenerationMatch``), a write lands only over the record its writer read. A holder
that lost the job cannot land a late heartbeat over its taker's record (it stopped the taker,
and trained on itself); two takers of a free job cannot both win."""

import json
import logging

import pytest
from lease_helpers import lease_under

from prefect_jax.training.errors import LeaseLostError
from prefect_jax.training.lease import Lease
from prefect_jax.training.storage import JobStorage

BUCKET = "leases"


@pytest.fixture(params=["local", "s3", "gs"])
def new_lease(request, tmp_path):
    """Makes `Lease`s of one job (flow run "run-2", this process), on a local path, S3 or GCS."""
    if request.param == "local":
        return lambda **kw: lease_under(tmp_path, **kw)
    if request.param == "gs":
        root, options = f"gs://{request.getfixturevalue('gcs_env').bucket}/{tmp_path.name}", {}
    else:
        s3 = request.getfixturevalue("s3_server")
        s3.create_bucket(BUCKET)
        root, options = f"s3://{BUCKET}/{tmp_path.name}", s3.storage_options
    return lambda timeout=60.0: Lease(
        JobStorage(root, "j", options), owner_id="run-2", timeout_secs=timeout
    )


def test_a_lost_holders_late_heartbeat_is_refused_and_the_taker_keeps_the_job(new_lease):
    """The holder reads its record for a beat, then stalls (a PUT that hangs, a long pause); a
    rerun of its flow run takes the job over meanwhile. The beat, written at last, is refused:
    the taker's record stays, the holder finds it and stops before its next checkpoint."""
    holder = new_lease()
    holder.acquire()
    taker = new_lease()
    try:
        assert holder.file.conditional
        beat_read, version = holder.file.read()  # (the beat's read, before the stall)
        assert beat_read["token"] == holder.token
        taker.acquire()  # (left by this process: taken over at once, as a retry's rerun)
        assert taker.taken_over["token"] == beat_read["token"]  # (a beat since clears .token)
        assert not holder.file.write_if(holder._record(), version)  # the late write: refused
        assert taker.read()["token"] == taker.token
        assert not holder.write_beat()  # its beat, reading again: the job is the taker's
        with pytest.raises(LeaseLostError):
            holder.verify()
        taker.verify()  # (the taker trains on)
    finally:
        taker.release()
        holder.release()
    assert taker.read() is None


def test_of_two_takers_of_a_free_job_one_wins(new_lease):
    """Two trainers read "no lease" and write theirs: the second write is refused (before, the
    later write won, and the first found out at its read-back)."""
    first, second = new_lease(), new_lease()
    record, version = first.file.read()
    assert record is None and version is None
    first.token, second.token = "first", "second"
    assert first.file.write_if(first._record(), version, make_parent=True)
    assert not second.file.write_if(second._record(), version, make_parent=True)
    assert first.read()["token"] == "first"


def test_a_release_never_removes_a_lease_written_since_its_read(new_lease, request):
    """A release reads its own record, then removes the file: where a taker wrote between the
    two, the remove is refused (locally under the lock; on S3 a DeleteObject with If-Match; on
    GCS a delete with ifGenerationMatch) and the taker keeps its lease."""
    if "[gs]" in request.node.name:  # (strict: once the emulator refuses it, this says so)
        request.applymarker(
            pytest.mark.xfail(
                strict=True,
                raises=AssertionError,
                reason="fake-gcs-server ignores ifGenerationMatch on a delete (GCS refuses it)",
            )
        )
    holder = new_lease()
    holder.acquire()
    try:
        _, version = holder.file.read()
        # (a taker's record, written after the release's read)
        JobStorage.write_json(holder.storage, holder.path, {"token": "taker", "heartbeat": 0})
        assert not holder.file.remove_if(version)
        assert holder.read()["token"] == "taker"
    finally:
        holder._stop.set()  # (lost: nothing of its to release; its beat stops)
        holder.token = None


def test_a_takers_write_over_a_lease_released_since_its_read_is_refused_not_raised(new_lease):
    """The holder lets the job go between the taker's read and its write: the write over the
    record read finds none (S3 answers 404 to If-Match), is refused, and the taking reads again
    (`lease_takeover`: nothing there, written anew)."""
    holder = new_lease()
    holder.acquire()
    _, version = holder.file.read()
    holder.release()
    taker = new_lease()
    taker.token = "taker"
    assert not taker.file.write_if(taker._record(), version)
    assert taker.read() is None
    taker.token = None
    taker.acquire()  # (and taken as a free job)
    try:
        assert taker.read()["token"] == taker.token
    finally:
        taker.release()


def test_the_local_lock_is_beside_the_jobs_folder_not_in_it(tmp_path):
    """Every local writer locks ``<storage>/.<job>.lease.lock``: the job's folder holds only the
    job's files (a refused job's empty folder can go; one made anew by a remount stays empty)."""
    lease = lease_under(tmp_path)
    lease.acquire()
    try:
        assert sorted(p.name for p in (tmp_path / "storage" / "j").iterdir()) == ["lease.json"]
        assert (tmp_path / "storage" / ".j.lease.lock").exists()
        assert lease.storage.jobs_there() == ["j"]
    finally:
        lease.release()


class _GCSAnswering:
    """A gcsfs file system whose every request gets `status` (and `headers`), turned into what
    gcsfs raises by gcsfs's own `validate_response`: the answers of real GCS that
    fake-gcs-server does not give (it deletes whatever the generation asked for)."""

    base = "https://storage.googleapis.com/storage/v1/"

    def __init__(self, status, headers=None, body=b"{}", layout=200, message="no"):
        self.status, self.headers, self.body, self.requests = status, headers or {}, body, []
        self.layout = layout  # the status of a request of the bucket's storage layout
        self.location_type = "region"  # what a layout read answers
        self.error = json.dumps({"error": {"message": message}}).encode()

    @staticmethod
    def split_path(path):
        bucket, _, key = path.removeprefix("gs://").partition("/")
        return bucket, key, None

    def call(self, method, path, *args, **kwargs):
        from gcsfs.retry import validate_response

        if path.endswith("/storageLayout"):
            assert (method, path, kwargs) == ("GET", "b/{}/storageLayout", {"json_out": True})
            self.requests.append(("layout", None))
            validate_response(self.layout, self.error, path, args)
            return {"bucket": args[0], "locationType": self.location_type}
        self.requests.append((method, kwargs.get("ifGenerationMatch")))
        validate_response(self.status, self.error, path, args)
        return self.headers, self.body

    def invalidate_cache(self, path):
        pass


def test_gcs_answers_the_emulator_does_not_give_are_read_as_gcs_means_them():
    """A delete GCS refuses (412: the lease written since) removes nothing and says so; one of a
    lease gone already is done; any other failure is raised, never read as a store without
    preconditions (which would write every later beat plainly); an object read without a
    generation (a GCS-compatible store that keeps none) is one: else each beat, made over
    generation 0, would be refused and never land."""
    from gcsfs.retry import HttpError

    from prefect_jax.training.object_preconditions import (
        GCSPreconditions,
        PreconditionUnsupported,
    )

    gcs, path = GCSPreconditions(zonal={}), "gs://jobs/j/lease.json"
    refusing = _GCSAnswering(412)
    assert not gcs.delete_if(refusing, path, "17")
    assert refusing.requests == [("DELETE", "17")]
    assert gcs.delete_if(_GCSAnswering(404), path, "17")
    for status in (400, 503):
        with pytest.raises((HttpError, ValueError)):
            gcs.delete_if(_GCSAnswering(status), path, "17")
        with pytest.raises((HttpError, ValueError)):
            gcs.put_if(_GCSAnswering(status, body=b"{}"), path, b"{}", "17")
    assert not gcs.put_if(_GCSAnswering(412), path, b"{}", None)
    assert gcs.read(_GCSAnswering(200, {"x-goog-generation": "5"}, b"{}"), path) == (b"{}", "5")
    with pytest.raises(PreconditionUnsupported):
        gcs.read(_GCSAnswering(200, {}, b"{}"), path)


def test_a_zonal_buckets_lease_is_written_plainly_its_kind_asked_once():
    """A zonal bucket (Rapid storage) holds appendable objects, which the JSON API's upload
    cannot write (400): its lease is written plainly (by gcsfs, over gRPC there), never through
    the JSON API. The bucket's kind is asked once where the answer was final (a layout, a 404,
    a 403), and again after a failure that may pass (a 503)."""
    from prefect_jax.training.object_preconditions import (
        GCSPreconditions,
        PreconditionUnsupported,
    )

    path = "gs://jobs/j/lease.json"
    gcs, zonal = GCSPreconditions(zonal={}), _GCSAnswering(200, {"x-goog-generation": "5"})
    zonal.location_type = "zone"
    for _ in range(2):
        with pytest.raises(PreconditionUnsupported, match="gs://jobs is a zonal bucket"):
            gcs.read(zonal, path)
    assert zonal.requests == [("layout", None)]
    for layout, asked in ((200, 1), (404, 1), (400, 1), (403, 1), (503, 2)):
        gcs, usual = (
            GCSPreconditions(zonal={}),
            _GCSAnswering(200, {"x-goog-generation": "5"}, b"{}", layout),
        )
        for _ in range(2):
            assert gcs.read(usual, path) == (b"{}", "5")  # (a bucket of the usual kind)
        assert usual.requests.count(("layout", None)) == asked, (layout, usual.requests)
    # A zonal bucket whose layout could not be read (a 503): its upload's refusal tells.
    gcs = GCSPreconditions(zonal={})
    refused = _GCSAnswering(400, layout=503, message="This bucket requires appendable objects.")
    with pytest.raises(PreconditionUnsupported, match="gs://jobs is a zonal bucket"):
        gcs.put_if(refused, path, b"{}", "5")
    with pytest.raises(PreconditionUnsupported, match="gs://jobs is a zonal bucket"):
        gcs.read(refused, path)  # (known now: not asked again)
    assert refused.requests == [("POST", "5")]


def test_on_a_zonal_bucket_the_lease_is_taken_beats_and_is_released_with_plain_writes(
    gcs_env, tmp_path, monkeypatch, caplog
):
    """fake-gcs-server standing in for a zonal bucket (its storage layout says ``zone``): the
    lease works as on a store without preconditions, said once at WARNING, instead of every
    write failing with the JSON API's 400."""
    from prefect_jax.training.object_preconditions import preconditions_for

    storage = JobStorage(f"gs://{gcs_env.bucket}/{tmp_path.name}", "j", {})
    call = storage.fs.call

    layouts = []

    def as_a_zonal_bucket(method, path, *args, **kwargs):
        if path.endswith("/storageLayout"):
            layouts.append(args[0])
            assert kwargs == {"json_out": True} and storage.fs.base.startswith("http"), kwargs
            return {"bucket": args[0], "locationType": "zone"}
        assert "upload/" not in path, path  # (no JSON API upload: refused on a zonal bucket)
        return call(method, path, *args, **kwargs)

    monkeypatch.setattr(storage.fs, "call", as_a_zonal_bucket)
    # (not what this process learnt of the emulator's bucket in the tests before)
    monkeypatch.setattr(preconditions_for("gs"), "zonal", {})
    lease = Lease(storage, owner_id="run-2", timeout_secs=60.0)
    with caplog.at_level(logging.WARNING, logger="prefect_jax.lease"):
        lease.acquire()
        try:
            assert lease.held and not lease.file.conditional
            assert lease.read()["token"] == lease.token and lease.write_beat()
        finally:
            lease.release()
    assert not storage.fs.exists(lease.path)
    assert caplog.text.count("is a zonal bucket (Rapid storage)") == 1, caplog.text
    assert Lease(storage).read() is None  # (an evaluator's check of its trainer, say)
    assert layouts == [gcs_env.bucket]  # asked once in this process, not once per lease
