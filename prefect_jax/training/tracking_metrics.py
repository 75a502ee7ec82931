"""The metrics side of a `Tracker`: train and eval metrics logged once each (a rerun recomputes
steps that a crashed attempt may have logged), the learning curve, the goodput, and the reads of
a metric's history.

`MetricCalls` is one of `Tracker`'s bases: its public methods queue a call (`Tracker._call`);
the underscored ones run it, in the MLflow worker process or on the tracker's thread.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from prefect_jax.training.mlflow_client import guarded
from prefect_jax.training.names import GOODPUT_FILE, GOODPUT_TAG


class MetricCalls:
    """Metric bookkeeping: what is in MLflow already, what is still on its way (part of
    `Tracker`)."""

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
        self._call("_log_new_metrics", rows, prefix).add_done_callback(
            lambda _, key=key: self._forget(key)
        )

    def unwritten_metrics(self) -> list[tuple[str, float, int]]:
        """Rows given to `log_new_metrics` that are not in MLflow yet (a checkpoint carries
        them)."""
        with self._unwritten_lock:
            return [r for rows in self._unwritten.values() for r in rows]

    def _forget(self, key: int) -> None:
        with self._unwritten_lock:
            self._unwritten.pop(key, None)

    def log_metrics_once(self, rows: Iterable[tuple[str, float, int]], key: str, step: int) -> None:
        """Log the rows unless `key` is already logged at `step` (a crash between log and
        record)."""
        self._call("_log_metrics_once", list(rows), key, step)

    @guarded
    def _log_metrics(self, rows: list[tuple[str, float, int]]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(k, float(v), now, int(s)) for k, v, s in rows]
        for i in range(0, len(metrics), 1000):
            self._client.log_batch(self._run_id, metrics=metrics[i : i + 1000])

    @guarded
    def _log_new_metrics(self, rows: list[tuple[str, float, int]], prefix: str) -> None:
        if prefix not in self._logged_until:
            last = self._last_logged_step(prefix)
            self._logged_until[prefix] = -1 if last is None else last
        fresh = [r for r in rows if r[2] > self._logged_until[prefix]]
        if fresh:
            self._log_metrics(fresh)
            self._logged_until[prefix] = max(r[2] for r in fresh)

    @guarded
    def _log_metrics_once(self, rows: list[tuple[str, float, int]], key: str, step: int) -> None:
        if key not in self._logged_at:  # one history read per key and process, then kept up to date
            self._logged_at[key] = {s for s, _ in self._metric_history(key)}
        if step not in self._logged_at[key]:
            self._log_metrics(rows)
            self._logged_at[key].add(step)

    def log_learning_curve(
        self, step: int, train_key: str, eval_keys: list[str], min_interval_secs: float = 0.0
    ) -> None:
        """In the background: the learning curve up to `step` (train `train_key` and the eval
        metrics by step, from the run's history) as the image ``learning_curve`` at `step`;
        skipped if one was drawn less than `min_interval_secs` ago in this process."""
        now = time.monotonic()
        if self._curve_drawn_at is not None and now - self._curve_drawn_at < min_interval_secs:
            return
        self._curve_drawn_at = now
        self._call("_log_learning_curve", step, train_key, list(eval_keys))

    @guarded
    def _log_learning_curve(self, step: int, train_key: str, eval_keys: list[str]) -> None:
        import numpy as np
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        history = {
            k: sorted((m.step, m.value) for m in self._client.get_metric_history(self._run_id, k))
            for k in [train_key, *eval_keys]
        }
        figure = Figure(figsize=(7, 4), dpi=100)
        ax = figure.add_subplot()
        for key, points in history.items():
            if points:
                xs, ys = zip(*points, strict=True)
                ax.plot(
                    xs,
                    ys,
                    marker="o" if key != train_key else None,
                    label=key,
                    linewidth=1.5 if key != train_key else 1,
                )
        ax.set_xlabel("step")
        ax.set_title(f"learning curve at step {step}")
        ax.grid(alpha=0.3)
        ax.legend(loc="best")
        canvas = FigureCanvasAgg(figure)
        canvas.draw()
        image = np.asarray(canvas.buffer_rgba())[..., :3].copy()
        self._client.log_image(self._run_id, image, key="learning_curve", step=int(step))

    def log_goodput(self, summary: dict[str, Any], step: int) -> None:
        """In the background: the job's goodput (see `prefect_jax.training.goodput`) as
        ``goodput/*``
        metrics at `step`, the artifact ``goodput.json`` and the tag ``prefect_jax.goodput``."""
        if summary:
            self._call("_log_goodput", dict(summary), int(step))

    @guarded
    def _log_goodput(self, summary: dict[str, Any], step: int) -> None:
        from prefect_jax.training.goodput_summary import mlflow_metrics

        rows = mlflow_metrics(summary, step)
        # Once per step, as every metric: a rerun of a finished job (or one whose end a SIGTERM
        # met after this landed) ends at the same step again. The artifact and tag say the newest.
        if rows:
            self._log_metrics_once(rows, rows[0][0], step)
        self._client.log_dict(self._run_id, summary, GOODPUT_FILE)
        self._client.set_tag(
            self._run_id,
            GOODPUT_TAG,
            f"{summary['goodput']:.3f} over {summary['attempts']} attempt(s)",
        )

    # -- reads (wait for the calls before them) ------------------------------------------

    @guarded
    def _last_logged_step(self, prefix: str) -> int | None:
        """The highest step at which a metric named ``<prefix>...`` was logged."""
        client = self._client
        keys = [k for k in client.get_run(self._run_id).data.metrics if k.startswith(prefix)]
        steps = [m.step for k in keys for m in client.get_metric_history(self._run_id, k)]
        return max(steps) if steps else None

    def metric_history(self, key: str) -> list[tuple[int, float]]:
        return self._wait("_metric_history", key)

    @guarded
    def _metric_history(self, key: str) -> list[tuple[int, float]]:
        return [(m.step, m.value) for m in self._client.get_metric_history(self._run_id, key)]
