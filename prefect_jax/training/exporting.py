"""A trainer's exports: run the job's exporters on an evaluated step, then register them.

Each exporter (`exporters.run_exporter`) writes a serving artifact of a committed, recorded
step; every exported step then becomes (once) a version of the job's MLflow registered model,
and each exporter's alias moves to its step. This module never imports prefect.
"""

from __future__ import annotations

import logging
import shlex
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from prefect_jax.training import exporters as exp
from prefect_jax.training.best import best_of
from prefect_jax.training.errors import ExportFailedError
from prefect_jax.training.eval_specs import BestExporter
from prefect_jax.training.evaluation import EvalResult
from prefect_jax.training.export_retention import prune_registered, registered_steps
from prefect_jax.training.names import REGISTRY_FILE
from prefect_jax.training.redaction import redact_url
from prefect_jax.training.registry import ALIASES_DESCRIPTION, alias_for, registered_model_of
from prefect_jax.training.serving import serving_record

if TYPE_CHECKING:
    from prefect_jax.training.trainer import Trainer

logger = logging.getLogger("prefect_jax.trainer")


def host_copy(state):
    """`state` in host memory (NumPy), for an export made while training goes on; PRNG keys
    (not NumPy) copied on their device."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    def copy(a):
        if isinstance(a, jax.Array):
            return (
                jnp.copy(a) if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key) else np.array(a)
            )
        return a

    return jax.tree.map(copy, state)


class _Background:
    """One step's export (lowering, writing, registering) on its own thread."""

    def __init__(self, step: int, write: Callable[[], dict[str, str]], on_done):
        self.step, self.written, self.error = step, {}, None
        self._write, self._on_done = write, on_done
        # (daemon: a process killed meanwhile leaves no torn export, see exporters._write_export)
        self._thread = threading.Thread(target=self._run, name=f"export-{step}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self.written = self._write()
        except BaseException as exc:  # noqa: BLE001 - raised on the training thread by `join`
            self.error = exc
            logger.error("the export of step %d failed: %r", self.step, exc)
            return
        try:
            self._on_done(self.written)
        except Exception:  # noqa: BLE001 - an announcement; the export is written
            logger.warning("after the export of step %d", self.step, exc_info=True)

    def join(self) -> None:
        self._thread.join()

    def retry(self) -> None:
        """Once more, on the calling thread, after it failed (a storage error of a moment, say):
        the same host copy and decisions, and the lowering if it was made."""
        self.error = None
        self._run()


class Exports:
    """The exports of one trainer's job (see `Trainer.export`)."""

    def __init__(self, trainer: Trainer):
        self.trainer = trainer
        self._example = None  # the serving input example (see `serving_example`)
        self._registering = None  # the newest registration's Future (see `registry_missing`)
        self._running: _Background | None = None  # an export in the background
        self._failed: _Background | None = None
        # Whether this trainer is the job's evaluator (set by `Trainer.recover` for the evaluate
        # flow, cleared by a restore): it holds no lease, yet the exports it held for MLflow are
        # its own to prune once registered, as a trainer's are while it holds the lease. Never an
        # export flow's: the step it wrote may be older than an exporter's `keep` newest, and
        # would go as soon as it was registered.
        self.prunes_once_registered = False

    @property
    def registered_model(self) -> str | None:
        """The MLflow registered model of this job's exports (None: not registered):
        `EvalSpec.registered_model`, else ``<job>-<hash of its storage>``
        (`registry.default_registered_model`: unique to the job and its storage)."""
        config = self.trainer.config
        return registered_model_of(
            config.eval.registered_model, config.job, self.trainer.job.storage.root
        )

    def export(
        self, result: EvalResult, on_done: Callable[[dict[str, str]], None] | None = None
    ) -> dict[str, str]:
        """`Trainer.export`; with `on_done`, `Trainer.export_in_background`."""
        t = self.trainer
        with t.job.goodput.phase("export"):
            self.join()  # one export at a time, in step order: the registry's order
            exported = self._export(result, on_done)
        if exported:
            t.push_compiled()
        return exported

    def wait(self) -> None:
        """Before a checkpoint is saved: wait for the export in the background, and raise its
        failure (`join`). A committed step after an evaluated one then says that one's exports
        are written: a rerun from it, after a kill, exports only its own step; a step never
        commits over one whose export failed (the rerun resumes from that one and exports it)."""
        running = self._running
        if running is not None:
            running.join()
            if running.error is None:
                return  # (what it wrote: the next `join`'s)
        if running is not None or self._failed is not None:
            self.join()  # tried once more on this thread; raises if it failed again

    def join(self) -> dict[str, str]:
        """Wait for the export in the background (if any): what it wrote.

        Raises:
            ExportFailedError: it failed (again at each call: the job must not end as if its
                exports were written).
        """
        running, self._running = self._running, None
        if running is not None:
            running.join()
            if running.error is not None:
                logger.warning(
                    "trying the export of step %d once more, on the training thread", running.step
                )
                running.retry()
            if running.error is None:
                if running.written:
                    self.trainer.push_compiled()
                return running.written
            self._failed = running
        if self._failed is not None:
            failed = self._failed
            raise ExportFailedError(
                f"the export of step {failed.step} (in the background, while training went on) "
                f"failed: {type(failed.error).__name__}: {failed.error}. The job stops here; its "
                "checkpoints are kept, and a rerun exports its newest evaluated step"
            ) from failed.error
        return {}

    def join_at_end(self, raise_failure: bool) -> None:
        """`join` as the job ends: a failure raised where `raise_failure`, else logged, with its
        traceback only where no earlier `join` raised it (that one told it)."""
        told = self._failed is not None  # (set by the `join` that first raised it)
        try:
            self.join()
        except ExportFailedError as exc:
            if raise_failure:
                raise
            logger.error(
                "job %s ends with an export that failed%s",
                self.trainer.config.job,
                f": {exc}" if told else "",
                exc_info=not told,
            )

    def _export(self, result: EvalResult, on_done=None) -> dict[str, str]:
        t, job, config = self.trainer, self.trainer.job, self.trainer.config
        t.ending.stop_if_preempted()
        written: dict[str, str] = {}
        # exports are of committed, recorded steps: this one's commit comes first
        if result.pending_commit:
            if exp.nothing_to_export(
                config.eval.exporters, job.storage, result, config.train.max_steps
            ):
                # nothing to export: training goes on, and the step is recorded once it commits
                return written
            pending = t.evaluations.pending
            if pending.step == result.step:
                recorded = pending.record(wait=True, inside="export")
            else:
                recorded = job.records.get(result.step)
            if recorded is None:
                return written
            result = recorded
        if not exp.is_recorded(result) or not job.is_primary:
            return written
        job.verify_lease()  # a trainer whose job was taken over exports nothing more
        model: list[bytes] = []
        if on_done is not None and exp.nothing_to_export(
            config.eval.exporters, job.storage, result, config.train.max_steps
        ):
            return written  # nothing to export: no copy of the state, no thread
        # In the background, of a host copy: training donates the live state's buffers.
        state = host_copy(t.evaluations.state_at(result.step)) if on_done else None

        def make_model() -> bytes:
            # one lowering per step, for every exporter and every platform
            if not model:
                t.wait_for_compile_cache()
                live = state if state is not None else t.evaluations.state_at(result.step)
                model.append(exp.serialize_serving(t.program, live, config.eval.export_platforms))
            return model[0]

        info = {
            "program": config.program,
            "program_fingerprint": t.program_fingerprint,
            "job": config.job,
            "inputs": serving_record(t.program),
        }

        registers = self.registered_model is not None and job.tracker.enabled
        if registers:  # (an export of its own, its process in no MLflow run: the job's, joined)
            t.evaluations.join_job_run(result.step)

        def write() -> dict[str, str]:
            exported = False  # by this run or an earlier one: registered either way
            for exporter in config.eval.exporters:
                outcome = exp.run_exporter(
                    exporter,
                    job.storage,
                    result,
                    config.train.max_steps,
                    make_model,
                    info,
                    registers,
                )
                if outcome is not None:
                    dest, written_now = outcome
                    exported = True
                    if written_now:  # (a rerun's step exported before: no line, no event)
                        written[exporter.name] = dest
            if exported:
                self._register()
            return written

        if on_done is None:
            return write()
        self._running = _Background(result.step, write, on_done)
        return {}

    def warm_registry(self) -> None:
        """Where this process will register exports (it evaluates: a trainer of the `train` role
        never does), the MLflow worker makes that ready while it evaluates (see
        `Tracker.warm_registry`; a command or a flow run that evaluates asks at its start)."""
        job = self.trainer.job
        if self.trainer.config.eval.registers_exports and job.is_primary and job.tracker.enabled:
            job.tracker.warm_registry()

    def _register(self) -> None:
        """Every exported step becomes (once) a version of the registered model, and each
        exporter's alias moves to its step: ``best`` from the durable eval records, ``final``,
        ``newest``."""
        config, job = self.trainer.config, self.trainer.job
        name, tracker, storage = self.registered_model, job.tracker, job.storage
        if name is None or not tracker.enabled:
            return
        aliases: dict[str, int] = {}
        exported: set[int] = set()
        for exporter in config.eval.exporters:
            steps = exp.exported_steps(storage, exporter.name)
            exported.update(steps)
            # the best recorded (so committed) evaluation that was exported
            if isinstance(exporter, BestExporter):
                records = [r for r in map(job.records.get, steps) if r is not None]
                best = best_of(exporter, records)
                step = best.step if best is not None else None
            else:
                step = steps[-1] if steps else None
            if step is not None:
                aliases[alias_for(exporter.name)] = int(step)
        if not aliases:
            return

        prunes = self.prunes_once_registered  # (as this export is: the callback comes later)

        def recorded(result: dict) -> None:
            registry = {"tracking_uri": redact_url(tracker.tracking_uri), **result}
            storage.write_json(storage.path(REGISTRY_FILE), registry)
            # (what waited for it; a trainer's not once the job is another's)
            if job.lease.held or prunes:
                best = lambda e: (exp.read_best(storage, e) or {}).get("step")  # noqa: E731
                prune_registered(storage, config.eval.exporters, best)

        description = (
            f"Exports of prefect-jax job `{config.job}` ({redact_url(storage.job_dir)}), "
            "one version per exported step."
            f" Aliases: {ALIASES_DESCRIPTION}; this job moves"
            f" {', '.join('@' + a for a in sorted(aliases))}{_judged_by(config.eval)}. Serve: "
            f"`mlflow.pyfunc.load_model('models:/{name}@best')`."
        )
        local_export = exp.LocalExport(storage, tuple(e.name for e in config.eval.exporters))
        self._registering = tracker.register_exports(
            name,
            config.job,
            aliases,
            local_export,
            self.serving_example(),
            on_done=recorded,
            description=description,
            steps=sorted(exported),
            notes=_eval_notes(config.eval.name, map(job.records.get, sorted(exported))),
        )

    def registry_missing(self) -> str | None:
        """At the end of a run that exported: which of its exporters' kept exports MLflow did not
        take as versions of the registered model (refused, said as a warning when it did, or
        still on its way when the run ended) and the command that registers them; None where
        each is a version, or nothing registers (no registered model, MLflow off, or no run of
        the job there: `mlflow_missing`)."""
        job, config, name = self.trainer.job, self.trainer.config, self.registered_model
        if name is None or not job.tracker.enabled or job.tracker.run_id is None:
            return None
        exported = {
            s for e in config.eval.exporters for s in exp.exported_steps(job.storage, e.name)
        }
        missing = sorted(exported - registered_steps(job.storage, name))
        if not missing:
            return None
        many = len(missing) > 1
        why = (
            "its registration was still running when the run ended"
            if self._registering is not None and not self._registering.done()
            else "the warning above says why"
        )
        command = " ".join(
            shlex.quote(a)
            for a in (
                *("prefect-jax", "export", "--program", config.program, "--job", config.job),
                *("--storage", redact_url(job.storage.root)),
                *(("--registered-model", name) if config.eval.registered_model else ()),
                *("--mlflow-tracking-uri", redact_url(job.tracker.tracking_uri)),
            )
        )
        return (
            f"step{'s' if many else ''} {', '.join(map(str, missing))} {'are' if many else 'is'} "
            f"exported but not {'versions' if many else 'a version'} of registered model {name} "
            f"in MLflow ({why}); once MLflow takes them, `{command}` (with the job's exporter "
            "flags) registers them"
        )

    def serving_example(self):
        """A few real inputs for the model's signature and input example: rows of the first eval
        batch that fit the serving input (zeros of its shape if none does)."""
        if self._example is None:
            self._example = exp.serving_example(self.trainer.program)
        return self._example


def _judged_by(spec) -> str:
    """How the job's best exporters judge (a team reading @best assumed its accuracy): ``;
    @best by eval/loss (min)``, or by its compare_fn."""
    judged = [
        f"@{alias_for(e.name)} by "
        + (f"compare_fn `{e.compare_fn}`" if e.compare_fn else f"{spec.name}/{e.metric} ({e.mode})")
        for e in spec.exporters
        if isinstance(e, BestExporter)
    ]
    return f"; {', '.join(judged)}" if judged else ""


def _eval_notes(name: str, records) -> dict[int, str]:
    """Each exported step's evaluation, for its version's description (``eval/loss=0.0396,
    eval/accuracy=0.9889``): the version page showed only its step."""
    notes = {
        int(r.step): ", ".join(f"{name}/{k}={v:.4g}" for k, v in sorted(r.metrics.items()))
        for r in records
        if r is not None and r.step is not None and r.metrics
    }
    # (MLflow's SQL stores hold 5000 characters of a version's description: per-class metrics)
    return {step: note if len(note) <= 1000 else note[:999] + "…" for step, note in notes.items()}
