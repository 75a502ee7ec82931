"""The publisher: Prefect API calls that only refresh what people see (artifacts), made in order on
one background thread, so that a training loop never waits on an HTTP round trip for them."""

from __future__ import annotations

import atexit
import contextvars
import logging
import math
import os
import queue
import re
import threading
import time
from collections.abc import Callable
from typing import Any


def artifact_key(*parts: str) -> str:
    """Prefect artifact keys allow lowercase letters, digits and dashes only."""
    return re.sub(r"-+", "-", re.sub(r"[^a-z0-9-]", "-", "-".join(parts).lower())).strip("-")[:100]


def job_artifact_key(job: str, storage: str, *parts: str) -> str:
    """The key of one of a job's artifacts: ``<job>-<8 hex digits>-<parts>``, the digits those of
    its default registered model (a hash of its storage root and name), so that two jobs of one
    name on two storages (a second ``digits``) keep two histories in Prefect's Artifacts page."""
    from prefect_jax.training.storage import job_digest

    # (the job's name cut, not the key: a long name would cut the digits and the parts off)
    return artifact_key(job[:60], job_digest(storage, job)[:8], *parts)


UI_REFRESH_SECS = 2.0
FLUSH_SECS = 60.0  # the longest a flush waits for the Prefect API
# ... once the process is going (a SIGTERM's notice: its checkpoint, MLflow run and lease are done
# by then): about one round trip, not the machine's grace period, if the API lags
HURRIED_FLUSH_SECS = 2.0


def ui_refresh_secs() -> float:
    """The shortest time between two refreshes of one artifact that only shows the latest state
    (the progress bar, the results table): `PREFECT_JAX_UI_REFRESH_SECS`, default 2; 0 refreshes
    at every change. Raises ValueError, naming the value and the fix, on anything else (a word,
    a negative number, NaN, infinity)."""
    raw = os.environ.get("PREFECT_JAX_UI_REFRESH_SECS", str(UI_REFRESH_SECS))
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not (value >= 0 and math.isfinite(value)):  # (NaN too)
        raise ValueError(
            f"PREFECT_JAX_UI_REFRESH_SECS={raw!r} is not a finite number of seconds >= 0: "
            "set it to e.g. 2, or 0 to refresh Prefect's artifacts at every change"
        )
    return value


class _Publisher:
    """Prefect API calls that only refresh what people see (artifacts), made in order by one
    background thread, so a training loop never waits on an HTTP round trip for them.

    Each call runs in a copy of the caller's context, so an artifact is still linked to the
    flow and task run that asked for it. Failures are logged, never raised: the UI may lag,
    training does not stop. Flows `flush` before they return.

    `refresh` is for calls that a later call of the same key makes stale (a progress update, the
    results table with every row): one runs at most every `ui_refresh_secs()` per key (sooner
    only at `flush`); one that comes sooner is held, replaced by any later one of its key, and
    runs when the time is up or at `flush`; a held call never runs while a newer call of its key
    is still in the queue behind it. After a flush the next call of a key runs at once. With
    `ui_refresh_secs()` 0 every call runs, in order, as `submit`'s do.
    With checkpoints seconds apart, the Prefect server records a fraction of the artifact
    versions and events it would otherwise (each costs it CPU), and the UI, which polls, shows
    the same.
    """

    def __init__(self):
        self._queue: queue.Queue = queue.Queue()  # (key or None, call), in order of submission
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._held: dict[
            Any, tuple
        ] = {}  # key -> its newest call that has had its turn, not run yet
        self._last_run: dict[Any, float] = {}  # key -> when its last call ran (monotonic)
        # key -> its calls put in the queue, not taken out yet: a held call with a newer one on
        # its way is stale, and never runs (a flush would otherwise run each as it comes out)
        self._queued: dict[Any, int] = {}
        self._hurry = 0  # flushes under way: held calls run at once
        self._warned = False
        self._longest_flush = FLUSH_SECS  # (`hurry`)

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> None:
        self._put(None, (contextvars.copy_context(), fn, args, kwargs))

    def refresh(self, key: Any, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> None:
        """Like `submit`, for a call that only refreshes what the next call of `key` refreshes
        too (see the class). It never runs before a call submitted ahead of it."""
        self._put(key, (contextvars.copy_context(), fn, args, kwargs))

    def _put(self, key: Any, call: tuple | None) -> None:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._work, name="prefect-jax-publish", daemon=True
                )
                self._thread.start()
            if key is not None:
                self._queued[key] = self._queued.get(key, 0) + 1
            self._queue.put((key, call))

    def _newer_on_its_way(self, key: Any) -> bool:
        with self._lock:
            return self._queued.get(key, 0) > 0

    def _due_in(self, key: Any, now: float) -> float:
        """Seconds until `key`'s held call may run (<= 0: now)."""
        refresh_secs = self._refresh_secs()
        if refresh_secs == 0:
            return 0.0  # every change shown, even with a newer one queued behind it
        if self._newer_on_its_way(key):
            return math.inf  # (its replacement is still in the queue)
        if self._hurry:
            return 0.0
        last = self._last_run.get(key)
        return -1.0 if last is None else last + refresh_secs - now

    def _refresh_secs(self) -> float:
        try:
            return ui_refresh_secs()
        except (
            ValueError
        ) as exc:  # (the flows check it before training; tasks in a user's flow get this)
            if not self._warned:
                self._warned = True
                logging.getLogger("prefect_jax.tasks").warning(
                    "%s; refreshing every %s s", exc, UI_REFRESH_SECS
                )
            return UI_REFRESH_SECS

    def _work(self) -> None:
        clients: dict[
            str, Any
        ] = {}  # this thread's own Prefect clients, by API URL, open for its life
        while True:
            now = time.monotonic()
            wait = min((self._due_in(key, now) for key in self._held), default=None)
            try:
                key, call = self._queue.get(
                    timeout=None if wait is None else min(max(wait, 0.0), threading.TIMEOUT_MAX)
                )
            except queue.Empty:
                key, call, got = None, None, False
            else:
                got = True
            try:
                if call is not None and key is None:
                    self._run(clients, call)
                elif call is not None:
                    with self._lock:
                        self._queued[key] -= 1
                    self._held[key] = call  # replaces an older one of its key
                self._run_held(clients)
            finally:
                if got:
                    self._queue.task_done()

    def _run_held(self, clients: dict[str, Any]) -> None:
        """Run every held call whose key's time is up (all of them during a flush)."""
        while True:
            now = time.monotonic()
            due = next((key for key in self._held if self._due_in(key, now) <= 0), None)
            if due is None:
                return
            self._last_run[due] = now
            try:
                self._run(clients, self._held[due])
            finally:
                del self._held[due]  # (after it ran: `flush` waits for held calls)

    @staticmethod
    def _run(clients: dict[str, Any], call: tuple) -> None:
        context, fn, args, kwargs = call
        try:
            context.run(_with_own_client, clients, fn, args, kwargs)
        except Exception as exc:  # noqa: BLE001 - the UI may lag; training goes on
            logging.getLogger("prefect_jax.tasks").warning(
                "could not publish %s: %r", getattr(fn, "__name__", fn), exc
            )

    def hurry(self) -> None:
        """This process is going (a SIGTERM's notice; not Ctrl-C, after which a notebook goes on):
        from now on, no flush waits longer than `HURRIED_FLUSH_SECS`."""
        self._longest_flush = HURRIED_FLUSH_SECS

    def flush(self, timeout: float = FLUSH_SECS) -> bool:
        """Run every held call now and wait until every submitted call has run (at most
        `timeout` seconds, or `HURRIED_FLUSH_SECS` after `hurry`); True if all did."""
        deadline = time.monotonic() + min(timeout, self._longest_flush)
        with self._lock:
            self._hurry += 1
        try:
            if self._held:
                self._put(None, None)  # wakes the thread to run them
            while (self._queue.unfinished_tasks or self._held) and time.monotonic() < deadline:
                time.sleep(0.01)
            done = not (self._queue.unfinished_tasks or self._held)
            if done:
                self._last_run.clear()  # the next flow run's first refresh shows at once
            return done
        finally:
            with self._lock:
                self._hurry -= 1


