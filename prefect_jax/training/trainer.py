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
import socket
import time
from typing import Any, Callable

import jax

from prefect_jax.training import exporters as exp
from prefect_jax.training.checkpoints import (
    Checkpoints,
    committed_steps,
    state_fingerprint,
    wait_for_new_checkpoint,
)
from prefect_jax.training.evaluation import EvalRecords, EvalResult, EvalStatus, aggregate, throttled
from prefect_jax.training.program import ProgramError, has_serving, load_program, program_fingerprint
from prefect_jax.training.specs import JobConfig
from prefect_jax.training.storage import JobStorage
from prefect_jax.training.tracking import STORAGE_TAG, Tracker, flatten_params

logger = logging.getLogger("prefect_jax.trainer")

ProgressListener = Callable[[int, int, dict[str, float]], None]
_progress_listeners: list[ProgressListener] = []


def add_progress_listener(fn: ProgressListener) -> Callable[[], None]:
    """Call ``fn(step, max_steps, last_metrics)`` as training advances; returns a remover."""
    _progress_listeners.append(fn)
    return lambda: _progress_listeners.remove(fn) if fn in _progress_listeners else None


def _iterate(dataset):
    """An iterator (with get_state/set_state) over a Grain MapDataset or IterDataset."""
    if hasattr(dataset, "to_iter_dataset"):
        dataset = dataset.to_iter_dataset()
    return iter(dataset)


def restore_or_init(
    checkpoints: Checkpoints | None,
    init: Callable[[], Any],
    abstract_state,
    *,
    checkpoint_dir: str | None = None,
    checkpoint_path: str | None = None,
    data_iter=None,
    wait_for_checkpoint: bool = False,
    max_wait_secs: float = 7200,
    recovery_wait_secs: float = 30,
    log: Callable[[str], None] = logger.info,
) -> tuple[Any, int, dict | None]:
    """`SessionManager.prepare_session` for a JAX train state.

    Restores the latest committed step under `checkpoint_dir`, or the one step at
    `checkpoint_path`; with neither (or nothing committed yet), runs `init`.

    Args:
        checkpoints: the job's `Checkpoints` (used for `checkpoint_dir`).
        init: builds a fresh state.
        abstract_state: ``jax.eval_shape`` of `init`: the structure a restore must match.
        checkpoint_dir: restore the latest committed step in this directory.
        checkpoint_path: restore exactly this step directory (``.../checkpoints/<step>``).
        data_iter: a Grain iterator whose position is restored with the state.
        wait_for_checkpoint: if no committed step exists yet, wait for one.
        max_wait_secs: how long to wait.
        recovery_wait_secs: how often to look while waiting.

    Returns:
        (state, step, metadata of the restored checkpoint or None after init).

    Raises:
        ValueError: both `checkpoint_dir` and `checkpoint_path` were given, or
            `checkpoint_path` is not a committed step directory.
        CheckpointMismatchError: the checkpoint's tree differs from `abstract_state`.
    """
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
            state, meta = source.restore(int(name), abstract_state, data_iter)
        finally:
            source.close()
        log(f"restored step {name} from {path}")
        return state, int(name), meta
    if checkpoint_dir:
        assert checkpoints is not None and checkpoints.directory == checkpoint_dir
        step = checkpoints.latest_committed()
        if step is None and wait_for_checkpoint:
            step = wait_for_new_checkpoint(checkpoints.committed_steps, None, max_wait_secs, recovery_wait_secs, log)
        if step is not None:
            state, meta = checkpoints.restore(step, abstract_state, data_iter)
            log(f"restored step {step} from {checkpoint_dir}")
            return state, step, meta
        log(f"no committed checkpoint in {checkpoint_dir}: initialising from scratch")
    return init(), 0, None


