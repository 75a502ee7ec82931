"""The flows' state hooks (a failed or crashed run closes its MLflow run, frees the lease, and
publishes the goodput so far) and the goodput artifact of a finished job."""

# No `from __future__ import annotations`: see prefect_jax/flows/__init__.py.
import functools
import signal
from typing import Any

from prefect import get_run_logger

from prefect_jax.flows.config import config_from
from prefect_jax.tasks import notices
from prefect_jax.training import trainer_thread
from prefect_jax.training.goodput_summary import PREEMPTED
from prefect_jax.training.specs import JobConfig


def end_the_job(status: str):
    """A flow's state hook (on failure: ``FAILED``; on crash: ``KILLED``) that ends the job this
    process trained: on a crash, the task runs the process left Running are marked Crashed; the
    checkpoint in flight commits, the MLflow run ends with `status`, the lease is freed
    (`live.finish_live`); after a preemption, the goodput so far is published and process 0 of
    several leaves JAX's cluster last."""

    # (named for the run's log: "Running hook 'prefect_jax_end_the_job' in response to ...")
    def prefect_jax_end_the_job(flow, flow_run, state):
        import sys

        if status == "KILLED":
            _crash_left_task_runs(flow_run, state)
        # Prefect may run this hook in a worker or `serve` process that never trained: do not
        # import jax, Orbax and MLflow there just to find nothing (it delays the rerun).
        live = sys.modules.get("prefect_jax.training.live")
        if live is None:
            return

        ended = status
        preemption = sys.modules.get("prefect_jax.training.preemption")
        if status == "FAILED" and preemption is not None and preemption.received_signal():
            # A SIGTERM that landed while Prefect was creating a task run makes Prefect's crash
            # handling fail ("Task run is not set"): the run was terminated, not failed.
            ended = "KILLED"
            _report_terminated(flow_run.id, state, preemption.received_signal())
        config = config_from(flow_run.parameters)
        if config is not None:
            # Let a checkpoint in flight commit (no step lost), close the MLflow run, free the
            # lease.
            # On the trainer's thread, after a call a notice cut short if one still runs; not
            # waiting for that call where the notice's ending ran already.
            trainer = live.live_trainer(config)
            ended_on_notice = trainer is not None and trainer.ending.preempted is not None
            busy = not trainer_thread.idle(0)
            wait = 0.0 if ended_on_notice and busy else config.train.sigterm_grace_secs
            notices.within(live.finish_live, wait, config, ended)
            if ended == "KILLED":
                signum = preemption.received_signal() if preemption is not None else None
                _publish_preempted_goodput(config, live.live_trainer(config), flow_run.id, signum)
                # Prefect kills the process with the SIGTERM once its hooks ran: process 0 of
                # several, where JAX's coordination service runs, lets the others go first.
                cluster = sys.modules.get("prefect_jax.training.cluster")
                if cluster is not None:
                    cluster.leave_last()

    return prefect_jax_end_the_job


def _crash_left_task_runs(flow_run, state) -> None:
    """The crashed flow run's task runs that its dead process left Running end Crashed too, so the
    run's page tells the truth before anyone retries it (here, wherever Prefect runs the hook: the
    worker or `serve` process after a SIGKILL, the flow-run process itself after a SIGTERM)."""
    from prefect_jax.tasks.runs import crash_left_task_runs

    message = f"its flow run crashed: {state.message}" if state.message else "its flow run crashed"
    try:
        marked = crash_left_task_runs(flow_run.id, state.timestamp, message)
    except Exception as exc:  # noqa: BLE001 - the next run of the job marks them when it takes over
        _hook_logger(flow_run).warning("could not mark its task runs Crashed: %r", exc)
        return
    if marked:
        _hook_logger(flow_run).warning("marked task run(s) %s Crashed", ", ".join(marked))


def _hook_logger(flow_run):
    """The flow run's logger (its logs in the UI) where a state hook runs: outside the run's
    context. `flow_run`: the run (its lines then carry its name), or its id (``<unknown>``)."""
    from prefect.logging.loggers import flow_run_logger

    if hasattr(flow_run, "name"):
        return flow_run_logger(flow_run=flow_run)
    return flow_run_logger(flow_run_id=flow_run)


