"""Background uploads of checkpoint steps to remote storage (`RemoteSteps.upload`).

`AsyncUploader` runs uploads on one thread, oldest first, so training goes on while a step is
copied; transient failures are retried with backoff, and what remains comes back on the next
`submit` or `wait`.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from prefect_jax.training.remote import RemoteSteps
from prefect_jax.training.remote_errors import first_line, transfer_may_succeed_again

logger = logging.getLogger("prefect_jax.remote")

# -- background uploads -----------------------------------------------------------------------


@dataclass
class _Job:
    step: int
    local_step_dir: str
    ready: Callable[[str], bool] | None
    ready_timeout: float


_STOP = object()


class AsyncUploader:
    """Uploads steps with `RemoteSteps.upload` on one background thread, oldest first.

    `submit` returns at once; the step is committed remotely once its upload ends. Transient
    errors (I/O, an endpoint that does not answer, timeouts) are retried `retries` times with
    exponential backoff; an error that remains is raised by the next `submit` or `wait` (and
    then forgotten), with a note naming the step. Later steps are still uploaded.

    Args:
        remote: where steps go.
        retries: how many times a transient failure is retried (so up to ``retries + 1`` tries).
        backoff_secs: the first wait between tries; doubles each time up to `max_backoff_secs`.
        on_uploaded: called with the step (on the uploader thread) after each upload commits.
    """

    def __init__(
        self,
        remote: RemoteSteps,
        *,
        retries: int = 4,
        backoff_secs: float = 1.0,
        max_backoff_secs: float = 30.0,
        on_uploaded: Callable[[int], None] | None = None,
    ):
        self.remote = remote
        self.retries = max(0, int(retries))
        self.backoff_secs = backoff_secs
        self.max_backoff_secs = max_backoff_secs
        self.on_uploaded = on_uploaded
        self._queue: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._pending: list[int] = []
        self._error: BaseException | None = None
        self._closing = threading.Event()
        self._thread: threading.Thread | None = None
        self.uploaded: list[int] = []
        self._done: set[int] = set()  # steps whose last upload committed them

    # -- public --------------------------------------------------------------------------------

    @property
    def pending(self) -> list[int]:
        """Steps submitted and not yet finished (queued or uploading)."""
        with self._lock:
            return list(self._pending)

    def submit(
        self,
        step: int,
        local_step_dir: str,
        *,
        ready: Callable[[str], bool] | None = None,
        ready_timeout: float = 600.0,
    ) -> None:
        """Queue one step for upload and return at once.

        Args:
            step: the step number.
            local_step_dir: the local directory of the step (committed, or becoming committed).
            ready: if given, the uploader thread polls ``ready(local_step_dir)`` until it is true
                (e.g. Orbax committed the step: ``checkpoint_dirs.is_committed``) before uploading,
                so a caller can submit right after starting an asynchronous save.
            ready_timeout: how long to wait for `ready` before failing this upload.

        Raises:
            Whatever an earlier upload raised after its retries.
            RuntimeError: the uploader was closed.
        """
        self._raise_pending_error()
        if self._closing.is_set():
            raise RuntimeError(
                f"uploader for {self.remote.safe_url} is closed; step {step} was not queued"
            )
        with self._lock:
            self._pending.append(int(step))
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._run, name="prefect-jax-upload", daemon=True
                )
                self._thread.start()
        self._queue.put(_Job(int(step), os.path.abspath(local_step_dir), ready, ready_timeout))

    def wait(self, timeout: float | None = None) -> bool:
        """Block until every submitted step is uploaded (or failed).

        Returns:
            True when nothing is pending; False when `timeout` passed first.

        Raises:
            Whatever an upload raised after its retries.
        """
        with self._idle:
            done = self._idle.wait_for(lambda: not self._pending, timeout)
        self._raise_pending_error()
        return done

    def wait_for(self, step: int, timeout: float | None = None) -> bool:
        """Block until `step`'s upload is done (or failed), without asking the storage.

        Returns:
            True when the step was uploaded (or found committed already); False when its upload
            failed (the error is still raised by the next `submit` or `wait`) or `timeout` passed.
        """
        step = int(step)
        with self._idle:
            return (
                self._idle.wait_for(lambda: step not in self._pending, timeout)
                and step in self._done
            )

    def committed(self, step: int) -> bool:
        """Whether this uploader committed `step` (its upload, or one found already committed),
        and it was not `forget`-ten since: known here, without asking the storage."""
        with self._lock:
            return int(step) in self._done

    def forget(self, steps) -> None:
        """Steps removed from the storage since (retention): no longer `committed`."""
        with self._lock:
            self._done.difference_update(int(s) for s in steps)

    def close(self, timeout: float | None = None) -> bool:
        """Finish the queued uploads (up to `timeout`), then stop the thread.

        Returns:
            True when every upload finished. Raises what `wait` raises.
        """
        try:
            return self.wait(timeout)
        finally:
            self._closing.set()
            self._queue.put(_STOP)
            thread = self._thread
            if thread is not None and thread is not threading.current_thread():
                thread.join(timeout=0 if timeout is not None and self.pending else None)

    def __enter__(self) -> AsyncUploader:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:  # do not hide the error in flight; still stop the thread
            self._closing.set()
            self._queue.put(_STOP)

    # -- worker ------------------------------------------------------------------------------

    def _raise_pending_error(self) -> None:
        with self._lock:
            error, self._error = self._error, None
        if error is not None:
            raise error

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is _STOP:
                return
            try:
                self._upload(job)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller on submit/wait
                try:
                    exc.add_note(
                        f"while uploading checkpoint step {job.step} from {job.local_step_dir} "
                        f"to {self.remote.safe_url}"
                    )
                except AttributeError:
                    pass
                logger.error(
                    "upload of step %d to %s failed: %s", job.step, self.remote.safe_url, exc
                )
                with self._lock:
                    if self._error is None:
                        self._error = exc
            else:
                self.uploaded.append(job.step)
            finally:
                with self._idle:
                    if job.step in self._pending:
                        self._pending.remove(job.step)
                    self._idle.notify_all()

    def _upload(self, job: _Job) -> None:
        with self._lock:
            self._done.discard(job.step)
        if job.ready is not None:
            deadline = time.monotonic() + job.ready_timeout
            delay = 0.01
            while not job.ready(job.local_step_dir):
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"local checkpoint step {job.local_step_dir} was not committed within "
                        f"{job.ready_timeout:g}s; it was not uploaded"
                    )
                time.sleep(delay)
                delay = min(delay * 2, 0.25)
        attempt = 0
        while True:
            try:
                self.remote.upload(job.step, job.local_step_dir)
                break
            except Exception as exc:  # noqa: BLE001 - retried when transient
                if attempt >= self.retries or not transfer_may_succeed_again(exc):
                    raise
                delay = min(self.backoff_secs * 2**attempt, self.max_backoff_secs)
                attempt += 1
                logger.warning(
                    "upload of step %d to %s failed (%s); retry %d of %d in %.1fs",
                    job.step,
                    self.remote.safe_url,
                    first_line(str(exc), 200),
                    attempt,
                    self.retries,
                    delay,
                )
                time.sleep(delay)
        with self._lock:  # committed: what follows (retention) does not change that
            self._done.add(job.step)
        if self.on_uploaded is not None:
            self.on_uploaded(job.step)
