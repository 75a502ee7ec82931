"""Durable control of a job shared by its roles: stop requests and the rerun budget.

- ``<job>/stop.json``: someone (an early-stopping hook, a person) asked the job to stop. The
  trainer stops at its next checkpoint boundary; the evaluator stops after its current eval.
- ``<job>/attempts.json``: the steps at which recent runs of the trainer started. A rerun
  that starts at the same step as the run before made no progress; after
  `max_reruns_without_progress` of those, the trainer refuses to go on and says so, so an
  automation that reruns crashed runs cannot loop forever.

Also TF's `_ContinuousEvalListener` (`before_eval` / `after_eval`) as eval hooks, and an
early-stopping hook built on it (TF's `stop_if_no_decrease_hook`).
"""

from __future__ import annotations

import importlib
import time
from typing import Any

from prefect_jax.training.errors import NoProgressError
from prefect_jax.training.evaluation import EvalRecords, EvalResult
from prefect_jax.training.program import ProgramError
from prefect_jax.training.storage import JobStorage


def stop_path(storage: JobStorage) -> str:
    return storage.path("stop.json")


def request_stop(storage: JobStorage, reason: str, step: int | None = None, by: str = "") -> None:
    """Ask every role of the job to stop (durable: survives restarts)."""
    storage.write_json(
        stop_path(storage), {"reason": reason, "step": step, "by": by, "at": time.time()}
    )


def stop_requested(storage: JobStorage) -> dict | None:
    """The stop request, if any."""
    return storage.read_json(stop_path(storage))


def record_attempt(
    storage: JobStorage, step: int, max_without_progress: int | None, owner: str = ""
) -> int:
    """Record that a trainer run starts at `step`; return how many runs in a row started there.

    Raises:
        NoProgressError: more than `max_without_progress` reruns started at this same step.
    """
    path = storage.path("attempts.json")
    data = storage.read_json(path) or {}
    same = int(data.get("reruns_without_progress", 0)) + 1 if data.get("step") == step else 0
    if max_without_progress is not None and same > max_without_progress:
        raise NoProgressError(
            f"job {storage.job_dir} was rerun {same} times without getting past step {step} "
            f"(max_reruns_without_progress={max_without_progress}); not trying again. If those "
            "runs crashed, look at their logs; if they were stopped (preempted, killed) before "
            "their first checkpoint, checkpoint more often (CheckpointSpec.every_secs, "
            f"`--checkpoint-every-secs`) or give them longer. Then delete {path} to reset the "
            "budget."
        )
    storage.write_json(
        path, {"step": step, "reruns_without_progress": same, "owner": owner, "at": time.time()}
    )
    return same


class EarlyStoppingHook:
    """Stop when `metric` has not improved by `min_delta` for `max_steps_without_improvement` steps.

    TF's `stop_if_no_decrease_hook` / `stop_if_no_increase_hook`, computed from the durable
    eval records, so it gives the same answer after a restart.
    """

    def __init__(
        self, metric: str, mode: str, max_steps_without_improvement: int, min_delta: float = 0.0
    ):
        self.metric, self.mode = metric, mode
        self.max_steps_without_improvement, self.min_delta = (
            max_steps_without_improvement,
            min_delta,
        )

    def should_stop(self, records: list[EvalResult]) -> str | None:
        series = [(r.step, r.metrics[self.metric]) for r in records if self.metric in r.metrics]
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


def load_hooks(paths: list[str]) -> list[Any]:
    """Load eval hooks named by import path; each may define `before_eval(step) -> bool`
    (False skips that evaluation) and `after_eval(result) -> bool` (True stops the job)."""
    hooks = []
    for path in paths:
        try:
            module, _, attr = path.partition(":")
            obj = importlib.import_module(module)
            for part in attr.split("."):
                obj = getattr(obj, part)
        except (ImportError, AttributeError, ValueError) as exc:
            raise ProgramError(
                f"eval hook {path!r} cannot be loaded ({exc}); use 'package.module:attribute'"
            ) from exc
        if not (hasattr(obj, "before_eval") or hasattr(obj, "after_eval")):
            raise ProgramError(
                f"eval hook {path!r} defines neither before_eval(step) nor after_eval(result)"
            )
        hooks.append(obj)
    return hooks


def after_eval_stop_reason(
    result: EvalResult, records: EvalRecords, early: EarlyStoppingHook | None, hooks: list
) -> str | None:
    """Run the after-eval hooks on a new result; a reason to stop the job, or None."""
    if early is not None:
        reason = early.should_stop(records.all())
        if reason:
            return reason
    for hook in hooks:
        after = getattr(hook, "after_eval", None)
        if after is not None and after(result):
            return f"eval hook {type(hook).__name__}.after_eval asked to stop at step {result.step}"
    return None
