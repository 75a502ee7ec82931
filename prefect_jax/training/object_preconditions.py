"""Reads that return an object's version, and writes and deletes that land only where the object
is still at that version, on the object stores that take such a precondition: S3 (the ETag,
``If-Match`` / ``If-None-Match``) and Google Cloud Storage (the generation, ``ifGenerationMatch``).
What the lease's compare-and-set stands on (`prefect_jax.training.lease_file`).

Each store's `read` is one GET that returns the version with the bytes (not a HEAD first: each is
a round trip). `put_if` and `delete_if` return False where the object changed since (the store
answered 412), and raise `PreconditionUnsupported` where the store refuses the precondition itself
(an S3-compatible store without conditional writes; a GCS-compatible one that returns no
generation; a zonal GCS bucket): the caller then writes plainly. A version of None means "no
object": a write that creates it.
"""

from __future__ import annotations

from typing import Any


class PreconditionUnsupported(Exception):
    """The store answered that it does not take the precondition (the caller writes plainly)."""


class S3Preconditions:
    """S3 and S3-compatible stores, through s3fs's async client (as its own `_cat_file` and
    `_pipe_file` call it): the version is the ETag."""

    protocols = ("s3", "s3a")

    def read(self, fs, path: str) -> tuple[bytes | None, Any]:
        import fsspec.asyn

        try:
            return fsspec.asyn.sync(fs.loop, _get_with_etag, fs, path)
        except FileNotFoundError:
            return None, None

    def put_if(self, fs, path: str, data: bytes, version: Any) -> bool:
        condition = {"mode": "create"} if version is None else {"IfMatch": version}
        try:
            fs.pipe_file(path, data, **condition)
        except FileExistsError:  # (If-None-Match refused: an object was written meanwhile)
            return False
        except FileNotFoundError:  # (If-Match on an object deleted since: S3 answers 404)
            return False
        except OSError as exc:
            if _s3_refused(exc):
                return False
            if _s3_not_implemented(exc):
                raise _unsupported(exc) from exc
            raise
        return True

    def delete_if(self, fs, path: str, version: Any) -> bool:
        import fsspec.asyn

        bucket, key, _ = fs.split_path(path)
        try:
            fsspec.asyn.sync(
                fs.loop, fs._call_s3, "delete_object", Bucket=bucket, Key=key, IfMatch=version
            )
        except OSError as exc:
            if _s3_refused(exc):
                return False
            if isinstance(exc, FileNotFoundError) or not _s3_not_implemented(exc):
                raise
            raise _unsupported(exc) from exc
        finally:
            fs.invalidate_cache(path)
        return True


