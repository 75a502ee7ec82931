"""A command's compile begun before its flow run, for the trainer that the flow run makes next.

A rerun after a preemption spends seconds before its first new step: Prefect's start-up, the
flow run's creation, the restore, and the compile of the train step (a trace in Python, then
XLA's compile, which runs outside Python's lock). The trainer starts that compile beside its
restore (`Loop.start_precompile`); a ``prefect-jax run`` of one process knows the job's program
and train spec as soon as its preflight has passed, before any of Prefect's work. There it
`begin`s the loop early: the program, its `Loop`, the compile on its thread, and the job's
compilation cache opened for it. The flow run's trainer of the same job in this process then
`adopt`s them (`Trainer.__init__`) instead of making its own, so the compile overlaps the flow
run's start as well as the restore, and the train step is still traced once. On object storage
it also begins the download of the newest step that the restore will read
(`prefect_jax.training.step_prefetch`).

Only a whole match is adopted (the program, its params, the train spec, the storage, the job and
the cache); anything else makes its own, as without a head start. What a compile writes goes to
the compilation cache only (with ``--compilation-cache job``, the job's ``compile-cache``
folder), nothing else of the job; the prefetch writes this machine's local stage only.

What the trainer refuses as it is made (`preflight.check_job_parts`) the preflight refuses before
the compile begins: a command refused later (a flow run that fails to start, the job's lease taken
meanwhile) waits for that compile to end before it exits, as a refused trainer waits for its own.

Begun before the flow run takes the job's lease, it starts JAX before that lease too: a second
command of a job whose trainer is still starting (its lease not taken yet) starts JAX before it is
refused, where a worker's duplicate flow run still waits for the lease first (`lease_early`).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

from prefect_jax.training import step_prefetch
from prefect_jax.training.compile_cache import open_compilation_cache
from prefect_jax.training.compile_cache_mirror import CompileCacheMirror
from prefect_jax.training.eval_specs import compared_metric_names
from prefect_jax.training.loop import Loop
from prefect_jax.training.program_params import ProgramParams
from prefect_jax.training.specs import JobConfig, TrainSpec
from prefect_jax.training.storage import JobStorage, normalize_root

logger = logging.getLogger("prefect_jax.trainer")


@dataclass
class HeadStart:
    """What `begin` made for one job, until its trainer adopts it."""

    key: str
    program: Any
    program_params: ProgramParams
    loop: Loop
    compile_cache: CompileCacheMirror | None  # a remote cache's mirror, pulling
    cache_opened: bool  # the job's compilation cache is open (as `open_compilation_cache` left it)
    # the export platforms the preflight checked serve for (`check_serving_early`), if it did
    serving_checked: tuple[str, ...] | None = None
    # the eval metrics the preflight checked (`preflight.check_evaluation`), if it did
    metrics_checked: tuple[str, ...] | None = None

    def checked_metrics_of(self, eval_spec: Any) -> bool:
        """Whether the preflight checked the metrics that `eval_spec` names (its trainer's may
        name others: a flow given another eval spec than `facade.preflight` was)."""
        asked = compared_metric_names(eval_spec)
        return self.metrics_checked is not None and self.metrics_checked == asked


_begun: HeadStart | None = None


def _key(
    program: str,
    program_params: dict[str, Any] | None,
    train: TrainSpec,
    storage: str,
    job: str,
    compilation_cache: str | None,
) -> str:
    # (the params as JSON: a flow run's parameters come back from Prefect's JSON, lists for tuples)
    params = json.dumps(program_params or {}, sort_keys=True, default=str)
    return json.dumps(
        [program, params, train.model_dump(mode="json"), storage, job, compilation_cache],
        sort_keys=True,
        default=str,
    )


def begin(
    program_ref: str,
    program: Any,
    program_params: ProgramParams,
    given_params: dict[str, Any] | None,
    train: TrainSpec,
    storage: JobStorage,
    compilation_cache: str | None,
    serving_checked: tuple[str, ...] | None = None,
    metrics_checked: tuple[str, ...] | None = None,
) -> bool:
    """Make the job's `Loop` for `program` (loaded from `program_ref` with `given_params`) and
    start the compile of its steps, after opening the job's compilation cache (`compilation_cache`
    as `JobConfig.compilation_cache_dir`); `serving_checked`: the export platforms the preflight
    checked ``serve`` for, if it did; `metrics_checked`: the eval metrics it checked, if it did.
    For one JAX process whose preflight has passed, which found no live trainer holding the job
    (`preflight_job.check_job`). Whether it began: any failure is left for the trainer to meet and
    report."""
    global _begun
    try:
        mirror, opened = None, False
        if compilation_cache:
            mirror = open_compilation_cache(compilation_cache, storage)
            opened = True
        key = _key(program_ref, given_params, train, storage.root, storage.job, compilation_cache)
        step_prefetch.begin(storage)  # (object storage: the step the restore will download)
        loop = Loop(program, train)
        loop.start_precompile(before=mirror.wait_pulled if mirror is not None else None)
    except Exception:  # noqa: BLE001 - the trainer does the same again and says what failed
        logger.debug("no head start for job %s", storage.job, exc_info=True)
        return False
    _begun = HeadStart(
        key, program, program_params, loop, mirror, opened, serving_checked, metrics_checked
    )
    return True


def adopt(config: JobConfig) -> HeadStart | None:
    """The head start `begin` made for the job of `config` in this process, once; None where
    none was made or it was made for another (its compile finishes unused: the process's exit
    waits for it, as for any compile under way)."""
    global _begun
    begun, _begun = _begun, None
    if begun is None:
        return None
    key = _key(
        config.program,
        config.program_params,
        config.train,
        normalize_root(config.storage),
        config.job,
        config.compilation_cache_dir,
    )
    if begun.key != key:
        logger.debug("the head start made for another job's config is not used")
        return None
    return begun


__all__ = ["HeadStart", "adopt", "begin"]
