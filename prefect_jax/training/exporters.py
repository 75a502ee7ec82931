"""Exporters: serving artifacts of evaluated checkpoints (TF's Latest/Best/Final exporters).

An export is a directory ``<job>/exports/<exporter>/<step>/`` holding:

- ``model.jax_export``: the program's ``serve(state, inputs)`` with the trained state baked
  in, serialized with ``jax.export`` (StableHLO). It runs without the program's code:
  ``load_export(path)(inputs)``.
- ``export.json``: step, eval metrics, input signature, program fingerprint.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from typing import Any

from prefect_jax.training.best import beats, best_of, best_record, judged_alike
from prefect_jax.training.eval_specs import (
    BestExporter,
    ExporterSpec,
    FinalExporter,
    LatestExporter,
)
from prefect_jax.training.evaluation import EvalRecords, EvalResult, EvalStatus
from prefect_jax.training.export_retention import prune
from prefect_jax.training.names import BEST_FILE, EXPORT_INFO_FILE, MODEL_FILE
from prefect_jax.training.records import DamagedRecordError, read_record, set_aside
from prefect_jax.training.serving import (  # noqa: F401 - serving_example: (its home was here)
    failing_platforms,
    named_platforms_error,
    resolve_platforms,
    serving_example,
    serving_specs,
    why_platforms_fail,
)
from prefect_jax.training.storage import JobStorage

logger = logging.getLogger("prefect_jax.trainer")  # shown in the flow run's logs


def best_path(storage: JobStorage, exporter: str) -> str:
    """A BestExporter's ``best.json``: its best so far (step, metrics, how it was judged)."""
    return f"{storage.export_dir(exporter)}/{BEST_FILE}"


def is_recorded(result: EvalResult) -> bool:
    """An evaluation with metrics: EVALUATED now, or found recorded (NO_NEW_CHECKPOINT). Exporters
    run on both: a process killed between an evaluation's record and its exports has them
    written by the next run, which finds the step already evaluated."""
    return (
        result.status in (EvalStatus.EVALUATED, EvalStatus.NO_NEW_CHECKPOINT)
        and result.step is not None
        and bool(result.metrics)
    )


def is_the_final_export(result: EvalResult, max_steps: int | None) -> bool:
    """True when the evaluated step is at or past `max_steps` (TF's `is_the_final_export`);
    never for a job that trains until stopped (`max_steps` None: no final step)."""
    from prefect_jax.training.specs import is_final_step

    return is_recorded(result) and is_final_step(result.step, max_steps)


# A program's platforms that serve() does not lower for, found at its first export and left out
# of the next ones without trying again (and without a warning each time).
_left_out: dict[tuple[str, str], tuple[str, ...]] = {}


def serialize_serving(
    program: Any, state, platforms: list[str] | tuple[str, ...] | None = None
) -> bytes:
    """``jax.export`` of ``serve(state, inputs)`` with `state` closed over as constants, lowered
    for `platforms` (``EvalSpec.export_platforms``, see `resolve_platforms`). One module holds
    every platform's code, and the state's constants once.

    Raises:
        ValueError: named `platforms` that ``serve`` does not lower for (the message names each,
            with its error).
        Exception: ``serve``'s own error, where it does not lower on this machine either.
    """
    import jax

    spec = serving_specs(program)

    def serving(inputs):
        return program.serve(state, inputs)

    fn, here = jax.jit(serving), jax.export.default_export_platform()
    key = (type(program).__module__, type(program).__qualname__)
    wanted, named = resolve_platforms(platforms)
    if not named:
        wanted = tuple(p for p in wanted if p not in _left_out.get(key, ()))
    try:
        return jax.export.export(fn, platforms=wanted)(spec).serialize()
    except Exception:
        failed = failing_platforms(fn, wanted, spec)
        if not failed or here in failed:
            raise  # serve() itself fails (or fails here, where it trains): its own error
    if named:
        raise named_platforms_error(failed, platforms)
    why = why_platforms_fail(failed)
    kept = tuple(p for p in wanted if p not in failed)
    _left_out[key] = (*_left_out.get(key, ()), *failed)
    logger.warning(
        "the export runs on %s, not on %s: serve() does not lower there (%s). Set "
        "EvalSpec.export_platforms (--export-platforms) to %s to skip trying",
        ", ".join(kept),
        ", ".join(failed),
        why,
        ",".join(kept),
    )
    return jax.export.export(fn, platforms=kept)(spec).serialize()