class Trainer:
    """One job's live training session.

    Args:
        config: the job.
        program: the program object (loaded from ``config.program`` when None).
        run_tags: extra metadata stored in checkpoints and MLflow tags (e.g. the Prefect
            flow-run id).
    """

    def __init__(self, config: JobConfig, program: Any = None, run_tags: dict[str, str] | None = None):
        self.config = config
        self.program = program if program is not None else load_program(config.program)
        self.storage = JobStorage(config.storage, config.job)
        self.checkpoints = Checkpoints(self.storage.checkpoint_dir, config.checkpoint)
        self.records = EvalRecords(self.storage, config.eval.name)
        self.tracker = Tracker(config.mlflow_tracking_uri, config.mlflow_experiment, self.storage.job_dir)
        self.run_tags = dict(run_tags or {})
        self.program_fingerprint = program_fingerprint(config.program, self.program)
        if config.eval.exporters and not has_serving(self.program):
            raise ProgramError(
                f"exporters {[e.name for e in config.eval.exporters]} are configured, but program "
                f"{config.program!r} has no serve(state, inputs) and serving_input(): add them, or drop the exporters"
            )
        # The CPU backend cannot donate buffers (it would warn on every compile); GPU/TPU can.
        donate = (0,) if jax.default_backend() != "cpu" else ()
        self._train_step = jax.jit(self.program.train_step, donate_argnums=donate)
        self._eval_step = jax.jit(self.program.eval_step)
        self._rng = jax.random.key(config.train.seed)
        self._abstract = None
        self.state = None
        self.step: int | None = None
        self.data_iter = None
        self._last_save = time.monotonic()
        self.last_train_metrics: dict[str, float] = {}

    # -- setup ----------------------------------------------------------------------

    @property
    def abstract_state(self):
        if self._abstract is None:
            self._abstract = jax.eval_shape(self.program.init, self._rng)
        return self._abstract

    def _fresh_iter(self):
        return _iterate(self.program.train_data(self.config.train.seed))

    def restore_or_init(
        self,
        checkpoint_path: str | None = None,
        wait_for_checkpoint: bool = False,
        max_wait_secs: float = 7200,
        recovery_wait_secs: float = 30,
    ) -> int:
        """Resume from the job's latest committed step; else from `checkpoint_path`; else init.

        Also finds (or creates) the job's MLflow run. Returns the step the state is at.
        """
        self.checkpoints.wait()
        data_iter = self._fresh_iter()
        has_own = self.checkpoints.latest_committed() is not None
        state, step, meta = restore_or_init(
            self.checkpoints,
            lambda: self.program.init(self._rng),
            self.abstract_state,
            checkpoint_dir=self.checkpoints.directory if (has_own or not checkpoint_path) else None,
            checkpoint_path=None if has_own else checkpoint_path,
            data_iter=data_iter,
            wait_for_checkpoint=wait_for_checkpoint,
            max_wait_secs=max_wait_secs,
            recovery_wait_secs=recovery_wait_secs,
        )
        if checkpoint_path and not has_own and step:
            data_iter = self._fresh_iter()  # warm start: weights from elsewhere, this job's data from the start
        self.state, self.step, self.data_iter = state, step, data_iter
        self._last_save = time.monotonic()
        self._notify(step, self.config.train.max_steps, {})
        self._attach_tracking((meta or {}).get("mlflow_run_id"))
        return step

    def _attach_tracking(self, run_id: str | None = None) -> None:
        """Find (by id, else by job tag) or create this job's MLflow run."""
        self.tracker.start(
            params=self._params(),
            tags={STORAGE_TAG: self.storage.root, "mlflow.runName": self.config.job, **self.run_tags},
            run_id=run_id,
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

    def train_until_checkpoint(self) -> int:
        """Train until the next checkpoint is due, save it asynchronously, return the step reached.

        Training metrics are kept on the device during the interval and sent to MLflow in
        one batch at its end, so the host never waits on the device in the loop.
        """
        self._require_live()
        max_steps = self.config.train.max_steps
        target = self.next_boundary()
        every_secs = self.config.checkpoint.every_secs
        log_every = self.config.train.log_every_steps
        logged: list[tuple[int, Any]] = []
        state, step, it, train_step = self.state, self.step, self.data_iter, self._train_step
        try:
            while step < target:
                state, metrics = train_step(state, next(it))
                step += 1
                if step % log_every == 0 or step == target:
                    logged.append((step, metrics))
                    if _progress_listeners:
                        self._notify(step, max_steps, metrics)
                if every_secs is not None and time.monotonic() - self._last_save >= every_secs:
                    break
        except BaseException:
            # The live state is now somewhere inside the interval (and its buffers may have been
            # donated): forget it, so the next attempt restores the last committed checkpoint.
            self.state = self.step = self.data_iter = None
            raise
        self.state, self.step = state, step
        self.save()
        rows = [(k, v, s) for s, m in jax.device_get(logged) for k, v in m.items()]
        if logged:
            self.last_train_metrics = {k: float(v) for k, v in jax.device_get(logged[-1][1]).items()}
        self.tracker.log_metrics(rows)
        self._notify(step, max_steps, self.last_train_metrics)
        return step

    def _notify(self, step, max_steps, metrics):
        for fn in list(_progress_listeners):
            try:
                fn(step, max_steps, metrics)
            except Exception:  # noqa: BLE001 - a broken progress bar must not stop training
                logger.exception("progress listener failed")

    def save(self) -> None:
        """Start an asynchronous checkpoint of the live state at the current step."""
        self.checkpoints.save(
            self.step,
            self.state,
            self.data_iter,
            {
                "program": self.config.program,
                "program_fingerprint": self.program_fingerprint,
                "config_fingerprint": self.config.fingerprint(),
                "mlflow_run_id": self.tracker.run_id,
                "host": socket.gethostname(),
                "pid": os.getpid(),
                **self.run_tags,
            },
        )
        self._last_save = time.monotonic()

    # -- evaluation -----------------------------------------------------------------

    def _state_at(self, step: int):
        if self.state is not None and self.step == step:
            return self.state
        self.checkpoints.wait()
        state, _ = self.checkpoints.restore(step, self.abstract_state)
        return state

    def evaluate_if_new(self, step: int | None = None, force: bool = False) -> EvalResult:
        """Evaluate `step` (default: the live step, else the newest committed one) unless done before.

        Returns an EvalResult with status EVALUATED (metrics logged to MLflow and recorded
        durably), NO_NEW_CHECKPOINT (already evaluated), MISSING_CHECKPOINT (nothing to
        evaluate) or THROTTLED (evaluated less than `throttle_secs` ago; `force` overrides).
        """
        spec = self.config.eval
        if step is None:
            step = self.step if self.state is not None else self.checkpoints.latest_committed()
        if step is None or (self.step != step and step not in self.checkpoints.committed_steps()):
            return EvalResult(status=EvalStatus.MISSING_CHECKPOINT, name=spec.name, step=step)
        done = self.records.get(step)
        if done is not None:
            return done.model_copy(update={"status": EvalStatus.NO_NEW_CHECKPOINT})
        is_final = step >= self.config.train.max_steps
        if not (force or is_final) and throttled(self.records, spec.throttle_secs):
            return EvalResult(status=EvalStatus.THROTTLED, name=spec.name, step=step)
        state = self._state_at(step)
        if self.tracker.run_id is None:
            self._attach_tracking()
        metrics, n, examples = aggregate(self._eval_step, state, _iterate(self.program.eval_data()), spec.steps)
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
        self.tracker.log_metrics([(f"{spec.name}/{k}", v, step) for k, v in metrics.items()])
        self.records.put(result)
        return result

    # -- export ---------------------------------------------------------------------

    def export(self, result: EvalResult) -> dict[str, str]:
        """Run every exporter on an EVALUATED result; returns ``{exporter name: export dir}``."""
        written: dict[str, str] = {}
        if result.status is not EvalStatus.EVALUATED:
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
        """Wait for pending saves and close the MLflow run with `status`."""
        self.checkpoints.wait()
        self.tracker.finish(status)

    def close(self) -> None:
        self.checkpoints.close()


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
