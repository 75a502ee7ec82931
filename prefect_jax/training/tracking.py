"""MLflow records of a job: one run per job, found again by tag when the job runs again.

Every MLflow call runs on one background thread, in the order made: importing MLflow and
opening its store (seconds, for SQLite) overlap the restore and the first compile, and a
training loop never waits on a metric write. Calls that answer something (`run_id`, the
reads) wait for what came before them; `flush` and `finish` wait for everything.

Tracking failures become warnings and training goes on, except in strict mode
(``PREFECT_JAX_MLFLOW_STRICT=1``, set by the test suite), where they raise, as MLflow's
own Keras callback does in tests (a background failure is raised by the next call that waits).
"""

from __future__ import annotations

import functools
import itertools
import logging
import os
import threading
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Iterable

logger = logging.getLogger("prefect_jax.tracking")

JOB_TAG = "prefect_jax.job"
STORAGE_TAG = "prefect_jax.storage"
KILLED_TAG = "prefect_jax.killed_attempts"  # how many attempts died without closing the run (see Tracker._note_killed)
DEFAULT_EXPERIMENT = "prefect-jax"
# The MLflow UI opens an experiment in the view its kind names (else it may guess GenAI).
EXPERIMENT_KIND_TAG, MODEL_TRAINING = "mlflow.experimentKind", "custom_model_development"
UI_MODEL_TRAINING = "workflowType=machine_learning"  # the query that opens MLflow's UI in its model-training view
NOTE_TAG = "mlflow.note.content"  # the run's description in the MLflow UI


def default_tracking_uri() -> str:
    """``MLFLOW_TRACKING_URI`` if set, else SQLite in the working directory (MLflow's own default)."""
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{os.path.abspath('mlflow.db')}"


