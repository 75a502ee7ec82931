"""The run side of a `Tracker`: find or create the job's MLflow run, reopen it, close it, record
the attempts that died without closing it, its tags, its link in the MLflow UI.

`RunCalls` is a base of `Tracker` (with `RegistryCalls`, `MetricCalls`): its public methods queue
a call (`Tracker._call`); the underscored ones run it, in the MLflow worker process or on the
tracker's thread.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from prefect_jax.training import redaction
from prefect_jax.training.mlflow_client import (
    EXIT_WAIT_SECS,
    exit_wait,
    filter_literal,
    guarded,
    process_lost,
    strict,
)
from prefect_jax.training.mlflow_store import sqlite_path
from prefect_jax.training.names import (
    EXPERIMENT_KIND_TAG,
    FLOW_RUN_URL_TAG,
    JOB_TAG,
    KILLED_ATTEMPT_TAG,
    KILLED_TAG,
    MAX_TAG_VALUE,
    MLFLOW_UI_URL_DEFAULT,
    MLFLOW_UI_URL_ENV,
    MODEL_TRAINING,
    NOTE_TAG,
    RUN_NAME_TAG,
    UI_MODEL_TRAINING,
)
from prefect_jax.training.tracking_params import log_params, reconcile_params

logger = logging.getLogger("prefect_jax.tracking")


class RunCalls:
    """The job's run: start, describe, tag, finish; model registration (part of `Tracker`)."""

    def start(
        self,
        params: dict[str, Any],
        tags: dict[str, str] | None = None,
        run_id: str | None = None,
        reopen: bool = True,
        killed: dict[str, Any] | None = None,
        description: str | None = None,
    ) -> None:
        """Find this job's run (by `run_id` or by job tag) or create it; mark it RUNNING if
        `reopen`.

        MLflow keeps a param's first value for good: a reopened run gets the params it lacks,
        and each whose value changed since is recorded as tag ``prefect_jax.param.<key>`` (see
        `tracking_params.reconcile_params`).
        `killed` describes an attempt that died without closing the run (a SIGKILLed trainer
        whose lease this process took over): the run is marked KILLED before it is reopened,
        and the attempt is recorded for good (see `_note_killed`). `description` becomes the
        run's description, followed by the killed attempts. Returns at once; `run_id` waits
        for the answer.
        """
        self.requested_run_id = run_id  # (known before MLflow answers: see `known_run_url`)
        self._started = self._call("_start", params, tags, run_id, reopen, killed, description)

    @guarded
    def _start(
        self,
        params: dict[str, Any],
        tags: dict[str, str] | None,
        run_id: str | None,
        reopen: bool,
        killed: dict | None = None,
        description: str | None = None,
    ) -> dict[str, str]:
        self._logged_until = {}  # this run's history is looked up again (see _log_new_metrics)
        self._logged_at = {}
        client = self._client
        run = None
        if run_id:
            try:
                run = client.get_run(run_id)
            except Exception:  # noqa: BLE001 - deleted or another store: fall back to the tag
                run = None
        if run is not None:  # (a run does not move between experiments: no other one is made)
            exp_id = run.info.experiment_id
            self._say_other_experiment(run, tags.get(RUN_NAME_TAG) if tags else None)
        else:
            exp_id = self._find_or_create_experiment()
            found = self._runs_of_job(exp_id)
            run = found[0] if found else None
        created = run is None
        if run is None:
            if run_id:  # a restored job's run, in neither form here: another store holds it
                logger.warning(
                    "job %s: its MLflow run %s, named by the checkpoint it restores, is not in %s: "
                    "a new run is made there, and its earlier records stay in the store it was "
                    "trained with. Give that store as --mlflow-tracking-uri (mlflow_tracking_uri) "
                    "to keep one history; the default, sqlite:///mlflow.db, is in the working "
                    "directory",
                    tags.get(RUN_NAME_TAG) if tags else self.job_key,
                    run_id,
                    redaction.redact_url(self.tracking_uri),
                )
            made = client.create_run(
                exp_id,
                tags={JOB_TAG: self.job_key, **(tags or {})},
                run_name=tags.get(RUN_NAME_TAG) if tags else None,
            )
            run = self._one_run_of_job(exp_id, made)
            log_params(client, run.info.run_id, params)
        else:
            if killed:
                self._note_killed(run, killed)
            if reopen and (killed or run.info.status != "RUNNING"):
                client.update_run(run.info.run_id, status="RUNNING")
        self._experiment_id = exp_id
        self._run_id = run.info.run_id
        if reopen and not created:  # (an evaluator joining the trainer's run leaves it alone)
            try:
                reconcile_params(client, run, params)
            except Exception as exc:  # noqa: BLE001 - the run is the job's all the same
                logger.warning(
                    "MLflow run %s: its params not brought up to date: %r", self._run_id, exc
                )
        if description is not None:
            self._describe(description)
        if reopen:
            self._start_system_metrics()
        return {"run_id": self._run_id, "experiment_id": exp_id}

    def _say_other_experiment(self, run, job: str | None) -> None:
        """Warn, once per tracker, where the `job`'s `run` is in another experiment than the
        one given: it goes on there."""
        if self._other_experiment_said:
            return
        try:
            was = self._client.get_experiment(run.info.experiment_id).name
        except Exception:  # noqa: BLE001 - only for the warning: the run goes on all the same
            return
        if was == self.experiment:
            return
        self._other_experiment_said = True
        logger.warning(
            "job %s: its MLflow run %s is in experiment %r, not %r as given: it goes on there (an "
            "MLflow run does not move between experiments). Give --mlflow-experiment %s "
            "(mlflow_experiment) to say so, or a new job name to train one in %r",
            job or self.job_key,
            run.info.run_id,
            was,
            self.experiment,
            was,
            self.experiment,
        )

    def _find_or_create_experiment(self) -> str:
        """The experiment's id, made if it is not there. A create that finds it made (another
        job starting into a new experiment, or MLflow's client sending the create again after a
        lost answer) reads it instead: that is not an error, and would turn tracking off."""
        from mlflow.exceptions import MlflowException

        client = self._client
        exp = client.get_experiment_by_name(self.experiment)
        if exp is None:
            try:
                return client.create_experiment(
                    self.experiment,
                    artifact_location=self._artifact_root(),
                    tags={EXPERIMENT_KIND_TAG: MODEL_TRAINING},
                )
            except MlflowException as exc:
                exp = client.get_experiment_by_name(self.experiment)
                if exc.error_code != "RESOURCE_ALREADY_EXISTS" or exp is None:
                    raise
        if EXPERIMENT_KIND_TAG not in exp.tags:  # a person's choice of view is left alone
            client.set_experiment_tag(exp.experiment_id, EXPERIMENT_KIND_TAG, MODEL_TRAINING)
        return exp.experiment_id

    def _runs_of_job(self, exp_id: str) -> list:
        """The active runs tagged with this job, oldest first (the job's run is the oldest)."""
        found = self._client.search_runs(
            [exp_id],
            filter_string=f"tags.`{JOB_TAG}` = {filter_literal(self.job_key)}",
            max_results=100,
            order_by=["attributes.start_time ASC"],
        )  # (ties: a resent create's runs share their start time)
        return sorted(found, key=lambda r: (r.info.start_time or 0, r.info.run_id))

    def _one_run_of_job(self, exp_id: str, made):
        """The job's run after `made` was created for it. MLflow's client sends any request
        again on a lost answer (a read timeout, a 5xx from a proxy after the server committed:
        `mlflow.utils.request_utils`), so one create can make two runs with the job's tag and
        the same start time (the client's, in the request). The oldest is kept, as a later
        attempt without a run id finds it; the others this create made (its start time, nothing
        logged yet) are deleted (MLflow keeps a deleted run until `mlflow gc`). A run of another
        start time is left alone: it may be another process's, in use."""
        from mlflow.exceptions import MlflowException

        found = self._runs_of_job(exp_id) or [made]
        for extra in found[1:]:
            if extra.info.start_time != made.info.start_time or extra.data.metrics:
                continue
            try:
                self._client.delete_run(extra.info.run_id)
            except MlflowException as exc:  # (EDIT without MANAGE, say): a twin, left as it is
                logger.warning("MLflow run %s, a twin, not deleted: %r", extra.info.run_id, exc)
        return found[0]

    def _start_system_metrics(self) -> None:
        """MLflow's system metrics (``system/cpu_utilization_percentage``, memory, disk, network,
        GPU where it finds one) for the trainer's run: on with a tracking server, on a SQLite
        store only with ``MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING=true`` (its own writer would
        contend for the file lock); MLflow's switch set false turns them off everywhere."""
        switch = os.environ.get("MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING", "").strip().lower()
        remote = self.tracking_uri.startswith(("http://", "https://", "databricks"))
        if (
            self._system_metrics is not None
            or switch in ("false", "0")
            or not (remote or switch in ("true", "1"))
        ):
            return
        try:
            from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

            self._system_metrics = SystemMetricsMonitor(
                self._run_id, resume_logging=True, tracking_uri=self.tracking_uri
            )
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

    def describe(self, description: str) -> None:
        """Set the run's description again (see `_describe`), after the calls made before."""
        self._call("_describe", description)

    @guarded
    def _describe(self, description: str) -> None:
        """Set the run's description, with a line naming the flow run its tag
        ``prefect.flow_run_url`` names (the newest that trained), and the killed attempts listed
        after it."""
        tags = self._client.get_run(self._run_id).data.tags
        url = tags.get(FLOW_RUN_URL_TAG)
        if url:
            description = f"{description.rstrip()}\n- Prefect flow run: [{url}]({url})"
        killed = [
            tags[f"{KILLED_ATTEMPT_TAG}{n}"]
            for n in range(1, int(tags.get(KILLED_TAG, "0") or 0) + 1)
            if f"{KILLED_ATTEMPT_TAG}{n}" in tags
        ]
        note = "\n\n".join([description.strip(), *killed])[-MAX_TAG_VALUE:]
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
        refused = killed.get("refused")  # (a rerun refused at its restore: not reopened)
        then = (
            "a rerun refused to train on (see the stop reason)"
            if refused
            else f"training resumed from step {killed.get('resumed_from')}"
        )
        line = (
            f"Attempt killed (run marked KILLED{'' if refused else ', then RUNNING again'}): host "
            f"{killed.get('host')}, pid {killed.get('pid')}, Prefect flow run "
            f"{killed.get('flow_run_id') or '-'}; its lease was taken over "
            f"({killed.get('reason')}) and {then}."
        )
        note = (tags.get(NOTE_TAG, "") + "\n\n" + line).strip()[-MAX_TAG_VALUE:]
        from mlflow.entities import RunTag

        tags = {KILLED_TAG: str(n), f"{KILLED_ATTEMPT_TAG}{n}": line, NOTE_TAG: note}
        client.log_batch(run_id, tags=[RunTag(k, v) for k, v in tags.items()])
        logger.warning("MLflow run %s: %s", run_id, line)

    def run_url(self) -> str | None:
        """The job's run in the MLflow UI: on the tracking server itself for an http(s) store, else
        on ``PREFECT_JAX_MLFLOW_UI_URL`` (default ``http://127.0.0.1:5000``, what ``mlflow ui``
        serves)."""
        run_id, experiment_id = self.run_id, self.experiment_id
        if not run_id or not experiment_id:
            return None
        return self._ui_url(f"experiments/{experiment_id}/runs/{run_id}")

    def known_run_url(self) -> str | None:
        """The job's run in the MLflow UI before MLflow answers: where `start` was given the
        run's id (a rerun: the id its checkpoints carry), the UI's direct route to a run by id,
        which opens it in its experiment (MLflow 3.17's in its GenAI view: `run_url` replaces it
        once MLflow answers); else None."""
        run_id = self.requested_run_id
        return self._ui_url(f"runs/{run_id}") if run_id else None

    def home_url(self) -> str:
        """The MLflow UI's home page (its experiments): where a run not started yet is found."""
        return self._ui_url("")

    def _ui_url(self, route: str) -> str:
        base = (
            self.tracking_uri
            if self.tracking_uri.startswith(("http://", "https://"))
            else (os.environ.get(MLFLOW_UI_URL_ENV) or MLFLOW_UI_URL_DEFAULT)
        )
        # MLflow 3's UI opens in its GenAI view unless the link asks for model training.
        return f"{base.rstrip('/')}/#/{route}?{UI_MODEL_TRAINING}"

    def _artifact_root(self) -> str | None:
        """For a SQLite store, artifacts go beside the database (not into ./mlruns of whatever the
        working directory was); other stores keep their server's default."""
        db = sqlite_path(self.tracking_uri)
        if db is not None:
            return "file://" + os.path.join(
                os.path.dirname(os.path.abspath(db)), "mlartifacts", self.experiment
            )
        return None

    def set_tags(self, tags: dict[str, str]) -> None:
        self._call("_set_tags", dict(tags))

    @guarded
    def _set_tags(self, tags: dict[str, str]) -> None:
        for k, v in tags.items():
            self._client.set_tag(self._run_id, k, v)

    def finish(self, status: str = "FINISHED", at_most: float | None = None) -> None:
        """Mark the run terminated with `status`, after every earlier call; waits for them while
        the store answers (`land_while_answering`), then warns. `at_most`: wait that long at most,
        then warn (`land`), as a failure on its way out does. After a lost process: `exit_wait`
        at most for the calls before it and for itself, then a warning."""
        if strict() or at_most is not None or not process_lost():
            self._call("_finish", status)
            then = f"the run may stay RUNNING, not {status}, until a later run of the job closes it"
            if at_most is None:
                self.land_while_answering(then)
            else:
                self.land(at_most, then)
            self._pending = []  # (what is still on its way: not waited for again, by `close`)
            return
        self.land()
        try:
            self._call("_finish", status).result(timeout=exit_wait(EXIT_WAIT_SECS))
        except TimeoutError:
            from prefect_jax.training.redaction import redact_url

            logger.warning(
                "MLflow at %s: the run was not marked %s within %gs (another process of the job "
                "went away); it stays RUNNING until a rerun of the job reopens it",
                redact_url(self.tracking_uri),
                status,
                exit_wait(EXIT_WAIT_SECS),
            )

    @guarded
    def _finish(self, status: str) -> None:
        self._stop_system_metrics()
        if self._run_id:
            self._client.set_terminated(self._run_id, status=status)
