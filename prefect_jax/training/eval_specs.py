"""Evaluation specs: how to evaluate (TF's `EvalSpec`), what to export after each
evaluation (`LatestExporter`, `BestExporter`, `FinalExporter`) and when to stop early.

Plain, JSON-able pydantic models like the other specs; `prefect_jax.training.specs`
re-exports every name here, and that is where flows, deployments and users import them from.

This module imports neither jax nor prefect.
"""

from __future__ import annotations

import posixpath
import re
from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from prefect_jax.training.names import EXPORTER_KINDS, REGISTERING_FLOWS, RESERVED_EVAL_NAMES
from prefect_jax.training.spec_base import Spec, check_name, positive

# The platforms `jax.export` lowers for, on any machine (exporters.serialize_serving): an
# export runs on each it was lowered for.
EXPORT_PLATFORMS = ("cpu", "cuda", "rocm", "tpu")
# `EvalSpec.export_platforms=["all"]`: each of EXPORT_PLATFORMS that serve() lowers for.
ALL_PLATFORMS = "all"


class _Exporter(Spec):
    name: str

    @field_validator("name")
    @classmethod
    def _name(cls, v):
        return check_name("exporter name", v)


class _KeepingExporter(_Exporter):
    keep: int | None = Field(5, description="Number of exports to keep (None: all).")

    @field_validator("keep")
    @classmethod
    def _keep(cls, v):
        return positive("keep", v, "keep at least 1 export, or None to keep all", True)


class LatestExporter(_KeepingExporter):
    """
    Export every evaluated checkpoint, keeping the newest `keep` exports (TF's `LatestExporter`).
    """

    kind: Literal["latest"] = "latest"
    name: str = "latest"


class BestExporter(_KeepingExporter):
    """Export a checkpoint when its evaluation beats every earlier one (TF's `BestExporter`).

    Better is `metric` under `mode` (TF's default: ``loss``, lower is better), or `compare_fn`,
    TF's ``compare_fn(best_eval_result, current_eval_result) -> bool`` (True: the current one is
    better) by import path, ``"package.module:function"``. Each eval result it gets is a dict:
    the evaluation's metrics, and ``global_step`` (as TF's eval results hold it). Give either
    `compare_fn` or `metric`/`mode`, not both. The function is loaded when the job's trainer
    starts; a path that does not load is refused there, named.

    The best so far (its step and metrics) is stored next to the exports, so it survives
    restarts.
    """

    kind: Literal["best"] = "best"
    name: str = "best"
    metric: str | None = Field(None, description="Eval metric to compare (default 'loss').")
    mode: Literal["min", "max"] | None = Field(
        None, description="'min' if lower is better (the default), 'max' if higher."
    )
    compare_fn: str | None = Field(
        None,
        description="'package.module:function', TF's compare_fn(best_eval_result, "
        "current_eval_result) -> bool over metrics dicts (with global_step); instead of "
        "metric/mode.",
    )

    @model_validator(mode="before")
    @classmethod
    def _comparison(cls, data):
        if not isinstance(data, dict):
            return data
        fn = data.get("compare_fn")
        if fn is None:  # TF's default: loss, lower is better
            metric, mode = data.get("metric"), data.get("mode")
            return {**data, "metric": "loss" if metric is None else metric, "mode": mode or "min"}
        given = {k: data[k] for k in ("metric", "mode") if data.get(k) is not None}
        if given:
            raise ValueError(
                f"BestExporter got both compare_fn={fn!r} and "
                f"{', '.join(f'{k}={v!r}' for k, v in given.items())}: compare_fn decides which "
                "result is better on its own; give compare_fn, or metric and mode, not both"
            )
        module, _, function = fn.partition(":") if isinstance(fn, str) else ("", "", "")
        if not module or not function:
            raise ValueError(
                f"compare_fn={fn!r} is not an import path: give 'package.module:function', a "
                "function compare_fn(best_eval_result, current_eval_result) -> bool"
            )
        return data


class FinalExporter(_Exporter):
    """Export only the final checkpoint, the one at or past `max_steps` (TF's `FinalExporter`)."""

    kind: Literal["final"] = "final"
    name: str = "final"


ExporterSpec = Annotated[LatestExporter | BestExporter | FinalExporter, Field(discriminator="kind")]


