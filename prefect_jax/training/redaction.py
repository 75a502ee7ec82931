"""Secrets out of everything shown: URLs, fsspec storage options and error messages.

Storage options carry credentials (keys, tokens, SAS strings, passwords in URLs). Whatever the
project logs, records in MLflow or puts in an exception goes through these functions first.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

REDACTED = "***"


# Option names (lowercase substrings) whose values are secrets.
_SECRET_WORDS = (
    "secret",
    "password",
    "passwd",
    "token",
    "credential",
    "private",
    "signature",
    "sas",
    "account_key",
    "accountkey",
    "connection_string",
    "api_key",
    "apikey",
    "session_key",
)
# Option names that identify a principal but are not secret by themselves: shown shortened.
_KEY_ID_NAMES = (
    "key",
    "aws_access_key_id",
    "access_key",
    "access_key_id",
    "username",
    "user",
    "client_id",
)
# Query parameters of signed URLs that must not be shown.
_SECRET_QUERY_WORDS = ("sig", "token", "secret", "password", "credential", "key", "auth")


def _is_secret_name(name: str) -> bool:
    lowered = name.lower()
    return any(word in lowered for word in _SECRET_WORDS)


def _shorten(value: str) -> str:
    return f"{value[:4]}{REDACTED}" if len(value) >= 12 else REDACTED


def _redact_one_url(url: str) -> str:
    if "://" not in url:
        return url
    try:
        parts = urlsplit(url)
    except ValueError:
        return url.split("://", 1)[0] + "://" + REDACTED
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, host = netloc.rsplit("@", 1)
        user = userinfo.split(":", 1)[0]
        # user:password shows the (shortened) user; a lone user part may itself be a token.
        netloc = (
            f"{_shorten(user) if user else ''}:{REDACTED}@{host}"
            if ":" in userinfo
            else f"{REDACTED}@{host}"
        )
    query = parts.query
    if query:
        pairs = parse_qsl(query, keep_blank_values=True)
        query = urlencode(
            [
                (k, REDACTED if any(w in k.lower() for w in _SECRET_QUERY_WORDS) else v)
                for k, v in pairs
            ],
            safe="*",
        )
    if netloc == parts.netloc and query == parts.query:
        return (
            url  # nothing secret: as given (urlunsplit would turn sqlite:////abs into sqlite://abs)
        )
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def redact_url(url: str) -> str:
    """`url` with passwords, tokens and signatures replaced by ``***``.

    Handles ``user:password@host`` user info, signed-URL query parameters
    (``X-Amz-Signature``, ``sig``, ``token``, ...) and chained URLs (``simplecache::s3://...``).

    >>> redact_url("s3://AKIAEXAMPLEKEY123:wJalrXUtnFEMI@bucket/prefix?X-Amz-Signature=abc&x=1")
    's3://AKIA***:***@bucket/prefix?X-Amz-Signature=***&x=1'
    """
    if not isinstance(url, str):
        return repr(type(url))
    return "::".join(_redact_one_url(part) for part in url.split("::"))


def redact_options(options: Mapping[str, Any] | None) -> dict:
    """A deep copy of fsspec storage options with secret values replaced by ``***``.

    Secret keys (``secret``, ``token``, ``password``, ``aws_secret_access_key``,
    ``account_key``, ``sas_token``, ...) are hidden at any depth; access-key ids are shortened
    to their first four characters; URLs (``endpoint_url``) lose their user info and signatures.
    """

    def walk(value, name: str = ""):
        if isinstance(value, Mapping):
            return {k: walk(v, str(k)) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(walk(v, name) for v in value)
        if name and _is_secret_name(name):
            return REDACTED if value not in (None, "", False) else value
        if name.lower() in _KEY_ID_NAMES and isinstance(value, str):
            return _shorten(value)
        if isinstance(value, str) and "://" in value:
            return redact_url(value)
        return value

    return walk(dict(options or {}))


def secret_values(url: str, options: Mapping[str, Any] | None) -> list[str]:
    """Every secret string in the options (and the URL's password), longest first, to scrub from
    messages."""
    found: list[str] = []

    def walk(value, name: str = ""):
        if isinstance(value, Mapping):
            for k, v in value.items():
                walk(v, str(k))
        elif isinstance(value, (list, tuple)):
            for v in value:
                walk(v, name)
        elif isinstance(value, str) and name and (_is_secret_name(name)) and len(value) >= 4:
            found.append(value)

    walk(dict(options or {}))
    for part in (url or "").split("::"):
        try:
            parts = urlsplit(part)
            if parts.password and len(parts.password) >= 4:
                found.append(parts.password)
            elif parts.username and not parts.password and len(parts.username) >= 4:
                found.append(parts.username)
            for k, v in parse_qsl(parts.query):
                if any(w in k.lower() for w in _SECRET_QUERY_WORDS) and len(v) >= 4:
                    found.append(v)
        except ValueError:
            pass
    return sorted(set(found), key=len, reverse=True)


def scrub(text: str, secrets: list[str]) -> str:
    """`text` with every one of `secrets` replaced by ``***``."""
    for secret in secrets:
        text = text.replace(secret, REDACTED)
    return text
