"""The engine as a command sees it: a small public surface over the engine's modules.

The `prefect-jax` command (`prefect_jax.cli`) asks the engine a handful of questions (is this job
fit to start, what does storage hold of it, which process of its job is this one) and hands it
a few signals; each is one function here, so the command does not depend on where the engine
keeps each piece. Like the rest of the engine this module never imports prefect, and importing
it imports neither jax nor mlflow: a command refused for bad input must stay quick.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from prefect_jax.training.cluster_config import (  # (re-exported: the command's; kept there)
    pod_process_id as pod_process_id,
)
from prefect_jax.training.errors import (
    EvalHookError,
    ExportFailedError,
    LeaseHeldError,
    NoFirstCheckpointError,
    NonFiniteLossError,
    NoProgressError,
    StorageNotWritableError,
)

# Errors that refuse a job for a reason its user can act on: a command prints one line, exit 1.
REFUSALS: tuple[type[Exception], ...] = (
    EvalHookError,
    ExportFailedError,
    LeaseHeldError,
    NoFirstCheckpointError,
    NoProgressError,
    NonFiniteLossError,
    StorageNotWritableError,
)


def build_specs(
    train: Mapping[str, Any],
    checkpoint: Mapping[str, Any],
    evaluation: Mapping[str, Any],
    exporters: Iterable[str] = (),
    best_metric: str | None = "loss",
    best_mode: str | None = "min",
    best_compare_fn: str | None = None,
    exports_to_keep: int | None = 5,
):
    """The `TrainSpec`, `CheckpointSpec` and `EvalSpec` of a job, from plain values.

    Args:
        train: `TrainSpec`'s fields (``max_steps`` at least).
        checkpoint: `CheckpointSpec`'s fields.
        evaluation: `EvalSpec`'s fields, but for its exporters.
        exporters: The exporters to run after each evaluation, by name, of ``latest``, ``best``
            and ``final``.
        best_metric: The metric the ``best`` exporter compares.
        best_mode: ``min`` or ``max``: which of its values is best.
        best_compare_fn: The ``best`` exporter's ``compare_fn`` by import path, instead of
            `best_metric` and `best_mode` (give those as None).
        exports_to_keep: The exports the ``latest`` and ``best`` exporters keep, each (None:
            every one).

    Returns:
        ``(train_spec, eval_spec, checkpoint_spec)``.

    Raises:
        pydantic.ValidationError: A value is refused; the message names the field, the value and
            the fix (a ``ValueError``).
        ValueError: An exporter name that is none of the three.

    Example:
        >>> train, evaluation, checkpoints = build_specs(
        ...     {"max_steps": 100}, {"every_steps": 20}, {"name": "eval"}, ["latest", "best"]
        ... )
        >>> (train.max_steps, checkpoints.every_steps, [e.name for e in evaluation.exporters])
        (100, 20, ['latest', 'best'])
    """
    from prefect_jax.training.names import EXPORTER_KINDS
    from prefect_jax.training.specs import (
        BestExporter,
        CheckpointSpec,
        EvalSpec,
        FinalExporter,
        LatestExporter,
        TrainSpec,
    )

    train_spec = TrainSpec(**train)
    checkpoint_spec = CheckpointSpec(**checkpoint)
    made = []
    for name in exporters:
        if name == "latest":
            made.append(LatestExporter(keep=exports_to_keep))
        elif name == "best":
            made.append(
                BestExporter(
                    metric=best_metric,
                    mode=best_mode,
                    compare_fn=best_compare_fn,
                    keep=exports_to_keep,
                )
            )
        elif name == "final":
            made.append(FinalExporter())
        else:
            raise ValueError(
                f"exporter {name!r}: not an exporter; give one of {', '.join(EXPORTER_KINDS)}"
            )
    eval_spec = EvalSpec(exporters=made, **evaluation)
    return train_spec, eval_spec, checkpoint_spec


def preflight(
    program: str,
    job: str,
    storage: str,
    max_steps: int | None = None,
    resolve: Callable[[str], tuple[str, Mapping[str, Any]]] | None = None,
    program_params: Mapping[str, Any] | None = None,
    checkpoint_path: str | None = None,
    eval_spec: Any = None,
    tracking_uri: str | None = None,
    mlflow_optional: bool = False,
    compilation_cache: str | None = None,
    train_spec: Any = None,
    evaluates: bool = True,
) -> None:
    """Refuse what a training flow would refuse, before anything starts.

    Reads the cluster from the environment (``TF_CONFIG`` & co.), loads the program with its
    params, checks that the job's storage is writable, that its newest committed step was trained
    with the same program params and, with `max_steps`, that no committed step is past it. The
    flows check the same again.

    Args:
        program: The program's import path, ``"package.module:attribute"``.
        job: The job's name.
        storage: The storage root, a directory or an fsspec URL.
        max_steps: The step the job trains to; None for a role that does not train. Where
            `train_spec` is None (a role that does not train), the newest step's trainer's
            max_steps is taken, and the program params its trainer was given go under
            `program_params` (`following`), as the flows take them.
        resolve: Turns `storage` into a URL and its fsspec options (credentials), once the program
            is loaded (a Prefect block's, say; before, for a role that does not train: it reads
            the newest step first); by default `storage` is the URL, with no options.
        program_params: The program's typed parameters (`JobConfig.program_params`), if any.
        checkpoint_path: The step directory a new job warm-starts from: it must be a committed
            step (unless the job has steps of its own, when it is ignored).
        eval_spec: The job's `EvalSpec`: the metrics its best exporters and early stopping
            compare must be ones the evaluation produces (found without computing).
        tracking_uri: The MLflow tracking URI: MLflow must support it and its store answer.
        mlflow_optional: A tracking URI that fails that check is a warning, not a refusal.
        compilation_cache: The compilation cache's directory: a local one must be one this
            process can make (``job`` and URLs are the storage's concern).
        train_spec: The job's `TrainSpec`, where this process trains the job next (a command):
            once every check passed, the compile of its steps begins (`head_start`), for the
            trainer the flow run makes; not for a job already at its final step, nor for one of
            several JAX processes. A new job's ``serve`` is checked first, where it exports.
        evaluates: This process evaluates the job: `eval_spec`'s metrics are checked (not for a
            trainer alone, role ``train``: its evaluator checks them; its exporters still are).

    Nothing is written before every check passed (the write probe of the storage comes last).

    Raises:
        ClusterConfigError: The cluster variables are malformed or name an unsupported task type.
        ProgramError: The program cannot be imported or is no program.
        ProgramParamsError: `program_params` do not fit the program's parameter type.
        ProgramParamsMismatchError: The job's newest step was trained with other params.
        StorageNotWritableError: The storage cannot be written.
        PastMaxStepsError: The job has a committed step past `max_steps`, where this process
            trains it (`train_spec`): the other roles follow the trainer's.
        BadInputError: A path, a metric name or the storage root is refused (a ``ValueError``).
        ShardingError: One process's program declares a mesh, shardings or a batch spec that the
            devices, its state or its first batch do not fit (`sharded_state.check_sharding`).
        ValueError: A new job's ``serve`` does not trace on its ``serving_input()``, or lower
            for the named export platforms (`serving.check_serving`).
        RemoteConfigError: The storage's protocol, options or bucket are refused.
        TrackingUnreachableError: The tracking URI is refused (without `mlflow_optional`).
    """
    from prefect_jax.training.preflight_job import check_job

    check_job(
        program,
        job,
        storage,
        max_steps,
        resolve=resolve,
        program_params=program_params,
        checkpoint_path=checkpoint_path,
        eval_spec=eval_spec,
        tracking_uri=tracking_uri,
        mlflow_optional=mlflow_optional,
        compilation_cache=compilation_cache,
        train_spec=train_spec,
        evaluates=evaluates,
    )


def check_export(
    job: str,
    storage: str,
    eval_name: str,
    step: int | None,
    resolve: Callable[[str], tuple[str, Mapping[str, Any]]] | None = None,
) -> None:
    """Refuse an export of `step` (None: the newest evaluated one) that has no evaluation to
    export, saying why and what to do, before its flow run starts (reads the storage only;
    `resolve` as `preflight`'s). Raises `BadInputError` (a ``ValueError``)."""
    from prefect_jax.training.export_choice import refuse_empty_export
    from prefect_jax.training.storage import JobStorage

    url, options = resolve(storage) if resolve is not None else (storage, {})
    refuse_empty_export(JobStorage(url, job, dict(options or {})), eval_name, step, storage)


def check_flow_tracking_uri(
    tracking_uri: str | None, optional: bool = False, given: bool = True
) -> None:
    """Refuse a flow run's tracking URI MLflow cannot use or reach, given as the flow's parameter
    (`given`) or, where none is, as ``MLFLOW_TRACKING_URI`` (the work pool's environment; its
    block's URI, where it names one); with `optional`, warn (see
    `prefect_jax.training.mlflow_reach.check_tracking_uri`)."""
    from prefect_jax.training import mlflow_reach

    env = os.environ.get("MLFLOW_TRACKING_URI")
    named = mlflow_reach.FLOW if given or not env else mlflow_reach.ENVIRONMENT
    mlflow_reach.check_tracking_uri(tracking_uri or env, optional, named)


def committed_steps(job: str, url: str, options: Mapping[str, Any] | None = None) -> list[int]:
    """The job's committed checkpoint steps, oldest first (torn or unfinished steps left out)."""
    from prefect_jax.training.steps import job_committed_steps
    from prefect_jax.training.storage import JobStorage

    return job_committed_steps(JobStorage(url, job, dict(options or {})))


def check_shared_by(job: str, url: str, options: Mapping[str, Any] | None, processes: int) -> None:
    """Refuse storage that `processes` JAX processes cannot write one checkpoint on
    (`JobStorage.check_shared_by`): ValueError naming the storage and the fix."""
    from prefect_jax.training.storage import JobStorage

    JobStorage(url, job, dict(options or {})).check_shared_by(processes)


def job_status(
    job: str, url: str, options: Mapping[str, Any] | None = None, shown: str | None = None
) -> dict[str, Any]:
    """What storage holds of a job: its committed steps, evaluated steps and exports, goodput,
    and its registered model's versions and aliases (read from MLflow, or as last recorded).

    Args:
        job: The job's name.
        url: The storage root, a directory or an fsspec URL.
        options: fsspec options for `url` (credentials), if any.
        shown: The storage as the user gave it, for errors (a block's name: its URL is `url`).

    Returns:
        ``storage`` (the root), ``committed_steps``, ``evaluated_steps``, ``exports``, ``goodput``,
        ``program_params`` (the newest step's, if any) and, once registered, ``registered_model``.

    Raises:
        FileNotFoundError: No such job there; the message names the jobs that are.
        RemoteConfigError, RemoteUnreachableError: Storage that cannot be read, and why.
    """
    from prefect_jax.training.job_status import job_status

    return job_status(job, url, options, shown)


def describe_goodput(summary: dict[str, Any]) -> str:
    """One line for people of a job's goodput summary (`job_status`'s ``goodput``)."""
    from prefect_jax.training.goodput_summary import describe

    return describe(summary)


def on_progress(listener: Callable[[int, int, dict], None]) -> Callable[[], None]:
    """Call ``listener(step, max_steps, last_metrics)`` as training in this process advances.

    Returns:
        A function that removes the listener.
    """
    from prefect_jax.training.progress import add_progress_listener

    return add_progress_listener(listener)


def make_local_dir(flag: str, path: str) -> None:
    """Make the local directory `flag` names (or find it there), or refuse the flag's value
    (`BadInputError`, which says why and what to give instead)."""
    from prefect_jax.training.preflight import make_local_dir as make

    make(flag, path)


def default_tracking_uri() -> str:
    """``MLFLOW_TRACKING_URI`` if set, else SQLite in the working directory (MLflow's default)."""
    from prefect_jax.training.mlflow_client import default_tracking_uri as default

    return default()


def warm_up_tracking(tracking_uri: str, registry: bool = False) -> None:
    """Have MLflow imported now, in this process's MLflow worker, while the caller imports the
    rest (with `registry`: what registering exports needs too)."""
    from prefect_jax.training.mlflow_client import warm_up

    warm_up(tracking_uri, registry=registry)


def note_signal(signum: int) -> None:
    """Record that this process was told to stop by `signum` (the command's own handler)."""
    from prefect_jax.training import preemption

    preemption.note_received(signum)


def received_signal() -> int | None:
    """The stop signal this process received (a trainer's guard or `note_signal`), or None."""
    from prefect_jax.training.preemption import received_signal as received

    return received()


def resumes_at() -> tuple[int | None] | None:
    """Where the job a preemption notice ended in this process resumes (see
    `prefect_jax.training.preemption.resumes_at`)."""
    from prefect_jax.training import preemption

    return preemption.resumes_at()


def forget_resumes_at() -> None:
    """Forget what an earlier command in this process ended with (a command's start: a Python
    session may run several): `resumes_at` is None until a trainer says."""
    from prefect_jax.training import preemption

    preemption.forget_resumes_at()


def deliver_lost_notices() -> None:
    """Send SIGTERM again where Python dropped its handler's exception (a garbage-collector
    callback, a ``__del__``): see `prefect_jax.training.preemption.deliver_lost_notices`."""
    from prefect_jax.training.preemption import deliver_lost_notices as deliver

    deliver()


def leads_from_env() -> bool:
    """Whether this process is process 0 of its job (or its only one), from its environment
    alone: the one that writes the job's MLflow run, and starts a Prefect server if one is due."""
    from prefect_jax.training.cluster_config import leads_from_env as leads

    return leads()


def joins_as_secondary() -> bool:
    """Join the job's JAX processes, if this one is of several (imports jax then); whether it is
    one other than process 0, which runs a child flow run of process 0's."""
    from prefect_jax.training import cluster

    return cluster.initialize() is not None and cluster.process_index() > 0


def set_exit_code(code: int) -> None:
    """The code this process exits with if it leaves a job of several processes from an exit
    handler (it lost another process). Loads nothing: a process that never joined one has none."""
    cluster = sys.modules.get("prefect_jax.training.cluster")
    if cluster is not None:
        cluster.exit_code = code
