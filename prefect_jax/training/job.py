"""What lives in storage for one job, built once from its config.

A `Job` owns the job's checkpoints (Orbax on local disk or ``gs://``; elsewhere a local stage
uploaded in the background), its eval records, its exports, its lease, its stop requests and
its MLflow run. It never trains: a `Loop` (`prefect_jax.training.loop`) does, and the
`Trainer` puts the two together.

Which process writes what is decided here, in `Job.is_primary`: with several JAX processes,
each writes its own part of a checkpoint (Orbax coordinates them), and only the primary one
(process 0) holds the lease, writes eval records and exports, and talks to MLflow.

Example:
    ```python
    job = Job(config)
    print(job.committed_steps(), job.records.steps(), job.stop_requested())
    job.close()
    ```
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from collections.abc import Callable, Iterator

from prefect_jax.training import control
from prefect_jax.training.announcer import Announcer
from prefect_jax.training.checkpoints import Checkpoints
from prefect_jax.training.cluster import from_primary, process_count, process_index
from prefect_jax.training.errors import LeaseLostError, NoProgressError
from prefect_jax.training.evaluation import EvalRecords
from prefect_jax.training.goodput import GoodputLedger
from prefect_jax.training.job_checkpoints import JobCheckpoints
from prefect_jax.training.lease import Lease
from prefect_jax.training.lease_early import adopt_early
from prefect_jax.training.mlflow_client import EXIT_WAIT_SECS
from prefect_jax.training.names import (
    FLOW_RUN_ID_TAG,
    FLOW_RUN_URL_TAG,
    MAX_TAG_VALUE,
    RUN_NAME_TAG,
    STOP_REASON_TAG,
    STORAGE_TAG,
)
from prefect_jax.training.redaction import redact_url
from prefect_jax.training.remote import RemoteSteps
from prefect_jax.training.specs import JobConfig
from prefect_jax.training.storage import JobStorage
from prefect_jax.training.tracking import Tracker
from prefect_jax.training.uploader import AsyncUploader

logger = logging.getLogger("prefect_jax.trainer")


class Job(JobCheckpoints):
    """The storage side of one job.

    Args:
        config: the job.
        run_tags: metadata stored in checkpoints and MLflow tags (e.g. the Prefect flow-run id,
            which also names the owner of the job's lease).
    """

    def __init__(self, config: JobConfig, run_tags: dict[str, str] | None = None):
        self.config = config
        self.run_tags = dict(run_tags or {})
        self.is_primary = process_index() == 0
        self.storage = JobStorage(config.storage, config.job, config.storage_options)
        self.processes = process_count()
        self.storage.check_shared_by(self.processes)
        # Taken already, its storage checked, when a flow run's restore task made this trainer
        # (before JAX started; one process, so this is process 0).
        early = adopt_early(self.storage.job_dir, self.run_tags.get(FLOW_RUN_ID_TAG))
        if self.is_primary and early is None:
            from prefect_jax.training.preflight import storage_errors

            with storage_errors(self.storage, config.storage_name or config.storage, "storage"):
                self.storage.check_writable()  # a refused write is found before anything changes
        if self.is_primary and (ignored := self.storage.options_orbax_ignores()):
            logger.warning(
                "storage %s: Orbax reads and writes this job's checkpoints with Google's default "
                "credentials (GOOGLE_APPLICATION_CREDENTIALS, a workload identity), not the "
                "storage options %s, which reach its other files only (eval records, exports, "
                "the lease): give the work pool those credentials",
                redact_url(self.storage.root),
                ignored,
            )
        self.remote: RemoteSteps | None = None
        self._uploader: AsyncUploader | None = None
        checkpoint_spec = config.checkpoint
        if not self.storage.orbax_native:
            # Orbax writes a local stage; steps count once uploaded (marker last). Retention is
            # applied to the remote copy after each upload, not by Orbax to the stage.
            self.remote = RemoteSteps(
                self.storage.remote_checkpoint_url, self.storage.storage_options
            )
            checkpoint_spec = checkpoint_spec.model_copy(
                update={
                    "keep_last": None,
                    "keep_every_steps": None,
                    "keep_every_secs": None,
                    "keep_until_evaluated": None,
                }
            )
        self.records = EvalRecords(self.storage, config.eval.name, writer=self.is_primary)
        self.checkpoints = Checkpoints(
            self.storage.checkpoint_dir, checkpoint_spec, newest_evaluated=self.newest_evaluated
        )
        if self.remote is not None:  # a superseded backup stays in the stage until it is uploaded
            self.checkpoints.pinned = lambda step: (
                self._uploader is not None and step in self._uploader.pending
            )
        self.tracker = Tracker(
            config.mlflow_tracking_uri,
            config.mlflow_experiment,
            self.storage.job_dir,
            enabled=self.is_primary,
        )
        self.lease = early or Lease(self.storage, timeout_secs=config.train.lease_timeout_secs)
        self.goodput = GoodputLedger(self.storage, enabled=self.is_primary)
        # (goodput, tracker) enabled as they were when the lease was lost (`_lease_lost`)
        self._records_at_loss: tuple[bool, bool] | None = None
        self.lease.on_lost = self._lease_lost
        # taken over while JAX started: `acquire` raises LeaseLostError
        if self.lease.lost_to is not None:
            self._lease_lost(self.lease.lost_to)
        self.commit_listeners: list[Callable[[int], None]] = []
        self._announcer = Announcer(self._announce_commit)
        # The save in flight an ending attempt stopped waiting for (said once)
        self._left_in_flight: str | None = None
        # The lease token of the dead holder already recorded in MLflow
        self._noted_takeover: str | None = None
        # The attempts record this run's count replaced (`record_attempt`, `uncounted_if`)
        self._attempts_replaced: dict | None = None

    # -- eval records ---------------------------------------------------------------------

    @property
    def checkpoint_location(self) -> str:
        """Where the job's committed steps stay, as summaries, task results and events name it:
        on object storage its URL (redacted), not this machine's stage of them."""
        return redact_url(self.storage.remote_checkpoint_url or self.checkpoints.directory)

    def newest_evaluated(self) -> int | None:
        steps = self.records.steps()
        return steps[-1] if steps else None

    def discard_records_after(self, step: int) -> None:
        """Eval records of steps past the one training resumes from are of steps that are no
        longer committed (moved aside as torn, unreadable or corrupt, or evaluated by an older
        version before their commit): move them aside, so those steps are evaluated again once
        they are committed again (the same metrics: training is exact)."""
        if not self.is_primary:
            return
        self.records.all()  # (a damaged record is moved aside: its step is evaluated again)
        for later in [s for s in self.records.steps() if s > step]:
            moved = self.records.discard(later, "uncommitted")
            logger.warning(
                "eval record of step %d (%s) is of a step that is not committed: moved aside to %s",
                later,
                self.config.eval.name,
                moved,
            )

    # -- the lease, stop requests, reruns -------------------------------------------------

    def acquire_lease(self, recheck: bool = False) -> bool:
        """Take (or keep) the job's lease; raises `LeaseHeldError` naming a live owner.
        `recheck`: see `Lease.acquire`. Whether it waited for a holder to let the job go (its last
        save may have committed meanwhile); False in every process but the primary."""
        if not self.is_primary:
            return False
        self.lease.owner_id = self.run_tags.get(FLOW_RUN_ID_TAG)
        self.lease.acquire(recheck)
        if self._records_at_loss is not None:  # held again (a restore after a duplicate's)
            self.goodput.enabled, self.tracker.enabled = self._records_at_loss
            self._records_at_loss = None
        return self.lease.waited_for_holder

    def _lease_lost(self, holder: dict) -> None:
        """Another trainer holds the job now: from here on this process writes none of its records
        (goodput ledger, MLflow run: the new holder's), whatever path it ends by."""
        if self._records_at_loss is None:
            self._records_at_loss = (self.goodput.enabled, self.tracker.enabled)
        self.goodput.enabled = False
        self.tracker.enabled = False

    def verify_lease(self, collective: bool = False, max_age: float = 0.0) -> None:
        """Before a write: raise `LeaseLostError` if another trainer took the job over. Process 0
        holds the lease; `collective` (every process calls it at the same point, as before a
        checkpoint, which they write together): every process raises with it. `max_age`: see
        `Lease.verify`."""
        lost: LeaseLostError | None = None
        if self.is_primary:
            try:
                self.lease.verify(max_age=max_age)
            except LeaseLostError as exc:
                lost = exc
        if collective and self.processes > 1 and from_primary(lost is not None) and lost is None:
            lost = LeaseLostError(
                redact_url(self.storage.job_dir), {}, why="process 0 of this job lost its lease"
            )
        if lost is not None:
            raise lost

    def stop_requested(self) -> dict | None:
        """A durable stop request of this job (early stopping, or a person), if any."""
        return control.stop_requested(self.storage)

    def request_stop(self, reason: str, step: int, by: str) -> None:
        if self.is_primary:
            control.request_stop(self.storage, reason, step, by=by)

    def record_attempt(self, step: int, params: Callable[[], dict[str, str]]) -> None:
        """Count a (re)run starting at `step`. A task retry (the same flow run in the same
        process) is not counted again.

        Raises:
            NoProgressError: past the rerun budget; the job's MLflow run (found by its job tag,
                made with `params` where there is none) is closed FAILED first, with the reason
                as its stop reason, rather than left as the crashed attempt left it.
        """
        if not self.is_primary:
            return
        try:
            _, replaced = control.count_attempt(
                self.storage,
                step,
                self.config.train.max_reruns_without_progress,
                self.run_tags.get(FLOW_RUN_ID_TAG, ""),
                f"{socket.gethostname()}:{os.getpid()}",
            )
            if replaced is not None:  # (a task retry's count is its first try's, kept for it)
                self._attempts_replaced = replaced
        except NoProgressError as refused:
            try:  # (not reopened: no attempt of this job resumed)
                killed = self._killed_attempt()  # (the dead holder whose lease this run took)
                self.attach_tracking(
                    params(), reopen=False, killed=killed and {**killed, "refused": True}
                )
                self.tracker.set_tags({STOP_REASON_TAG: str(refused)[:MAX_TAG_VALUE]})
                self.tracker.finish("FAILED", at_most=EXIT_WAIT_SECS)
            except Exception:  # noqa: BLE001 - the refusal is what the caller must see
                logger.warning(
                    "job %s: its MLflow run was not closed", self.config.job, exc_info=True
                )
            # Nothing of the job is written: it is free for the next run, and a flow's failure
            # hook (`live.finish_live`) leaves its MLflow run as closed here.
            self.lease.release()
            raise

    @contextlib.contextmanager
    def uncounted_if(self, *refusals: type[BaseException]) -> Iterator[None]:
        """Around the restore that `record_attempt` counted: a run refused with one of
        `refusals` (its input's; the budget is for runs that crash or are killed) takes its
        count back, so that the corrected rerun does not find the budget spent. A restore that
        succeeds keeps it for good; one that fails otherwise keeps it for its task retry."""
        try:
            yield
        except refusals:
            if self.is_primary and self._attempts_replaced is not None:
                control.uncount_attempt(self.storage, self._attempts_replaced)
            self._attempts_replaced = None
            raise
        self._attempts_replaced = None

    # -- MLflow ---------------------------------------------------------------------------

    def attach_tracking(
        self,
        params: dict[str, str],
        run_id: str | None = None,
        reopen: bool = True,
        killed: dict | None = None,
    ) -> None:
        """Find (by id, else by job tag) or create this job's MLflow run (in the background).

        After taking over the lease of a dead trainer (SIGKILLed: it never closed the run), the
        run is marked KILLED, the attempt recorded, and the run reopened (see `Tracker.start`);
        `killed`: that attempt, where the caller has taken it already (not reopening).
        """
        self.tracker.start(
            params=params,
            tags={
                STORAGE_TAG: redact_url(self.storage.root),
                RUN_NAME_TAG: self.config.job,
                **self.run_tags,
            },
            run_id=run_id,
            reopen=reopen,
            killed=self._killed_attempt() if reopen else killed,
            description=self.description() if reopen else None,  # an evaluator leaves the trainer's
        )

    def description(self) -> str:
        """The MLflow run's description (Markdown): what the job is and where its parts live."""
        c, root = self.config, redact_url(self.storage.job_dir)
        checkpoints = redact_url(self.storage.path("checkpoints"))
        from prefect_jax.training.registry import registered_model_of

        model = registered_model_of(c.eval.registered_model, c.job, self.storage.root)
        lines = [
            f"**prefect-jax job `{c.job}`**: program `{c.program}`, "
            + (f"{c.train.max_steps} steps." if c.train.max_steps else "trains until stopped."),
            "",
            f"- Storage: `{root}` (`prefect-jax status --job {c.job} --storage "
            f"{c.storage_name or redact_url(self.storage.root)}`)",
            f"- Checkpoints (Orbax steps): `{checkpoints}/<step>`",
            f"- Eval records: `{root}/evals/{c.eval.name}/<step>.json`",
            f"- Exports: `{root}/exports/<exporter>/<step>`"
            + (f"; registered model `{model}`" if model and c.eval.exporters else ""),
        ]
        # (the Prefect flow run that trained last follows, from the run's tag: `Tracker._describe`)
        return "\n".join(lines)

    def name_this_flow_run(self) -> None:
        """MLflow's "Prefect flow run" (tags ``prefect.flow_run_url`` and ``prefect.flow_run_id``,
        and the description's line) names this process's flow run from here on: for a run that
        trains (a no-op run of a finished job leaves them naming the run that trained; every run
        keeps its own ``prefect.flow_run.<id>`` tag)."""
        newest = {
            k: v for k, v in self.run_tags.items() if k in (FLOW_RUN_URL_TAG, FLOW_RUN_ID_TAG)
        }
        if not self.is_primary or not newest.get(FLOW_RUN_ID_TAG):
            return
        self.tracker.set_tags(newest)
        self.tracker.describe(self.description())

    def _killed_attempt(self) -> dict | None:
        """The dead holder whose lease this process took over, once (the step training resumes from
        added)."""
        taken = self.lease.taken_over
        if not taken or taken.get("token") == self._noted_takeover:
            return None
        self._noted_takeover = taken.get("token")
        return {**taken, "resumed_from": self.newest_committed() or 0}

    # -- end ------------------------------------------------------------------------------

    def finish(self, status: str) -> None:
        """Wait for pending saves, close the MLflow run with `status`, release the lease."""
        try:
            self.wait_ended(status)
            self.tracker.finish(status)
        finally:
            self.lease.release()

    def close(self) -> None:
        try:
            self.checkpoints.close()
            if self._uploader is not None:
                self._uploader.close()
            self.tracker.close()
        finally:
            self.lease.release()
