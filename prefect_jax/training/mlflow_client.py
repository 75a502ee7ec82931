"""How a process makes its MLflow calls: the child process that runs them (`_Worker`, started
by `warm_up` or by the first `Tracker`), and the settings every call follows.

The child is `prefect_jax.training.mlflow_worker`, one per training process: MLflow's Python work
never holds the GIL the training loop needs. With ``PREFECT_JAX_MLFLOW_IN_PROCESS=1`` (or if the
child cannot start) a tracker's calls run on a thread of its own process instead (`in_process`).

Tracking failures become warnings (`TrackingWarning`) and training goes on, except in strict mode
(``PREFECT_JAX_MLFLOW_STRICT=1``, set by the test suite: `strict`), where they raise. The waits at
the end of a run or a process are bounded (`exit_wait`), shorter once another process of the job
went away.
"""

from __future__ import annotations

import atexit
import functools
import itertools
import logging
import os
import pickle
import queue
import subprocess
import sys
import threading
import warnings
from concurrent.futures import Future

logger = logging.getLogger("prefect_jax.tracking")
# how long a process's exit waits for its MLflow worker, and an evaluate or export run's end
# (`Tracker.land`)
EXIT_WAIT_SECS = 30.0
# The same waits once another process of the job went away (`cluster.lost_process`): JAX's
# coordination service aborts this process about its heartbeat timeout (30 s) after the loss if it
# is still there, and the run would end Crashed instead of Failed.
LOST_EXIT_WAIT_SECS = 5.0


def process_lost() -> bool:
    """Whether another process of this job went away (`cluster.lost_process`)."""
    from prefect_jax.training.cluster import lost_process

    return lost_process() is not None


def exit_wait(timeout: float) -> float:
    """`timeout` for a wait at the end of a run or process; shorter after a lost process."""
    return min(timeout, LOST_EXIT_WAIT_SECS) if process_lost() else timeout


def default_tracking_uri() -> str:
    """``MLFLOW_TRACKING_URI`` if set, else SQLite in the working directory (MLflow's own
    default)."""
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{os.path.abspath('mlflow.db')}"


strict_here = threading.local()  # the MLflow worker: the calling process's strictness, per call


def filter_literal(value: str) -> str:
    """`value` as a string literal of MLflow's search filters (its quotes escaped)."""
    return "'" + value.replace("'", "\\'") + "'"


def strict() -> bool:
    """Whether a failed MLflow call raises (``PREFECT_JAX_MLFLOW_STRICT=1``; in the worker: its
    caller's setting) rather than warns."""
    value = getattr(strict_here, "value", None)
    if value is not None:
        return value
    return os.environ.get("PREFECT_JAX_MLFLOW_STRICT", "").lower() in ("1", "true", "yes")


def in_process() -> bool:
    """``PREFECT_JAX_MLFLOW_IN_PROCESS=1``: MLflow calls on a thread of this process, not in a
    child."""
    return os.environ.get("PREFECT_JAX_MLFLOW_IN_PROCESS", "").lower() in ("1", "true", "yes")


class TrackingWarning(UserWarning):
    """An MLflow call failed; training went on."""


