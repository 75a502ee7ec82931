"""The engine: restore-or-init, train to the next checkpoint, evaluate, export.

A `Trainer` holds one job's live train state in this process between checkpoint intervals,
so an interval does not re-read the checkpoint it just wrote. A retry, a rerun or another
process restores from storage. This module never imports prefect: call it from a notebook.

Example:
    ```python
    from prefect_jax.training import JobConfig, TrainSpec, CheckpointSpec, Trainer

    config = JobConfig(program="prefect_jax.examples.digits:program", job="digits",
                       storage="/tmp/runs", train=TrainSpec(max_steps=600),
                       checkpoint=CheckpointSpec(every_steps=200))
    trainer = Trainer(config)
    trainer.restore_or_init()
    while trainer.step < config.train.max_steps:
        trainer.train_until_checkpoint()
        print(trainer.evaluate().metrics)
    trainer.close()
    ```
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import threading
import time
from typing import Any, Callable

import grain
import jax

from prefect_jax.training import exporters as exp
from prefect_jax.training.checkpoints import (
    CheckpointMismatchError,
    Checkpoints,
    CorruptCheckpointError,
    committed_steps,
    is_committed,
    step_dirs,
    state_fingerprint,
    wait_for_new_checkpoint,
)
from prefect_jax.training import control
from prefect_jax.training.errors import NonFiniteLossError, Preempted
from prefect_jax.training.evaluation import EvalRecords, EvalResult, EvalStatus, aggregate, throttled
from prefect_jax.training.program import ProgramError, has_serving, load_program, program_fingerprint
from prefect_jax.training.specs import JobConfig
from prefect_jax.training.lease import Lease
from prefect_jax.training.redaction import redact_url
from prefect_jax.training.remote import RemoteSteps
from prefect_jax.training.uploader import AsyncUploader
from prefect_jax.training.storage import JobStorage
from prefect_jax.training.tracking import STORAGE_TAG, Tracker, flatten_params

logger = logging.getLogger("prefect_jax.trainer")

ProgressListener = Callable[[int, int, dict[str, float]], None]
_progress_listeners: list[ProgressListener] = []


def add_progress_listener(fn: ProgressListener) -> Callable[[], None]:
    """Call ``fn(step, max_steps, last_metrics)`` as training advances; returns a remover."""
    _progress_listeners.append(fn)
    return lambda: _progress_listeners.remove(fn) if fn in _progress_listeners else None


def guard_int(value: int):
    """An int32 scalar for the step guard: a numpy scalar, so making one dispatches nothing."""
    import numpy as np

    return np.int32(value)


def enable_compilation_cache(directory: str) -> None:
    """Turn on JAX's persistent compilation cache in `directory` (every compile is cached)."""
    if "://" not in directory:
        os.makedirs(directory, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def _iterate(dataset, read_options=None):
    """An iterator (with get_state/set_state) over a Grain MapDataset (read with `read_options`,
    default Grain's) or IterDataset."""
    if hasattr(dataset, "to_iter_dataset"):
        dataset = dataset.to_iter_dataset(read_options) if read_options is not None else dataset.to_iter_dataset()
    return iter(dataset)


def restore_or_init(
    checkpoints: Checkpoints | None,
    init: Callable[[], Any],
    abstract_state,
    *,
    checkpoint_dir: str | None = None,
    checkpoint_path: str | None = None,
    make_data_iter: Callable[[], Any] | None = None,
    wait_for_checkpoint: bool = False,
    max_wait_secs: float = 7200,
    recovery_wait_secs: float = 30,
    on_unreadable: Callable[[int, BaseException], None] | None = None,
    list_steps: Callable[[], list[int]] | None = None,
    prepare_step: Callable[[int], None] | None = None,
    log: Callable[[str], None] = logger.info,
) -> tuple[Any, int, dict | None, Any]:
    """`SessionManager.prepare_session` for a JAX train state.

    Restores the latest committed step under `checkpoint_dir`, or the one step at
    `checkpoint_path`; with neither (or nothing committed yet), runs `init`. A newest step
    that cannot be read (truncated or missing files) is skipped with a warning naming it,
    and the next newer committed step is tried: partial state is never restored.

    Args:
        checkpoints: the job's `Checkpoints` (used for `checkpoint_dir`).
        init: builds a fresh state.
        abstract_state: ``jax.eval_shape`` of `init`: the structure a restore must match.
        checkpoint_dir: restore the latest committed step in this directory.
        checkpoint_path: restore exactly this step directory (``.../checkpoints/<step>``).
        make_data_iter: builds a fresh Grain iterator whose position is restored with the state.
        wait_for_checkpoint: if no committed step exists yet, wait for one.
        max_wait_secs: how long to wait.
        recovery_wait_secs: how often to look while waiting.
        on_unreadable: called with (step, error) for each step skipped as unreadable.
        list_steps: the committed steps (default: those in `checkpoint_dir`; remote storage
            lists its own).
        prepare_step: makes a step readable in `checkpoint_dir` before its restore (remote
            storage downloads it).

    Returns:
        (state, step, metadata of the restored checkpoint or None after init, data iterator or None).

    Raises:
        ValueError: both `checkpoint_dir` and `checkpoint_path` were given, or
            `checkpoint_path` is not a committed step directory.
        CheckpointMismatchError: the checkpoint's tree differs from `abstract_state`.
    """
    new_iter = make_data_iter or (lambda: None)
    if checkpoint_dir and checkpoint_path:
        raise ValueError(
            f"both checkpoint_dir={checkpoint_dir!r} and checkpoint_path={checkpoint_path!r} were given: "
            "pass checkpoint_dir to resume from its latest checkpoint, or checkpoint_path to restore one step, not both"
        )
    if checkpoint_path:
        path = checkpoint_path.rstrip("/")
        parent, name = os.path.split(path)
        if not name.isdigit() or int(name) not in committed_steps(parent):
            raise ValueError(
                f"checkpoint_path={checkpoint_path!r} is not a committed checkpoint step directory; "
                f"committed steps in {parent!r}: {committed_steps(parent)}. Point it at '<checkpoints>/<step>'."
            )
        source = Checkpoints(parent, read_only=True)
        try:
            data_iter = new_iter()
            state, meta = source.restore(int(name), abstract_state, data_iter)
        finally:
            source.close()
        log(f"restored step {name} from {path}")
        return state, int(name), meta, data_iter
    if checkpoint_dir:
        assert checkpoints is not None and checkpoints.directory == checkpoint_dir
        list_steps = list_steps or checkpoints.committed_steps
        if not list_steps() and wait_for_checkpoint:
            wait_for_new_checkpoint(list_steps, None, max_wait_secs, recovery_wait_secs, log)
        for step in reversed(list_steps()):
            data_iter = new_iter()
            try:
                if prepare_step is not None:
                    prepare_step(step)
                state, meta = checkpoints.restore(step, abstract_state, data_iter)
            except CheckpointMismatchError:
                raise
            except Exception as exc:  # noqa: BLE001 - a damaged step: fall back to the one before
                logger.warning(
                    "checkpoint step %d in %s is unreadable (%s: %s); falling back to the previous committed step",
                    step, checkpoint_dir, type(exc).__name__, str(exc).splitlines()[0][:300] if str(exc) else "",
                )
                if on_unreadable is not None:
                    on_unreadable(step, exc)
                continue
            log(f"restored step {step} from {checkpoint_dir}")
            return state, step, meta, data_iter
        log(f"no committed checkpoint in {checkpoint_dir}: initialising from scratch")
    return init(), 0, None, new_iter()


class _PreemptionGuard:
    """SIGTERM (a preemption notice) while a trainer holds its job, from its restore to its finish
    (main thread only).

    Inside the training loop the signal only sets a flag: the step in flight finishes, the
    trainer checkpoints it and forwards the signal. Inside a save it is held until the save is
    handed to Orbax. Anywhere else (between intervals, during an evaluation, an export or
    Prefect's own bookkeeping) `on_signal` runs at once: it lets the saves in flight commit
    within the grace period, then forwards. Forwarding gives the signal to the handler that was
    there before (Prefect's, which ends the run Crashed or reschedules it; or the default,
    which ends the process).
    """

    def __init__(self, on_signal: Callable[[], None]):
        self.signum: int | None = None
        self.deferring = 0  # > 0 inside the loop or a save: the signal is handled there
        self.handling = False  # someone is handling the signal (a second SIGTERM changes nothing)
        self.active = False  # between install and uninstall: a finished trainer only passes it on
        self._on_signal = on_signal
        self._previous = None

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def installed(self) -> bool:
        return signal.getsignal(signal.SIGTERM) == self._handle

    def install(self) -> None:
        """Put the guard in front of the current SIGTERM handler (again, if someone replaced it)."""
        if threading.current_thread() is threading.main_thread() and not self.installed:
            self._previous = signal.getsignal(signal.SIGTERM)
            signal.signal(signal.SIGTERM, self._handle)
            self.active = True

    def uninstall(self) -> None:
        self.active = False
        if threading.current_thread() is threading.main_thread() and self.installed:
            signal.signal(signal.SIGTERM, self._previous)

    def _handle(self, signum, frame):
        if not self.active:  # left in a chain of handlers by a trainer that has finished
            self._pass_on(signum)
            return
        self.signum = signum
        self.handle_if_pending()

    def handle_if_pending(self) -> None:
        """Run `on_signal` if a signal came and nobody handles it (called after a deferred block)."""
        if self.signum is not None and not self.deferring and not self.handling:
            self.handling = True
            self._on_signal()

    def deferred(self):
        """A block in which the signal is only recorded (checked with `requested` afterwards)."""
        guard = self

        class _Deferred:
            def __enter__(self):
                guard.deferring += 1
                return guard

            def __exit__(self, *exc):
                guard.deferring -= 1
                return False

        return _Deferred()

    def forward(self) -> None:
        """Deliver the signal to the handler that was installed before us."""
        self.uninstall()
        self._pass_on(self.signum)

    def _pass_on(self, signum: int) -> None:
        previous = self._previous
        if callable(previous):
            previous(signum, None)
        elif previous in (signal.SIG_DFL, None):
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            time.sleep(5)  # the default action ends the process


def _guarded_step(train_step: Callable, check_finite: bool) -> Callable:
    """Wrap `train_step` to also count steps and remember the first with a NaN/Inf loss, on the device."""
    import jax.numpy as jnp

    def step(state, batch, guard):
        state, metrics = train_step(state, batch)
        count, first_bad = guard
        count = count + 1
        if check_finite and metrics:
            keys = [k for k in metrics if "loss" in k] or list(metrics)
            finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(metrics[k])) for k in keys]))
            first_bad = jnp.where((first_bad < 0) & ~finite, count, first_bad)
        return state, metrics, (count, first_bad)

    return step