class EarlyStopping(Spec):
    """Stop training when an eval metric stops improving (TF's `stop_if_no_decrease_hook`).

    Both roles stop: the evaluator writes ``<job>/stop.json`` and the trainer stops at its
    next checkpoint boundary.
    """

    metric: str = Field("loss", description="Eval metric to watch.")
    mode: Literal["min", "max"] = Field(
        "min", description="'min' if lower is better, 'max' if higher."
    )
    max_steps_without_improvement: int = Field(
        description="Stop once the best value is this many steps old."
    )
    min_delta: float = Field(
        0.0, ge=0, description="Smaller changes do not count as improvement (0 or more)."
    )
    min_steps: int = Field(
        0,
        ge=0,
        description="Evaluations before this global step are left out (TF's min_steps): no stop "
        "before it, and the best value counts from it.",
    )

    @field_validator("min_delta", mode="before")  # (before `ge=0`, which says no fix)
    @classmethod
    def _min_delta(cls, v):
        if isinstance(v, int | float) and not isinstance(v, bool) and v < 0:
            raise ValueError(
                f"min_delta={v} is negative: a worse value would count as an improvement, and "
                "the job would never stop; give 0 or more, e.g. 0.001"
            )
        return v

    @field_validator("max_steps_without_improvement")
    @classmethod
    def _patience(cls, v):
        return positive(
            "max_steps_without_improvement", v, "give a number of global steps, e.g. 1000"
        )


class EvalSpec(Spec):
    """How to evaluate (TF's `EvalSpec`).

    Args:
        steps: number of eval batches; None evaluates the whole eval set.
        name: name of this evaluation; metrics are logged as ``<name>/<metric>`` and
            records are kept under ``<job>/evals/<name>/``. Not ``train``, ``goodput`` or
            ``system`` (`RESERVED_EVAL_NAMES`): those metrics are prefect-jax's and MLflow's.
        start_delay_secs: the continuous evaluator waits this long before its first eval.
        throttle_secs: do not evaluate again sooner than this many seconds after the last
            evaluation (the final checkpoint is always evaluated).
        exporters: what to export after each evaluation.
        early_stopping: stop the job when a metric stops improving.
        hooks: eval hooks by import path (TF's `_ContinuousEvalListener`).
        learning_curve_every_secs: the learning-curve image (MLflow) is drawn at most this often;
            the final evaluation always draws it; 0 draws it at every evaluation.
        registered_model: the MLflow registered model the exports become versions of, with
            an alias per exporter (``best``, ``final``, ``newest`` for ``latest``); None:
            ``<job>-<hash of its storage>`` (unique to the job and its storage); ``""``: do not
            register.
        export_platforms: the platforms the exported model runs on (``jax.export`` lowers for
            each, once per exported step, for all the exporters); None: the platform the job
            runs on and ``cpu``; ``["all"]``: every one of `EXPORT_PLATFORMS`. For those two, a
            platform ``serve`` does not lower for is left out (a warning names it); a named one
            must lower (checked before training).
    """

    steps: int | None = Field(None, description="Eval batches; None: the whole eval set.")
    name: str = Field("eval", description="Eval name (metric prefix, record folder).")
    start_delay_secs: float = Field(0.0, description="Delay before the first evaluation.")
    throttle_secs: float = Field(0.0, description="Minimum seconds between evaluations.")
    exporters: list[ExporterSpec] = Field(
        default_factory=list, description="Exporters run after each eval."
    )
    early_stopping: EarlyStopping | None = Field(
        None, description="Stop when a metric stops improving."
    )
    hooks: list[str] = Field(
        default_factory=list,
        description="Eval hooks by import path (a class is instantiated): TF's "
        "before_eval() or before_eval(step) and after_eval(result) (False stops evaluating), "
        "and should_stop_job(result) (True stops the job).",
    )
    learning_curve_every_secs: float = Field(
        30.0,
        ge=0,
        description="Draw the MLflow learning-curve image at most this often (the final "
        "evaluation always draws it; 0: at every evaluation). Drawing reads the run's history "
        "and renders a PNG: on fast jobs it competes with training.",
    )
    registered_model: str | None = Field(
        None,
        description="MLflow registered model of the exports "
        "(None: <job>-<hash of its storage>; '': none).",
    )
    export_platforms: list[str] | None = Field(
        None,
        description=f"Platforms the exported model runs on, of {', '.join(EXPORT_PLATFORMS)}. "
        "None: the one the job runs on and cpu; ['all']: all of them, less those serve() does "
        "not lower for (a warning names them).",
    )

    @property
    def registers_exports(self) -> bool:
        """Whether an evaluator with this spec registers exports in the MLflow registry: it has
        exporters and a registered model (`registered_model` "" is none)."""
        return bool(self.exporters) and self.registered_model != ""

    @field_validator("steps")
    @classmethod
    def _steps(cls, v):
        return positive(
            "steps", v, "give the number of eval batches, or None for the whole eval set", True
        )

    @field_validator("registered_model")
    @classmethod
    def _registered_model(cls, v):
        # MLflow's own rule for a registered model's name, checked here rather than at the first
        # export's registration: MLflow refuses it then (a warning; a job with no versions).
        if v is None or v == "":
            return v
        norm = posixpath.normpath(v)
        if (
            v.strip() == ""
            or "/" in v
            or ":" in v
            or norm != v
            or norm == "."
            or norm.startswith("..")
        ):
            fixed = re.sub(r"[/:\s]+", "-", v).strip("-.") or "my-model"
            raise ValueError(
                f"registered model name {v!r}: MLflow refuses a name that is blank, holds '/' "
                f"or ':', or reads as another path; give one such as {fixed!r}, or '' to "
                "register none"
            )
        return v

    @field_validator("name")
    @classmethod
    def _name(cls, v):
        if v in RESERVED_EVAL_NAMES:  # their metrics would mix with the evaluation's in MLflow
            raise ValueError(
                f"eval name {v!r} is taken: its metrics would be logged as '{v}/<metric>', "
                "among others' (prefect-jax logs the train metrics as train/... and the goodput "
                "as goodput/..., MLflow its system metrics as system/...); give the evaluation "
                "another name, e.g. 'eval' (the default) or 'validation'"
            )
        return check_name("eval name", v)

    @field_validator("start_delay_secs", "throttle_secs")
    @classmethod
    def _non_negative(cls, v, info):
        if v is None or v < 0:
            raise ValueError(f"{info.field_name}={v!r} must be >= 0 seconds; use 0 for no delay")
        return v

    @field_validator("exporters", mode="before")
    @classmethod
    def _exporters(cls, v):
        """As TF's `EvalSpec`: one exporter, an iterable of them, or None (none)."""
        fix = (
            "give LatestExporter(), BestExporter(metric=..., mode=...) or FinalExporter(), a list "
            'of them, or None (in JSON: {"kind": "latest"}, {"kind": "best", ...}, '
            '{"kind": "final"})'
        )
        if v is None:
            return []
        if isinstance(v, (_Exporter, dict)):
            v = [v]
        elif isinstance(v, (str, bytes)) or not hasattr(v, "__iter__"):
            raise ValueError(f"exporters={v!r} is not an exporter nor a list of them: {fix}")
        v = list(v)
        for i, e in enumerate(v):
            if not isinstance(e, _Exporter) and not (
                isinstance(e, dict) and e.get("kind") in EXPORTER_KINDS
            ):
                raise ValueError(f"exporters[{i}]={e!r} is not an exporter: {fix}")
        return v

    @field_validator("export_platforms")
    @classmethod
    def _platforms(cls, v):
        if v is None or list(v) == [ALL_PLATFORMS]:
            return v if v is None else [ALL_PLATFORMS]
        bad = [p for p in v if p not in EXPORT_PLATFORMS]
        if bad or not v:
            what = (
                "unknown platform(s) " + repr(bad) if bad else "an empty list exports for nowhere"
            )
            raise ValueError(
                f"export_platforms={v!r}: {what}; "
                f"give some of {list(EXPORT_PLATFORMS)} (jax.export's names: 'cuda' for NVIDIA "
                "GPUs, 'rocm' for AMD), ['all'] for all that serve() lowers for, or None for "
                "the job's platform and cpu"
            )
        return list(dict.fromkeys(v))

    @model_validator(mode="after")
    def _unique_exporters(self):
        names = [e.name for e in self.exporters]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(
                f"exporters share the name(s) {dupes}: each exporter writes under exports/<name>/, "
                "so give each a distinct name= (e.g. LatestExporter(name='latest'), "
                "BestExporter(name='best'))"
            )
        return self


