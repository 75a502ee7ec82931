"""MLflow records of a job: one run per job, found again by tag when the job runs again.

Every MLflow call runs in the background, in the order made: importing MLflow and opening its
store (seconds of CPU, for SQLite) overlap the restore and the first compile, and a training
loop never waits on a metric write. Calls that answer something (`run_id`, the reads) wait for
what came before them; `flush` and `finish` wait for everything.

The calls run in a child process (`prefect_jax.training.mlflow_worker`, one per training
process), so MLflow's Python work never holds the GIL the training loop needs; with
``PREFECT_JAX_MLFLOW_IN_PROCESS=1`` (or if the child cannot start) they run on a thread of
this process instead.

Tracking failures become warnings and training goes on, except in strict mode
(``PREFECT_JAX_MLFLOW_STRICT=1``, set by the test suite), where they raise, as MLflow's
own Keras callback does in tests (a background failure is raised by the next call that waits).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

# Imported from here by the command and the flows (to be imported from mlflow_client instead).
from prefect_jax.training.mlflow_client import (
    EXIT_WAIT_SECS,
    RemoteCalls,
    TrackingWarning,
    default_tracking_uri,
    exit_wait,
    in_process,
    strict,
    worker,
)
from prefect_jax.training.redaction import redact_url
from prefect_jax.training.tracking_metrics import MetricCalls
from prefect_jax.training.tracking_registry import RegistryCalls
from prefect_jax.training.tracking_run import RunCalls

logger = logging.getLogger("prefect_jax.tracking")

# How long a job's end waits for its MLflow calls with none landing before it asks whether the
# store still answers (`Tracker.land_while_answering`).
ANSWER_CHECK_SECS = 30.0
# Set by the command, which owns its process (`freeze_mlflow_once_connected`): gc.freeze() once
# MLflow is imported
freeze_after_connect = False


def freeze_mlflow_once_connected() -> None:
    """MLflow's objects, once a tracker of this process imports it, are frozen as the command's
    start-up objects were (`prefect_jax.cli.startup.freeze_startup_objects`): only a process that
    the package started calls this; in a user's process the collector is left alone."""
    global freeze_after_connect
    freeze_after_connect = True


