"""Errors of the engine, and which of them a retry can fix.

Transient failures (I/O, preemption, a lost lease race) are worth retrying from the newest
checkpoint; permanent ones (a bad program, a checkpoint that does not fit, a NaN loss, a job
someone else is training, memory run out) fail at once, with a message that says what to fix.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator


def and_its_causes(exc: BaseException | None, limit: int = 8) -> Iterator[BaseException]:
    """`exc`, then the exception it was raised from or while handling, and so on (`limit` at most:
    a chain set by hand can loop)."""
    for _ in range(limit):
        if exc is None:
            return
        yield exc
        exc = exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)


def out_of_memory(exc: BaseException) -> bool:
    """Whether `exc`, or an error it was raised from, says the host or a device ran out of memory
    (`MemoryError`; XLA's ``RESOURCE_EXHAUSTED`` saying so, not a storage's rate limit)."""
    return any(
        isinstance(e, MemoryError)
        or (str(e).startswith("RESOURCE_EXHAUSTED") and _OUT_OF_MEMORY_WORDS.search(str(e)))
        for e in and_its_causes(exc)
    )


# How XLA says it: "Out of memory while trying to allocate" (GPU), "Ran out of memory in memory
# space hbm" (TPU), "Failed to allocate request for 1.00GiB" (a device allocator).
_OUT_OF_MEMORY_WORDS = re.compile(r"out of memory|failed to allocate", re.IGNORECASE)


# What a run that ran out of memory is told (it is not retried: the same step in the same
# process needs the same memory).
OUT_OF_MEMORY_FIX = (
    "out of memory: a retry would need the same memory, so none is made. Lower the batch size "
    "(gradient accumulation keeps the batch the optimizer sees), shard the state over more "
    "devices (the program's mesh: docs/program.md#sharding), or pass --no-device-copy where "
    "the checkpoints' copy on the device tipped it over"
)


def said(cause: BaseException) -> str:
    """``"TypeName: its first line"`` (at most 400 characters of it), for a message that names
    the error it wraps."""
    first = str(cause).splitlines()[0][:400] if str(cause) else ""
    return f"{type(cause).__name__}: {first}"


class CheckpointMismatchError(ValueError):
    """A checkpoint's tree differs from the tree the program's `init` builds; `leaves`: the
    differing leaves as listed (for a refusal that words its advice otherwise: a warm start's)."""

    def __init__(self, message: str, leaves: str = ""):
        super().__init__(message)
        self.leaves = leaves


class CheckpointSaveError(OSError):
    """A checkpoint save failed (a full disk, a write error): its step did not commit.

    An OSError, so the train task's retries resume from the newest committed step, which succeeds
    once the storage takes writes again."""

    def __init__(self, step: int | None, directory: str, cause: BaseException):
        self.step, self.directory = step, directory
        super().__init__(
            f"saving checkpoint step {step} to {directory} failed ({said(cause)}): step {step} "
            "did not commit, and no later step counts. Free space on the "
            "storage (or fix what refused the write) and run the job again: it resumes from its "
            "newest committed step (the train task's retries do so once the storage takes writes)."
        )


class RestoreFailedError(RuntimeError):
    """A committed step failed to restore for a cause that is the run's, not the step's (device
    memory, this machine's libraries or storage, another layout of processes), `why` says how
    that is known. So the step is neither set aside nor passed over for an older one: doing so
    would throw away saved progress for a cause that the next step would meet too. A retry is
    decided by the cause (`is_transient`)."""

    def __init__(self, step_dir: str, cause: BaseException, why: str):
        self.step_dir, self.cause = step_dir, cause
        super().__init__(
            f"checkpoint {step_dir} did not restore ({said(cause)}), and {why}. Nothing was set "
            "aside: fix the cause (device memory, the machine's libraries or storage) and run "
            f"the job again, and it resumes from this step; if the step itself is bad, move "
            f"{step_dir} aside by hand to resume from the one before."
        )


class IntactStepRestoreError(RestoreFailedError):
    """`RestoreFailedError` of a step whose files match the checksums of its commit."""

    def __init__(self, step_dir: str, cause: BaseException):
        why = "the step is intact (its files match the checksums of its commit)"
        super().__init__(step_dir, cause, why)


class EvalHookError(RuntimeError):
    """An eval hook raised. Not retried: a retry would find its step already recorded and never
    call the hook on it again (TF's evaluator ends on a listener's exception too)."""

    def __init__(self, name: str, step: int | None, exc: BaseException):
        super().__init__(
            f"eval hook {name} raised {type(exc).__name__}: {exc} (step {step}, its evaluation "
            "recorded); fix the hook and run the job again: evaluation goes on from the next "
            "step, training from its newest checkpoint"
        )


class NonFiniteLossError(FloatingPointError):
    """Training produced a NaN or Inf metric; the state of that step is not checkpointed."""

    def __init__(
        self,
        step: int,
        metrics: dict[str, float],
        last_checkpoint: int | None,
        warm_started: bool = False,
    ):
        self.step, self.metrics, self.last_checkpoint = step, metrics, last_checkpoint
        # (`metrics`: the means logged at the first log point from that step on)
        shown = ", ".join(f"{k}={v}" for k, v in sorted(metrics.items()))
        if last_checkpoint is not None:
            rerun = f"a rerun resumes from its newest checkpoint, step {last_checkpoint}"
        elif warm_started:
            rerun = "no step of the job is committed: a rerun warm-starts again (checkpoint_path)"
        else:
            rerun = "no step of the job is committed: a rerun starts from init"
        super().__init__(
            f"non-finite training metric at step {step} (the means logged from it: {shown}); "
            "training stopped and this state was not checkpointed. Lower the learning rate, add "
            f"gradient clipping, or check the input data near this step; {rerun}."
        )


class LeaseHeldError(RuntimeError):
    """Another trainer holds this job's lease."""

    def __init__(self, job_dir: str, owner: dict, timeout_secs: float):
        self.owner = owner
        # (the owner's own heartbeat; a record without one, or none read, counts as fresh)
        age_secs = max(0.0, time.time() - float(owner.get("heartbeat") or time.time()))
        who = ", ".join(
            f"{k}={owner.get(k)}"
            for k in ("flow_run_id", "host", "pid")
            if owner.get(k) is not None
        )
        if owner.get("torn"):  # (`Lease.read`: a lease file that is not JSON)
            who = (
                f"unknown: its lease file {owner['torn']} is torn (not JSON), held until it goes "
                "stale"
            )
        # (a holder killed on another machine: a rerun there waits this long, not a guess)
        # (the holder's own timeout decides a takeover: `local_processes.holder_gone`)
        limit = float(owner.get("timeout_secs") or timeout_secs)
        left = max(0.0, limit - age_secs)
        super().__init__(
            f"job {job_dir} is being trained by another process ({who}; heartbeat {age_secs:.0f}s "
            "ago). Only one trainer may write a job: wait for it to finish, cancel it, or, if it "
            "is gone, the lease is taken over once its heartbeat is older than "
            f"{limit:.0f}s (in {left:.0f}s: run this again then)."
        )


class JobTrainedHereError(ValueError):
    """Another flow run in this process trains the job (a sweep's trials on a threaded task
    runner, two given one job name): its live trainer is not closed under it."""

    def __init__(self, job_dir: str, flow_run_id: str):
        super().__init__(
            f"job {job_dir} is being trained in this process by flow run {flow_run_id}: one "
            "trainer per job. Give each run its own job name (a sweep: one per trial), or run "
            "this one when that one has ended; nothing was changed"
        )


class LeaseLostError(LeaseHeldError):
    """Another trainer took this job's lease over while this process trained it: this process
    stops before its next write, so that one trainer writes the job."""

    def __init__(self, job_dir: str, owner: dict, why: str | None = None):
        self.owner = owner
        who = ", ".join(
            f"{k}={owner.get(k)}"
            for k in ("flow_run_id", "host", "pid")
            if owner.get(k) is not None
        )
        why = why or (
            f"another trainer took it over ({who})"
            if who
            else "its lease file is gone (another trainer took it and ended)"
        )
        RuntimeError.__init__(
            self,
            f"job {job_dir} is no longer this process's to train: {why}"
            + " while this process trained it. This process stopped before its next write and "
            "leaves the job to that trainer, which resumes from the newest committed step. A "
            "lease is taken over when its heartbeat is older than lease_timeout_secs (the storage "
            "was unreachable or the process stalled that long), or by a rerun of the same flow "
            "run on another machine; that trainer's run shows the job's progress.",
        )


class JobDirectoryGoneError(LeaseLostError):
    """The job's directory disappeared while this process trained it (a storage unmounted or
    deleted; perhaps back since, empty or another one): this process writes nothing more there."""

    def __init__(self, job_dir: str, why: str):
        self.owner = {}
        RuntimeError.__init__(
            self,
            f"job {job_dir}: {why} while this process trained it. This process stopped and "
            "writes nothing more there (no checkpoint, record or export into a directory that is "
            "not the one it found). Check the storage (a mount that dropped, a directory deleted "
            "or replaced), then run the job again: it resumes from the newest committed step it "
            "finds there.",
        )


class PastMaxStepsError(ValueError):
    """The job has already committed a step past the `max_steps` asked for."""

    def __init__(self, job_dir: str, committed: int, max_steps: int, warm_start: str = ""):
        self.committed, self.max_steps = committed, max_steps
        if warm_start:  # (a new job's checkpoint_path: another job's step, kept as TF's session)
            super().__init__(
                f"max_steps={max_steps} is below step {committed} of the warm start's "
                f"checkpoint_path {warm_start}: a warm start keeps its step (as TF's "
                "SessionManager.prepare_session keeps global_step), so job "
                f"{job_dir} would train nothing, and nothing was changed. Pass a max_steps "
                f"(--max-steps) above {committed} ({committed + max_steps} for {max_steps} steps "
                "from it)."
            )
            return
        super().__init__(
            f"max_steps={max_steps} is below step {committed}, already committed by job {job_dir}: "
            "there is nothing to train, and nothing was changed. Pass a max_steps (--max-steps) "
            f"above {committed} to train on, or another job name (--job) to start over."
        )


class StorageNotWritableError(PermissionError):
    """The job's storage refuses writes (permissions, a read-only mount, credentials)."""

    def __init__(self, root: str, cause: BaseException):
        super().__init__(
            f"storage {root} is not writable by this process ({type(cause).__name__}: {cause}); "
            "nothing was written there. Give a storage (--storage) this user can write to, or fix "
            "its permissions or credentials."
        )


class FinalEvaluationMissingError(RuntimeError):
    """Local mode trained to max_steps, but the final step's evaluation was not recorded: as TF's
    train_and_evaluate, which raises when training ends without an evaluated final checkpoint."""

    def __init__(self, job: str, step: int):
        self.job, self.step = job, step
        super().__init__(
            f"job {job!r} trained to its final step {step}, but that step's evaluation was not "
            "recorded (the log above says why), so the job has no final metrics or final export. "
            f"Run the flow again: it restores step {step}, evaluates and exports it, and ends."
        )


class NoFirstCheckpointError(TimeoutError):
    """An evaluator waited for its job's first committed checkpoint, and none came
    (TF's `wait_for_session` timing out): the message names where it looked and what to check."""


class NoProgressError(RuntimeError):
    """The job was rerun too many times in a row without getting past a step."""


class ExportFailedError(RuntimeError):
    """An export made in the background failed, and again when tried once more on the training
    thread (see `Trainer.export_in_background`). Not retried by the task: this process raises it
    at every later save and export, so a retry would only train an interval to fail again; the
    rerun resumes from the newest committed step (no step commits over the failed one) and
    exports it first."""


class Preempted(Exception):
    """Training was interrupted by a preemption notice after checkpointing the step in flight.
    `committed`: None when no checkpoint was being written (a notice before the first save, or
    in a restore)."""

    def __init__(
        self, step: int, committed: bool | None, signum: int | None = None, by_another=False
    ):
        self.step, self.committed, self.signum = step, committed, signum
        # the notice was another JAX process's (`PreemptionGuard.adopt`): this one's caller raises
        # it on as its own SIGTERM would (`prefect_jax.tasks.notices.call`)
        self.by_another = by_another
        what = (
            "no checkpoint was being written"
            if committed is None
            else f"the checkpoint of step {step} "
            + ("committed" if committed else "could not be committed within the grace period")
        )
        super().__init__(f"preempted at step {step} (signal {signum}); {what}")


class EvalOutputError(ValueError):
    """The program's eval_step returns no dict of (sum, count) pairs: every retry would too."""


class EndlessEvalDataError(ValueError):
    """The program's eval_data() never ends and the evaluation reads all of it: every retry
    would wait as long."""


# Errors no task retries, evaluations and exports included: an eval hook's (its step is
# recorded: a retry would never call the hook there again), a failed export's (this process
# raises it at every later export), an eval_step output's and an endless eval_data's.
NEVER_RETRIED = (EvalHookError, ExportFailedError, EvalOutputError, EndlessEvalDataError)

# Errors a retry cannot fix: the program, the config or the data is wrong.
PERMANENT = (
    *NEVER_RETRIED,
    NonFiniteLossError,
    NoProgressError,
    LeaseHeldError,
    ValueError,  # includes ProgramError, CheckpointMismatchError, pydantic's ValidationError
    TypeError,
    AttributeError,
    KeyError,
    ImportError,
    NotImplementedError,
)


def is_transient(exc: BaseException) -> bool:
    """True when retrying from the newest checkpoint may succeed (I/O errors, preemption,
    timeouts...); not for a program, config or data that is wrong, nor out of memory."""
    if isinstance(exc, StorageNotWritableError):
        return False
    if isinstance(exc, RestoreFailedError):
        return is_transient(exc.cause)
    if out_of_memory(exc):
        return False
    if isinstance(exc, (OSError, TimeoutError, ConnectionError, Preempted)):
        return True
    return not isinstance(exc, PERMANENT)
