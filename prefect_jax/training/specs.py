"""Specs: what to train, how often to checkpoint, how to retry, and the job that holds them.

Plain pydantic models with TensorFlow's names where they fit (`max_steps`, `steps`,
`start_delay_secs`, `throttle_secs`, `exporters`). They are JSON-able, so a Prefect
deployment can carry them as parameters. Bad values are refused at construction with a
message that names the field, the value and the fix.

The evaluation specs (`EvalSpec`, the exporters, `EarlyStopping`) live in
`prefect_jax.training.eval_specs` and `RetrySpec` in `prefect_jax.training.retry_spec`; both are
re-exported here: import every spec from this module.

This module imports neither jax nor prefect.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator, model_validator

from prefect_jax.training.eval_specs import (
    EXPORT_PLATFORMS,
    BestExporter,
    EarlyStopping,
    EvalSpec,
    ExporterSpec,
    FinalExporter,
    LatestExporter,
    flow_registers_exports,
)
from prefect_jax.training.names import DEFAULT_EXPERIMENT
from prefect_jax.training.retry_spec import RetrySpec
from prefect_jax.training.spec_base import Spec, check_name, positive
from prefect_jax.training.train_hooks import TrainHook

# The waits' defaults, of every function, flow and flag that takes them: TF's SessionManager's
# (wait_for_checkpoint's max_wait_secs, recovery_wait_secs), and the evaluator role's for its
# first checkpoint and between looks for a new one.
MAX_WAIT_SECS, RECOVERY_WAIT_SECS = 7200.0, 30.0
FIRST_CHECKPOINT_WAIT_SECS, EVAL_POLL_SECS = 3600.0, 10.0


class TrainSpec(Spec):
    """How long to train.

    Args:
        max_steps: train until the global step reaches this number (as in
            `tf.estimator.TrainSpec`). None trains until stopped, as TF's: a stop request
            (`<job>/stop.json`, early stopping, an eval hook), a preemption or the user's cancel
            ends it; there is no final step (no `FinalExporter` export, no final evaluation
            required), and a rerun resumes from the newest checkpoint.
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
        check_finite: stop at a NaN or Inf loss (`NonFiniteLossError`, naming the step),
            checked at each log point and before each checkpoint, so no such state is saved.
        sigterm_grace_secs: on SIGTERM, how long the checkpoint of the step in flight may take
            before it is abandoned (keep it under the platform's own grace period).
        lease_timeout_secs: a job's lease whose heartbeat is older than this is taken over by
            a new trainer (the old one is gone); a live holder beats every quarter of it.
        max_reruns_without_progress: refuse to train after this many reruns in a row that
            started at the same step (a crash loop a rerun automation would feed); None: no
            limit.
        hooks: TF's `TrainSpec.hooks`, by import path (`TrainHook`, or its string form
            ``"pkg.mod:fn@every=N"``): called every N steps, at each checkpoint, at the end,
            in every process; they observe and never change the state (docs/program.md).
    """

    max_steps: int | None = Field(
        description="Train until the global step reaches this number (None: until stopped)."
    )
    seed: int = Field(0, description="Seed for init and for the training data order.")
    log_every_steps: int = Field(50, description="Log train metrics to MLflow every N steps.")
    steps_per_dispatch: int = Field(
        1,
        description="Steps per device call: K>1 runs K steps in one jitted lax.scan (same "
        "checkpoints; equal up to float reassociation).",
    )
    check_finite: bool = Field(
        True,
        description="Stop at a NaN/Inf loss (checked every log_every_steps and before each "
        "checkpoint).",
    )
    sigterm_grace_secs: float = Field(
        25.0,
        description="On SIGTERM, how long the checkpoint of the step in flight may take "
        "before it is abandoned.",
    )
    lease_timeout_secs: float = Field(
        120.0,
        description="A job's lease whose heartbeat is older than this is taken over by a new "
        "trainer.",
    )
    max_reruns_without_progress: int | None = Field(
        3,
        description="Refuse to train after this many reruns in a row started at the same "
        "step (None: no limit).",
    )
    hooks: list[TrainHook] = Field(
        default_factory=list,
        description="Train hooks by import path: 'pkg.mod:fn@every=N' (or checkpoint, end), "
        "called with a read-only view of the step, metrics and state.",
    )

    @field_validator("max_steps")
    @classmethod
    def _max_steps(cls, v):
        return positive(
            "max_steps",
            v,
            "set it to the total number of training steps, e.g. max_steps=1000, or None to "
            "train until stopped",
            allow_none=True,
        )

    def is_final(self, step: int | None) -> bool:
        """Whether `step` is the final one: at or past `max_steps` (never when it is None)."""
        return is_final_step(step, self.max_steps)

    @field_validator("seed")
    @classmethod
    def _seed(cls, v):  # (the range of Grain's shuffles: another failed in the first interval)
        if not 0 <= v < 2**32:
            raise ValueError(f"seed={v!r} must be between 0 and 2**32-1 ({2**32 - 1}), e.g. 0")
        return v

    @field_validator("max_reruns_without_progress")
    @classmethod
    def _reruns(cls, v):
        if v is not None and v < 0:
            raise ValueError(f"max_reruns_without_progress={v!r} must be 0 or more, or None")
        return v

    @field_validator("log_every_steps")
    @classmethod
    def _log_every(cls, v):
        return positive("log_every_steps", v, "log every N>=1 steps, e.g. log_every_steps=50")

    @field_validator("steps_per_dispatch")
    @classmethod
    def _per_dispatch(cls, v):
        return positive(
            "steps_per_dispatch",
            v,
            "use 1 for one step per call, or K>1 to scan K steps per call, e.g. 10",
        )

    @field_validator("sigterm_grace_secs")
    @classmethod
    def _grace(cls, v):
        return positive(
            "sigterm_grace_secs",
            v,
            "give the seconds a preempted node has to save (e.g. 25 on a 30 s notice)",
        )

    @field_validator("lease_timeout_secs")
    @classmethod
    def _lease(cls, v):
        return positive(
            "lease_timeout_secs",
            v,
            "give the seconds after which a silent trainer's lease is taken over, e.g. 120",
        )


def is_final_step(step: int | None, max_steps: int | None) -> bool:
    """Whether `step` is at or past `max_steps`: the final step (TF's `is_the_final_export`). A
    job with ``max_steps=None`` trains until stopped and has no final step."""
    return step is not None and max_steps is not None and step >= max_steps


class CheckpointSpec(Spec):
    """When to write checkpoints and which to keep.

    A checkpoint is written when either cadence is reached (whichever comes first), and
    always at `max_steps`. Retention follows Orbax: the newest `keep_last` steps are kept, plus
    every multiple of `keep_every_steps`, plus the oldest of each `keep_every_secs` window.
    The decisions are `prefect_jax.training.policy.CheckpointPolicy.from_spec(spec, max_steps)`'s.

    Args:
        every_steps: write a checkpoint every this many steps.
        every_secs: write a checkpoint when this many seconds passed since the last one (or the
            restore), not counting a new process's first dispatch (its compile included).
        keep_last: how many of the newest checkpoints to keep (None keeps all).
        keep_every_steps: also keep every checkpoint whose step is a multiple of this.
        keep_every_secs: also keep, for good, the oldest checkpoint saved in each window of
            this many seconds of wall-clock time (TF's ``keep_checkpoint_every_n_hours`` times
            3600), by the time each step's metadata records.
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
        device_copy: at each save, copy the state on its own devices and give the copy to Orbax
            on a thread, so that training goes on while it is copied to the host
            (`prefect_jax.training.save_handoff`). It holds a second copy of the state in device
            memory until Orbax has it. None (the default): with one JAX process on a GPU or TPU,
            on where, at the first save, a copy fits beside the process's peak use of device
            memory so far (with a tenth of the device's memory to spare; said in a warning where
            not; devices that keep no memory statistics take it); off on a CPU (where there is
            no transfer to wait for) and with several processes (True is refused there). True:
            on whatever the memory; False: off.
    """

    every_steps: int | None = Field(1000, description="Checkpoint every N steps.")
    every_secs: float | None = Field(None, description="Checkpoint every N seconds.")
    keep_last: int | None = Field(3, description="Keep the newest N checkpoints (None: all).")
    keep_every_steps: int | None = Field(
        None, description="Also keep steps that are multiples of N."
    )
    keep_every_secs: float | None = Field(
        None, description="Also keep the oldest step of each N-second window, for good."
    )
    keep_until_evaluated: bool | None = Field(
        None,
        description="Keep steps the evaluator has not reached yet (None: on for the train "
        "role only).",
    )
    backups: bool = Field(
        True,
        description="After kills without notice, also write resume-only backups at the "
        "Young/Daly interval.",
    )

    device_copy: bool | None = Field(
        None,
        description="Copy the state on its devices at each save and save the copy on a thread "
        "(None: on for one process on a GPU or TPU where a copy fits in device memory).",
    )

    @field_validator("every_steps")
    @classmethod
    def _every_steps(cls, v):
        return positive(
            "every_steps",
            v,
            "checkpoint every N>=1 steps, or by time only: every_steps=None with every_secs "
            "(--checkpoint-every-steps none --checkpoint-every-secs N)",
            True,
        )

    @field_validator("every_secs")
    @classmethod
    def _every_secs(cls, v):
        return positive(
            "every_secs",
            v,
            "give a positive number of seconds, or None to checkpoint by steps only",
            True,
        )

    @field_validator("keep_last")
    @classmethod
    def _keep_last(cls, v):
        return positive("keep_last", v, "keep at least 1 checkpoint, or None to keep all", True)

    @field_validator("keep_every_steps")
    @classmethod
    def _keep_every(cls, v):
        return positive("keep_every_steps", v, "give a positive step period, or None", True)

    @field_validator("keep_every_secs")
    @classmethod
    def _keep_every_secs(cls, v):
        return positive("keep_every_secs", v, "give a positive number of seconds, or None", True)

    @model_validator(mode="after")
    def _some_cadence(self):
        if self.every_steps is None and self.every_secs is None:
            raise ValueError(
                "every_steps=None and every_secs=None: no checkpoint would ever be written "
                "before max_steps; set every_steps (e.g. 1000) or every_secs (e.g. 600)"
            )
        return self


class JobConfig(Spec):
    """Everything that defines one training job; JSON-able, so it travels as a flow parameter.

    Args:
        program: import path of the program, ``"package.module:attribute"``.
        program_params: the program's typed parameters, for a program path naming a factory
            whose one parameter is a pydantic model or a dataclass (see
            `prefect_jax.training.program_params`); None for none.
        job: job name; the job's files live under ``<storage>/<job>/``.
        storage: storage root (local directory or URL).
        storage_name: the storage block it came from (``jax-checkpoint-storage/<name>``), or None.
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
    program_params: dict[str, Any] | None = Field(
        None,
        description="The program's parameters (its factory's typed parameter, as a dict); "
        "recorded in checkpoints and MLflow, checked when the job resumes.",
    )
    job: str
    storage: str
    storage_name: str | None = Field(
        None,
        description="The storage as the user named it, where that is a Prefect block "
        "(jax-checkpoint-storage/<name>) whose URL `storage` holds: hints that name the "
        "storage show it, since the block carries the endpoint and keys.",
    )
    train: TrainSpec
    eval: EvalSpec = Field(default_factory=EvalSpec)
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec)
    retry: RetrySpec = Field(default_factory=RetrySpec)
    mlflow_tracking_uri: str | None = None
    mlflow_experiment: str = DEFAULT_EXPERIMENT
    storage_options: dict[str, Any] = Field(
        default_factory=dict,
        exclude=True,
        repr=False,
        description="fsspec options for the storage (may hold secrets: never serialized, "
        "logged or recorded).",
    )
    compilation_cache_dir: str | None = Field(
        None,
        description="JAX persistent compilation cache: a directory or URL, or 'job' for "
        "<storage>/<job>/compile-cache, "
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

        shape = {"program": self.program, "seed": self.train.seed}
        if self.program_params:  # (jobs without params keep the fingerprint they had)
            shape["program_params"] = self.program_params
        blob = json.dumps(shape, sort_keys=True, default=repr)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


__all__ = [
    "EXPORT_PLATFORMS",
    "EarlyStopping",
    "JobConfig",
    "BestExporter",
    "CheckpointSpec",
    "EvalSpec",
    "ExporterSpec",
    "FinalExporter",
    "LatestExporter",
    "RetrySpec",
    "TrainHook",
    "TrainSpec",
    "check_name",
    "flow_registers_exports",
    "is_final_step",
]
