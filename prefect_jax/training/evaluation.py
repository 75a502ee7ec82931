"""Evaluation: exact aggregation of `eval_step` sums, validated results, durable records."""

from __future__ import annotations

import enum
import logging
import math
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from prefect_jax.training.records import DamagedRecordError, read_record, set_aside
from prefect_jax.training.storage import JobStorage

logger = logging.getLogger("prefect_jax.records")


class EvalStatus(str, enum.Enum):
    """What an evaluation attempt found (TF's continuous-eval statuses, plus throttling)."""

    EVALUATED = "EVALUATED"
    MISSING_CHECKPOINT = "MISSING_CHECKPOINT"
    NO_NEW_CHECKPOINT = "NO_NEW_CHECKPOINT"
    THROTTLED = "THROTTLED"
    # A checkpoint a preemption notice made off the every_steps cadence: kept to resume from,
    # never evaluated or exported (an interrupted job then evaluates the steps an uninterrupted one
    # does).
    PREEMPTION_CHECKPOINT = "PREEMPTION_CHECKPOINT"
    # One of several JAX processes other than process 0, which alone evaluates (on its replica).
    OTHER_PROCESS = "OTHER_PROCESS"
    # An eval listener stopped this trainer's evaluations (TF's before_eval / after_eval
    # answered False): nothing more is evaluated or exported by it.
    EVALUATION_STOPPED = "EVALUATION_STOPPED"


class EvalResult(BaseModel):
    """The outcome of one evaluation attempt (TF's `_EvalResult`, validated).

    An EVALUATED result must carry the global step it was computed at and its metrics.
    """

    model_config = ConfigDict(frozen=True)

    status: EvalStatus
    name: str = "eval"
    step: int | None = Field(None, description="Global step of the evaluated checkpoint.")
    metrics: dict[str, float] = Field(default_factory=dict)
    num_batches: int = 0
    num_examples: int | None = None
    evaluated_at: float | None = None
    started_at: float | None = Field(
        None,
        description="When the evaluation began (time.time()): throttle_secs counts from it, as "
        "TF's does; None in records written before it was kept (their evaluated_at counts).",
    )
    is_final: bool = False
    checkpoint_path: str | None = Field(
        None,
        description="The evaluated step's checkpoint (TF's _EvalResult.checkpoint_path): its "
        "directory, or its URL on object storage (redacted); None in records written before.",
    )
    stop_reason: str | None = Field(
        None, description="Why an eval hook asked the job to stop, if it did."
    )
    evaluation_stopped: str | None = Field(
        None,
        description="Why an eval listener stopped evaluating (its before_eval or after_eval "
        "answered False), if it did: no more evaluations or exports; training goes on.",
    )
    pending_commit: bool = Field(
        False,
        description="Evaluated on the trainer's live step while that step's checkpoint was still "
        "being written: recorded (MLflow, the durable records, the eval event) once the "
        "checkpoint commits, while training goes on; never if it does not commit (the rerun "
        "evaluates the step again).",
    )

    @model_validator(mode="after")
    def _validate(self):
        if self.status is EvalStatus.EVALUATED:
            if self.step is None or self.step < 0:
                raise ValueError(
                    "EvalResult EVALUATED needs the global step it was computed at, got "
                    f"step={self.step!r}"
                )
            if not self.metrics:
                raise ValueError(
                    f"EvalResult EVALUATED at step {self.step} has no metrics: eval_step returned "
                    "an empty dict"
                )
        return self


def derived(derive_metrics: Callable | None, means: dict[str, float]) -> dict[str, float]:
    """`means` with the metrics `derive_metrics` (the program's, optional) computes from them,
    e.g. perplexity from the mean loss.

    Raises:
        ValueError: `derive_metrics` returned no dict of numbers, or a name `eval_step` already
            aggregates.
    """
    if derive_metrics is None:
        return means
    extra = derive_metrics(dict(means))
    if not isinstance(extra, dict):
        raise ValueError(
            f"derive_metrics returned {type(extra).__name__} {extra!r}: it must return a dict of "
            "new metric names to floats, e.g. {'perplexity': math.exp(means['loss'])}"
        )
    clash = sorted(set(extra) & set(means))
    if clash:
        raise ValueError(
            f"derive_metrics returned {clash}, already aggregated by eval_step: give a derived "
            "metric a name of its own"
        )
    try:
        return {**means, **{str(k): float(v) for k, v in extra.items()}}
    except (TypeError, ValueError) as exc:
        raise ValueError(
            f"derive_metrics returned {extra!r}: each value must be a number ({exc})"
        ) from None


class EvaluationAbandoned(Exception):
    """An evaluation made ahead of its need was given up (`aggregate`'s `stop`)."""


