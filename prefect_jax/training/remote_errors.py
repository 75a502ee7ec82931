"""Errors of remote checkpoint storage, and how fsspec's and the cloud SDKs' failures become them.

A failure is classified by the names of its exception's classes (botocore, google-auth, azure,
aiohttp, fsspec), so that none of those packages is imported to tell: missing or refused
credentials and bad options are `RemoteConfigError` (a retry cannot fix them), an endpoint that
does not answer is `RemoteUnreachableError` (retried as transient). Every message names the
redacted URL and what to check; secrets never reach one (`prefect_jax.training.redaction`).
"""

from __future__ import annotations

import re
import socket
from collections.abc import Callable, Mapping

import fsspec

from prefect_jax.training.redaction import redact_options, redact_url, scrub


class RemoteStorageError(Exception):
    """A remote checkpoint directory cannot be used; the message names the (redacted) URL and what
    to check."""

    def __init__(self, message: str, url: str = ""):
        super().__init__(message)
        self.url = url  # already redacted


class RemoteConfigError(RemoteStorageError, ValueError):
    """Unknown protocol, missing package, missing or refused credentials, bad options: a retry
    cannot fix it."""


class RemoteUnreachableError(RemoteStorageError, ConnectionError):
    """The storage service did not answer (endpoint down, network, timeout): a retry may fix it."""


_CREDENTIAL_ERRORS = {
    "NoCredentialsError",
    "PartialCredentialsError",
    "CredentialRetrievalError",
    "UnknownCredentialError",
    "NoAuthTokenError",
    "ProfileNotFound",
    "DefaultCredentialsError",
    "RefreshError",
    "ClientAuthenticationError",
    "CredentialUnavailableError",
    "InvalidConfigError",
}
_UNREACHABLE_ERRORS = {
    "EndpointConnectionError",
    "ConnectTimeoutError",
    "ReadTimeoutError",
    "ConnectionClosedError",
    "ProxyConnectionError",
    "HTTPClientError",
    "ClientConnectorError",
    "ClientConnectionError",
    "ClientOSError",
    "ServerDisconnectedError",
    "ServerTimeoutError",
    "FSTimeoutError",
    "ServiceRequestError",
    "ServiceResponseError",
    "TransportError",
    "ConnectionError",
    "TimeoutError",
}


def _class_names(exc: BaseException) -> set[str]:
    return {cls.__name__ for cls in type(exc).__mro__}


def _is_credentials_error(exc: BaseException) -> bool:
    return bool(_class_names(exc) & _CREDENTIAL_ERRORS)


def _is_unreachable_error(exc: BaseException) -> bool:
    if isinstance(exc, RemoteUnreachableError):
        return True
    if isinstance(exc, (ConnectionError, TimeoutError, socket.timeout, socket.gaierror)):
        return True
    return bool(_class_names(exc) & _UNREACHABLE_ERRORS)


def transfer_may_succeed_again(exc: BaseException) -> bool:
    """True when the same transfer, tried again in seconds, may succeed (the uploader's retries):
    I/O errors, timeouts, throttling, an endpoint that did not answer. False for configuration
    errors, refused credentials, and files that are not there. (Whether a failed task is retried,
    from its newest checkpoint, is `errors.is_transient`'s question: a permission refused now may
    be granted by then.)"""
    if isinstance(exc, RemoteConfigError):
        return False
    if _is_unreachable_error(exc):
        return True
    if isinstance(
        exc,
        (
            PermissionError,
            FileNotFoundError,
            FileExistsError,
            NotADirectoryError,
            IsADirectoryError,
        ),
    ):
        return False
    return isinstance(exc, OSError)


_CREDENTIAL_HINTS = {
    "s3": "pass key/secret (and token) in the storage options, set AWS_ACCESS_KEY_ID/"
    "AWS_SECRET_ACCESS_KEY or AWS_PROFILE, or anon=True for a public bucket",
    "gs": "pass token= (a service-account JSON file) in the storage options, or set "
    "GOOGLE_APPLICATION_CREDENTIALS",
    "az": "pass account_name with account_key, sas_token or connection_string in the storage "
    "options, or set AZURE_STORAGE_CONNECTION_STRING",
}
_CREDENTIAL_HINTS.update(
    s3a=_CREDENTIAL_HINTS["s3"],
    gcs=_CREDENTIAL_HINTS["gs"],
    abfs=_CREDENTIAL_HINTS["az"],
    abfss=_CREDENTIAL_HINTS["az"],
)


def first_line(text: str, limit: int = 300) -> str:
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line if len(line) <= limit else line[:limit] + "..."