__all__ = [
    "ALL_PLATFORMS",
    "EXPORT_PLATFORMS",
    "BestExporter",
    "EarlyStopping",
    "EvalSpec",
    "ExporterSpec",
    "FinalExporter",
    "LatestExporter",
]


def flow_registers_exports(flow: str, eval_spec) -> bool:
    """Whether flow function `flow` registers exports in the MLflow registry with `eval_spec` (an
    `EvalSpec`, its dict as a deployment passes it, or None): the `REGISTERING_FLOWS`, with
    exporters and a registered model (`EvalSpec.registers_exports`). The command's MLflow
    warm-up and the flows' run tags both ask this."""
    if flow not in REGISTERING_FLOWS or eval_spec is None:
        return False
    try:
        return EvalSpec.model_validate(eval_spec).registers_exports
    except Exception:  # noqa: BLE001 - not an eval spec: the flow's own validation says why
        return False


def compared_metrics(eval_spec: EvalSpec) -> list[tuple[str | None, str]]:
    """The eval metrics that `eval_spec` compares, each with the best exporter that compares it
    (None: early stopping): its best exporters' without a ``compare_fn``, its early stopping's."""
    compared: list[tuple[str | None, str]] = [
        (e.name, e.metric)
        for e in eval_spec.exporters
        if isinstance(e, BestExporter) and e.compare_fn is None
    ]
    if eval_spec.early_stopping is not None:
        compared.append((None, eval_spec.early_stopping.metric))
    return compared


def compared_metric_names(eval_spec: EvalSpec) -> tuple[str, ...]:
    """The names of the metrics in `compared_metrics(eval_spec)`, in its order: what a preflight
    checked, and what a head start's trainer then need not check again."""
    return tuple(metric for _, metric in compared_metrics(eval_spec))