def guarded(fn):
    """A `Tracker` call that MLflow answers: None without a client; a failure is a
    `TrackingWarning` and None, except in strict mode, where it raises."""

    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        if self._client is None:
            return None
        try:
            return fn(self, *args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - tracking must never stop training
            if strict():
                raise
            msg = (
                f"MLflow {fn.__name__} failed against {self.tracking_uri}: {exc!r}; training goes "
                "on"
            )
            warnings.warn(msg, TrackingWarning, stacklevel=2)
            logger.warning(msg)
            return None

    return wrapper


class _Worker:
    """The child process that makes this process's MLflow calls
    (`prefect_jax.training.mlflow_worker`).

    Started from a thread of its own that lives as long as it does: Linux ends the child when
    that thread's process dies (its parent-death signal follows the thread that started it).
    Frames are pickled here, before they are written, so a call that does not pickle fails
    alone. If the child dies, the calls still waiting fail: in strict mode with an error, else
    with a warning and no answer, and training goes on.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._futures: dict[int, Future] = {}
        # requests of `request`: nothing waits for them at the end
        self._background: set[int] = set()
        self._registry_warmed: Future | None = None  # `warm_registry`'s answer, once asked
        self._ids = itertools.count()
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._started = threading.Event()
        self._error: BaseException | None = None
        self.alive = False
        self.pid = os.getpid()  # a forked child of this process starts a worker of its own
        self.warmed: set[str] = set()  # the tracking URIs it was asked to open early (`warm_up`)
        self._warned = False  # that it died (once)
        self.process: subprocess.Popen | None = None
        threading.Thread(target=self._write, name="prefect-jax-mlflow-send", daemon=True).start()
        self._started.wait()
        if self._error is not None:
            raise self._error

    def _write(self) -> None:
        try:
            # This process's prefect_jax, not one the working directory happens to hold (-P: none
            # of it on the path; the package's own folder first).
            import prefect_jax

            package_root = os.path.dirname(os.path.dirname(os.path.abspath(prefect_jax.__file__)))
            pythonpath = os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))
            self.process = subprocess.Popen(
                [
                    sys.executable,
                    "-P",
                    "-m",
                    "prefect_jax.training.mlflow_worker",
                    str(os.getpid()),
                ],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                close_fds=True,
                env={
                    **os.environ,
                    "PYTHONPATH": pythonpath,
                    "JAX_PLATFORMS": "cpu",
                },  # see mlflow_worker._worker_environment
            )
        except BaseException as exc:  # noqa: BLE001 - the tracker falls back to a thread
            self._error = exc
            self._started.set()
            return
        self.alive = True
        threading.Thread(target=self._read, name="prefect-jax-mlflow-receive", daemon=True).start()
        self._started.set()
        stdin = self.process.stdin
        while True:
            message = self._outbox.get()
            if message is None:
                stdin.close()  # the child finishes what it was asked, then exits
                # this thread outlives it: its end would kill the child (PR_SET_PDEATHSIG)
                self.process.wait()
                return
            try:
                frame = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
            except Exception as exc:  # noqa: BLE001 - this call alone fails
                if message[0] == "call":
                    self._resolve(message[1], False, exc)
                continue
            try:
                stdin.write(frame)
                stdin.flush()
            except OSError:  # the child is gone: _read fails what waits
                pass

    def _read(self) -> None:
        stdout = self.process.stdout
        while True:
            try:
                call_id, ok, value, captured = pickle.load(stdout)
            except EOFError:
                stdout.close()
                break
            # An answer this process cannot read (no MLflow here).
            except Exception as exc:  # noqa: BLE001
                logger.warning("MLflow worker: unreadable answer: %r", exc)
                continue
            for record in captured:  # where this process's user sees them: its warnings, its log
                if record[0] == "warning":
                    warnings.warn(record[1], TrackingWarning, stacklevel=2)
                else:
                    logging.getLogger(record[1]).log(record[2], "%s", record[3])
            self._resolve(call_id, ok, value)
        with self._lock:  # with `call`'s check: no call is left waiting for a dead child
            self.alive = False
            waiting, self._futures = self._futures, {}
            background, self._background = self._background, set()
        code = self.process.wait()
        for call_id in waiting:
            if call_id in background:
                waiting[call_id].set_result(None)  # (no MLflow call was lost)
            else:
                self._resolve_dead(waiting[call_id], code)

    def _resolve_dead(self, future: Future, code: int | None) -> None:
        error = RuntimeError(
            f"the MLflow worker process exited (code {code}): MLflow calls are lost"
        )
        if strict():
            future.set_exception(error)
            return
        if not self._warned:
            self._warned = True
            warnings.warn(f"{error}; training goes on", TrackingWarning, stacklevel=2)
            logger.warning("%s; training goes on", error)
        future.set_result(None)

    def _resolve(self, call_id: int, ok: bool, value) -> None:
        with self._lock:
            future = self._futures.pop(call_id, None)
            self._background.discard(call_id)
        if future is None:
            return
        if ok:
            future.set_result(value)
        else:
            future.set_exception(value)

    def send(self, message: tuple) -> None:
        self._outbox.put(message)

    def _new_call(self, background: bool = False) -> tuple[Future, int | None]:
        """A future for an answer and its call id (None: the worker is gone)."""
        future: Future = Future()
        with self._lock:
            if not self.alive:
                return future, None
            call_id = next(self._ids)
            self._futures[call_id] = future
            if background:
                self._background.add(call_id)
        return future, call_id

    def call(self, key: int, name: str, args: tuple) -> Future:
        future, call_id = self._new_call()
        if call_id is None:
            self._resolve_dead(future, self.process.poll() if self.process else None)
        else:
            self._outbox.put(("call", call_id, key, name, args, strict()))
        return future

    def request(self, kind: str) -> Future:
        """Ask the worker for something of its own (``"warm_registry"``), answered as a call is;
        the end of this process does not wait for it, and a worker gone meanwhile answers None."""
        future, call_id = self._new_call(background=True)
        if call_id is None:
            future.set_result(None)
        else:
            self._outbox.put((kind, call_id))
        return future

    def warm_registry(self) -> Future:
        """The worker's registry warm-up (see `Tracker.warm_registry`), asked for once: a command,
        its flow run and its evaluating trainer each ask, and get the same answer."""
        if self._registry_warmed is None:
            self._registry_warmed = self.request("warm_registry")
        return self._registry_warmed

    def stop(self, timeout: float) -> None:
        """Close the child's input and give it `timeout` seconds to finish what it was asked."""
        self._outbox.put(None)
        with self._lock:
            waiting = bool(set(self._futures) - self._background)
        if self.process is not None and waiting:
            try:
                self.process.wait(exit_wait(timeout))
            except subprocess.TimeoutExpired:
                pass


_worker_lock = threading.Lock()
_the_worker: _Worker | None = None
_keys = itertools.count()


def worker() -> _Worker:
    """This process's MLflow worker (started on first use; again if it died)."""
    global _the_worker
    with _worker_lock:
        if _the_worker is None or not _the_worker.alive or _the_worker.pid != os.getpid():
            _the_worker = _Worker()
            # Where concurrent.futures joins its threads at exit (not after a SIGTERM: see
            # prefect_jax.cli.entry).
            register = getattr(threading, "_register_atexit", atexit.register)
            try:
                register(_the_worker.stop, EXIT_WAIT_SECS)
            except RuntimeError:  # the interpreter is shutting down already
                pass
        return _the_worker


def warm_up(tracking_uri: str | None = None, registry: bool = False) -> None:
    """Start this process's MLflow worker now and have it import MLflow (seconds of CPU, on
    another core) while this process imports the rest; a command and every flow call it first
    thing. `registry`: the job will register its exports, so once MLflow is ready the worker
    makes ready what logging a model needs too (see `Tracker.warm_registry`). Does nothing with
    ``PREFECT_JAX_MLFLOW_IN_PROCESS=1``, nor in a process other than process 0 of its job (which
    writes no MLflow run; see `cluster_config.leads_from_env`)."""
    from prefect_jax.training.cluster_config import leads_from_env

    if in_process() or not leads_from_env():
        return
    try:
        process, uri = worker(), tracking_uri or default_tracking_uri()
        if uri not in process.warmed:
            process.warmed.add(uri)
            process.send(("warm", uri))
        if registry:
            process.warm_registry()
    except Exception as exc:  # noqa: BLE001 - the trackers start it again, or run MLflow here
        logger.warning("MLflow worker process not started early: %r", exc)


class RemoteCalls:
    """One tracker's calls, in the worker process."""

    def __init__(self, worker: _Worker, args: tuple):
        self.worker, self.key = worker, next(_keys)
        worker.send(("new", self.key, args, dict(os.environ)))

    def call(self, name: str, args: tuple) -> Future:
        return self.worker.call(self.key, name, args)

    def close(self) -> None:
        self.worker.send(("drop", self.key))