class ErrorTranslation:
    """Clear errors for one remote directory (part of `RemoteSteps`: it sets ``url``,
    ``safe_url``, ``protocol``, ``_options`` and ``_secrets``)."""

    @property
    def storage_options(self) -> dict:
        """The storage options, redacted (for logs and messages)."""
        return redact_options(self._options)

    def _endpoint(self) -> str | None:
        for holder in (self._options, self._options.get("client_kwargs") or {}):
            for name in ("endpoint_url", "endpoint", "host"):
                if isinstance(holder, Mapping) and holder.get(name):
                    return redact_url(str(holder[name]))
        return None

    def _cause(self, exc: BaseException) -> str:
        return scrub(f"{type(exc).__name__}: {first_line(str(exc))}", self._secrets)

    def _config_error(self, exc: BaseException) -> RemoteConfigError:
        if isinstance(exc, ValueError) and "protocol not known" in str(exc).lower():
            known = ", ".join(
                p
                for p in ("file", "memory", "s3", "gs", "az", "abfs", "http", "sftp", "hdfs")
                if p in fsspec.available_protocols()
            )
            return RemoteConfigError(
                f"remote checkpoint URL {self.safe_url}: fsspec knows no protocol "
                f"{self.protocol!r}. Check the spelling of the URL's scheme (known ones include "
                f"{known}), or install the package that implements it.",
                self.safe_url,
            )
        if isinstance(exc, ImportError):
            return RemoteConfigError(
                f"remote checkpoint URL {self.safe_url}: protocol {self.protocol!r} needs a "
                f"package that is not installed ({self._cause(exc)}). Install it in this "
                "environment (s3fs for s3://, gcsfs for gs://, adlfs for az://).",
                self.safe_url,
            )
        option = re.search(r"unexpected keyword argument '([^']+)'", str(exc))
        if isinstance(exc, TypeError) and option:
            return RemoteConfigError(
                f"remote checkpoint URL {self.safe_url}: storage option {option.group(1)!r} is not "
                f"one the {self.protocol}:// filesystem accepts ({self._cause(exc)}). Remove it or "
                "correct its name in the storage options (the block's storage_options or "
                f"secret_options); redacted, they are {self.storage_options}.",
                self.safe_url,
            )
        return RemoteConfigError(
            f"remote checkpoint URL {self.safe_url}: cannot open {self.protocol}:// with the given "
            f"storage options ({self._cause(exc)}). Check the storage options (redacted: "
            f"{self.storage_options}).",
            self.safe_url,
        )

    def _translate(self, exc: BaseException, doing: str) -> BaseException | None:
        """A clear error for a failure of `doing`, or None to let `exc` through unchanged."""
        where = self.safe_url + (f" (endpoint {self._endpoint()})" if self._endpoint() else "")
        if isinstance(exc, RemoteStorageError):
            return None
        if _is_credentials_error(exc):
            hint = _CREDENTIAL_HINTS.get(
                self.protocol, "pass the credentials in the storage options"
            )
            return RemoteConfigError(
                f"no usable credentials for {where} while {doing} ({self._cause(exc)}): {hint}.",
                self.safe_url,
            )
        if isinstance(exc, PermissionError):
            return RemoteConfigError(
                f"access to {where} was refused while {doing} ({self._cause(exc)}): check that the "
                "credentials are right and allowed to list, read, write and delete under this "
                "prefix.",
                self.safe_url,
            )
        if _is_unreachable_error(exc):
            return RemoteUnreachableError(
                f"cannot reach {where} while {doing} ({self._cause(exc)}): check the endpoint URL, "
                "the network and that the storage service is up (a transient error: a flow's task "
                "retries it; run a command again once the service answers).",
                self.safe_url,
            )
        if isinstance(exc, TypeError) and "keyword argument" in str(exc):
            return self._config_error(exc)
        if isinstance(exc, ImportError):
            return self._config_error(exc)
        return None

    def _call(self, doing: str, fn: Callable, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - translated or re-raised as is
            clear = self._translate(exc, doing)
            if clear is None:
                raise
            raise clear from None


class _StorageRoot(ErrorTranslation):
    """`ErrorTranslation` for a storage root (`storage_error`)."""

    def __init__(self, url: str, options: Mapping):
        from prefect_jax.training.redaction import secret_values

        self.url, self.safe_url = url, redact_url(url)
        self.protocol = url.split("://", 1)[0] if "://" in url else "file"
        self._options, self._secrets = dict(options), secret_values(url, options)


def storage_error(
    storage,
    exc: BaseException,
    shown: str,
    named: str = "--storage",
    doing: str = "checking that the storage is writable",
) -> RemoteStorageError | None:
    """A clear error, naming the storage (`named`, as `shown`) and the fix, for `exc` raised
    while the job's storage (a `JobStorage`) was first opened and written; None: no clearer one.

    Covers an unknown protocol, a missing package, options the filesystem rejects, credentials,
    an endpoint that does not answer, and a bucket that does not exist. `doing`: what the command
    was doing, for the message."""
    root = _StorageRoot(storage.root, storage.storage_options)
    if isinstance(exc, FileNotFoundError) and root.protocol != "file":
        bucket = storage.root.split("://", 1)[1].split("/", 1)[0]
        return RemoteConfigError(
            f"{named} {shown}: bucket {bucket!r} does not exist (or these credentials cannot "
            f"see it) at {root.safe_url}"
            + (f" (endpoint {root._endpoint()})" if root._endpoint() else "")
            + f": create the bucket {bucket!r} first, or correct the bucket in the URL.",
            root.safe_url,
        )
    if isinstance(exc, ValueError) and "protocol not known" in str(exc).lower():
        clear = root._config_error(exc)
    else:
        clear = root._translate(exc, doing)
    if clear is None:
        return None
    return type(clear)(f"{named} {shown}: {clear}", clear.url)
