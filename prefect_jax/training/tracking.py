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
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Iterable

from prefect_jax.training.names import (
    EXPERIMENT_KIND_TAG,
    GOODPUT_TAG,
    JOB_TAG,
    KILLED_ATTEMPT_TAG,
    KILLED_TAG,
    MODEL_TRAINING,
    NOTE_TAG,
    RUN_NAME_TAG,
    UI_MODEL_TRAINING,
)

logger = logging.getLogger("prefect_jax.tracking")
EXIT_WAIT_SECS = 30.0  # how long a process's exit waits for its MLflow worker, and an evaluate or export run's end (`Tracker.land`)
# The same waits once another process of the job went away (`cluster.lost_process`): JAX's
# coordination service aborts this process about its heartbeat timeout (30 s) after the loss if it
# is still there, and the run would end Crashed instead of Failed.
LOST_EXIT_WAIT_SECS = 5.0


def _lost() -> bool:
    from prefect_jax.training.cluster import lost_process

    return lost_process() is not None


def exit_wait(timeout: float) -> float:
    """`timeout` for a wait at the end of a run or process; shorter after a lost process."""
    return min(timeout, LOST_EXIT_WAIT_SECS) if _lost() else timeout


def default_tracking_uri() -> str:
    """``MLFLOW_TRACKING_URI`` if set, else SQLite in the working directory (MLflow's own default)."""
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{os.path.abspath('mlflow.db')}"


strict_here = threading.local()  # the MLflow worker: the calling process's strictness, per call


def strict() -> bool:
    value = getattr(strict_here, "value", None)
    if value is not None:
        return value
    return os.environ.get("PREFECT_JAX_MLFLOW_STRICT", "").lower() in ("1", "true", "yes")


def in_process() -> bool:
    """``PREFECT_JAX_MLFLOW_IN_PROCESS=1``: MLflow calls on a thread of this process, not in a child."""
    return os.environ.get("PREFECT_JAX_MLFLOW_IN_PROCESS", "").lower() in ("1", "true", "yes")


freeze_after_connect = False  # set by the command, which owns its process: gc.freeze() once MLflow is imported


class TrackingWarning(UserWarning):
    """An MLflow call failed; training went on."""