def load_export(path: str) -> Callable:
    """Load an export directory (or its ``model.jax_export`` file) as a callable."""
    import fsspec
    import jax

    target = path if path.endswith(MODEL_FILE) else path.rstrip("/") + "/" + MODEL_FILE
    with fsspec.open(target, "rb") as f:
        exported = jax.export.deserialize(bytearray(f.read()))
    return exported.call


@dataclasses.dataclass(frozen=True)
class LocalExport:
    """A step's export as a local directory (a copy, for remote storage). It pickles: MLflow's
    worker process calls it to log the export as a model (see `Tracker.register_exports`)."""

    storage: JobStorage
    exporters: tuple[str, ...]

    def __call__(self, step: int) -> str:
        storage = self.storage
        for name in self.exporters:
            path = storage.export_dir(name, step)
            if storage.fs.exists(path):
                return path if storage.protocol == "file" else download_export(storage, path)
        raise FileNotFoundError(f"no export of step {step} in {storage.path('exports')}")


def download_export(storage: JobStorage, path: str) -> str:
    """A local copy of a remote export directory (kept under the cache root, reused)."""
    import hashlib

    from prefect_jax.training.storage import cache_root

    local = os.path.join(cache_root(), "exports", hashlib.sha256(path.encode()).hexdigest()[:16])
    if not os.path.exists(os.path.join(local, MODEL_FILE)):
        tmp = f"{local}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        storage.fs.get(path.rstrip("/") + "/", tmp + "/", recursive=True)
        shutil.rmtree(local, ignore_errors=True)
        os.makedirs(os.path.dirname(local), exist_ok=True)
        os.replace(tmp, local)
    return local


def _write_export(storage: JobStorage, dest: str, model_bytes: bytes, info: dict) -> None:
    """Write the export into a temporary sibling, then move it into place: readers see all or
    nothing."""
    fs = storage.fs
    with tempfile.TemporaryDirectory() as tmp:
        with open(os.path.join(tmp, MODEL_FILE), "wb") as f:
            f.write(model_bytes)
        with open(os.path.join(tmp, EXPORT_INFO_FILE), "w") as f:
            json.dump(info, f, indent=1, sort_keys=True)
        if storage.protocol == "file":
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            staging = f"{dest}.tmp-{os.getpid()}"
            shutil.rmtree(staging, ignore_errors=True)
            shutil.copytree(tmp, staging)
            os.replace(staging, dest)
        else:
            fs.put(tmp + "/", dest, recursive=True)


def exported_steps(storage: JobStorage, name: str) -> list[int]:
    return storage.list_int_names(storage.export_dir(name))


def exports_nothing(
    exporter: ExporterSpec, storage: JobStorage, result: EvalResult, max_steps: int
) -> bool:
    """True where `run_exporter` certainly exports nothing for `result` once it is recorded: a
    `FinalExporter` before the final step, a `BestExporter` whose durable best (another step's)
    is at least as good. An evaluation not yet recorded (its step's save still in flight) is then
    not waited for by the export: it is recorded once the step commits, as without exporters.
    A best judged from the eval records (`_best_so_far`) is not certain: `run_exporter` then runs
    and keeps it in ``best.json``, so that no later evaluation reads the history again."""
    if isinstance(exporter, FinalExporter):
        return not is_the_final_export(result, max_steps)
    if isinstance(exporter, BestExporter) and (
        exporter.compare_fn or exporter.metric in result.metrics
    ):  # (else run_exporter names the metrics)
        best, stored, _ = _best_so_far(storage, exporter, result)
        return (
            stored
            and best.get("step") != int(result.step)
            and not beats(exporter, result.metrics, int(result.step), best)
        )
    return False


