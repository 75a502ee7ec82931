"""Train hooks: TF's `TrainSpec.hooks`, declared by import path, as Levanter's
``trainer.add_hook(fn, every=N)``.

A hook is a function (or a class, made once per trainer with no arguments, whose instances are
callable) named ``"package.module:attribute"``, so a deployment's JSON parameters can carry it.
It is called with a `TrainHookView`: every `every` global steps, after each checkpoint the
cadence writes, and once when training finishes, as the `TrainHook` spec says; in every process
of the job, as TF runs `TrainSpec.hooks` on every worker.

A hook observes; it never changes training. Its return value is ignored (it cannot hand back a
state), and it must not mutate the state it is shown, nor draw from the data iterator: that is
what keeps a resumed job's trajectory exactly the uninterrupted one's. An exception in a hook
fails the task, as in TF; the rerun resumes from the newest checkpoint.

This module imports neither jax nor prefect.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Literal

from pydantic import ConfigDict, Field, model_validator

from prefect_jax.training.spec_base import Spec

Event = Literal["step", "checkpoint", "end"]


def _or_its_string(schema: dict[str, Any]) -> None:
    """The JSON schema of a hook: its object, or its string form (``"pkg.mod:fn@every=N"``), so a
    deployment's parameters (prefect.yaml, the UI's form) take the string the docs show; the
    server refused it with a 422, "is not of type 'object'"."""
    as_object = dict(schema)
    schema.clear()
    schema["anyOf"] = [
        as_object,
        {
            "type": "string",
            "title": "pkg.mod:fn@every=N",
            "description": "'pkg.mod:fn' (each checkpoint and the end) or 'pkg.mod:fn@' and a "
            "comma list of every=N, checkpoint, end",
        },
    ]


class TrainHook(Spec):
    """One train hook: what to call and when.

    A string is accepted in its place: ``"pkg.mod:fn"`` (at each checkpoint and at the end), or
    with ``@`` and a comma-separated list of ``every=N``, ``checkpoint``, ``end``, e.g.
    ``"pkg.mod:fn@every=100"`` or ``"pkg.mod:Hook@every=50,end"`` (the ``--train-hook`` form).

    Args:
        path: ``"package.module:attribute"``, a function ``fn(view)`` or a class whose instances
            are called so.
        every: call it after every global step that is a multiple of this (None: never).
        at_checkpoint: call it after each checkpoint of the cadence (not backups, not the
            checkpoint a SIGTERM writes).
        at_end: call it once when training finishes (the final step, or a stop request).
    """

    model_config = ConfigDict(json_schema_extra=_or_its_string)

    path: str = Field(description="'package.module:attribute': fn(view), or a class of such.")
    every: int | None = Field(None, description="Call after every global step divisible by N.")
    at_checkpoint: bool = Field(False, description="Call after each checkpoint of the cadence.")
    at_end: bool = Field(False, description="Call once when training finishes.")

    @model_validator(mode="before")
    @classmethod
    def _from_string(cls, data):
        if not isinstance(data, str):
            return data
        path, at, when = data.partition("@")
        if not at:
            return {"path": path, "at_checkpoint": True, "at_end": True}
        fields: dict[str, Any] = {"path": path}
        for part in (p.strip() for p in when.split(",")):
            if part == "checkpoint":
                fields["at_checkpoint"] = True
            elif part == "end":
                fields["at_end"] = True
            elif part.startswith("every="):
                fields["every"] = part.removeprefix("every=")
            else:
                raise ValueError(
                    f"train hook {data!r}: {part!r} is not a time to call it; give "
                    "'pkg.mod:fn@every=N', '@checkpoint', '@end' or a comma list of them"
                )
        return fields

    @model_validator(mode="after")
    def _check(self):
        module, _, attr = self.path.partition(":")
        if not module or not attr:
            raise ValueError(
                f"train hook path {self.path!r} is not an import path: give "
                "'package.module:function' (or a class)"
            )
        if self.every is not None and self.every < 1:
            raise ValueError(
                f"train hook {self.path!r}: every={self.every} must be 1 or more, e.g. every=100"
            )
        if self.every is None and not self.at_checkpoint and not self.at_end:
            raise ValueError(
                f"train hook {self.path!r} is never called: set every=N, at_checkpoint or at_end"
            )
        return self


@dataclasses.dataclass(frozen=True)
class TrainHookView:
    """What a train hook is shown. Read it; change none of it.

    Attributes:
        event: ``"step"`` (an `every` step), ``"checkpoint"`` or ``"end"``.
        step: the global step the state is at.
        max_steps: the job's `TrainSpec.max_steps` (None: it trains until stopped).
        metrics: the train metrics logged at `step` (``"step"`` events) or the newest logged ones
            (a copy: plain floats).
        state: the live train state (the program's pytree, on the device). Do not mutate it, nor
            keep it past the call: the next step donates its buffers. With several JAX processes
            its arrays are global: `jax.device_get` of one is a collective every process's hook
            must make alike; read `addressable_shards` for this process's part.
        job: the job's name.
        process_index: this JAX process (0 for one process).
        stop: how `request_stop` asks the job to stop (the engine's; call `request_stop`).
    """

    event: Event
    step: int
    max_steps: int | None
    metrics: dict[str, float]
    state: Any
    job: str
    process_index: int = 0
    stop: Callable[[str], None] | None = dataclasses.field(default=None, repr=False)

    def request_stop(self, reason: str) -> None:
        """Ask the job to stop, as TF's ``run_context.request_stop()`` (a ``StopAtStepHook``, a
        ``NanTensorHook`` that does not fail): training ends at this interval's checkpoint, which
        is committed and evaluated first, and the job's evaluator stops too (the job's
        ``stop.json``, as early stopping writes it; a rerun trains no further until it is
        deleted). Process 0's request is the job's: a hook decides alike in every process."""
        if self.stop is None:
            raise RuntimeError("this view was made without a job to stop")
        self.stop(f"train hook at step {self.step}: {reason}")


def _load(path: str) -> Callable[[TrainHookView], Any]:
    from prefect_jax.training.program import (
        ProgramError,
        check_called_with,
        import_path,
        made_if_class,
    )

    obj = made_if_class(import_path(path, "train hook"), path, "train hook", "name a function")
    if not callable(obj):
        raise ProgramError(
            f"train hook {path!r} is a {type(obj).__name__}, not callable: name a function "
            "fn(view) or a class with __call__(self, view)"
        )
    check_called_with(
        obj, 1, f"train hook {path!r}", "fn(view), or a class with __call__(self, view)"
    )
    return obj


class TrainHooks:
    """A trainer's loaded train hooks (loaded when the trainer is made: a bad path fails then)."""

    def __init__(self, specs: list[TrainHook]):
        self.hooks = [(spec, _load(spec.path)) for spec in specs]
        self._every = sorted({spec.every for spec, _ in self.hooks if spec.every})

    def next_step_stop(self, step: int, boundary: int) -> int:
        """The first step after `step` an `every` hook wants, or `boundary` if none comes first."""
        after = [(step // n + 1) * n for n in self._every]
        return min([boundary, *after])

    def _call(self, event: Event, wanted: Callable[[TrainHook], bool], **view: Any) -> None:
        made = None
        for spec, fn in self.hooks:
            if wanted(spec):
                made = made or TrainHookView(event=event, **view)
                fn(made)

    def at_step(self, **view: Any) -> None:
        """The `every` hooks whose multiple `view["step"]` is."""
        step = view["step"]
        self._call("step", lambda s: bool(s.every) and step % s.every == 0, **view)

    def at_checkpoint(self, **view: Any) -> None:
        """The `at_checkpoint` hooks."""
        self._call("checkpoint", lambda s: s.at_checkpoint, **view)

    def at_end(self, **view: Any) -> None:
        """The `at_end` hooks."""
        self._call("end", lambda s: s.at_end, **view)

    def __bool__(self) -> bool:
        return bool(self.hooks)