def _with_own_client(
    clients: dict[str, Any], fn: Callable[..., Any], args: tuple, kwargs: dict
) -> Any:
    """Run `fn` (in a copy of its caller's context: the runs it is about) with the publisher's own
    Prefect client rather than the caller's: by the time it runs, the caller's may be closed (a sync
    task run in an async flow, or outside any flow, closes the client it opened when it ends)."""
    from prefect.context import AsyncClientContext, SyncClientContext
    from prefect.settings import PREFECT_API_URL

    no_client = SyncClientContext.__var__.set(None), AsyncClientContext.__var__.set(None)
    try:
        url = PREFECT_API_URL.value()
        if url not in clients:
            own = SyncClientContext()  # (made while no client is in the context: a new one)
            own.client.__enter__()
            clients[url] = own
        SyncClientContext.__var__.set(clients[url])
        return fn(*args, **kwargs)
    finally:
        SyncClientContext.__var__.reset(no_client[0])
        AsyncClientContext.__var__.reset(no_client[1])


publisher = _Publisher()
atexit.register(
    publisher.flush, 15.0
)  # flows flush before returning; this covers tasks used in other flows


def existing_artifact(key: str, flow_run_id) -> Any:
    """The newest artifact with key `key` of flow run `flow_run_id`, or None: one artifact per key
    per run, however often the run is started (the rerun automation may start a crashed run
    twice, a retry runs its flow again)."""
    from uuid import UUID

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        ArtifactFilter,
        ArtifactFilterFlowRunId,
        ArtifactFilterKey,
    )
    from prefect.client.schemas.sorting import ArtifactSort

    with get_client(sync_client=True) as client:
        found = client.read_artifacts(
            artifact_filter=ArtifactFilter(
                key=ArtifactFilterKey(any_=[key]),
                flow_run_id=ArtifactFilterFlowRunId(any_=[UUID(str(flow_run_id))]),
            ),
            sort=ArtifactSort.UPDATED_DESC,
            limit=1,
        )
    return found[0] if found else None


_LOOK_UP = object()  # (`create_or_update_artifact`: the caller did not read the existing one)


def create_or_update_artifact(
    artifact, flow_run_id, task_run_id=None, existing: Any = _LOOK_UP
) -> None:
    """Create Prefect artifact `artifact` (a `prefect.artifacts.Artifact` with a key) for flow run
    `flow_run_id` (and task run `task_run_id`), or, if that run has one of its key already,
    update that one's data and description in place. `existing`: that run's artifact of the key
    (or None), if the caller read it already (`existing_artifact`)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import ArtifactCreate, ArtifactUpdate

    data = artifact.format(_sync=True)
    if existing is _LOOK_UP:
        existing = existing_artifact(artifact.key, flow_run_id)
    with get_client(sync_client=True) as client:
        if existing is not None:
            client.update_artifact(
                existing.id, ArtifactUpdate(data=data, description=artifact.description)
            )
        else:
            client.create_artifact(
                ArtifactCreate(
                    type=artifact.type,
                    key=artifact.key,
                    description=artifact.description,
                    flow_run_id=flow_run_id,
                    task_run_id=task_run_id,
                    data=data,
                )
            )