def nothing_to_export(
    exporters: list[ExporterSpec], storage: JobStorage, result: EvalResult, max_steps: int | None
) -> bool:
    """True where no exporter of `exporters` writes anything for `result` (`exports_nothing`):
    then nothing needs the step's state for its exports."""
    return all(exports_nothing(e, storage, result, max_steps) for e in exporters)


def read_best(storage: JobStorage, exporter: BestExporter) -> dict | None:
    """The exporter's ``best.json`` (None: no best yet). A damaged one is rebuilt from what it
    summarises, the ``export.json`` of each step the exporter kept (their step and metrics,
    judged as the exporter judges), and the damaged copy kept beside it with a warning: read as
    absent, it would have let the next evaluation take @best from a better step."""
    path = best_path(storage, exporter.name)
    try:
        return read_record(storage, path)
    except DamagedRecordError as exc:
        best = None
        for step in exported_steps(storage, exporter.name):
            try:
                info = read_record(
                    storage, f"{storage.export_dir(exporter.name, step)}/{EXPORT_INFO_FILE}"
                )
            except DamagedRecordError as damaged:  # that export cannot be judged: not a candidate
                logger.warning("%s: the rebuilt best.json leaves step %d out", damaged, step)
                continue
            metrics = (info or {}).get("metrics")
            usable = metrics and (exporter.compare_fn or exporter.metric in metrics)
            if usable and beats(exporter, metrics, step, best):
                best = best_record(exporter, EvalResult.model_construct(step=step, metrics=metrics))
        moved = set_aside(storage, path)
        if best is not None:
            storage.write_json(path, best)
        logger.warning(
            "%s: moved aside to %s and rebuilt from the exports' records (best: step %s)",
            exc,
            moved,
            best and best["step"],
        )
        return best


def _best_so_far(storage: JobStorage, exporter: BestExporter, result: EvalResult):
    """What `result` must beat, and whether it is ``best.json`` as stored: the exporter's
    ``best.json``; else, as TF's BestExporter reads the eval history it finds, the best of the
    evaluations recorded before `result`'s step, as the exporter judges them: where the exporter
    was added to a job evaluated before (it does not put @best on a step worse than one already
    evaluated), or where ``best.json`` was judged by another metric, mode or compare_fn (a loss
    is not compared with an accuracy). ``(None, False, records)``: nothing to beat. The third
    value: the comparable eval records it read, None where it read ``best.json``."""
    best = read_best(storage, exporter)
    if best is not None and judged_alike(exporter, best):
        return best, True, None
    if best is not None:  # (a rerun or an export without the flags the job had: said)
        if best.get("compare_fn"):
            fn = best["compare_fn"]
            before = f"--best-compare-fn {fn} (BestExporter(compare_fn={fn!r}))"
        else:
            judged = {k: best[k] for k in ("metric", "mode") if best.get(k) is not None}
            flags = " ".join(f"--best-{k} {v}" for k, v in judged.items())
            before = f"{flags} (BestExporter({', '.join(f'{k}={v!r}' for k, v in judged.items())}))"
        logger.warning(
            "exporter %s: best.json was judged by %s, the exporter now judges by %s: the best so "
            "far is judged again from the eval records, and @best may move. To judge as before, "
            "give %s",
            exporter.name,
            best.get("compare_fn") or f"{best.get('metric')} ({best.get('mode')})",
            exporter.compare_fn or f"{exporter.metric} ({exporter.mode})",
            before,
        )
    records = EvalRecords(storage, result.name).all()
    if exporter.compare_fn:  # (records from before a metric was added: not comparable)
        records = [r for r in records if set(result.metrics) <= set(r.metrics)]
    found = best_of(exporter, [r for r in records if r.step < int(result.step)])
    return (None if found is None else best_record(exporter, found)), False, records