def refuse_endless_eval_data(eval_data, steps: int | None) -> None:
    """Refuse an `eval_data()` that never ends (a MapDataset repeated without a number of epochs:
    its length is ``sys.maxsize``, or that over the batch size where it is batched after) where
    `steps` is None, the whole eval set: the evaluation would run until killed, silently. (An
    IterDataset's length is unknown until it ends.)

    Raises:
        EndlessEvalDataError: naming the two fixes.
    """
    import grain

    if steps is not None or not isinstance(eval_data, grain.MapDataset):
        return
    try:  # (2**40 batches: more than any eval set read whole, fewer than any repeat's batches)
        endless = len(eval_data) >= 2**40
    except TypeError:  # (a MapDataset whose source has no length)
        return
    if endless:
        from prefect_jax.training.errors import EndlessEvalDataError

        raise EndlessEvalDataError(
            "the program's eval_data() never ends (a .repeat() with no num_epochs), and the "
            "evaluation reads the whole eval set (eval steps None): it would never end. Drop the "
            ".repeat(), or give a number of eval batches (--eval-steps N, EvalSpec(steps=N)), as "
            "TF's EvalSpec.steps bounds a repeated input_fn"
        )


def eval_batches(eval_data, steps: int | None = None) -> Iterator:
    """The batches of one pass over a program's `eval_data()` (an endless one refused where the
    pass reads it all: `steps` None). A finite pass needs no resumable iterator: a MapDataset is
    read by index, without Grain's prefetch threads (starting them cost more than a whole
    evaluation of a small eval set)."""
    import grain

    refuse_endless_eval_data(eval_data, steps)
    if isinstance(eval_data, grain.MapDataset):
        return (eval_data[i] for i in range(len(eval_data)))
    from prefect_jax.training.data_positions import iterate

    return iterate(eval_data)


def evaluate_pass(
    program,
    eval_step: Callable,
    state,
    steps: int | None,
    place: Callable | None = None,
    stop: Callable[[], bool] | None = None,
    give_up: Callable[[], bool] | None = None,
) -> tuple[dict[str, float], int, int | None]:
    """`aggregate` over one pass of `program`'s ``eval_data()`` (each batch through `place`, if
    given), with its ``derive_metrics``."""
    batches = eval_batches(program.eval_data(), steps)
    if place is not None:
        batches = map(place, batches)
    derive = getattr(program, "derive_metrics", None)
    return aggregate(eval_step, state, batches, steps, derive, stop, give_up)


def aggregate(
    eval_step: Callable,
    state,
    batches,
    steps: int | None,
    derive_metrics: Callable | None = None,
    stop: Callable[[], bool] | None = None,
    give_up: Callable[[], bool] | None = None,
) -> tuple[dict[str, float], int, int | None]:
    """Run `eval_step` over `batches` (at most `steps`) and divide summed values by summed counts.

    `eval_step` returns ``{name: (sum, count)}``. Sums stay on the device until the end, so
    the host waits once per evaluation, not once per batch. The program's optional
    `derive_metrics` then adds metrics computed from those means (see `derived`). With `stop`,
    the pass stays within one batch of the device and raises `EvaluationAbandoned` at the first
    batch boundary where `stop()` is True: a batch's time after it turns True, not the pass's.
    `give_up` is asked before each batch too, without waiting for the device (the batches queued
    on it run to their end, unread): `EvaluationAbandoned` where it is True.

    Returns:
        (metrics, number of batches, number of examples if the program reports ``count``).
    """
    import itertools

    import jax

    totals = previous = None
    n = 0
    for batch in batches if steps is None else itertools.islice(batches, steps):
        if stop is not None:
            if previous is not None:
                jax.block_until_ready(previous)
            if stop():
                raise EvaluationAbandoned(f"given up after {n} batches")
        if give_up is not None and give_up():
            raise EvaluationAbandoned(f"given up after {n} batches")
        out = eval_step(state, batch)
        totals = out if totals is None else jax.tree_util.tree_map(lambda a, b: a + b, totals, out)
        previous = out
        n += 1
    if totals is None:
        raise ValueError("eval_data() yielded no batches: the eval set is empty, or steps=0")
    totals = jax.device_get(totals)
    metrics: dict[str, float] = {}
    examples = None
    check_pairs(totals)
    for name, value in totals.items():
        total, count = float(value[0]), float(value[1])
        metrics[name] = total / count if count else math.nan
        if examples is None:
            examples = int(count)
    return derived(derive_metrics, metrics), n, examples