class Tracker(RunCalls, RegistryCalls, MetricCalls):
    """The MLflow run of one job.

    Args:
        tracking_uri: MLflow tracking URI (``sqlite:///...``, ``http://...``).
        experiment: experiment name.
        job_key: identifies the job across reruns (tag ``prefect_jax.job``).
        enabled: False in a process that does not write the job's records (not the primary
            one of several): every call then does nothing.
    """

    def __init__(
        self,
        tracking_uri: str | None,
        experiment: str,
        job_key: str,
        enabled: bool = True,
        _worker_side: bool = False,
    ):
        self.enabled = enabled
        self.tracking_uri = tracking_uri or default_tracking_uri()
        self.experiment = experiment
        self.job_key = job_key
        self._run_id: str | None = None
        self._experiment_id: str | None = None  # where the calls run (see `experiment_id`)
        self._other_experiment_said = False  # (`RunCalls._say_other_experiment`: once)
        self._started: Future | None = None
        self.requested_run_id: str | None = None  # the id `start` was given, if any
        self._client = None
        # Prefix -> its last step in MLflow (looked up once per run and process)
        self._logged_until: dict[str, int] = {}
        # Steps of a metric known to be in MLflow (looked up once)
        self._logged_at: dict[str, set[int]] = {}
        # Train rows submitted, not yet written
        self._unwritten: dict[int, list[tuple[str, float, int]]] = {}
        self._unwritten_lock = threading.Lock()
        self._ids = itertools.count()
        self._pending: list[Future] = []
        self._system_metrics = None  # MLflow's SystemMetricsMonitor while the trainer's run is open
        # When the last learning curve was asked for (monotonic)
        self._curve_drawn_at: float | None = None
        # The calls' thread (this process, or the worker's)
        self._pool: ThreadPoolExecutor | None = None
        self._remote: RemoteCalls | None = None  # the calls' worker process
        self._own_client = None  # `client` of a tracker whose calls run in the worker
        if _worker_side:  # in the worker: its reader hands this tracker's calls to its thread
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prefect-jax-mlflow")
            return
        if not enabled:
            return
        from prefect_jax.training.mlflow_reach import found_unusable

        # (--mlflow-optional: the summary says so; the URI as given, or MLFLOW_TRACKING_URI's)
        if found_unusable(self.tracking_uri):
            self.enabled = False
            logger.warning(
                "MLflow at %s did not answer the job's check: nothing of this run is sent to it",
                redact_url(self.tracking_uri),
            )
            return
        if not in_process():
            try:
                self._remote = RemoteCalls(worker(), (self.tracking_uri, experiment, job_key))
            except Exception as exc:  # noqa: BLE001 - MLflow still works, in this process
                logger.warning(
                    "MLflow worker process not started (%r): MLflow calls run in this process", exc
                )
        if self._remote is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prefect-jax-mlflow")
        self._call("_connect")

    # -- the background calls -------------------------------------------------------------

    def _call(self, name: str, *args) -> Future:
        """Run method `name` in the background (in the worker process, or on this process's
        thread)."""
        if not self.enabled:
            future: Future = Future()
            future.set_result(None)
            return future
        future = (
            self._remote.call(name, args)
            if self._remote is not None
            else self._pool.submit(getattr(self, name), *args)
        )
        self._pending = [f for f in self._pending if not f.done() or f.exception() is not None] + [
            future
        ]
        return future

    def flush(self) -> None:
        """Wait for every call made so far; in strict mode, raise the first one that failed."""
        pending, self._pending = self._pending, []
        errors = [f.exception() for f in pending]
        failed = [e for e in errors if e is not None]
        if failed:
            raise failed[0]

    def land(
        self,
        timeout: float = EXIT_WAIT_SECS,
        then: str = "the run goes on without them",
        waited: float | None = None,
    ) -> None:
        """Wait for every call made so far, as the end of an evaluate or export flow run does. In
        strict mode: `flush`. Otherwise up to `timeout` seconds, and what failed or is still on its
        way then is logged, not raised (an unreachable tracking server must not hold or fail the
        run: the eval records are the durable truth, and the job's next evaluator logs what MLflow
        lacks), with `then`: what follows for the run (`waited`: how long its caller waited
        already, for the message)."""
        if strict():
            self.flush()
            return
        from concurrent.futures import wait

        timeout = exit_wait(timeout)
        done, waiting = wait(list(self._pending), timeout=max(0.0, timeout))
        failed = [f.exception() for f in done if f.exception() is not None]
        self._pending = list(waiting)
        if waiting or failed:
            from prefect_jax.training.redaction import redact_url, scrub, secret_values

            first = (
                f" (first: {scrub(repr(failed[0]), secret_values(self.tracking_uri, None))})"
                if failed
                else ""
            )
            logger.warning(
                "MLflow at %s: %d write(s) still on their way after %gs, %d failed%s; %s",
                redact_url(self.tracking_uri),
                len(waiting),
                timeout if waited is None else round(waited),
                len(failed),
                first,
                then,
            )

    def land_while_answering(self, then: str) -> None:
        """Wait for every call made so far for as long as they land or the store answers, as a
        job's end does: each `ANSWER_CHECK_SECS` in which none lands, the store is asked once
        (`mlflow_reach.Probe`: one quick request to a server; a local store's folder looked at),
        and two such checks in a row unanswered end the wait. A large model's upload to a live
        server is waited for; a server that went away is not: each call would wait out MLflow's
        own retries (minutes), and a job's end held its lease for all of them (20 minutes and
        more, a SIGTERM meanwhile waiting too). What is left is `land`'s warning, with `then`. In
        strict mode: `flush`."""
        if strict():
            self.flush()
            return
        from concurrent.futures import FIRST_COMPLETED, wait

        from prefect_jax.training.mlflow_reach import Probe

        started, waiting, unanswered = time.monotonic(), set(self._pending), 0
        while waiting and unanswered < 2:  # (twice in a row: not a blip, nor one busy moment)
            landed, waiting = wait(waiting, timeout=ANSWER_CHECK_SECS, return_when=FIRST_COMPLETED)
            if landed:
                unanswered = 0
                continue
            probe = Probe(self.tracking_uri)
            try:
                unanswered = unanswered + 1 if probe.check() is not None else 0
            finally:
                probe.close()
        self.land(0.0, then, waited=time.monotonic() - started)

    def _wait(self, name: str, *args):
        self.flush()
        return self._call(name, *args).result()

    def _connect(self) -> None:
        try:
            from mlflow.tracking import MlflowClient

            self._client = MlflowClient(tracking_uri=self.tracking_uri)
            # the command froze its imports (prefect_jax.cli): MLflow's too
            if freeze_after_connect:
                import gc

                gc.freeze()
        except Exception as exc:  # noqa: BLE001
            if strict():
                raise
            warnings.warn(
                f"MLflow unavailable at {self.tracking_uri}: {exc!r}", TrackingWarning, stacklevel=2
            )

    @property
    def client(self):
        """An MlflowClient for this tracker's store (None if MLflow is unavailable), once every
        call made so far is done. With the calls in the worker process, a client of this process's
        own."""
        self.flush()
        if self._remote is None:
            return self._client
        if self._own_client is None:
            from mlflow.tracking import MlflowClient

            self._own_client = MlflowClient(tracking_uri=self.tracking_uri)
        return self._own_client

    def _run(self) -> dict:
        """What `start` found: ``{"run_id", "experiment_id"}`` (waits for it; empty before
        `start`)."""
        return (self._started.result() or {}) if self._started is not None else {}

    @property
    def run_id(self) -> str | None:
        """The job's run id, once `start` has found or created it (None before `start`)."""
        return self._run().get("run_id")

    @property
    def experiment_id(self) -> str | None:
        """The run's experiment id, once `start` has found it (None before `start`)."""
        return self._run().get("experiment_id")

    @property
    def started(self) -> bool:
        """Whether `start` was called (its answer may still be on its way)."""
        return self._started is not None

    def when_started(self, fn: Callable[[], None]) -> None:
        """Call `fn()` once `start` has answered (found or created the run, or failed): at once if
        it has, or if `start` was never called; else on the thread that gets the answer."""
        started = self._started
        if started is None:
            fn()
        else:
            started.add_done_callback(lambda _: fn())

    def wait_started(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds for `start`'s answer; whether it came (True too where
        `start` was never called or this tracker writes nothing). Raises only what a signal's
        handler raises: the wait is in slices (`trainer_thread.wait_in_slices`), as a restore
        task waits here on a flow run's main thread."""
        started = self._started
        if started is None or not self.enabled:
            return True
        from prefect_jax.training.trainer_thread import wait_in_slices

        # (an event, not the future's own wait: an exception raised inside that leaves its lock)
        answered = threading.Event()
        started.add_done_callback(lambda _: answered.set())
        return wait_in_slices(answered.wait, max(0.0, timeout))

    def run_id_if_known(self) -> str | None:
        """The run id if `start` has already found it; never waits."""
        started = self._started
        if started is None or not started.done() or started.exception() is not None:
            return None
        return (started.result() or {}).get("run_id")

    def close(self) -> None:
        """Finish the calls made so far and stop the background thread."""
        try:
            self.flush()
        finally:
            if self._remote is not None:
                self._remote.close()
            elif self._pool is not None:
                self._stop_system_metrics()
                self._pool.shutdown(wait=True)
