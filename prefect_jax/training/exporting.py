"""A trainer's exports: run the job's exporters on an evaluated step, then register them.

Each exporter (`exporters.run_exporter`) writes a serving artifact of a committed, recorded
step; every exported step then becomes (once) a version of the job's MLflow registered model,
and each exporter's alias moves to its step. This module never imports prefect.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prefect_jax.training import exporters as exp
from prefect_jax.training.best import best_of
from prefect_jax.training.eval_specs import BestExporter
from prefect_jax.training.evaluation import EvalResult
from prefect_jax.training.redaction import redact_url
from prefect_jax.training.registry import ALIASES_DESCRIPTION, alias_for, default_registered_model

if TYPE_CHECKING:
    from prefect_jax.training.trainer import Trainer


class Exports:
    """The exports of one trainer's job (see `Trainer.export`)."""

    def __init__(self, trainer: Trainer):
        self.trainer = trainer
        self._example = None  # the serving input example (see `serving_example`)

    @property
    def registered_model(self) -> str | None:
        """The MLflow registered model of this job's exports (None: not registered):
        `EvalSpec.registered_model`, else ``<job>-<hash of its storage>``
        (`registry.default_registered_model`: unique to the job and its storage)."""
        config = self.trainer.config
        name = config.eval.registered_model
        if name is None:
            return default_registered_model(config.job, self.trainer.job.storage.root)
        return name or None

    def export(self, result: EvalResult) -> dict[str, str]:
        """`Trainer.export`."""
        t = self.trainer
        with t.job.goodput.phase("export"):
            exported = self._export(result)
        if exported:
            t.push_compiled()
        return exported

    def _export(self, result: EvalResult) -> dict[str, str]:
        t, job, config = self.trainer, self.trainer.job, self.trainer.config
        t.ending.stop_if_preempted()
        written: dict[str, str] = {}
        # exports are of committed, recorded steps: this one's commit comes first
        if result.pending_commit:
            max_steps = config.train.max_steps
            if all(
                exp.exports_nothing(e, job.storage, result, max_steps)
                for e in config.eval.exporters
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

        def make_model() -> bytes:
            if not model:
                t.wait_for_compile_cache()
                state = t.evaluations.state_at(result.step)
                model.append(exp.serialize_serving(t.program, state, config.eval.export_platforms))
            return model[0]

        info = {
            "program": config.program,
            "program_fingerprint": t.program_fingerprint,
            "job": config.job,
        }
        for exporter in config.eval.exporters:
            dest = exp.run_exporter(
                exporter, job.storage, result, config.train.max_steps, make_model, info
            )
            if dest is None:
                continue
            written[exporter.name] = dest
        if written:
            self._register()
        return written

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

        def recorded(result: dict) -> None:
            registry = {"tracking_uri": redact_url(tracker.tracking_uri), **result}
            storage.write_json(storage.path("registry.json"), registry)

        description = (
            f"Exports of prefect-jax job `{config.job}` ({redact_url(storage.job_dir)}), "
            "one version per exported step."
            f" Aliases: {ALIASES_DESCRIPTION}; this job moves"
            f" {', '.join('@' + a for a in sorted(aliases))}. Serve: "
            f"`mlflow.pyfunc.load_model('models:/{name}@best')`."
        )
        local_export = exp.LocalExport(storage, tuple(e.name for e in config.eval.exporters))
        tracker.register_exports(
            name,
            config.job,
            aliases,
            local_export,
            self.serving_example(),
            on_done=recorded,
            description=description,
            steps=sorted(exported),
        )

    def serving_example(self):
        """A few real inputs for the model's signature and input example: rows of the first eval
        batch that fit the serving input (zeros of its shape if none does)."""
        if self._example is None:
            self._example = exp.serving_example(self.trainer.program)
        return self._example