def _guarded(fn):
    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        if self._client is None:
            return None
        try:
            return fn(self, *args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - tracking must never stop training
            if strict():
                raise
            msg = f"MLflow {fn.__name__} failed against {self.tracking_uri}: {exc!r}; training goes on"
            warnings.warn(msg, TrackingWarning, stacklevel=2)
            logger.warning(msg)
            return None

    return wrapper


def flatten_params(prefix: str, obj: Any) -> dict[str, str]:
    """Flatten nested dicts/lists into ``a.b.0.c`` keys with string values (MLflow params)."""
    out: dict[str, str] = {}
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.update(flatten_params(f"{prefix}.{k}" if prefix else str(k), v))
    elif isinstance(obj, (list, tuple)) and obj and isinstance(obj[0], (dict, list, tuple)):
        for i, v in enumerate(obj):
            out.update(flatten_params(f"{prefix}.{i}", v))
    else:
        out[prefix] = str(obj)[:6000]
    return out


class Tracker:
    """The MLflow run of one job.

    Args:
        tracking_uri: MLflow tracking URI (``sqlite:///...``, ``http://...``).
        experiment: experiment name.
        job_key: identifies the job across reruns (tag ``prefect_jax.job``).
        enabled: False in a process that does not write the job's records (not the primary
            one of several): every call then does nothing.
    """

    def __init__(self, tracking_uri: str | None, experiment: str, job_key: str, enabled: bool = True,
                 _worker_side: bool = False):  # fmt: skip
        self.enabled = enabled
        self.tracking_uri = tracking_uri or default_tracking_uri()
        self.experiment = experiment
        self.job_key = job_key
        self._run_id: str | None = None
        self._experiment_id: str | None = None  # where the calls run (see `experiment_id`)
        self._started: Future | None = None
        self._client = None
        self._logged_until: dict[str, int] = {}  # prefix -> its last step in MLflow (looked up once per run and process)
        self._logged_at: dict[str, set[int]] = {}  # steps of a metric known to be in MLflow (looked up once)
        self._unwritten: dict[int, list[tuple[str, float, int]]] = {}  # train rows submitted, not yet written
        self._unwritten_lock = threading.Lock()
        self._ids = itertools.count()
        self._pending: list[Future] = []
        self._system_metrics = None  # MLflow's SystemMetricsMonitor while the trainer's run is open
        self._curve_drawn_at: float | None = None  # when the last learning curve was asked for (monotonic)
        self._pool: ThreadPoolExecutor | None = None  # the calls' thread (this process, or the worker's)
        self._remote: _Remote | None = None  # the calls' worker process
        self._own_client = None  # `client` of a tracker whose calls run in the worker
        if _worker_side:  # in the worker: its reader hands this tracker's calls to its thread
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prefect-jax-mlflow")
            return
        if not enabled:
            return
        if not in_process():
            try:
                self._remote = _Remote(_worker(), (self.tracking_uri, experiment, job_key))
            except Exception as exc:  # noqa: BLE001 - MLflow still works, in this process
                logger.warning("MLflow worker process not started (%r): MLflow calls run in this process", exc)
        if self._remote is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prefect-jax-mlflow")
        self._call("_connect")

    # -- the background calls -------------------------------------------------------------

    def _call(self, name: str, *args) -> Future:
        """Run method `name` in the background (in the worker process, or on this process's thread)."""
        if not self.enabled:
            future: Future = Future()
            future.set_result(None)
            return future
        future = self._remote.call(name, args) if self._remote is not None else self._pool.submit(getattr(self, name), *args)
        self._pending = [f for f in self._pending if not f.done() or f.exception() is not None] + [future]
        return future

    def flush(self) -> None:
        """Wait for every call made so far; in strict mode, raise the first one that failed."""
        pending, self._pending = self._pending, []
        errors = [f.exception() for f in pending]
        failed = [e for e in errors if e is not None]
        if failed:
            raise failed[0]

    def land(self, timeout: float = EXIT_WAIT_SECS) -> None:
        """Wait for every call made so far, as the end of an evaluate or export flow run does. In
        strict mode: `flush`. Otherwise up to `timeout` seconds, and what failed or is still on its
        way then is logged, not raised (an unreachable tracking server must not hold or fail the run:
        the eval records are the durable truth, and the job's next evaluator logs what MLflow lacks)."""
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

            first = f" (first: {scrub(repr(failed[0]), secret_values(self.tracking_uri, None))})" if failed else ""
            logger.warning("MLflow at %s: %d write(s) still on their way after %gs, %d failed%s; the run goes on without them",
                           redact_url(self.tracking_uri), len(waiting), timeout, len(failed), first)  # fmt: skip

    def _wait(self, name: str, *args):
        self.flush()
        return self._call(name, *args).result()

    def _connect(self) -> None:
        try:
            from mlflow.tracking import MlflowClient

            self._client = MlflowClient(tracking_uri=self.tracking_uri)
            if freeze_after_connect:  # the command froze its imports (prefect_jax.cli): MLflow's too
                import gc

                gc.freeze()
        except Exception as exc:  # noqa: BLE001
            if strict():
                raise
            warnings.warn(f"MLflow unavailable at {self.tracking_uri}: {exc!r}", TrackingWarning, stacklevel=2)

    @property
    def client(self):
        """An MlflowClient for this tracker's store (None if MLflow is unavailable), once every
        call made so far is done. With the calls in the worker process, a client of this process's own."""
        self.flush()
        if self._remote is None:
            return self._client
        if self._own_client is None:
            from mlflow.tracking import MlflowClient

            self._own_client = MlflowClient(tracking_uri=self.tracking_uri)
        return self._own_client

    def _run(self) -> dict:
        """What `start` found: ``{"run_id", "experiment_id"}`` (waits for it; empty before `start`)."""
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

    # -- the calls ------------------------------------------------------------------------

    def start(
        self, params: dict[str, Any], tags: dict[str, str] | None = None, run_id: str | None = None, reopen: bool = True,
        killed: dict[str, Any] | None = None, description: str | None = None,
    ) -> None:
        """Find this job's run (by `run_id` or by job tag) or create it; mark it RUNNING if `reopen`.

        Params are logged only when the run is created, so a rerun never conflicts with them.
        `killed` describes an attempt that died without closing the run (a SIGKILLed trainer
        whose lease this process took over): the run is marked KILLED before it is reopened,
        and the attempt is recorded for good (see `_note_killed`). `description` becomes the
        run's description, followed by the killed attempts. Returns at once; `run_id` waits
        for the answer.
        """
        self._started = self._call("_start", params, tags, run_id, reopen, killed, description)

    @_guarded
    def _start(
        self, params: dict[str, Any], tags: dict[str, str] | None, run_id: str | None, reopen: bool, killed: dict | None = None,
        description: str | None = None,
    ) -> dict[str, str]:
        self._logged_until = {}  # this run's history is looked up again (see _log_new_metrics)
        self._logged_at = {}
        client = self._client
        exp = client.get_experiment_by_name(self.experiment)
        if exp is None:
            exp_id = client.create_experiment(self.experiment, artifact_location=self._artifact_root(), tags={EXPERIMENT_KIND_TAG: MODEL_TRAINING})
        else:
            exp_id = exp.experiment_id
            if EXPERIMENT_KIND_TAG not in exp.tags:  # a person's choice of view is left alone
                client.set_experiment_tag(exp_id, EXPERIMENT_KIND_TAG, MODEL_TRAINING)
        run = None
        if run_id:
            try:
                run = client.get_run(run_id)
            except Exception:  # noqa: BLE001 - deleted or another store: fall back to the tag
                run = None
        if run is None:
            escaped = self.job_key.replace("'", "\\'")
            found = client.search_runs(
                [exp_id], filter_string=f"tags.`{JOB_TAG}` = '{escaped}'", max_results=1, order_by=["attributes.start_time ASC"]
            )
            run = found[0] if found else None
        if run is None:
            run = client.create_run(exp_id, tags={JOB_TAG: self.job_key, **(tags or {})}, run_name=tags.get(RUN_NAME_TAG) if tags else None)
            from mlflow.entities import Param

            items = [Param(k, v) for k, v in sorted(params.items())]
            for i in range(0, len(items), 100):
                client.log_batch(run.info.run_id, params=items[i : i + 100])
        else:
            if killed:
                self._note_killed(run, killed)
            if reopen and (killed or run.info.status != "RUNNING"):
                client.update_run(run.info.run_id, status="RUNNING")
        self._experiment_id = exp_id
        self._run_id = run.info.run_id
        if description is not None:
            self._describe(description)
        if reopen:
            self._start_system_metrics()
        return {"run_id": self._run_id, "experiment_id": exp_id}

    def _start_system_metrics(self) -> None:
        """MLflow's system metrics (``system/cpu_utilization_percentage``, memory, disk, network,
        GPU where it finds one) for the trainer's run: on with a tracking server, on a SQLite
        store only with ``MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING=true`` (its own writer would
        contend for the file lock); MLflow's switch set false turns them off everywhere."""
        switch = os.environ.get("MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING", "").strip().lower()
        remote = self.tracking_uri.startswith(("http://", "https://", "databricks"))
        if self._system_metrics is not None or switch in ("false", "0") or not (remote or switch in ("true", "1")):
            return
        try:
            from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

            self._system_metrics = SystemMetricsMonitor(self._run_id, resume_logging=True, tracking_uri=self.tracking_uri)
            self._system_metrics.start()
        except Exception as exc:  # noqa: BLE001 - nice to have; training goes on
            logger.warning("MLflow system metrics not started: %r", exc)
            self._system_metrics = None

    def _stop_system_metrics(self) -> None:
        monitor, self._system_metrics = self._system_metrics, None
        if monitor is not None:
            try:
                monitor.finish()
            except Exception as exc:  # noqa: BLE001
                logger.warning("MLflow system metrics did not stop cleanly: %r", exc)

    @_guarded
    def _describe(self, description: str) -> None:
        """Set the run's description (the killed attempts stay listed after it)."""
        tags = self._client.get_run(self._run_id).data.tags
        killed = [tags[f"{KILLED_ATTEMPT_TAG}{n}"] for n in range(1, int(tags.get(KILLED_TAG, "0") or 0) + 1) if f"{KILLED_ATTEMPT_TAG}{n}" in tags]
        note = "\n\n".join([description.strip(), *killed])[-5000:]
        if tags.get(NOTE_TAG) != note:
            self._client.set_tag(self._run_id, NOTE_TAG, note)

    def _note_killed(self, run, killed: dict[str, Any]) -> None:
        """Close the run of a dead attempt KILLED (if it still says RUNNING), and record that
        attempt, since the run is RUNNING again at once: tag ``prefect_jax.killed_attempts`` (a
        count), ``prefect_jax.killed.<n>`` (who, and the step training resumed from) and a line
        in the run's description (``mlflow.note.content``)."""
        client, run_id, tags = self._client, run.info.run_id, run.data.tags
        if run.info.status == "RUNNING":
            client.set_terminated(run_id, status="KILLED")
        n = int(tags.get(KILLED_TAG, "0") or 0) + 1
        line = (
            f"Attempt killed (run marked KILLED, then RUNNING again): host {killed.get('host')}, pid {killed.get('pid')}, Prefect flow run "
            f"{killed.get('flow_run_id') or '-'}; its lease was taken over ({killed.get('reason')}) and training "
            f"resumed from step {killed.get('resumed_from')}."
        )
        note = (tags.get(NOTE_TAG, "") + "\n\n" + line).strip()[-5000:]
        from mlflow.entities import RunTag

        tags = {KILLED_TAG: str(n), f"{KILLED_ATTEMPT_TAG}{n}": line, NOTE_TAG: note}
        client.log_batch(run_id, tags=[RunTag(k, v) for k, v in tags.items()])
        logger.warning("MLflow run %s: %s", run_id, line)

    def run_url(self) -> str | None:
        """The job's run in the MLflow UI: on the tracking server itself for an http(s) store, else
        on ``PREFECT_JAX_MLFLOW_UI_URL`` (default ``http://127.0.0.1:5000``, what ``mlflow ui`` serves)."""
        run_id, experiment_id = self.run_id, self.experiment_id
        if not run_id or not experiment_id:
            return None
        base = self.tracking_uri if self.tracking_uri.startswith(("http://", "https://")) else (
            os.environ.get("PREFECT_JAX_MLFLOW_UI_URL") or "http://127.0.0.1:5000"
        )  # fmt: skip
        # MLflow 3's UI opens in its GenAI view unless the link asks for model training.
        return f"{base.rstrip('/')}/#/experiments/{experiment_id}/runs/{run_id}?{UI_MODEL_TRAINING}"

    def _artifact_root(self) -> str | None:
        """For a SQLite store, artifacts go beside the database (not into ./mlruns of whatever the
        working directory was); other stores keep their server's default."""
        if self.tracking_uri.startswith("sqlite:///"):
            db = self.tracking_uri[len("sqlite:///") :]
            return "file://" + os.path.join(os.path.dirname(os.path.abspath(db)), "mlartifacts", self.experiment)
        return None

    def log_new_metrics(self, rows: Iterable[tuple[str, float, int]], prefix: str) -> None:
        """Log the rows (metrics named ``<prefix>...``) past the last step at which this run had a
        metric under `prefix` before this process started (in the background).

        A resumed job recomputes, bit for bit, the steps between its checkpoint and a crash,
        some of which may have been logged: they are not logged twice. Other metrics (an
        evaluation's, the goodput's at the step a preempted attempt ended) do not count: rows
        carried by the checkpoint a process ended at, and never logged by it, are logged.
        """
        rows, key = list(rows), next(self._ids)
        with self._unwritten_lock:
            self._unwritten[key] = rows
        self._call("_log_new_metrics", rows, prefix).add_done_callback(lambda _, key=key: self._forget(key))

    def unwritten_metrics(self) -> list[tuple[str, float, int]]:
        """Rows given to `log_new_metrics` that are not in MLflow yet (a checkpoint carries them)."""
        with self._unwritten_lock:
            return [r for rows in self._unwritten.values() for r in rows]

    def _forget(self, key: int) -> None:
        with self._unwritten_lock:
            self._unwritten.pop(key, None)

    def log_metrics_once(self, rows: Iterable[tuple[str, float, int]], key: str, step: int) -> None:
        """Log the rows unless `key` is already logged at `step` (a crash between log and record)."""
        self._call("_log_metrics_once", list(rows), key, step)

    @_guarded
    def _log_metrics(self, rows: list[tuple[str, float, int]]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(k, float(v), now, int(s)) for k, v, s in rows]
        for i in range(0, len(metrics), 1000):
            self._client.log_batch(self._run_id, metrics=metrics[i : i + 1000])

    @_guarded
    def _log_new_metrics(self, rows: list[tuple[str, float, int]], prefix: str) -> None:
        if prefix not in self._logged_until:
            last = self._last_logged_step(prefix)
            self._logged_until[prefix] = -1 if last is None else last
        fresh = [r for r in rows if r[2] > self._logged_until[prefix]]
        if fresh:
            self._log_metrics(fresh)
            self._logged_until[prefix] = max(r[2] for r in fresh)

    @_guarded
    def _log_metrics_once(self, rows: list[tuple[str, float, int]], key: str, step: int) -> None:
        if key not in self._logged_at:  # one history read per key and process, then kept up to date
            self._logged_at[key] = {s for s, _ in self._metric_history(key)}
        if step not in self._logged_at[key]:
            self._log_metrics(rows)
            self._logged_at[key].add(step)

    def warm_registry(self) -> Future | None:
        """Have the worker process make ready, now and beside this tracker's calls, what its first
        logged model would otherwise wait for (`registry.warm_jax`, `registry.warm_mlflow`: JAX
        and its CPU client, MLflow's model modules, its map of installed packages): ~1 s of CPU
        at its nice level, which the first `register_exports` paid in the queue, ahead of every
        later MLflow write. Once per worker. Returns what answers once it is done (its error, if
        any; the first export then fails with its own); None where MLflow runs in this process
        (``PREFECT_JAX_MLFLOW_IN_PROCESS``, or no worker could start), which does it at that
        first export."""
        return self._remote.worker.warm_registry() if self._remote is not None else None

    def register_exports(self, name: str, job: str, aliases: dict[str, int], local_export: Callable[[int], str], example,
                         on_done: Callable[[dict], None] | None = None, description: str = "", steps: list[int] = ()) -> Future:  # fmt: skip
        """In the background: each exported step (`steps`, and each step an alias points at)
        becomes an MLflow Model of the run and a version of registered model `name` (once), and
        the aliases move (see `registry.sync_registry`). `local_export` must pickle (it runs in
        the worker process); `on_done` gets the result in this process."""
        future = self._call("_register_exports", name, job, aliases, local_export, example, description, list(steps))
        if on_done is not None:
            future.add_done_callback(lambda f: _after(f, on_done))
        return future

    @_guarded
    def _register_exports(self, name, job, aliases, local_export, example, description, steps) -> dict:
        from prefect_jax.training.registry import sync_registry

        return sync_registry(self._client, self.tracking_uri, self._experiment_id, self._run_id, name, job, self.job_key,
                             aliases, local_export, example, description, steps)  # fmt: skip

    def log_learning_curve(self, step: int, train_key: str, eval_keys: list[str], min_interval_secs: float = 0.0) -> None:
        """In the background: the learning curve up to `step` (train `train_key` and the eval
        metrics by step, from the run's history) as the image ``learning_curve`` at `step`;
        skipped if one was drawn less than `min_interval_secs` ago in this process."""
        now = time.monotonic()
        if self._curve_drawn_at is not None and now - self._curve_drawn_at < min_interval_secs:
            return
        self._curve_drawn_at = now
        self._call("_log_learning_curve", step, train_key, list(eval_keys))

    @_guarded
    def _log_learning_curve(self, step: int, train_key: str, eval_keys: list[str]) -> None:
        import numpy as np
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        history = {k: sorted((m.step, m.value) for m in self._client.get_metric_history(self._run_id, k)) for k in [train_key, *eval_keys]}
        figure = Figure(figsize=(7, 4), dpi=100)
        ax = figure.add_subplot()
        for key, points in history.items():
            if points:
                xs, ys = zip(*points)
                ax.plot(xs, ys, marker="o" if key != train_key else None, label=key, linewidth=1.5 if key != train_key else 1)
        ax.set_xlabel("step")
        ax.set_title(f"learning curve at step {step}")
        ax.grid(alpha=0.3)
        ax.legend(loc="best")
        canvas = FigureCanvasAgg(figure)
        canvas.draw()
        image = np.asarray(canvas.buffer_rgba())[..., :3].copy()
        self._client.log_image(self._run_id, image, key="learning_curve", step=int(step))

    def log_goodput(self, summary: dict[str, Any], step: int) -> None:
        """In the background: the job's goodput (see `prefect_jax.training.goodput`) as ``goodput/*``
        metrics at `step`, the artifact ``goodput.json`` and the tag ``prefect_jax.goodput``."""
        if summary:
            self._call("_log_goodput", dict(summary), int(step))

    @_guarded
    def _log_goodput(self, summary: dict[str, Any], step: int) -> None:
        from prefect_jax.training.goodput import mlflow_metrics

        self._log_metrics(mlflow_metrics(summary, step))
        self._client.log_dict(self._run_id, summary, "goodput.json")
        self._client.set_tag(self._run_id, GOODPUT_TAG, f"{summary['goodput']:.3f} over {summary['attempts']} attempt(s)")

    def set_tags(self, tags: dict[str, str]) -> None:
        self._call("_set_tags", dict(tags))

    @_guarded
    def _set_tags(self, tags: dict[str, str]) -> None:
        for k, v in tags.items():
            self._client.set_tag(self._run_id, k, v)

    def finish(self, status: str = "FINISHED") -> None:
        """Mark the run terminated with `status`, after every earlier call; waits for it (after a
        lost process, `exit_wait` at most for the calls before it and for itself, then a warning)."""
        if not _lost() or strict():
            self._wait("_finish", status)
            return
        self.land()
        try:
            self._call("_finish", status).result(timeout=exit_wait(EXIT_WAIT_SECS))
        except TimeoutError:
            from prefect_jax.training.redaction import redact_url

            logger.warning("MLflow at %s: the run was not marked %s within %gs (another process of the job went away); "
                           "it stays RUNNING until a rerun of the job reopens it", redact_url(self.tracking_uri), status,
                           exit_wait(EXIT_WAIT_SECS))  # fmt: skip

    @_guarded
    def _finish(self, status: str) -> None:
        self._stop_system_metrics()
        if self._run_id:
            self._client.set_terminated(self._run_id, status=status)

    # -- reads (wait for the calls before them) -----------------------------------------------

    @_guarded
    def _last_logged_step(self, prefix: str) -> int | None:
        """The highest step at which a metric named ``<prefix>...`` was logged."""
        client = self._client
        keys = [k for k in client.get_run(self._run_id).data.metrics if k.startswith(prefix)]
        steps = [m.step for k in keys for m in client.get_metric_history(self._run_id, k)]
        return max(steps) if steps else None

    def metric_history(self, key: str) -> list[tuple[int, float]]:
        return self._wait("_metric_history", key)

    @_guarded
    def _metric_history(self, key: str) -> list[tuple[int, float]]:
        return [(m.step, m.value) for m in self._client.get_metric_history(self._run_id, key)]


def _after(future: Future, fn: Callable[[Any], None]) -> None:
    """`fn(result)` of a background call that answered (not one that failed or was skipped)."""
    if future.exception() is None and future.result() is not None:
        try:
            fn(future.result())
        except Exception as exc:  # noqa: BLE001 - tracking must never stop training
            logger.warning("after an MLflow call: %r", exc)


class _Worker:
    """The child process that makes this process's MLflow calls (`prefect_jax.training.mlflow_worker`).

    Started from a thread of its own that lives as long as it does: Linux ends the child when
    that thread's process dies (its parent-death signal follows the thread that started it).
    Frames are pickled here, before they are written, so a call that does not pickle fails
    alone. If the child dies, the calls still waiting fail: in strict mode with an error, else
    with a warning and no answer, and training goes on.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._futures: dict[int, Future] = {}
        self._background: set[int] = set()  # requests of `request`: nothing waits for them at the end
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
                [sys.executable, "-P", "-m", "prefect_jax.training.mlflow_worker", str(os.getpid())],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, close_fds=True,
                env={**os.environ, "PYTHONPATH": pythonpath, "JAX_PLATFORMS": "cpu"},  # see mlflow_worker._worker_environment
            )  # fmt: skip
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
                self.process.wait()  # this thread outlives it: its end would kill the child (PR_SET_PDEATHSIG)
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
            except Exception as exc:  # noqa: BLE001 - an answer this process cannot read (no MLflow here)
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
        error = RuntimeError(f"the MLflow worker process exited (code {code}): MLflow calls are lost")
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


def _worker() -> _Worker:
    """This process's MLflow worker (started on first use; again if it died)."""
    global _the_worker
    with _worker_lock:
        if _the_worker is None or not _the_worker.alive or _the_worker.pid != os.getpid():
            _the_worker = _Worker()
            # Where concurrent.futures joins its threads at exit (not after a SIGTERM: see prefect_jax.cli.entry).
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
    writes no MLflow run; see `cluster.leads_from_env`)."""
    from prefect_jax.training.cluster import leads_from_env

    if in_process() or not leads_from_env():
        return
    try:
        worker, uri = _worker(), tracking_uri or default_tracking_uri()
        if uri not in worker.warmed:
            worker.warmed.add(uri)
            worker.send(("warm", uri))
        if registry:
            worker.warm_registry()
    except Exception as exc:  # noqa: BLE001 - the trackers start it again, or run MLflow here
        logger.warning("MLflow worker process not started early: %r", exc)


class _Remote:
    """One tracker's calls, in the worker process."""

    def __init__(self, worker: _Worker, args: tuple):
        self.worker, self.key = worker, next(_keys)
        worker.send(("new", self.key, args, dict(os.environ)))

    def call(self, name: str, args: tuple) -> Future:
        return self.worker.call(self.key, name, args)

    def close(self) -> None:
        self.worker.send(("drop", self.key))