def _beaten_later(exporter: BestExporter, result: EvalResult, records: list) -> int | None:
    """A later step of `records` (the comparable ones `_best_so_far` read) whose evaluation
    beats `result`'s, or None: there are some where an export of an older step is asked for
    (`prefect-jax export --step`) with no ``best.json`` to judge by. TF's BestExporter,
    exporting in step order, would not have put @best on that step for long; here it is not put
    there at all (a tie leaves it to the earlier step, as then)."""
    mine = best_record(exporter, result)
    for r in records:
        if exporter.compare_fn is None and exporter.metric not in r.metrics:
            continue  # (as `best_of` leaves it out)
        if r.step > int(result.step) and beats(exporter, r.metrics, int(r.step), mine):
            return int(r.step)
    return None


def run_exporter(
    exporter: ExporterSpec,
    storage: JobStorage,
    result: EvalResult,
    max_steps: int,
    make_model: Callable[[], bytes],
    info: dict,
    registers: bool = False,
) -> tuple[str, bool] | None:
    """Run one exporter for one eval result.

    Args:
        exporter: the exporter spec.
        storage: the job's storage.
        result: an evaluated result (EVALUATED, or a recorded one: see `is_recorded`).
        max_steps: the job's `max_steps` (for `is_the_final_export`).
        make_model: builds the serialized model (called only when something is exported).
        info: extra metadata for ``export.json``.
        registers: the job registers its exports in MLflow: the older ones it has not registered
            yet are kept past `keep` a while (`export_retention.prune`).

    Returns:
        ``(export directory, written now)``: False where an earlier run (a rerun's, or one a
        kill cut short before its registration) wrote it; None when this exporter exports
        nothing for this result.
    """
    if not is_recorded(result):
        return None
    step = int(result.step)
    dest = storage.export_dir(exporter.name, step)
    best_file = best_path(storage, exporter.name)
    if isinstance(exporter, FinalExporter) and not is_the_final_export(result, max_steps):
        return None
    if isinstance(exporter, BestExporter):
        if exporter.compare_fn is None and exporter.metric not in result.metrics:
            raise ValueError(
                f"BestExporter {exporter.name!r} compares metric {exporter.metric!r}, but the eval "
                f"results hold {sorted(result.metrics)}; set metric= to one of those"
            )
        best, stored, records = _best_so_far(storage, exporter, result)
        if best is not None and best.get("step") == step:
            return (dest, False) if storage.fs.exists(dest) else None
        if not beats(exporter, result.metrics, step, best):
            if not stored:  # (judged from the history: kept, not judged again)
                storage.write_json(best_file, best)
            return None
        if not stored and _beaten_later(exporter, result, records) is not None:
            return None  # (best.json is left to that step's own export)
    written_now = not storage.fs.exists(dest)
    if written_now:
        _write_export(
            storage,
            dest,
            make_model(),
            dict(
                info,
                step=step,
                eval_name=result.name,
                metrics=result.metrics,
                exporter=exporter.model_dump(),
                exported_at=time.time(),
            ),
        )
    if isinstance(exporter, BestExporter):
        storage.write_json(best_file, best_record(exporter, result))
        prune(storage, exporter.name, exporter.keep, step, registers)
    elif isinstance(exporter, LatestExporter):
        prune(storage, exporter.name, exporter.keep, step, registers)
    return dest, written_now


def list_exports(storage: JobStorage) -> dict[str, list[int]]:
    """``{exporter name: [steps]}`` of every export under the job."""
    base = storage.path("exports")
    try:
        names = [p.rstrip("/").rsplit("/", 1)[-1] for p in storage.fs.ls(base, detail=False)]
    except FileNotFoundError:
        return {}
    return {n: exported_steps(storage, n) for n in sorted(names)}