def strict() -> bool:
    return os.environ.get("PREFECT_JAX_MLFLOW_STRICT", "").lower() in ("1", "true", "yes")


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

    def __init__(self, tracking_uri: str | None, experiment: str, job_key: str, enabled: bool = True):
        self.enabled = enabled
        self.tracking_uri = tracking_uri or default_tracking_uri()
        self.experiment = experiment
        self.job_key = job_key
        self._run_id: str | None = None
        self.experiment_id: str | None = None
        self._started: Future | None = None
        self._client = None
        self._logged_until: int | None = None  # the last train step in MLflow before this process; None: not looked up
        self._logged_at: dict[str, set[int]] = {}  # steps of a metric known to be in MLflow (looked up once)
        self._unwritten: dict[int, list[tuple[str, float, int]]] = {}  # train rows submitted, not yet written
        self._unwritten_lock = threading.Lock()
        self._ids = itertools.count()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prefect-jax-mlflow")
        self._pending: list[Future] = []
        self._system_metrics = None  # MLflow's SystemMetricsMonitor while the trainer's run is open
        self._curve_drawn_at: float | None = None  # when the last learning curve was asked for (monotonic)
        self._submit(self._connect)

    # -- the background thread ----------------------------------------------------------

    def _submit(self, fn: Callable, *args, **kwargs) -> Future:
        if not self.enabled:
            future: Future = Future()
            future.set_result(None)
            return future
        future = self._pool.submit(fn, *args, **kwargs)
        self._pending = [f for f in self._pending if not f.done() or f.exception() is not None] + [future]
        return future

    def flush(self) -> None:
        """Wait for every call made so far; in strict mode, raise the first one that failed."""
        pending, self._pending = self._pending, []
        errors = [f.exception() for f in pending]
        failed = [e for e in errors if e is not None]
        if failed:
            raise failed[0]

    def _wait(self, fn: Callable, *args, **kwargs):
        self.flush()
        return self._submit(fn, *args, **kwargs).result()

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
        """The MlflowClient (None if MLflow is unavailable), once every call made so far is done."""
        self.flush()
        return self._client

    @property
    def run_id(self) -> str | None:
        """The job's run id, once `start` has found or created it (None before `start`)."""
        if self._started is not None:
            self._started.result()
        return self._run_id

    @property
    def started(self) -> bool:
        """Whether `start` was called (its answer may still be on its way)."""
        return self._started is not None

    def run_id_if_known(self) -> str | None:
        """The run id if `start` has already found it; never waits."""
        return self._run_id if self._started is not None and self._started.done() else None

    def close(self) -> None:
        """Finish the calls made so far and stop the background thread."""
        try:
            self.flush()
        finally:
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
        self._logged_until = None
        self._logged_at = {}
        self._started = self._submit(self._start, params, tags, run_id, reopen, killed, description)

    @_guarded
    def _start(
        self, params: dict[str, Any], tags: dict[str, str] | None, run_id: str | None, reopen: bool, killed: dict | None = None,
        description: str | None = None,
    ) -> str:
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
            run = client.create_run(exp_id, tags={JOB_TAG: self.job_key, **(tags or {})}, run_name=tags.get("mlflow.runName") if tags else None)
            from mlflow.entities import Param

            items = [Param(k, v) for k, v in sorted(params.items())]
            for i in range(0, len(items), 100):
                client.log_batch(run.info.run_id, params=items[i : i + 100])
        else:
            if killed:
                self._note_killed(run, killed)
            if reopen and (killed or run.info.status != "RUNNING"):
                client.update_run(run.info.run_id, status="RUNNING")
        self.experiment_id = exp_id
        self._run_id = run.info.run_id
        if description is not None:
            self._describe(description)
        if reopen:
            self._start_system_metrics()
        return self._run_id

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
        killed = [tags[f"prefect_jax.killed.{n}"] for n in range(1, int(tags.get(KILLED_TAG, "0") or 0) + 1) if f"prefect_jax.killed.{n}" in tags]
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

        tags = {KILLED_TAG: str(n), f"prefect_jax.killed.{n}": line, NOTE_TAG: note}
        client.log_batch(run_id, tags=[RunTag(k, v) for k, v in tags.items()])
        logger.warning("MLflow run %s: %s", run_id, line)

    def run_url(self) -> str | None:
        """The job's run in the MLflow UI: on the tracking server itself for an http(s) store, else
        on ``PREFECT_JAX_MLFLOW_UI_URL`` (default ``http://127.0.0.1:5000``, what ``mlflow ui`` serves)."""
        run_id = self.run_id
        if not run_id or not self.experiment_id:
            return None
        base = self.tracking_uri if self.tracking_uri.startswith(("http://", "https://")) else (
            os.environ.get("PREFECT_JAX_MLFLOW_UI_URL") or "http://127.0.0.1:5000"
        )  # fmt: skip
        # MLflow 3's UI opens in its GenAI view unless the link asks for model training.
        return f"{base.rstrip('/')}/#/experiments/{self.experiment_id}/runs/{run_id}?{UI_MODEL_TRAINING}"

    def _artifact_root(self) -> str | None:
        """For a SQLite store, artifacts go beside the database (not into ./mlruns of whatever the
        working directory was); other stores keep their server's default."""
        if self.tracking_uri.startswith("sqlite:///"):
            db = self.tracking_uri[len("sqlite:///") :]
            return "file://" + os.path.join(os.path.dirname(os.path.abspath(db)), "mlartifacts", self.experiment)
        return None

    def log_new_metrics(self, rows: Iterable[tuple[str, float, int]], exclude_prefix: str = "") -> None:
        """Log the rows past the last step this run had before this process started (in the background).

        A resumed job recomputes, bit for bit, the steps between its checkpoint and a crash,
        some of which may have been logged: they are not logged twice.
        """
        rows, key = list(rows), next(self._ids)
        with self._unwritten_lock:
            self._unwritten[key] = rows
        self._submit(self._log_new_metrics_then_forget, key, rows, exclude_prefix)

    def unwritten_metrics(self) -> list[tuple[str, float, int]]:
        """Rows given to `log_new_metrics` that are not in MLflow yet (a checkpoint carries them)."""
        with self._unwritten_lock:
            return [r for rows in self._unwritten.values() for r in rows]

    def _log_new_metrics_then_forget(self, key: int, rows: list[tuple[str, float, int]], exclude_prefix: str) -> None:
        try:
            self._log_new_metrics(rows, exclude_prefix)
        finally:
            with self._unwritten_lock:
                self._unwritten.pop(key, None)

    def log_metrics_once(self, rows: Iterable[tuple[str, float, int]], key: str, step: int) -> None:
        """Log the rows unless `key` is already logged at `step` (a crash between log and record)."""
        self._submit(self._log_metrics_once, list(rows), key, step)

    @_guarded
    def _log_metrics(self, rows: list[tuple[str, float, int]]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(k, float(v), now, int(s)) for k, v, s in rows]
        for i in range(0, len(metrics), 1000):
            self._client.log_batch(self._run_id, metrics=metrics[i : i + 1000])

    @_guarded
    def _log_new_metrics(self, rows: list[tuple[str, float, int]], exclude_prefix: str) -> None:
        if self._logged_until is None:
            last = self._last_logged_step(exclude_prefix)
            self._logged_until = -1 if last is None else last
        fresh = [r for r in rows if r[2] > self._logged_until]
        if fresh:
            self._log_metrics(fresh)
            self._logged_until = max(r[2] for r in fresh)

    @_guarded
    def _log_metrics_once(self, rows: list[tuple[str, float, int]], key: str, step: int) -> None:
        if key not in self._logged_at:  # one history read per key and process, then kept up to date
            self._logged_at[key] = {s for s, _ in self._metric_history(key)}
        if step not in self._logged_at[key]:
            self._log_metrics(rows)
            self._logged_at[key].add(step)

    def register_exports(self, name: str, job: str, aliases: dict[str, int], local_export: Callable[[int], str], example,
                         on_done: Callable[[dict], None] | None = None, description: str = "", steps: list[int] = ()) -> Future:  # fmt: skip
        """In the background: each exported step (`steps`, and each step an alias points at)
        becomes an MLflow Model of the run and a version of registered model `name` (once), and
        the aliases move (see `registry.sync_registry`)."""
        return self._submit(self._register_exports, name, job, aliases, local_export, example, on_done, description, list(steps))

    @_guarded
    def _register_exports(self, name, job, aliases, local_export, example, on_done, description, steps) -> dict:
        from prefect_jax.training.registry import sync_registry

        result = sync_registry(self._client, self.tracking_uri, self.experiment_id, self._run_id, name, job, self.job_key,
                               aliases, local_export, example, description, steps)  # fmt: skip
        if on_done is not None:
            on_done(result)
        return result

    def log_learning_curve(self, step: int, train_key: str, eval_keys: list[str], min_interval_secs: float = 0.0) -> None:
        """In the background: the learning curve up to `step` (train `train_key` and the eval
        metrics by step, from the run's history) as the image ``learning_curve`` at `step`;
        skipped if one was drawn less than `min_interval_secs` ago in this process."""
        now = time.monotonic()
        if self._curve_drawn_at is not None and now - self._curve_drawn_at < min_interval_secs:
            return
        self._curve_drawn_at = now
        self._submit(self._log_learning_curve, step, train_key, list(eval_keys))

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
            self._submit(self._log_goodput, dict(summary), int(step))

    @_guarded
    def _log_goodput(self, summary: dict[str, Any], step: int) -> None:
        from prefect_jax.training.goodput import mlflow_metrics

        self._log_metrics(mlflow_metrics(summary, step))
        self._client.log_dict(self._run_id, summary, "goodput.json")
        self._client.set_tag(self._run_id, "prefect_jax.goodput", f"{summary['goodput']:.3f} over {summary['attempts']} attempt(s)")

    def set_tags(self, tags: dict[str, str]) -> None:
        self._submit(self._set_tags, dict(tags))

    @_guarded
    def _set_tags(self, tags: dict[str, str]) -> None:
        for k, v in tags.items():
            self._client.set_tag(self._run_id, k, v)

    def finish(self, status: str = "FINISHED") -> None:
        """Mark the run terminated with `status`, after every earlier call; waits for it."""
        self._wait(self._finish, status)

    @_guarded
    def _finish(self, status: str) -> None:
        self._stop_system_metrics()
        if self._run_id:
            self._client.set_terminated(self._run_id, status=status)

    # -- reads (wait for the calls before them) -----------------------------------------------

    @_guarded
    def _last_logged_step(self, exclude_prefix: str) -> int | None:
        """The highest step at which any metric (except those under `exclude_prefix`) was logged."""
        client = self._client
        keys = [k for k in client.get_run(self._run_id).data.metrics if not (exclude_prefix and k.startswith(exclude_prefix))]
        steps = [m.step for k in keys for m in client.get_metric_history(self._run_id, k)]
        return max(steps) if steps else None

    def metric_history(self, key: str) -> list[tuple[int, float]]:
        return self._wait(self._metric_history, key)

    @_guarded
    def _metric_history(self, key: str) -> list[tuple[int, float]]:
        return [(m.step, m.value) for m in self._client.get_metric_history(self._run_id, key)]