PREEMPTED_ARTIFACT_SECS = 10.0  # the longest a SIGTERMed run's exit waits to publish its goodput


def _publish_preempted_goodput(config: JobConfig, trainer, flow_run_id, signum: int | None) -> None:
    """A run this process trained and a SIGTERM (or Ctrl-C, or a crash) stopped: its flow run
    gets the job's goodput so far, as a finished run does, so that the Crashed run in the UI says
    what the preemptions cost (the trainer wrote its attempt's end to the ledger before handing
    the signal on). Within `PREEMPTED_ARTIFACT_SECS`: the exit of a preempted machine must not
    wait on an API that does not answer (the checkpoint, the lease and MLflow are done by now)."""
    attempt = (
        trainer.job.goodput.attempt if trainer is not None and trainer.job.is_primary else None
    )
    if not attempt or attempt.get("ended") != PREEMPTED:
        return
    import contextvars

    from prefect_jax.training.ending import signal_name, within  # (imported: it trained)

    how = (
        f"stopped by {signal_name(signum)} after step {attempt['step']}"
        if signum
        else f"interrupted (its newest checkpoint is step {attempt['step']})"
    )
    lead = f"This run was {how}: a rerun resumes from its newest committed step. So far: "
    publish = functools.partial(publish_goodput, config, trainer.goodput(), lead, flow_run_id)
    if not within(
        functools.partial(contextvars.copy_context().run, publish), PREEMPTED_ARTIFACT_SECS
    ):
        _hook_logger(flow_run_id).warning(
            "the goodput artifact was not published within %.0fs: gave up", PREEMPTED_ARTIFACT_SECS
        )


def _report_terminated(flow_run_id, state, signum: int | None) -> None:
    """Mark the flow run Crashed, as Prefect does a run its SIGTERM (or Ctrl-C) ends (and as
    automations that rerun crashed runs expect)."""
    from prefect.client.orchestration import get_client
    from prefect.states import Crashed

    aborted_by = (
        "an interrupt signal (SIGINT)"
        if signum == signal.SIGINT
        else "a termination signal (SIGTERM)"
    )
    message = f"Execution was aborted by {aborted_by}; Prefect reported: {state.message}"
    try:
        with get_client(sync_client=True) as client:
            client.set_flow_run_state(flow_run_id, Crashed(message=message), force=True)
    except Exception as exc:  # noqa: BLE001 - the run stays Failed; nothing is lost
        _hook_logger(flow_run_id).warning("could not mark the terminated run Crashed: %r", exc)


def publish_goodput(
    config: JobConfig, goodput: dict[str, Any], lead: str = "", flow_run_id=None
) -> None:
    """The job's goodput as a table artifact (key ``<job>-<hash>-goodput``): what preemptions
    cost, by cause.

    Of the current flow run, or of `flow_run_id` (a state hook runs outside the run's context)."""
    if not goodput:
        return
    from prefect.artifacts import TableArtifact

    from prefect_jax.tasks import job_artifact_key
    from prefect_jax.tasks.publish import create_or_update_artifact
    from prefect_jax.training.goodput_summary import as_rows

    description = lead + (
        f"**Goodput of job `{config.job}`: {goodput['goodput']:.1%}** of "
        f"{goodput['wall_s']:.1f} s of wall time went into training steps that were kept, over "
        f"{goodput['attempts']} attempt(s), {goodput['interrupted']} of them interrupted. "
        "The rows say where the rest went (`prefect-jax status` shows the same; MLflow has it "
        "as `goodput/*`)."
    )
    try:
        artifact = TableArtifact(
            key=job_artifact_key(config.job, config.storage, "goodput"),
            table=as_rows(goodput),
            description=description,
        )
        if flow_run_id is None:
            from prefect.runtime import flow_run

            flow_run_id = flow_run.id
        if flow_run_id is None:  # outside any flow run: nothing to be one of
            artifact.create(_sync=True)
        else:  # one per run: a run started twice (the rerun automation) updates its own
            create_or_update_artifact(artifact, flow_run_id)
    except Exception as exc:  # noqa: BLE001 - an artifact must not fail a finished job
        (_hook_logger(flow_run_id) if flow_run_id else get_run_logger()).warning(
            "could not publish the goodput artifact: %r", exc
        )
