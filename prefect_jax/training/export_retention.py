"""How many of an exporter's exports stay: the newest `keep` (TF's exporters' ``exports_to_keep``),
and, where the job registers its exports in MLflow, the older ones MLflow has not registered yet,
up to a bound. MLflow's worker registers behind the training (`Tracker.register_exports`): a
fast cadence with a slow MLflow pruned exports before they were ever versions.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable

from prefect_jax.training.eval_specs import BestExporter, ExporterSpec, LatestExporter
from prefect_jax.training.names import REGISTRY_FILE
from prefect_jax.training.storage import JobStorage

logger = logging.getLogger("prefect_jax.trainer")  # shown in the flow run's logs


def registered_steps(storage: JobStorage, name: str | None = None) -> set[int]:
    """The steps the job's registry record (``registry.json``, written once MLflow registered
    them) holds as versions (of registered model `name`, where given: a job given another
    model since has none of it); empty where there is none, or it cannot be read."""
    try:
        recorded = storage.read_json(storage.path(REGISTRY_FILE)) or {}
        if name is not None and recorded.get("name") != name:
            return set()
        return {int(step) for step in recorded.get("versions") or {}}
    except (OSError, ValueError, TypeError, AttributeError):
        return set()


# Exports MLflow has not registered kept past `keep` (`prune`): what a long MLflow outage costs
# on disk, `keep` + this many exports of each exporter at most.
HELD_UNREGISTERED = 10


def prune_registered(
    storage: JobStorage,
    exporters: list[ExporterSpec],
    best_step: Callable[[BestExporter], int | None],
) -> None:
    """Once MLflow registered exports (``registry.json`` written), the ones `prune` held for it
    go, so that each exporter is back to its `keep`; a best exporter's best (`best_step`) stays,
    whichever step it is (an older step exported after a newer one, by another process)."""
    for exporter in exporters:
        if isinstance(exporter, LatestExporter):
            prune(storage, exporter.name, exporter.keep, None, registers=True)
        elif isinstance(exporter, BestExporter):
            prune(storage, exporter.name, exporter.keep, best_step(exporter), registers=True)


def prune(
    storage: JobStorage, name: str, keep: int | None, step: int | None, registers: bool
) -> None:
    """Keep the newest `keep` exports of exporter `name` and `step` (just written, or the best).
    Where the job `registers` its exports, an older one MLflow has not registered yet stays too
    (its worker registers exports in the background, behind the training: pruned first, an
    export was never a version), up to `HELD_UNREGISTERED` (or `keep`) of them: MLflow further
    behind than that loses the oldest, said."""
    if keep is None:
        return
    steps = storage.list_int_names(storage.export_dir(name))
    doomed = [s for s in steps[: max(0, len(steps) - keep)] if s != step]
    if registers and doomed:
        registered = registered_steps(storage)
        waiting = [s for s in doomed if s not in registered]
        held = set(waiting[-max(keep, HELD_UNREGISTERED) :])
        doomed = [s for s in doomed if s not in held]
        lost = [s for s in doomed if s not in registered]
        if lost:
            logger.warning(
                "exporter %s: the exports of steps %s are pruned before MLflow registered them "
                "(it is more than %d exports behind): they will not be versions of the registered "
                "model",
                name,
                lost,
                max(keep, HELD_UNREGISTERED),
            )
    for old in doomed:  # (an export and a registration's end may prune at once)
        with contextlib.suppress(FileNotFoundError):
            storage.fs.rm(storage.export_dir(name, old), recursive=True)
