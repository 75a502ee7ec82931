"""`facade.preflight`'s sequence: a job's checks (`preflight`) in order, against its storage's
newest step, and the head start of its compile after them (`head_start`). A role that does not
train builds its program as its trainer did (`following`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from prefect_jax.training.eval_specs import compared_metric_names
from prefect_jax.training.preflight import (
    check_checkpoint_path,
    check_compilation_cache,
    check_evaluation,
    check_job_parts,
    storage_errors,
)
from prefect_jax.training.redaction import redact_url
from prefect_jax.training.storage import JobStorage


def check_job(
    program: str,
    job: str,
    storage: str,
    max_steps: int | None,
    *,
    resolve: Callable[[str], tuple[str, Mapping[str, Any]]] | None,
    program_params: Mapping[str, Any] | None,
    checkpoint_path: str | None,
    eval_spec: Any,
    tracking_uri: str | None,
    mlflow_optional: bool,
    compilation_cache: str | None,
    train_spec: Any,
    evaluates: bool,
) -> None:
    """`facade.preflight`: its arguments, its checks in order, and the head start after them."""
    from prefect_jax.training.cluster_config import from_env
    from prefect_jax.training.mlflow_reach import finish_check, start_check

    # before anything is written; None: one process (several see their devices only once JAX's
    # distributed runtime is up, in the flow run: the engine checks their sharding there)
    cluster = from_env()
    probe = start_check(tracking_uri, mlflow_optional)  # a server answers while the program loads
    if probe is not None and probe.answered:  # a local store: checked before JAX's import
        finish_check(probe, mlflow_optional)
        probe = None

    from prefect_jax.training.checksums import CorruptCheckpointError
    from prefect_jax.training.control import load_hooks
    from prefect_jax.training.errors import PastMaxStepsError
    from prefect_jax.training.following import trainers_max_steps, trainers_program_params
    from prefect_jax.training.lease import Lease
    from prefect_jax.training.program import load_program_with_params
    from prefect_jax.training.resume_checks import (
        check_restore_of,
        check_warm_start,
        data_fingerprint_of,
    )
    from prefect_jax.training.serving import check_serving_early
    from prefect_jax.training.sharded_state import check_sharding

    def job_storage() -> JobStorage:
        url, options = resolve(storage) if resolve is not None else (storage, {})
        return JobStorage(url, job, dict(options or {}))

    js = committed = newest_meta = None
    try:
        if train_spec is None:  # a role that does not train builds its program as its trainer did
            js = job_storage()
            committed, newest_meta = _newest_step(js, storage)
            max_steps = trainers_max_steps(newest_meta, max_steps)  # (the program's horizon)
            program_params = trainers_program_params(
                newest_meta, dict(program_params) if program_params is not None else None
            )[0]
        loaded, params = load_program_with_params(
            program, dict(program_params) if program_params else None, max_steps
        )
        metrics_checked = None  # (the metrics checked here: the head start's trainer skips them)
        if eval_spec is not None and evaluates:
            if check_evaluation(loaded, eval_spec, one_process=cluster is None):
                metrics_checked = compared_metric_names(eval_spec)
        exporters = eval_spec.exporters if eval_spec is not None else []
        if train_spec is not None:  # what its trainer refuses as it is made (see head_start)
            check_job_parts(loaded, program, exporters, train_spec.hooks)
        if eval_spec is not None and eval_spec.hooks:  # (as every role's trainer loads them)
            load_hooks(eval_spec.hooks)
        if probe is not None:
            finish_check(probe, mlflow_optional)
    finally:
        if probe is not None:
            probe.close()
    if js is None:  # (every role restores the newest step: its params)
        js = job_storage()
        committed, newest_meta = _newest_step(js, storage)
    if committed:
        newest = committed[-1]
        try:
            reads = (
                dict(seed=train_spec.seed, data=lambda: data_fingerprint_of(loaded))
                if train_spec is not None and not train_spec.is_final(newest)
                else {}
            )
            step_dir = f"{js.checkpoint_dir}/{newest}"
            check_restore_of(step_dir, newest_meta, params, job, newest, **reads)
        except CorruptCheckpointError:
            pass  # damage, not other params: the trainer moves the step aside and falls back
    # (after the params: a job of another program would only meet that refusal past max_steps)
    if train_spec is not None and max_steps is not None and committed and committed[-1] > max_steps:
        raise PastMaxStepsError(redact_url(js.job_dir), committed[-1], max_steps)
    abstract_state = None
    if cluster is None and max_steps is not None:
        # the mesh and the first batch; the state's shardings where the mesh is new
        abstract_state = check_sharding(
            loaded,
            resumed=newest_meta if committed else None,
            trains=train_spec is not None,
            params=program_params,
        )
    if checkpoint_path and not committed:
        check_checkpoint_path(checkpoint_path)
        if train_spec is not None:
            check_warm_start(js.job_dir, checkpoint_path, max_steps)
    # What follows starts JAX's work for the trainer this command's flow run makes: the serve
    # check, the head start. Not beside a live trainer of the job (its lease held): this process
    # would start JAX, on a GPU take its memory, for a command the lease refuses.
    trains_here = train_spec is not None and cluster is None
    checks_serve = trains_here and not committed and bool(exporters)
    head_starts = trains_here and not train_spec.is_final(committed[-1] if committed else None)
    job_free = True  # (read only where it decides something)
    if checks_serve or head_starts:
        with storage_errors(js, storage):
            job_free = Lease(js).is_free()
    serving_checked = None
    if checks_serve and job_free:
        # A new job's serve, before its compile begins: a broken one is one line, not a failed
        # flow run (a rerun's trainer checks as it starts).
        serving_checked = check_serving_early(
            loaded, program, eval_spec.export_platforms, train_spec.seed, abstract_state
        )
    with storage_errors(js, storage):
        js.check_writable()
    check_compilation_cache("--compilation-cache", compilation_cache)
    if head_starts and job_free:
        from prefect_jax.training import head_start

        given = dict(program_params) if program_params else None
        head_start.begin(
            program,
            loaded,
            params,
            given,
            train_spec,
            js,
            compilation_cache,
            serving_checked,
            metrics_checked,
        )


def _newest_step(js: JobStorage, storage: str) -> tuple[list[int], dict | None]:
    """The job's committed steps and its newest step's metadata (None: no step, or unreadable)."""
    from prefect_jax.training.steps import job_committed_steps, step_meta

    with storage_errors(js, storage):
        committed = job_committed_steps(js)
    return committed, step_meta(js, committed[-1]) if committed else None