def _scanned(step: Callable) -> Callable:
    """`step(state, batch, guard)` over a leading axis of stacked batches, in one `lax.scan`:
    returns (state, metrics stacked per step, guard)."""

    def run(state, batches, guard):
        def body(carry, batch):
            state, metrics, guard = step(carry[0], batch, carry[1])
            return (state, guard), metrics

        (state, guard), metrics = jax.lax.scan(body, (state, guard), batches)
        return state, metrics, guard

    return run


def _stack(batches: list):
    """K host batches (pytrees of arrays) as one pytree with a leading axis of K."""
    import numpy as np

    return jax.tree.map(lambda *xs: np.stack(xs), *batches)


def _metrics_at(metrics, index: int | None):
    """One step's metrics: as they are (one step per dispatch), or row `index` of a scan's stack."""
    return metrics if index is None else jax.tree.map(lambda m: m[index], metrics)


class Trainer:
    """One job's live training session.

    Args:
        config: the job.
        program: the program object (loaded from ``config.program`` when None).
        run_tags: extra metadata stored in checkpoints and MLflow tags (e.g. the Prefect
            flow-run id, which also names the owner of the job's lease).
    """

    def __init__(self, config: JobConfig, program: Any = None, run_tags: dict[str, str] | None = None):
        self.config = config
        self.program = program if program is not None else load_program(config.program)
        self.storage = JobStorage(config.storage, config.job, config.storage_options)
        if config.compilation_cache_dir:
            enable_compilation_cache(
                self.storage.path("compile-cache") if config.compilation_cache_dir == "job" else config.compilation_cache_dir
            )
        self.remote = None
        self._uploader = None
        checkpoint_spec = config.checkpoint
        if not self.storage.orbax_native:
            # Orbax writes a local stage; steps count once uploaded (marker last). Retention is
            # applied to the remote copy after each upload, not by Orbax to the stage.
            self.remote = RemoteSteps(self.storage.remote_checkpoint_url, self.storage.storage_options)
            checkpoint_spec = checkpoint_spec.model_copy(
                update={"keep_last": None, "keep_every_steps": None, "keep_until_evaluated": None}
            )
        self.records = EvalRecords(self.storage, config.eval.name)
        self.checkpoints = Checkpoints(self.storage.checkpoint_dir, checkpoint_spec, newest_evaluated=self._newest_evaluated)
        self.tracker = Tracker(config.mlflow_tracking_uri, config.mlflow_experiment, self.storage.job_dir)
        self.run_tags = dict(run_tags or {})
        self.lease = Lease(self.storage, timeout_secs=config.train.lease_timeout_secs)
        self.program_fingerprint = program_fingerprint(config.program, self.program)
        if config.eval.exporters and not has_serving(self.program):
            raise ProgramError(
                f"exporters {[e.name for e in config.eval.exporters]} are configured, but program "
                f"{config.program!r} has no serve(state, inputs) and serving_input(): add them, or drop the exporters"
            )
        # The CPU backend cannot donate buffers (it would warn on every compile); GPU/TPU can.
        # The guard is never donated: the loop reads an earlier one after later steps ran.
        donate = (0,) if jax.default_backend() != "cpu" else ()
        guarded = _guarded_step(self.program.train_step, config.train.check_finite)
        self._train_step = jax.jit(guarded, donate_argnums=donate)
        self._scan_steps = jax.jit(_scanned(guarded), donate_argnums=donate)
        self._eval_step = jax.jit(self.program.eval_step)
        self._rng = jax.random.key(config.train.seed)
        self._abstract = None
        self._precompiling: threading.Thread | None = None
        self._evals_reconciled = False
        self._started_from: int | None = None
        devices = jax.devices()
        # On one device (CPU, or one GPU) the state is committed to it, so that the compile done
        # ahead of time (`_start_precompile`) is the one the loop finds; several devices: no precompile.
        self._one_device = jax.sharding.SingleDeviceSharding(devices[0]) if len(devices) == 1 else None
        self.state = None
        self.step: int | None = None
        self.data_iter = None
        self._last_save = time.monotonic()
        self.last_train_metrics: dict[str, float] = {}
        self.commit_listeners: list[Callable[[int], None]] = []
        self._announcers: list[threading.Thread] = []
        self._guard = _PreemptionGuard(self._preempted_between_intervals)
        self.eval_hooks = control.load_hooks(config.eval.hooks)
        es = config.eval.early_stopping
        self.early_stopping = (
            control.EarlyStoppingHook(es.metric, es.mode, es.max_steps_without_improvement, es.min_delta) if es else None
        )

    # -- setup ----------------------------------------------------------------------

    @property
    def abstract_state(self):
        if self._abstract is None:
            self._abstract = jax.eval_shape(self.program.init, self._rng)
        return self._abstract

    def _fresh_iter(self):
        return _iterate(self.program.train_data(self.config.train.seed), getattr(self.program, "read_options", None))

    def restore_or_init(
        self,
        checkpoint_path: str | None = None,
        wait_for_checkpoint: bool = False,
        max_wait_secs: float = 7200,
        recovery_wait_secs: float = 30,
    ) -> int:
        """Take the job's lease, then resume from its latest readable committed step; else from
        `checkpoint_path`; else init.

        Torn steps (never committed) and unreadable ones are moved aside with a warning naming
        the step. Also finds (or creates) the job's MLflow run. Returns the step the state is at.

        Raises:
            LeaseHeldError: another live trainer holds the job.
        """
        self.checkpoints.wait()
        self._acquire_lease()
        self._guard.install()
        self._start_precompile()
        if self.remote is not None:
            self._sync_stage()
        else:
            self.checkpoints.quarantine_uncommitted()
        has_own = bool(self.committed_steps())
        state, step, meta, data_iter = restore_or_init(
            self.checkpoints,
            lambda: self.program.init(self._rng),
            self.abstract_state,
            checkpoint_dir=self.checkpoints.directory if (has_own or not checkpoint_path) else None,
            checkpoint_path=None if has_own else checkpoint_path,
            make_data_iter=self._fresh_iter,
            wait_for_checkpoint=wait_for_checkpoint,
            max_wait_secs=max_wait_secs,
            recovery_wait_secs=recovery_wait_secs,
            on_unreadable=self._unreadable,
            list_steps=self.committed_steps,
            prepare_step=self._fetch if self.remote is not None else None,
        )
        if checkpoint_path and not has_own and step:
            data_iter = self._fresh_iter()  # warm start: weights from elsewhere, this job's data from the start
        self._discard_records_after(step)
        # Attach to MLflow first, so that a refusal below still closes the run as FAILED.
        self._attach_tracking((meta or {}).get("mlflow_run_id"))
        # The restored interval's train metrics, in case its process died before writing them.
        self.tracker.log_new_metrics([tuple(r) for r in (meta or {}).get("train_metrics", [])], exclude_prefix=self._eval_prefix)
        if step < self.config.train.max_steps:
            control.record_attempt(
                self.storage, step, self.config.train.max_reruns_without_progress, self.run_tags.get("prefect.flow_run_id", "")
            )
        if self._one_device is not None:
            state = jax.device_put(state, self._one_device)  # a restored state already is; an initialised one is not
        self.state, self.step, self.data_iter = state, step, data_iter
        self._started_from = step  # committed, or init / a warm start: a rerun gets the same state
        self._last_save = time.monotonic()
        self._notify(step, self.config.train.max_steps, {})
        return step

    def _newest_evaluated(self) -> int | None:
        steps = self.records.steps()
        return steps[-1] if steps else None

    def _discard_records_after(self, step: int) -> None:
        """Eval records of steps past the one training resumes from are of steps that are no
        longer committed (moved aside as torn, unreadable or corrupt, or evaluated by an older
        version before their commit): move them aside, so those steps are evaluated again once
        they are committed again (the same metrics: training is exact)."""
        for later in [s for s in self.records.steps() if s > step]:
            moved = self.records.discard(later, "uncommitted")
            logger.warning("eval record of step %d (%s) is of a step that is not committed: moved aside to %s",
                           later, self.config.eval.name, moved)  # fmt: skip

    def _start_precompile(self) -> None:
        """Compile the train step (and the eval step) for the job's shapes on a background
        thread, so the compile overlaps the restore instead of following it: the first call
        then finds the executable in jit's cache. Only for Grain MapDatasets, whose first
        batch is read by index without starting the pipeline; any failure is left for the
        real call to report."""
        if self._precompiling is not None or self.state is not None or self._one_device is None:
            return
        import numpy as np

        def spec(tree):
            return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype), tree)

        # The state the loop gets is committed to the one device (see restore_or_init): a spec
        # without that sharding would compile an executable the loop never finds.
        state = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=self._one_device), self.abstract_state)

        def compile_steps():
            try:
                train_data = self.program.train_data(self.config.train.seed)
                if isinstance(train_data, grain.MapDataset):
                    batch, guard = spec(train_data[0]), spec((guard_int(0), guard_int(-1)))
                    k = self.config.train.steps_per_dispatch
                    if k == 1:
                        self._train_step.lower(state, batch, guard).compile()
                    else:
                        stacked = jax.tree.map(lambda b: jax.ShapeDtypeStruct((k, *b.shape), b.dtype), batch)
                        self._scan_steps.lower(state, stacked, guard).compile()
                eval_data = self.program.eval_data()
                if isinstance(eval_data, grain.MapDataset):
                    self._eval_step.lower(state, spec(eval_data[0])).compile()
            except Exception:  # noqa: BLE001 - the real call compiles again and reports it
                logger.debug("background compile failed", exc_info=True)

        self.abstract_state  # noqa: B018 - traced here, not in two threads at once
        # Not a daemon: a process must not exit in the middle of an XLA compile (it aborts).
        self._precompiling = threading.Thread(target=compile_steps, name="prefect-jax-compile")
        self._precompiling.start()

    def _join_precompile(self) -> None:
        if self._precompiling is not None:
            self._precompiling.join()

    def committed_steps(self) -> list[int]:
        """The job's committed steps: on its storage (remote steps count once uploaded)."""
        return self.remote.committed_steps() if self.remote is not None else self.checkpoints.committed_steps()

    def _unreadable(self, step: int, exc: BaseException) -> None:
        if self.remote is None:
            self.checkpoints.quarantine(step, "corrupt" if isinstance(exc, CorruptCheckpointError) else "unreadable")
        else:  # drop the local copy; the remote step stays for someone to inspect
            shutil.rmtree(os.path.join(self.checkpoints.directory, str(step)), ignore_errors=True)
            self.checkpoints.manager.reload()

    def _sync_stage(self) -> None:
        """The writer's view of remote storage after a crash: partial uploads are removed, and
        local staged steps that never got uploaded are dropped (they do not count)."""
        pending = set(self._uploader.pending) if self._uploader is not None else set()
        for step in self.remote.delete_uncommitted(keep=lambda s: s in pending):
            logger.warning("checkpoint step %d at %s was never committed: removed", step, self.remote.safe_url)
        committed = set(self.remote.committed_steps())
        for step in step_dirs(self.checkpoints.directory):
            if step not in committed and step not in pending:
                shutil.rmtree(os.path.join(self.checkpoints.directory, str(step)), ignore_errors=True)
        self.checkpoints.manager.reload()

    def _fetch(self, step: int) -> None:
        """Make a committed remote step readable in the local stage (download it unless it is there)."""
        if self.remote is None or step in self.checkpoints.committed_steps():
            return
        self.remote.download(step, self.checkpoints.directory)
        self.checkpoints.manager.reload()

    def _upload_done(self, step: int) -> None:
        """After an upload: apply retention to the remote steps, keep only the newest locally."""
        spec = self.config.checkpoint
        steps = self.remote.committed_steps()
        keep = set(steps[-spec.keep_last :]) if spec.keep_last else set(steps)
        if spec.keep_every_steps:
            keep |= {s for s in steps if s % spec.keep_every_steps == 0}
        if spec.keep_until_evaluated:
            newest = self._newest_evaluated()
            keep |= {s for s in steps if newest is None or s >= newest}
        for old in steps:
            if old not in keep and old != step:
                self.remote.delete(old)
        for old in step_dirs(self.checkpoints.directory):
            if old < step and old not in self._uploader.pending:
                shutil.rmtree(os.path.join(self.checkpoints.directory, str(old)), ignore_errors=True)

    @property
    def uploader(self) -> AsyncUploader | None:
        if self.remote is not None and self._uploader is None:
            self._uploader = AsyncUploader(self.remote, on_uploaded=self._upload_done)
        return self._uploader

    def _acquire_lease(self) -> None:
        self.lease.owner_id = self.run_tags.get("prefect.flow_run_id")
        self.lease.acquire()

    def _attach_tracking(self, run_id: str | None = None, reopen: bool = True) -> None:
        """Find (by id, else by job tag) or create this job's MLflow run."""
        self.tracker.start(
            params=self._params(),
            tags={STORAGE_TAG: redact_url(self.storage.root), "mlflow.runName": self.config.job, **self.run_tags},
            run_id=run_id,
            reopen=reopen,
        )

    def _params(self) -> dict[str, str]:
        c = self.config
        return flatten_params(
            "",
            {
                "program": c.program,
                "job": c.job,
                "train": c.train.model_dump(mode="json"),
                "eval": c.eval.model_dump(mode="json"),
                "checkpoint": c.checkpoint.model_dump(mode="json"),
                "program_config": getattr(self.program, "config", None) or {},
            },
        )

    def _require_live(self):
        if self.state is None:
            raise RuntimeError("no live state: call restore_or_init() first")

    # -- training -------------------------------------------------------------------

    def next_boundary(self) -> int:
        """The next step at which a checkpoint is due by step cadence (or max_steps)."""
        every = self.config.checkpoint.every_steps
        max_steps = self.config.train.max_steps
        if every is None:
            return max_steps
        return min(max_steps, (self.step // every + 1) * every)

    def _forget_live_state(self) -> None:
        """The live state is somewhere inside an interval (its buffers may have been donated):
        drop it, so the next attempt restores the last committed checkpoint."""
        self.state = self.step = self.data_iter = None

    def train_until_checkpoint(self) -> int:
        """Train until the next checkpoint is due, save it asynchronously, return the step reached.

        Training metrics stay on the device during the interval and go to MLflow in one batch
        at its end. A NaN/Inf loss is looked for every `log_every_steps` and before the save;
        it raises `NonFiniteLossError` naming the step and nothing of it is checkpointed.
        On SIGTERM the step in flight finishes, is checkpointed within `sigterm_grace_secs`,
        and the signal goes on to the previous handler (see `_PreemptionNotice`).
        """
        self._require_live()
        self._acquire_lease()
        self._guard.install()
        self._join_precompile()  # its executable is the one this loop calls
        spec = self.config.train
        target = self.next_boundary()
        every_secs = self.config.checkpoint.every_secs
        log_every, per_dispatch = spec.log_every_steps, spec.steps_per_dispatch
        # (step, metrics, row): row is None for one step's metrics, else the step's row in a scan's stack.
        logged: list[tuple[int, Any, int | None]] = []
        state, step, it = self.state, self.step, self.data_iter
        guard = (guard_int(step), guard_int(-1))
        checked = None  # the guard of the previous log point: read one log point later, so the loop never waits on it
        try:
            with self._guard.deferred() as notice:
                while step < target:
                    start = step
                    if per_dispatch == 1:
                        state, metrics, guard = self._train_step(state, next(it), guard)
                        step += 1
                    else:
                        n = min(per_dispatch, target - step)
                        state, metrics, guard = self._scan_steps(state, _stack([next(it) for _ in range(n)]), guard)
                        step += n
                    due = [s for s in range(start + 1, step + 1) if s % log_every == 0 or s == target]
                    if due:
                        logged.extend((s, metrics, None if per_dispatch == 1 else s - start - 1) for s in due)
                        if checked is not None:
                            self._check_finite(checked, logged)
                        checked = guard
                        if _progress_listeners:
                            self._notify(step, spec.max_steps, _metrics_at(*logged[-1][1:]))
                    if notice.requested:
                        break
                    if every_secs is not None and time.monotonic() - self._last_save >= every_secs:
                        break
                self._check_finite(guard, logged)
                self.state, self.step = state, step
                if notice.requested:
                    notice.handling = True
                    self._checkpoint_before_exit(notice, logged)
        except BaseException:
            self._forget_live_state()
            raise
        rows = self._train_rows(logged)
        self.save(rows)
        self.tracker.log_new_metrics(rows, exclude_prefix=self._eval_prefix)
        self._notify(step, spec.max_steps, self.last_train_metrics)
        return step

    def _check_finite(self, guard, logged) -> None:
        if not self.config.train.check_finite:
            return
        first_bad = int(guard[1])
        if first_bad >= 0:
            shown = {}
            for s, m, row in logged:
                if s >= first_bad:
                    shown = {k: float(v) for k, v in jax.device_get(_metrics_at(m, row)).items()}
                    break
            self._wait_committed()  # the error names the checkpoint a rerun resumes from: let saves in flight land
            raise NonFiniteLossError(first_bad, shown, (self.committed_steps() or [None])[-1])

    def _checkpoint_before_exit(self, notice: _PreemptionGuard, logged) -> None:
        grace = self.config.train.sigterm_grace_secs
        started = time.monotonic()
        logger.warning("SIGTERM at step %d: checkpointing it (grace %.0fs)", self.step, grace)
        rows = self._train_rows(logged)
        self.save(rows)
        waiter = threading.Thread(target=self._wait_committed, daemon=True)
        waiter.start()
        waiter.join(timeout=max(0.0, grace - (time.monotonic() - started)))
        committed = not waiter.is_alive()
        if committed:
            logger.warning("step %d committed in %.2fs after SIGTERM", self.step, time.monotonic() - started)
            self.tracker.log_new_metrics(rows, exclude_prefix=self._eval_prefix)
        else:
            logger.error(
                "the checkpoint of step %d did not commit within %.0fs: abandoned; step %s stays the newest valid one",
                self.step, grace, (self.committed_steps() or [None])[-1],
            )
        self.tracker.finish("KILLED")
        self.lease.release()
        notice.forward()
        raise Preempted(self.step, committed, notice.signum)

    def _preempted_between_intervals(self) -> None:
        """SIGTERM outside the training loop (during an evaluation, an export, between tasks):
        the live step's save may be in flight. Let it commit within the grace period, say which
        step is the newest committed one, close the MLflow run and forward the signal."""
        grace = self.config.train.sigterm_grace_secs
        started = time.monotonic()
        logger.warning("SIGTERM at step %s (between checkpoints): letting its checkpoint commit (grace %.0fs)", self.step, grace)
        waiter = threading.Thread(target=self._wait_committed, daemon=True)
        waiter.start()
        waiter.join(timeout=grace)
        committed_steps = self.committed_steps()
        newest = committed_steps[-1] if committed_steps else None
        committed = not waiter.is_alive() and self.step in committed_steps
        if committed:
            logger.warning("step %d committed in %.2fs after SIGTERM", self.step, time.monotonic() - started)
        else:
            logger.error("the checkpoint of step %s did not commit within %.0fs: abandoned; step %s stays the newest valid one",
                         self.step, grace, newest)  # fmt: skip
        # MLflow may be slow (or its thread busy): never past the grace period.
        closer = threading.Thread(target=self.tracker.finish, args=("KILLED",), daemon=True)
        closer.start()
        closer.join(timeout=max(1.0, grace - (time.monotonic() - started)))
        self.lease.release()
        step, signum = self.step, self._guard.signum
        self._forget_live_state()
        self._guard.forward()
        raise Preempted(step, committed, signum)

    def _wait_committed(self) -> None:
        """Wait until every save started so far counts: committed by Orbax, and uploaded if remote."""
        self.checkpoints.wait()
        if self._uploader is not None:
            self._uploader.wait()
        for announcer in self._announcers:  # the commit events of those saves are out too
            announcer.join(timeout=30)

    @property
    def _eval_prefix(self) -> str:
        return f"{self.config.eval.name}/"

    def _train_rows(self, logged) -> list[tuple[str, float, int]]:
        """The interval's logged train metrics as MLflow rows (one device-to-host copy)."""
        if not logged:
            return []
        values = [(s, _metrics_at(m, row)) for s, m, row in jax.device_get(logged)]
        self.last_train_metrics = {k: float(v) for k, v in values[-1][1].items()}
        return [(k, float(v), s) for s, m in values for k, v in m.items()]

    def _notify(self, step, max_steps, metrics):
        for fn in list(_progress_listeners):
            try:
                fn(step, max_steps, metrics)
            except Exception:  # noqa: BLE001 - a broken progress bar must not stop training
                logger.exception("progress listener failed")

    def save(self, train_metrics: list[tuple[str, float, int]] = ()) -> None:
        """Start an asynchronous checkpoint of the live state at the current step.

        MLflow writes are asynchronous, so the interval's train metrics (`train_metrics`), and
        any earlier ones still on their way, go into the checkpoint too: a process killed after
        this step commits but before they reach MLflow has them logged by the rerun that
        restores this step (nothing is logged twice).
        """
        train_metrics = self.tracker.unwritten_metrics() + list(train_metrics)
        with self._guard.deferred():  # a SIGTERM now is handled once Orbax has the step
            self._save(train_metrics)
        self._guard.handle_if_pending()

    def _save(self, train_metrics) -> None:
        self.checkpoints.save(
            self.step,
            self.state,
            self.data_iter,
            {
                "program": self.config.program,
                "program_fingerprint": self.program_fingerprint,
                "config_fingerprint": self.config.fingerprint(),
                # Known unless MLflow is still opening (the first save of a fresh process): then
                # evaluators and reruns find the run by its job tag instead.
                "mlflow_run_id": self.tracker.run_id_if_known(),
                "host": socket.gethostname(),
                "pid": os.getpid(),
                "train_metrics": [list(r) for r in train_metrics],
                **self.run_tags,
            },
        )
        self._last_save = time.monotonic()
        if self.remote is not None:
            self.uploader.submit(self.step, os.path.join(self.checkpoints.directory, str(self.step)), ready=is_committed)
        if self.commit_listeners:
            announcer = threading.Thread(target=self._announce_commit, args=(self.step,), name="prefect-jax-commit", daemon=True)
            announcer.start()
            self._announcers = [t for t in self._announcers if t.is_alive()] + [announcer]

    def _announce_commit(self, step: int) -> None:
        """Tell the commit listeners once `step` is committed (from a background thread)."""
        self.checkpoints.wait()
        if self.remote is not None:
            deadline = time.monotonic() + 3600
            while step not in self.remote.committed_steps() and time.monotonic() < deadline:
                if step not in self.uploader.pending and step not in self.remote.committed_steps():
                    return  # the upload failed; it is reported by the next save or finish
                time.sleep(0.2)
        if step not in self.committed_steps():
            return
        for fn in list(self.commit_listeners):
            try:
                fn(step)
            except Exception:  # noqa: BLE001 - a listener must not break training
                logger.exception("commit listener failed for step %d", step)

    def stop_requested(self) -> dict | None:
        """A durable stop request of this job (early stopping, or a person), if any."""
        return control.stop_requested(self.storage)

    # -- evaluation -----------------------------------------------------------------

    def _state_at(self, step: int):
        if self.state is not None and self.step == step:
            return self.state
        self.checkpoints.wait()
        self._fetch(step)
        state, _ = self.checkpoints.restore(step, self.abstract_state)
        return state

    def evaluate_if_new(self, step: int | None = None, force: bool = False) -> EvalResult:
        """Evaluate `step` (default: the live step, else the newest committed one) unless done before.

        Returns an EvalResult with status EVALUATED (metrics logged to MLflow and recorded
        durably), NO_NEW_CHECKPOINT (already evaluated), MISSING_CHECKPOINT (nothing to
        evaluate) or THROTTLED (evaluated less than `throttle_secs` ago; `force` overrides).
        """
        spec = self.config.eval
        if self.lease.held:  # the trainer evaluating its own steps (local mode)
            self._guard.install()
        if step is None:
            step = self.step if self.state is not None else (self.committed_steps() or [None])[-1]
        live = self.state is not None and self.step == step
        if step is None or (not live and step not in self.committed_steps()):
            return EvalResult(status=EvalStatus.MISSING_CHECKPOINT, name=spec.name, step=step)
        if not self._evals_reconciled:
            self.reconcile_eval_metrics(step)
        done = self.records.get(step)
        if done is not None:
            return done.model_copy(update={"status": EvalStatus.NO_NEW_CHECKPOINT})
        is_final = step >= self.config.train.max_steps
        if not (force or is_final) and throttled(self.records, spec.throttle_secs):
            return EvalResult(status=EvalStatus.THROTTLED, name=spec.name, step=step)
        for hook in self.eval_hooks:
            before = getattr(hook, "before_eval", None)
            if before is not None and before(step) is False:
                return EvalResult(status=EvalStatus.THROTTLED, name=spec.name, step=step)
        try:
            state = self._state_at(step)
        except CorruptCheckpointError as exc:
            logger.error("not evaluating step %d: %s", step, exc)
            return EvalResult(status=EvalStatus.MISSING_CHECKPOINT, name=spec.name, step=step)
        # A finite pass needs no resumable iterator: a MapDataset is read by index, without Grain's
        # prefetch threads (starting them cost more than this whole eval on small sets).
        eval_data = self.program.eval_data()
        if isinstance(eval_data, grain.MapDataset):
            batches = (eval_data[i] for i in range(len(eval_data)))
        else:
            batches = _iterate(eval_data)
        metrics, n, examples = aggregate(self._eval_step, state, batches, spec.steps)
        result = EvalResult(
            status=EvalStatus.EVALUATED,
            name=spec.name,
            step=step,
            metrics=metrics,
            num_batches=n,
            num_examples=examples,
            evaluated_at=time.time(),
            is_final=is_final,
        )
        # The live step's save may still be in flight (the evaluation overlapped it): a step is
        # recorded, logged and exported only once it is committed, so that a crash before the
        # commit leaves nothing that says it was evaluated (the rerun evaluates it again).
        if live and not self._committed(step):
            logger.error("step %d did not commit: its evaluation is not recorded", step)
            return EvalResult(status=EvalStatus.MISSING_CHECKPOINT, name=spec.name, step=step)
        # Unless a crash came between this log and the record below, in an earlier attempt.
        rows = [(f"{spec.name}/{k}", v, step) for k, v in sorted(metrics.items())]
        self.tracker.log_metrics_once(rows, rows[0][0], step)
        self.records.put(result)
        reason = control.after_eval_stop_reason(result, self.records, self.early_stopping, self.eval_hooks)
        if reason:
            logger.warning("%s: asking job %s to stop", reason, self.config.job)
            control.request_stop(self.storage, reason, step, by=f"eval {spec.name}")
            self.tracker.set_tags({"prefect_jax.stop_reason": reason[:5000]})
            result = result.model_copy(update={"stop_reason": reason})
        return result

    def _committed(self, step: int) -> bool:
        """Whether `step` counts, once the saves in flight have landed (waits for them). The state
        training started from counts too: committed, or made by init (or a warm start), which a
        rerun makes again, bit for bit."""
        if step == self._started_from:
            return True
        if step == self.step:
            self._wait_committed()
        return step in self.committed_steps()

    def reconcile_eval_metrics(self, step: int | None = None) -> int:
        """Log to MLflow every recorded evaluation that MLflow lacks; returns how many records it checked.

        Eval metrics reach MLflow in the background, so a process can die after writing an eval
        record and before its metrics are in MLflow. The job's evaluator (the trainer in local
        mode, the evaluate flow otherwise) calls this once per process, before it evaluates: the
        record is the durable truth, and nobody else writes eval metrics, so each is logged
        exactly once (one metric-history read per process). `step` names a committed step whose
        checkpoint names the MLflow run, for an evaluator that has not joined it yet.
        """
        self._evals_reconciled = True
        if not self.tracker.started:  # an evaluator: join the trainer's run, leave its status alone
            steps = self.committed_steps()
            source = step if step is not None and (step in steps or step == self.step) else (steps[-1] if steps else None)
            if source is None:
                self._evals_reconciled = False  # nothing to join yet: try again next time
                return 0
            self._fetch(source)
            self._attach_tracking(self.checkpoints.read_meta(source).get("mlflow_run_id"), reopen=False)
        name, logged = self.config.eval.name, 0
        for recorded in self.records.all():
            if recorded.metrics:
                rows = [(f"{name}/{k}", v, recorded.step) for k, v in sorted(recorded.metrics.items())]
                self.tracker.log_metrics_once(rows, rows[0][0], recorded.step)
                logged += 1
        return logged

    # -- export ---------------------------------------------------------------------

    def export(self, result: EvalResult) -> dict[str, str]:
        """Run every exporter on an evaluated result; returns ``{exporter name: export dir}``.

        Also on a result found already evaluated (NO_NEW_CHECKPOINT): exports written before
        are kept as they are, and those a crash left unwritten are written now.
        """
        written: dict[str, str] = {}
        if not exp.is_recorded(result):
            return written
        model: list[bytes] = []

        def make_model() -> bytes:
            if not model:
                model.append(exp.serialize_serving(self.program, self._state_at(result.step)))
            return model[0]

        info = {"program": self.config.program, "program_fingerprint": self.program_fingerprint, "job": self.config.job}
        for exporter in self.config.eval.exporters:
            existed = self.storage.fs.exists(self.storage.export_dir(exporter.name, result.step))
            dest = exp.run_exporter(exporter, self.storage, result, self.config.train.max_steps, make_model, info)
            if dest is None:
                continue
            written[exporter.name] = dest
            if not existed and self.storage.protocol == "file":
                self.tracker.log_artifacts(dest, f"exports/{exporter.name}/{result.step}")
        return written

    # -- end ------------------------------------------------------------------------

    def fingerprint(self) -> str:
        self._require_live()
        return state_fingerprint(self.state)

    def finish(self, status: str = "FINISHED") -> None:
        """Wait for pending saves, close the MLflow run with `status`, release the lease."""
        try:
            self._wait_committed()
            self.tracker.finish(status)
        finally:
            self._guard.uninstall()
            self.lease.release()

    def close(self) -> None:
        try:
            self._join_precompile()
            self.checkpoints.close()
            if self._uploader is not None:
                self._uploader.close()
            self.tracker.close()
        finally:
            self._guard.uninstall()
            self.lease.release()


# -- the process-local cache of live trainers ---------------------------------------------

_live: dict[str, Trainer] = {}


def get_trainer(config: JobConfig, run_tags: dict[str, str] | None = None) -> Trainer:
    """The live Trainer of this job in this process, or a new one (with no state yet).

    A cached trainer is reused only if its config is identical; otherwise it is closed
    and replaced.
    """
    key = JobStorage(config.storage, config.job).job_dir
    trainer = _live.get(key)
    if trainer is not None and trainer.config == config:
        if run_tags:
            trainer.run_tags.update(run_tags)
        return trainer
    if trainer is not None:
        trainer.close()
    trainer = Trainer(config, run_tags=run_tags)
    _live[key] = trainer
    return trainer


def drop_trainer(config: JobConfig) -> None:
    """Forget (and close) this job's live trainer."""
    trainer = _live.pop(JobStorage(config.storage, config.job).job_dir, None)
    if trainer is not None:
        trainer.close()
