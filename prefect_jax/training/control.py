"""Durable control of a job shared by its roles: stop requests and the rerun budget.

- ``<job>/stop.json``: someone (an early-stopping hook, a person) asked the job to stop. The
  trainer stops at its next checkpoint boundary; the evaluator stops after its current eval.
- ``<job>/attempts.json``: the step the latest run of the trainer started at (the newest
  committed step, recorded once the run holds the lease, before it restores), and how many
  reruns in a row started there. A rerun
  that starts at the same step as the run before made no progress; after
  `max_reruns_without_progress` of those, the trainer refuses to go on and says so, so an
  automation that reruns crashed runs cannot loop forever.

Also the eval hooks: TF's `_ContinuousEvalListener` (`before_eval` / `after_eval`: a falsy answer
stops evaluating), prefect-jax's own `should_stop_job(result)` (True stops the whole job), and
early stopping (TF's `stop_if_no_decrease_hook`).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import time
from typing import Any

from prefect_jax.training.errors import EvalHookError, NoProgressError
from prefect_jax.training.evaluation import EvalRecords, EvalResult
from prefect_jax.training.names import ATTEMPTS_FILE, STOP_FILE
from prefect_jax.training.program import (
    ProgramError,
    import_path,
    made_if_class,
    positional_counts,
)
from prefect_jax.training.records import DamagedRecordError, read_record, set_aside
from prefect_jax.training.redaction import redact_url
from prefect_jax.training.storage import JobStorage

logger = logging.getLogger("prefect_jax.trainer")


def stop_path(storage: JobStorage) -> str:
    return storage.path(STOP_FILE)


def request_stop(storage: JobStorage, reason: str, step: int | None = None, by: str = "") -> None:
    """Ask every role of the job to stop (durable: survives restarts)."""
    storage.write_json(
        stop_path(storage), {"reason": reason, "step": step, "by": by, "at": time.time()}
    )


_BY_EVALUATION = "its evaluation "  # how an evaluation's stop request names who asked


def by_evaluation(name: str) -> str:
    """Who asked a stop that the evaluation `name` asked (early stopping, `should_stop_job`)."""
    return f"{_BY_EVALUATION}{name!r}"


def asked_by_an_evaluation(request: dict) -> bool:
    """Whether stop request `request` was an evaluation's: it ends the evaluations there, where
    another's (a train hook's, a person's) leaves the trainer's last checkpoint to evaluate."""
    return str(request.get("by") or "").startswith(_BY_EVALUATION)


def stop_requested(storage: JobStorage) -> dict | None:
    """The stop request, if any. A damaged one (a torn write) is still a request to stop: the
    file says somebody asked; its reason names the file and the fix."""
    path = stop_path(storage)
    try:
        return read_record(storage, path)
    except DamagedRecordError as exc:
        return {"reason": f"{exc}; a stop was asked: delete the file to let the job run on"}


def record_attempt(
    storage: JobStorage,
    step: int,
    max_without_progress: int | None,
    owner: str = "",
    process: str = "",
) -> int:
    """Record that a trainer run starts at `step`; return how many runs in a row started there.

    Raises:
        NoProgressError: more than `max_without_progress` reruns started at this same step.
    """
    return count_attempt(storage, step, max_without_progress, owner, process)[0]


def count_attempt(
    storage: JobStorage,
    step: int,
    max_without_progress: int | None,
    owner: str = "",
    process: str = "",
) -> tuple[int, dict | None]:
    """`record_attempt`, also returning the record it replaced, for `uncount_attempt`: ``{}``
    where there was none, None where it wrote nothing (a task retry)."""
    path = storage.path(ATTEMPTS_FILE)
    try:
        data = read_record(storage, path) or {}
    except DamagedRecordError as exc:  # a count of reruns: started again, the damaged copy kept
        logger.warning("%s: moved aside to %s; counting reruns anew", exc, set_aside(storage, path))
        data = {}
    counted = int(data.get("reruns_without_progress", 0))
    recorded_here = owner and data.get("owner") == owner and data.get("process") == process
    if data.get("step") == step and recorded_here:
        return counted, None  # a task retry (the flow run and process that recorded it)
    same = counted + 1 if data.get("step") == step else 0
    if max_without_progress is not None and same > max_without_progress:
        raise NoProgressError(
            f"job {redact_url(storage.job_dir)} was rerun {same} times without getting past "
            f"step {step} (max_reruns_without_progress={max_without_progress}); not trying again. "
            "If those runs crashed, look at their logs; if they were stopped (preempted, killed) "
            "before their first checkpoint, checkpoint more often (CheckpointSpec.every_secs, "
            "`--checkpoint-every-secs`) or give them longer. Then delete "
            f"{redact_url(path)} to reset the budget."
        )
    storage.write_json(
        path,
        {
            "step": step,
            "reruns_without_progress": same,
            "owner": owner,
            "process": process,
            "at": time.time(),
        },
    )
    return same, data


def uncount_attempt(storage: JobStorage, replaced: dict | None) -> None:
    """Put back the record `count_attempt` replaced (`replaced`, as it returned it): the run it
    counted was refused for its input (another seed, program params or state tree), which is no
    rerun that failed to progress, and its corrected rerun must not find the budget spent."""
    if replaced is None:
        return
    path = storage.path(ATTEMPTS_FILE)
    if replaced:
        storage.write_json(path, replaced)
    else:
        with contextlib.suppress(FileNotFoundError):
            storage.fs.rm(path)


class EarlyStoppingHook:
    """Stop when `metric` has not improved by `min_delta` for `max_steps_without_improvement` steps,
    counting only evaluations at `min_steps` or later.

    TF's `stop_if_no_decrease_hook` / `stop_if_no_increase_hook`, computed from the durable
    eval records, so it gives the same answer after a restart.
    """

    def __init__(
        self,
        metric: str,
        mode: str,
        max_steps_without_improvement: int,
        min_delta: float = 0.0,
        min_steps: int = 0,
    ):
        self.metric, self.mode, self.min_delta = metric, mode, min_delta
        self.max_steps_without_improvement, self.min_steps = (
            max_steps_without_improvement,
            min_steps,
        )

    @classmethod
    def of(cls, spec) -> EarlyStoppingHook:
        """The hook an `EarlyStopping` spec describes."""
        return cls(
            spec.metric,
            spec.mode,
            spec.max_steps_without_improvement,
            spec.min_delta,
            spec.min_steps,
        )

    def should_stop(self, records: list[EvalResult]) -> str | None:
        series = [
            (r.step, r.metrics[self.metric])
            for r in records
            if self.metric in r.metrics and r.step >= self.min_steps
        ]
        if not series:
            return None
        sign = 1.0 if self.mode == "min" else -1.0
        best_step, best = series[0]
        for step, value in series[1:]:
            if sign * (best - value) > self.min_delta:
                best_step, best = step, value
        last_step = series[-1][0]
        if last_step - best_step >= self.max_steps_without_improvement:
            return (
                f"early stopping: {self.metric} has not improved by more than {self.min_delta} for "
                f"{last_step - best_step} steps (best {best:.6g} at step {best_step}, last eval at "
                f"step {last_step})"
            )
        return None


HOOK_METHODS = ("before_eval", "after_eval", "should_stop_job")


def _check_hook(path: str, hook: Any) -> None:
    if not any(hasattr(hook, name) for name in HOOK_METHODS):
        raise ProgramError(
            f"eval hook {path!r} defines none of before_eval() or before_eval(step), "
            "after_eval(result), should_stop_job(result): define at least one"
        )
    # TF's before_eval takes no argument; prefect-jax also passes the step to one that takes it.
    wanted = {
        "before_eval": (0, 1, "before_eval() or before_eval(step)"),
        "after_eval": (1, 1, "after_eval(result)"),
        "should_stop_job": (1, 1, "should_stop_job(result)"),
    }
    for name, (least, most, shape) in wanted.items():
        method = getattr(hook, name, None)
        if method is None:
            continue
        try:
            required, accepted = positional_counts(method)
        except (TypeError, ValueError):  # no signature to read (a builtin): called as documented
            continue
        if required > most or accepted < least:
            raise ProgramError(
                f"eval hook {path!r}: {name} takes {required} required positional arguments "
                f"(at most {accepted}); define it as {shape}"
            )


def load_hooks(paths: list[str]) -> list[Any]:
    """Load eval hooks named by import path; a class is instantiated with no arguments (one
    listener per trainer, as TF makes one per evaluator). A hook may define:

    - `before_eval()` or `before_eval(step)`: TF's; a falsy answer stops evaluating (no more
      evaluations or exports by this evaluator; see `before_eval_stop`).
    - `after_eval(result)`: TF's; called with each recorded `EvalResult`, a falsy answer stops
      evaluating after that evaluation and its exports.
    - `should_stop_job(result)`: prefect-jax's own; True asks the whole job to stop, as a stop
      request does (`<job>/stop.json`: the trainer and the evaluator both end).
    """
    hooks = []
    for path in paths:
        obj = made_if_class(import_path(path, "eval hook"), path, "eval hook", "name an instance")
        _check_hook(path, obj)
        hooks.append(obj)
    return hooks


def _name(hook: Any, method: str) -> str:
    owner = hook.__name__ if inspect.ismodule(hook) else type(hook).__name__
    return f"{owner}.{method}"


def _ask(hook: Any, method: str, step: int | None, *args) -> Any:
    """`hook.method(*args)`; an exception raised there becomes `EvalHookError`, naming it."""
    try:
        return getattr(hook, method)(*args)
    except Exception as exc:
        raise EvalHookError(_name(hook, method), step, exc) from exc


def for_listeners(result: EvalResult) -> EvalResult:
    """The result a hook gets: its metrics with ``global_step``, as TF's eval dicts carry it
    (a `_ContinuousEvalListener` reads ``eval_result.metrics["global_step"]``)."""
    if result.step is None:
        return result
    return result.model_copy(update={"metrics": {**result.metrics, "global_step": result.step}})


# (a listener that only logs returns None: it ends the evaluations after its first one, as TF's)
_KEEP_GOING = "return True to keep evaluating"


def before_eval_stop(hooks: list, step: int) -> str | None:
    """Ask each hook's `before_eval` before evaluating `step` (with the step if it takes one);
    why evaluating stops (TF: a falsy answer ends the continuous evaluation), or None."""
    for hook in hooks:
        before = getattr(hook, "before_eval", None)
        if before is None:
            continue
        try:
            takes_step = positional_counts(before)[1] > 0
        except (TypeError, ValueError):
            takes_step = True
        answer = _ask(hook, "before_eval", step, *([step] if takes_step else []))
        if not answer:
            return (
                f"eval listener {_name(hook, 'before_eval')} returned {answer!r} before step "
                f"{step}: no more evaluations (TF's _ContinuousEvalListener; {_KEEP_GOING})"
            )
    return None


def after_eval_stop(hooks: list, result: EvalResult) -> str | None:
    """Give a recorded result to each hook's `after_eval`; why evaluating stops (TF: a falsy
    answer ends the continuous evaluation), or None."""
    for hook in hooks:
        if getattr(hook, "after_eval", None) is None:
            continue
        answer = _ask(hook, "after_eval", result.step, for_listeners(result))
        if not answer:
            return (
                f"eval listener {_name(hook, 'after_eval')} returned {answer!r} after step "
                f"{result.step}: no more evaluations (TF's _ContinuousEvalListener; "
                f"{_KEEP_GOING})"
            )
    return None


def job_stop_reason(
    result: EvalResult, records: EvalRecords, early: EarlyStoppingHook | None, hooks: list
) -> str | None:
    """Early stopping and each hook's `should_stop_job` on a new result; a reason to stop the
    job, or None."""
    if early is not None:
        reason = early.should_stop(records.all())
        if reason:
            return reason
    for hook in hooks:
        if getattr(hook, "should_stop_job", None) is None:
            continue
        if _ask(hook, "should_stop_job", result.step, for_listeners(result)):
            return f"eval hook {_name(hook, 'should_stop_job')} asked to stop at step {result.step}"
    return None
