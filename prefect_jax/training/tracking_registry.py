"""The registry side of a `Tracker`: the job's exports as MLflow Models of its run and versions
of its registered model (`prefect_jax.training.registry` does the work, in the MLflow worker).

`RegistryCalls` is a base of `Tracker` (with `RunCalls`, `MetricCalls`): its public methods queue
a call (`Tracker._call`); the underscored ones run it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from prefect_jax.training.mlflow_client import guarded

logger = logging.getLogger("prefect_jax.tracking")


class RegistryCalls:
    """The job's exports as MLflow Models and registry versions (part of `Tracker`)."""

    def warm_registry(self) -> Future | None:
        """Have the worker process make ready, now and beside this tracker's calls, what its first
        logged model would otherwise wait for (`registry.warm_jax`, `registry.warm_mlflow`: JAX
        and its CPU client, MLflow's model modules, its map of installed packages): seconds of CPU
        at its nice level, which the first `register_exports` paid in the queue, ahead of every
        later MLflow write. Once per worker. Returns what answers once it is done (its error, if
        any; the first export then fails with its own); None where MLflow runs in this process
        (``PREFECT_JAX_MLFLOW_IN_PROCESS``, or no worker could start), which does it at that
        first export."""
        return self._remote.worker.warm_registry() if self._remote is not None else None

    def register_exports(
        self,
        name: str,
        job: str,
        aliases: dict[str, int],
        local_export: Callable[[int], str],
        example,
        on_done: Callable[[dict], None] | None = None,
        description: str = "",
        steps: list[int] = (),
        notes: dict[int, str] | None = None,
    ) -> Future:
        """In the background: each exported step (`steps`, and each step an alias points at)
        becomes an MLflow Model of the run and a version of registered model `name` (once), and
        the aliases move (see `registry.sync_registry`); `notes`: a step's evaluation, for its
        version's description. `local_export` must pickle (it runs in the worker process);
        `on_done` gets the result in this process."""
        future = self._call(
            "_register_exports",
            name,
            job,
            aliases,
            local_export,
            example,
            description,
            list(steps),
            dict(notes or {}),
        )
        if on_done is None:
            return future
        # Done once `on_done` ran too, and waited for so: the callbacks of a future run after its
        # waiters wake, and a job's end must find what `on_done` writes (registry.json), its
        # lease still held.
        done: Future = Future()

        def then(f: Future) -> None:
            try:
                _after(f, on_done)
            finally:
                if f.exception() is not None:
                    done.set_exception(f.exception())
                else:
                    done.set_result(f.result())

        future.add_done_callback(then)
        self._pending.append(done)
        return done

    @guarded
    def _register_exports(
        self, name, job, aliases, local_export, example, description, steps, notes=None
    ) -> dict:
        from prefect_jax.training.registry import sync_registry

        return sync_registry(
            self._client,
            self.tracking_uri,
            self._experiment_id,
            self._run_id,
            name,
            job,
            self.job_key,
            aliases,
            local_export,
            example,
            description,
            steps,
            notes,
        )


def _after(future: Future, fn: Callable[[Any], None]) -> None:
    """`fn(result)` of a background call that answered (not one that failed or was skipped)."""
    if future.exception() is None and future.result() is not None:
        try:
            fn(future.result())
        except Exception as exc:  # noqa: BLE001 - tracking must never stop training
            logger.warning("after an MLflow call: %r", exc)