class GCSPreconditions:
    """Google Cloud Storage, through gcsfs's public `call` (its JSON API requests, with its
    credentials and retries): the version is the object's generation. gcsfs's own `pipe_file`
    takes no generation but 0 (``mode="create"``), so a write over a version is the multipart
    upload that gcsfs makes, with ``ifGenerationMatch``. Every GCS bucket but a zonal one takes
    the precondition, so an answer other than 412 or 404 is raised as it comes (a 400 is a
    request to mend, and a 429 or 503 that gcsfs could not retry away is a failed write, retried
    by the next heartbeat), never read as "unsupported", which would write plainly for good.

    Zonal buckets (Rapid storage) hold appendable objects only, which gcsfs writes over gRPC;
    the JSON API refuses an upload there (400). The bucket's kind is asked once, as gcsfs asks
    it (its storage layout's ``locationType``, ``zone``), by `read`, the first request of every
    compare-and-set; a zonal bucket's lease is written plainly, by gcsfs.

    Args:
        zonal: what is known of buckets' kinds, by endpoint and bucket (default: this process's,
            shared by every lease file: an evaluator's check of its trainer makes one a poll).
    """

    protocols = ("gs", "gcs")

    def __init__(self, zonal: dict[tuple[str, str], bool] | None = None):
        self.zonal = _ZONAL_BUCKETS if zonal is None else zonal

    def read(self, fs, path: str) -> tuple[bytes | None, Any]:
        bucket, key, _ = fs.split_path(path)
        if self._is_zonal(fs, bucket):
            raise _zonal(bucket)
        try:
            headers, data = fs.call("GET", "b/{}/o/{}", bucket, key, alt="media")
        except FileNotFoundError:
            return None, None
        generation = headers.get("x-goog-generation")  # (GCS sends it with every object)
        if generation is None:  # (a GCS-compatible store without generations: every write
            # over the record read would be refused, and the heartbeat would never land)
            raise PreconditionUnsupported("the store returns no object generation")
        return data, generation

    def _is_zonal(self, fs, bucket: str) -> bool:
        """Whether `bucket`'s storage layout says it is zonal. A layout that cannot be read is
        taken, as gcsfs takes it, for a bucket of the usual kind: for good where the answer was
        final (a GCS-compatible store without that call: 404 or 400; credentials that may not
        read it: 403), else (a failure gcsfs would retry, left after its retries: a 503, a
        network error) asked again by the next read. A zonal bucket taken for a usual one so is
        found by the upload's refusal (`put_if`)."""
        from gcsfs.retry import is_retriable

        known = (fs.base, bucket)
        if known not in self.zonal:
            try:
                layout = fs.call("GET", "b/{}/storageLayout", bucket, json_out=True)
            except Exception as exc:  # noqa: BLE001 - a question whose every failure means "no"
                if is_retriable(exc):
                    return False
                layout = {}
            self.zonal[known] = layout.get("locationType") == "zone"
        return self.zonal[known]

    def put_if(self, fs, path: str, data: bytes, version: Any) -> bool:
        import json

        from gcsfs.retry import HttpError

        bucket, key, _ = fs.split_path(path)
        boundary = "prefect-jax-lease"  # (no such line in a JSON record)
        metadata = json.dumps({"name": key, "contentType": "application/json"})
        part = f"--{boundary}\r\nContent-Type: application/json"
        body = b"".join(
            (
                f"{part}; charset=UTF-8\r\n\r\n{metadata}\r\n{part}\r\n\r\n".encode(),
                data,
                f"\r\n--{boundary}--".encode(),
            )
        )
        upload = fs.base.removesuffix("storage/v1/") + "upload/storage/v1/b/{}/o"
        try:
            fs.call(
                "POST",
                upload,
                bucket,
                uploadType="multipart",
                ifGenerationMatch="0" if version is None else str(version),
                headers={"Content-Type": f'multipart/related; boundary="{boundary}"'},
                data=body,
                json_out=True,
            )
        except FileExistsError:  # (gcsfs's 412: the generation changed, or an object came)
            return False
        except HttpError as exc:  # (a zonal bucket whose layout could not be read)
            if exc.code != 400 or "appendable" not in str(exc.message):
                raise
            self.zonal[(fs.base, bucket)] = True
            raise _zonal(bucket) from exc
        finally:
            fs.invalidate_cache(path)
        return True

    def delete_if(self, fs, path: str, version: Any) -> bool:
        bucket, key, _ = fs.split_path(path)
        try:
            fs.call("DELETE", "b/{}/o/{}", bucket, key, ifGenerationMatch=str(version))
        except FileExistsError:  # (412: written since)
            return False
        except FileNotFoundError:  # (gone already)
            pass
        finally:
            fs.invalidate_cache(path)
        return True


_ZONAL_BUCKETS: dict[tuple[str, str], bool] = {}  # (endpoint, bucket) -> zonal (`GCSPreconditions`)

STORES = (S3Preconditions(), GCSPreconditions())


def preconditions_for(protocol: str) -> S3Preconditions | GCSPreconditions | None:
    """The store of `protocol` that takes a precondition on a write, or None."""
    return next((store for store in STORES if protocol in store.protocols), None)


async def _get_with_etag(fs, path: str) -> tuple[bytes, str | None]:
    """An S3 object's bytes and its ETag, from one GET (s3fs's async API, as its `_cat_file`)."""
    bucket, key, _ = fs.split_path(path)
    response = await fs._call_s3("get_object", Bucket=bucket, Key=key)
    try:
        return await response["Body"].read(), response.get("ETag")
    finally:
        response["Body"].close()


def _s3_answered(exc: BaseException, codes: tuple[str, ...], statuses: tuple[int, ...]) -> bool:
    """Whether a botocore response behind an error s3fs raised (its cause chain) has one of
    `codes` or `statuses`."""
    seen = exc
    while seen is not None:
        response = getattr(seen, "response", None)
        if isinstance(response, dict):
            code = (response.get("Error") or {}).get("Code")
            status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
            if code in codes or status in statuses:
                return True
        seen = seen.__cause__ or seen.__context__
    return False


def _s3_refused(exc: BaseException) -> bool:
    """Whether S3 refused a precondition: 412 (the object changed), or 409 (a conditional write
    raced another)."""
    return _s3_answered(exc, ("PreconditionFailed", "ConditionalRequestConflict"), (409, 412))


def _s3_not_implemented(exc: BaseException) -> bool:
    """Whether an S3-compatible store does not implement the precondition: 501, or 400 (a small
    PUT or a DELETE that its credentials may make is refused for its precondition header)."""
    return _s3_answered(exc, ("NotImplemented", "InvalidArgument", "InvalidRequest"), (400, 501))


def _zonal(bucket: str) -> PreconditionUnsupported:
    return PreconditionUnsupported(
        f"gs://{bucket} is a zonal bucket (Rapid storage), whose appendable objects the JSON "
        "API cannot upload"
    )


def _unsupported(exc: BaseException) -> PreconditionUnsupported:
    return PreconditionUnsupported(f"the store refused the precondition ({exc})")
