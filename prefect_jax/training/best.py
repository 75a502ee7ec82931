"""BestExporter's judgement: which evaluation is the best so far, by `metric` and `mode` or by a
`compare_fn` by import path (TF's `BestExporter(compare_fn=...)`), and what ``best.json`` holds."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from prefect_jax.training.eval_specs import BestExporter
from prefect_jax.training.evaluation import EvalResult


def _better(value: float, best: float | None, mode: str) -> bool:
    if best is None:
        return True
    return value < best if mode == "min" else value > best


_TF_NAMES = ("best_eval_result", "current_eval_result")


def load_compare_fn(path: str) -> Callable[[dict, dict], Any]:
    """A `BestExporter.compare_fn` by its import path, ``"package.module:function"``, as a
    function of (best, current). One that names TF's parameters is called by them, as TF's
    BestExporter calls it: ``def f(current_eval_result, best_eval_result)`` is valid TF, and was
    called the other way round; any other is called with the two in that order.

    Raises:
        ProgramError: it does not load, or is not callable; the message names the path.
    """
    from prefect_jax.training.program import ProgramError, check_called_with, import_path

    obj = import_path(path, "BestExporter compare_fn", "'package.module:function'")
    shape = "compare_fn(best_eval_result, current_eval_result) -> bool"
    if not callable(obj):
        raise ProgramError(
            f"BestExporter compare_fn {path!r} is a {type(obj).__name__}, not a function {shape}"
        )
    try:  # (callable by those names, nothing else required: not positional-only ones)
        inspect.signature(obj).bind(**dict.fromkeys(_TF_NAMES))
        named = True
    except (TypeError, ValueError):  # (no signature to read, or not so: called by position)
        named = False
    if named:
        return lambda best, current: obj(best_eval_result=best, current_eval_result=current)
    check_called_with(obj, 2, f"BestExporter compare_fn {path!r}", shape)
    return obj


def eval_result_dict(metrics: dict[str, float], step: int) -> dict[str, Any]:
    """An evaluation as a `compare_fn` gets it: its metrics and ``global_step``, as TF's eval
    results are."""
    return {**metrics, "global_step": int(step)}


def judged_alike(exporter: BestExporter, best: dict) -> bool:
    """Whether `best` (``best.json``) was judged as `exporter` judges: by the same compare_fn, or
    the same metric and mode."""
    if exporter.compare_fn is not None:
        return best.get("compare_fn") == exporter.compare_fn
    return best.get("compare_fn") is None and (best.get("metric"), best.get("mode")) == (
        exporter.metric,
        exporter.mode,
    )


def beats(exporter: BestExporter, metrics: dict, step: int, best: dict | None) -> bool:
    """Whether the evaluation (`metrics` at `step`) is better than `best` (``best.json``, None:
    no best yet): by `compare_fn(best, current)`, else `metric` under `mode`."""
    if best is None:
        return True
    if exporter.compare_fn is None:
        return _better(metrics[exporter.metric], best["value"], exporter.mode)
    # (a best written before the exporter had a compare_fn holds its one metric)
    best_metrics = best.get("metrics") or {best.get("metric"): best.get("value")}
    best_result = eval_result_dict(best_metrics, best["step"])
    try:
        return bool(
            load_compare_fn(exporter.compare_fn)(best_result, eval_result_dict(metrics, step))
        )
    except Exception as exc:
        raise ValueError(
            f"BestExporter {exporter.name!r}: compare_fn {exporter.compare_fn!r} failed comparing "
            f"step {step} with the best so far, step {best['step']} ({type(exc).__name__}: "
            f"{exc}); it gets two dicts of eval metrics with global_step (keys: "
            f"{sorted(eval_result_dict(metrics, step))})"
        ) from exc


def best_of(exporter: BestExporter, results: list[EvalResult]) -> EvalResult | None:
    """The best of `results` as the exporter judges (ties: the earliest step, as it keeps it)."""
    best: EvalResult | None = None
    for result in sorted(results, key=lambda r: r.step):
        if exporter.compare_fn is None and exporter.metric not in result.metrics:
            continue
        stored = None if best is None else best_record(exporter, best)
        if beats(exporter, result.metrics, int(result.step), stored):
            best = result
    return best


def best_record(exporter: BestExporter, result: EvalResult) -> dict[str, Any]:
    """What ``best.json`` holds for `result`."""
    record: dict[str, Any] = {"step": int(result.step), "metrics": dict(result.metrics)}
    if exporter.compare_fn is None:
        record.update(
            metric=exporter.metric, value=result.metrics[exporter.metric], mode=exporter.mode
        )
    else:
        record["compare_fn"] = exporter.compare_fn
    return record