def check_pairs(out: dict) -> None:
    """Refuse an `eval_step` output (its values, or their shapes) that is not a dict of
    ``(sum, count)`` pairs, naming the metric and the fix (`EvalOutputError`: never retried)."""
    from prefect_jax.training.errors import EvalOutputError

    if not isinstance(out, Mapping):
        raise EvalOutputError(
            f"eval_step returned {type(out).__name__} {out!r}; it must return a dict of metrics, "
            "each a (sum, count) pair, e.g. {'accuracy': (correct.sum(), labels.size)}"
        )
    for name, value in out.items():
        if not (isinstance(value, (tuple, list)) and len(value) == 2):
            raise EvalOutputError(
                f"eval_step returned {name!r}={value!r}; each metric must be a (sum, count) pair, "
                "e.g. {'accuracy': (correct.sum(), labels.size)}"
            )


class EvalRecords:
    """Durable record of evaluated steps: ``<job>/evals/<name>/<step>.json``.

    A step's record is written once and never changes, so records read or written here are
    kept in memory: the results table of every eval does not re-read every earlier record.

    A record that is not JSON (torn, damaged) counts as no record: the job's `writer` moves it
    aside (``<step>.json.damaged-<time>``) with a warning naming it, and the step is evaluated
    again; a reader only warns.
    """

    def __init__(self, storage: JobStorage, name: str, writer: bool = False):
        self.storage = storage
        self.name = name
        self.dir = storage.eval_dir(name)
        self.writer = writer
        self._known: dict[int, EvalResult] = {}

    def steps(self) -> list[int]:
        return self.storage.list_int_names(self.dir)

    def get(self, step: int) -> EvalResult | None:
        step = int(step)
        if step not in self._known:
            path = f"{self.dir}/{step}.json"
            try:
                data = read_record(self.storage, path)
            except DamagedRecordError as exc:
                self._damaged(step, exc)
                return None
            if not data:
                return None
            self._known[step] = EvalResult.model_validate(data)
        return self._known[step]

    def newest_known(self) -> EvalResult | None:
        """The newest record this process wrote or read; never asks the storage (a progress
        card's look costs no round trip: the live step's record is written once it commits)."""
        return self._known[max(self._known)] if self._known else None

    def _damaged(self, step: int, exc: DamagedRecordError) -> None:
        if not self.writer:
            logger.warning("%s: not counted (the job's trainer evaluates step %d again)", exc, step)
            return
        moved = set_aside(self.storage, exc.path)
        logger.warning(
            "%s: moved aside to %s; the evaluation of step %d is redone if the step is committed",
            exc,
            moved,
            step,
        )

    def put(self, result: EvalResult) -> None:
        if result.status is not EvalStatus.EVALUATED:
            raise ValueError(f"only EVALUATED results are recorded, got {result.status.value}")
        # (`pending_commit` is not kept: a record is of a committed step)
        self.storage.write_json(
            f"{self.dir}/{result.step}.json",
            result.model_dump(mode="json", exclude={"pending_commit"}),
        )
        self._known[int(result.step)] = result

    def discard(self, step: int, why: str) -> str:
        """Move a step's record aside (``<step>.json.<why>-<time>``, no longer counted); returns
        where."""
        src = f"{self.dir}/{int(step)}.json"
        dst = f"{src}.{why}-{int(time.time())}"
        self.storage.fs.mv(src, dst)
        self._known.pop(int(step), None)
        return dst

    def last_started_at(self) -> float | None:
        """When the newest recorded evaluation began (its end, for a record without the start)."""
        steps = self.steps()
        if not steps:
            return None
        last = self.get(steps[-1])
        return (last.started_at or last.evaluated_at) if last else None

    def all(self) -> list[EvalResult]:
        return [r for r in (self.get(s) for s in self.steps()) if r is not None]


def throttle_wait(last_started: float | None, throttle_secs: float, now: float) -> float:
    """The seconds before the next evaluation may start (0: now): TF's ``throttle_secs``,
    counted from the start of the last one, as TF's timer does. The one rule local mode
    (`throttled`: it skips the step) and the evaluator role (it waits) apply; neither throttles
    the final step."""
    if last_started is None or throttle_secs <= 0:
        return 0.0
    return max(0.0, throttle_secs - (now - last_started))


def throttled(
    records: EvalRecords, throttle_secs: float, now: Callable[[], float] = time.time
) -> bool:
    """Whether the records' last evaluation started less than `throttle_secs` ago."""
    if throttle_secs <= 0:  # (the records are not read)
        return False
    return throttle_wait(records.last_started_at(), throttle_secs, now()) > 0


def as_row(result: EvalResult) -> dict[str, Any]:
    return {"step": result.step, **{k: round(v, 6) for k, v in sorted(result.metrics.items())}}
