"""Specs: what to train, how often to checkpoint, how to evaluate and export.

Plain pydantic models with TensorFlow's names where they fit (`max_steps`, `steps`,
`start_delay_secs`, `throttle_secs`, `exporters`). They are JSON-able, so a Prefect
deployment can carry them as parameters. Bad values are refused at construction with a
message that names the field, the value and the fix.

This module imports neither jax nor prefect.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


def check_name(kind: str, value: str) -> str:
    """Refuse names that would escape their directory (``..``, ``/``, absolute paths).

    Args:
        kind: what the name is, for the message (``"job"``, ``"eval name"``).
        value: the name.

    Returns:
        The name, unchanged.

    Raises:
        ValueError: the name is empty, contains a path separator, is ``.`` or ``..``, or
            uses characters outside ``[A-Za-z0-9_.-]``.
    """
    if (
        not isinstance(value, str)
        or not _NAME_RE.match(value)
        or value in (".", "..")
        or ".." in value
    ):
        raise ValueError(
            f"{kind} {value!r} is not a valid name: use 1-128 characters from [A-Za-z0-9_.-], "
            "starting with a letter or digit, with no '..' and no path separators "
            f"(for example {kind.split()[0]}-1)."
        )
    return value


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _positive(field: str, value, fix: str, allow_none: bool = False):
    if value is None and allow_none:
        return value
    if value is None or value <= 0:
        raise ValueError(f"{field}={value!r} must be a positive number; {fix}")
    return value


class TrainSpec(_Spec):
    """How long to train.

    Args:
        max_steps: train until the global step reaches this number (as in
            `tf.estimator.TrainSpec`).
        seed: seed of the model initialisation and of the training data order.
        log_every_steps: record training metrics in MLflow every this many steps.
        steps_per_dispatch: run this many steps per call into the device, as one jitted
            ``lax.scan`` over that many stacked batches (TPU-style ``steps_per_execution``).
            It removes the per-step Python dispatch, which is most of a step's time for small
            models. Checkpoints, logged steps and the data position are the same as with 1
            (an interval ends with a shorter scan when K does not divide it); the state
            agrees with 1 up to floating-point reassociation (XLA may fuse the scanned step
            differently), not bit for bit. Costs K batches of host memory and one compile per
            distinct scan length; a SIGTERM is seen between dispatches (at most K steps late).
    """

    max_steps: int = Field(description="Train until the global step reaches this number.")
    seed: int = Field(0, description="Seed for init and for the training data order.")
    log_every_steps: int = Field(50, description="Log train metrics to MLflow every N steps.")
    steps_per_dispatch: int = Field(
        1,
        description="Steps per device call: K>1 runs K steps in one jitted lax.scan (same checkpoints; equal up to float reassociation).",
    )
    check_finite: bool = Field(
        True,
        description="Stop at a NaN/Inf loss (checked every log_every_steps and before each checkpoint).",
    )
    sigterm_grace_secs: float = Field(
        25.0,
        description="On SIGTERM, how long the checkpoint of the step in flight may take before it is abandoned.",
    )
    lease_timeout_secs: float = Field(
        120.0,
        description="A job's lease whose heartbeat is older than this is taken over by a new trainer.",
    )
    max_reruns_without_progress: int | None = Field(
        3,
        description="Refuse to train after this many reruns in a row started at the same step (None: no limit).",
    )

    @field_validator("max_steps")
    @classmethod
    def _max_steps(cls, v):
        return _positive(
            "max_steps", v, "set it to the total number of training steps, e.g. max_steps=1000"
        )

    @field_validator("log_every_steps")
    @classmethod
    def _log_every(cls, v):
        return _positive("log_every_steps", v, "log every N>=1 steps, e.g. log_every_steps=50")

    @field_validator("steps_per_dispatch")
    @classmethod
    def _per_dispatch(cls, v):
        return _positive(
            "steps_per_dispatch",
            v,
            "use 1 for one step per call, or K>1 to scan K steps per call, e.g. 10",
        )

    @field_validator("sigterm_grace_secs")
    @classmethod
    def _grace(cls, v):
        return _positive(
            "sigterm_grace_secs",
            v,
            "give the seconds a preempted node has to save (e.g. 25 on a 30 s notice)",
        )

    @field_validator("lease_timeout_secs")
    @classmethod
    def _lease(cls, v):
        return _positive(
            "lease_timeout_secs",
            v,
            "give the seconds after which a silent trainer's lease is taken over, e.g. 120",
        )


class CheckpointSpec(_Spec):
    """When to write checkpoints and which to keep.

    A checkpoint is written when either cadence is reached (whichever comes first), and
    always at `max_steps`. Retention follows Orbax: the newest `keep_last` steps are kept,
    plus every step that is a multiple of `keep_every_steps`. The decisions themselves are
    `prefect_jax.training.policy.CheckpointPolicy.from_spec(spec, max_steps)`'s.

    Args:
        every_steps: write a checkpoint every this many steps.
        every_secs: write a checkpoint when this many seconds passed since the last one.
        keep_last: how many of the newest checkpoints to keep (None keeps all).
        keep_every_steps: also keep every checkpoint whose step is a multiple of this.
        keep_until_evaluated: also keep every step from the newest evaluated one on (eval
            records under ``<job>/evals/<eval name>/``), so that retention never deletes a step
            before a separate evaluator reached it. None (the default) means: on for the
            `train` role, whose evaluator runs elsewhere; off for `train_and_evaluate`, which
            evaluates each step itself. A trainer whose evaluator never runs keeps every step.
        backups: once attempts of this job were killed without notice (SIGKILL, a lost node: what
            they trained since their last checkpoint was lost), also write *backups* between the
            cadence's checkpoints: resume-only checkpoints (never evaluated), at the interval
            that minimises the expected loss for the kills seen (Young/Daly,
            ``sqrt(2 * save blocking * mean time between kills)``; see
            `prefect_jax.training.policy.backup_interval`; on remote storage, not before the
            previous step is uploaded). A backup is kept only until a newer step commits (it
            does not count in `keep_last`) and emits no ``prefect-jax.checkpoint.committed``
            event. Jobs that were never killed (or only got preemption notices, which lose
            nothing) write none. With several JAX processes, process 0 decides and all of
            them write each backup; a process that went away counts as a kill.
    """

    every_steps: int | None = Field(1000, description="Checkpoint every N steps.")
    every_secs: float | None = Field(None, description="Checkpoint every N seconds.")
    keep_last: int | None = Field(3, description="Keep the newest N checkpoints (None: all).")
    keep_every_steps: int | None = Field(
        None, description="Also keep steps that are multiples of N."
    )
    keep_until_evaluated: bool | None = Field(
        None,
        description="Keep steps the evaluator has not reached yet (None: on for the train role only).",
    )
    backups: bool = Field(
        True,
        description="After kills without notice, also write resume-only backups at the Young/Daly interval.",
    )

    @field_validator("every_steps")
    @classmethod
    def _every_steps(cls, v):
        return _positive(
            "every_steps",
            v,
            "checkpoint every N>=1 steps, or set every_steps=None and use every_secs",
            True,
        )

    @field_validator("every_secs")
    @classmethod
    def _every_secs(cls, v):
        return _positive(
            "every_secs",
            v,
            "give a positive number of seconds, or None to checkpoint by steps only",
            True,
        )

    @field_validator("keep_last")
    @classmethod
    def _keep_last(cls, v):
        return _positive("keep_last", v, "keep at least 1 checkpoint, or None to keep all", True)

    @field_validator("keep_every_steps")
    @classmethod
    def _keep_every(cls, v):
        return _positive("keep_every_steps", v, "give a positive step period, or None", True)

    @model_validator(mode="after")
    def _some_cadence(self):
        if self.every_steps is None and self.every_secs is None:
            raise ValueError(
                "every_steps=None and every_secs=None: no checkpoint would ever be written "
                "before max_steps; set every_steps (e.g. 1000) or every_secs (e.g. 600)"
            )
        return self


class _Exporter(_Spec):
    name: str

    @field_validator("name")
    @classmethod
    def _name(cls, v):
        return check_name("exporter name", v)


class _KeepingExporter(_Exporter):
    keep: int | None = Field(5, description="Number of exports to keep (None: all).")

    @field_validator("keep")
    @classmethod
    def _keep(cls, v):
        return _positive("keep", v, "keep at least 1 export, or None to keep all", True)


class LatestExporter(_KeepingExporter):
    """Export every evaluated checkpoint, keeping the newest `keep` exports (TF's `LatestExporter`)."""

    kind: Literal["latest"] = "latest"
    name: str = "latest"


class BestExporter(_KeepingExporter):
    """Export a checkpoint when its eval `metric` beats every earlier one (TF's `BestExporter`).

    The best value so far is stored next to the exports, so it survives restarts.
    """

    kind: Literal["best"] = "best"
    name: str = "best"
    metric: str = Field("loss", description="Eval metric to compare.")
    mode: Literal["min", "max"] = Field(
        "min", description="'min' if lower is better, 'max' if higher."
    )


class FinalExporter(_Exporter):
    """Export only the final checkpoint, the one at or past `max_steps` (TF's `FinalExporter`)."""

    kind: Literal["final"] = "final"
    name: str = "final"


ExporterSpec = Annotated[LatestExporter | BestExporter | FinalExporter, Field(discriminator="kind")]


class EarlyStopping(_Spec):
    """Stop training when an eval metric stops improving (TF's `stop_if_no_decrease_hook`).

    Both roles stop: the evaluator writes ``<job>/stop.json`` and the trainer stops at its
    next checkpoint boundary.
    """

    metric: str = Field("loss", description="Eval metric to watch.")
    mode: Literal["min", "max"] = Field(
        "min", description="'min' if lower is better, 'max' if higher."
    )
    max_steps_without_improvement: int = Field(
        description="Stop once the best value is this many steps old."
    )
    min_delta: float = Field(0.0, description="Smaller changes do not count as improvement.")

    @field_validator("max_steps_without_improvement")
    @classmethod
    def _patience(cls, v):
        return _positive(
            "max_steps_without_improvement", v, "give a number of global steps, e.g. 1000"
        )


# The platforms `jax.export` lowers for, on any machine (exporters.serialize_serving): an
# export runs on each it was lowered for.
EXPORT_PLATFORMS = ("cpu", "cuda", "rocm", "tpu")


from prefect_jax.training.names import RESERVED_EVAL_NAMES  # noqa: E402


class EvalSpec(_Spec):
    """How to evaluate (TF's `EvalSpec`).

    Args:
        steps: number of eval batches; None evaluates the whole eval set.
        name: name of this evaluation; metrics are logged as ``<name>/<metric>`` and
            records are kept under ``<job>/evals/<name>/``. Not ``train``, ``goodput`` or
            ``system`` (`RESERVED_EVAL_NAMES`): those metrics are prefect-jax's and MLflow's.
        start_delay_secs: the continuous evaluator waits this long before its first eval.
        throttle_secs: do not evaluate again sooner than this many seconds after the last
            evaluation (the final checkpoint is always evaluated).
        exporters: what to export after each evaluation.
        early_stopping: stop the job when a metric stops improving.
        hooks: eval hooks by import path (TF's `_ContinuousEvalListener`).
        learning_curve_every_secs: the learning-curve image (MLflow) is drawn at most this often;
            the final evaluation always draws it; 0 draws it at every evaluation.
        registered_model: the MLflow registered model the exports become versions of, with
            an alias per exporter (``best``, ``final``, ``newest`` for ``latest``); None: the
            job's name; ``""``: do not register.
        export_platforms: the platforms the exported model runs on (``jax.export`` lowers for
            each of `EXPORT_PLATFORMS`); None: all of them, less those ``serve`` does not lower
            for (a warning names them).
    """

    steps: int | None = Field(None, description="Eval batches; None: the whole eval set.")
    name: str = Field("eval", description="Eval name (metric prefix, record folder).")
    start_delay_secs: float = Field(0.0, description="Delay before the first evaluation.")
    throttle_secs: float = Field(0.0, description="Minimum seconds between evaluations.")
    exporters: list[ExporterSpec] = Field(
        default_factory=list, description="Exporters run after each eval."
    )
    early_stopping: EarlyStopping | None = Field(
        None, description="Stop when a metric stops improving."
    )
    hooks: list[str] = Field(
        default_factory=list,
        description="Eval hooks by import path: before_eval(step) -> bool (False skips), after_eval(result) -> bool (True stops).",
    )
    learning_curve_every_secs: float = Field(
        30.0,
        ge=0,
        description="Draw the MLflow learning-curve image at most this often (the final evaluation always "
        "draws it; 0: at every evaluation). Drawing reads the run's history and renders a PNG: on fast jobs it competes with training.",
    )
    registered_model: str | None = Field(
        None, description="MLflow registered model of the exports (None: the job's name; '': none)."
    )
    export_platforms: list[str] | None = Field(
        None,
        description=f"Platforms the exported model runs on, of {', '.join(EXPORT_PLATFORMS)}. None: all of "
        "them, less those serve() does not lower for (a warning names them).",
    )

    @property
    def registers_exports(self) -> bool:
        """Whether an evaluator with this spec registers exports in the MLflow registry: it has
        exporters and a registered model (`registered_model` "" is none)."""
        return bool(self.exporters) and self.registered_model != ""

    @field_validator("steps")
    @classmethod
    def _steps(cls, v):
        return _positive(
            "steps", v, "give the number of eval batches, or None for the whole eval set", True
        )

    @field_validator("name")
    @classmethod
    def _name(cls, v):
        if v in RESERVED_EVAL_NAMES:  # their metrics would mix with the evaluation's in MLflow
            raise ValueError(
                f"eval name {v!r} is taken: its metrics would be logged as '{v}/<metric>', among others' (prefect-jax "
                "logs the train metrics as train/... and the goodput as goodput/..., MLflow its system metrics as "
                "system/...); give the evaluation another name, e.g. 'eval' (the default) or 'validation'"
            )
        return check_name("eval name", v)

    @field_validator("start_delay_secs", "throttle_secs")
    @classmethod
    def _non_negative(cls, v, info):
        if v is None or v < 0:
            raise ValueError(f"{info.field_name}={v!r} must be >= 0 seconds; use 0 for no delay")
        return v

    @field_validator("export_platforms")
    @classmethod
    def _platforms(cls, v):
        if v is None:
            return v
        bad = [p for p in v if p not in EXPORT_PLATFORMS]
        if bad or not v:
            raise ValueError(
                f"export_platforms={v!r}: {'unknown platform(s) ' + repr(bad) if bad else 'an empty list exports for nowhere'}; "
                f"give some of {list(EXPORT_PLATFORMS)} (jax.export's names: 'cuda' for NVIDIA GPUs, 'rocm' for AMD), "
                "or None for all that serve() lowers for"
            )
        return list(dict.fromkeys(v))

    @model_validator(mode="after")
    def _unique_exporters(self):
        names = [e.name for e in self.exporters]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(
                f"exporters share the name(s) {dupes}: each exporter writes under exports/<name>/, "
                "so give each a distinct name= (e.g. LatestExporter(name='latest'), BestExporter(name='best'))"
            )
        return self


class RetrySpec(_Spec):
    """How often a failed task run is retried, by kind of task (Prefect's `retries` and
    `retry_delay_seconds`). Only failures a retry can fix are retried at all (an I/O error, a
    timeout, a preemption: `prefect_jax.training.errors.is_transient`); a job trained by several
    JAX processes retries no training task (its processes are rerun together).

    Args:
        retries: retries of the training tasks (``restore_or_init``, ``train_until_checkpoint``).
        eval_retries: retries of ``evaluate_if_new`` and ``export``.
        retry_delay_seconds: seconds between a failure and its retry.
    """

    retries: int = Field(2, description="Retries of restore_or_init and train_until_checkpoint.")
    eval_retries: int = Field(1, description="Retries of evaluate_if_new and export.")
    retry_delay_seconds: float = Field(2.0, description="Seconds between a failure and its retry.")

    @field_validator("retries", "eval_retries", "retry_delay_seconds")
    @classmethod
    def _not_negative(cls, v, info):
        if v < 0:
            raise ValueError(f"{info.field_name}={v!r} must be 0 or more; 0 turns retries off")
        return v


class JobConfig(_Spec):
    """Everything that defines one training job; JSON-able, so it travels as a flow parameter.

    Args:
        program: import path of the program, ``"package.module:attribute"``.
        job: job name; the job's files live under ``<storage>/<job>/``.
        storage: storage root (local directory or URL).
        train: the TrainSpec.
        eval: the EvalSpec.
        checkpoint: the CheckpointSpec.
        retry: the RetrySpec (how often the tasks retry).
        mlflow_tracking_uri: MLflow tracking URI (None: ``MLFLOW_TRACKING_URI`` or
            ``sqlite:///mlflow.db`` in the working directory).
        mlflow_experiment: MLflow experiment name.
        compilation_cache_dir: JAX's persistent compilation cache directory, or ``"job"``
            for one under the job's storage. A URL (object storage) is mirrored in a local
            directory that JAX uses (`prefect_jax.training.compile_cache`); it is opened with
            ``storage_options`` where it is on the storage's file system (s3 with s3, ...).
    """

    program: str
    job: str
    storage: str
    train: TrainSpec
    eval: EvalSpec = Field(default_factory=EvalSpec)
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec)
    retry: RetrySpec = Field(default_factory=RetrySpec)
    mlflow_tracking_uri: str | None = None
    mlflow_experiment: str = "prefect-jax"
    storage_options: dict[str, Any] = Field(
        default_factory=dict,
        exclude=True,
        repr=False,
        description="fsspec options for the storage (may hold secrets: never serialized, logged or recorded).",
    )
    compilation_cache_dir: str | None = Field(
        None,
        description="JAX persistent compilation cache: a directory or URL, or 'job' for <storage>/<job>/compile-cache, "
        "so a resumed run does not recompile (on object storage, also on another machine).",
    )

    @field_validator("job")
    @classmethod
    def _job(cls, v):
        return check_name("job", v)

    def fingerprint(self) -> str:
        """Hash of the specs that shape the training trajectory (not cadence of logs or evals)."""
        import hashlib
        import json

        blob = json.dumps({"program": self.program, "seed": self.train.seed}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


__all__ = [
    "EarlyStopping",
    "JobConfig",
    "BestExporter",
    "CheckpointSpec",
    "EvalSpec",
    "ExporterSpec",
    "FinalExporter",
    "LatestExporter",
    "RetrySpec",
    "TrainSpec",
    "check_name",
]
