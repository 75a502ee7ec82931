"""The byte-level LM's typed program parameters: a preset and overrides of its `Config` fields.

``prefect_jax.examples.bytelm:program`` is the factory `program(params: ByteLMParams)`, so the
engine validates a job's ``program_params`` into `ByteLMParams` and records them (see
`prefect_jax.training.program_params`)::

    prefect-jax run --program prefect_jax.examples.bytelm:program \\
        --program-param preset=tiny --program-param batch_size=16 ...

``preset`` names a preset of `PRESETS` (default ``small``); every other field overrides the
preset's value of the same `Config` field. ``decay_steps`` left unset makes the learning-rate
schedule's horizon the job's ``max_steps`` (the engine fills `ByteLMParams.max_steps`), so a
cosine decay ends where the job does.

Fallback: where no field is given (but ``max_steps``), ``PREFECT_JAX_BYTELM_PRESET`` and
``PREFECT_JAX_BYTELM_CONFIG`` are read as before (`config_from_env`); what they give is recorded
as the job's params like any others. Where fields are given, they are not read, with a warning.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import typing
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, create_model, model_validator

from prefect_jax.examples.bytelm.config import (
    CONFIG_ENV,
    PRESET_ENV,
    PRESETS,
    Config,
    config_from_env,
)
from prefect_jax.examples.bytelm.corpus import SOURCE_ENV
from prefect_jax.examples.bytelm.lm import ByteLMProgram

# Fields that do not change what is computed: recorded, not compared when a job resumes (how many
# threads read batches, how far ahead, the eval batch size: eval metrics are exact sums; and the
# mesh: a checkpoint is restored into any mesh's shardings).
RESTORE_EXEMPT = ("read_threads", "prefetch", "eval_batch_size", "mesh")

logger = logging.getLogger("prefect_jax.examples.bytelm")


class _Base(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    restore_exempt: ClassVar[tuple[str, ...]] = RESTORE_EXEMPT

    preset: Literal[tuple(PRESETS)] = Field("small", description="the preset overridden")  # type: ignore[valid-type]
    max_steps: int | None = Field(
        None,
        description="the job's max_steps (filled by the engine): the schedule's horizon when "
        "decay_steps is not given",
    )

    @model_validator(mode="before")
    @classmethod
    def _preset_then_overrides(cls, data: Any) -> Any:
        """Every field's value: the preset's, unless given (``decay_steps`` stays unset)."""
        if not isinstance(data, dict):
            return data
        given = dict(data)
        env_preset, env_config = os.environ.get(PRESET_ENV), os.environ.get(CONFIG_ENV)
        if not set(given) - {"max_steps"} and (env_preset or env_config):
            # the documented fallback: the environment's preset and overrides
            config_from_env()  # a bad preset or override refused, naming its variable
            given = {"preset": env_preset or "small", **json.loads(env_config or "{}"), **given}
        elif env_preset or env_config:
            _say_environment_unread(sorted(set(given) - {"max_steps"}))
        source = given.get("source")
        if isinstance(source, str) and source.strip():  # the same folder from any directory
            given["source"] = _folder(source)
        preset = given.get("preset", "small")
        if preset not in PRESETS:
            return given  # refused by the field's type, which names the presets
        values = dataclasses.asdict(PRESETS[preset])
        values["decay_steps"] = None  # unset: the horizon is max_steps
        del values["source"]  # unset: the environment's folder (`_source_from_env`)
        return {**values, **given}

    @model_validator(mode="after")
    def _in_range(self):
        """Each field's range, as `Config` checks it (one place), before any work."""
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError(f"max_steps={self.max_steps!r}: must be at least 1")
        if self.decay_steps is not None and self.decay_steps < 1:
            raise ValueError(f"decay_steps={self.decay_steps!r}: must be at least 1 (or unset)")
        self.to_config()
        return self

    def to_config(self) -> Config:
        """The `Config` these params make: ``decay_steps`` unset is `max_steps` (or, with neither,
        the preset's)."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(Config)}
        values["decay_steps"] = (
            self.decay_steps or self.max_steps or PRESETS[self.preset].decay_steps
        )
        return Config(**values)


def _folder(path: str) -> str:
    return os.path.abspath(os.path.expanduser(path))


def _source_from_env() -> str | None:
    """``source`` unset: ``$PREFECT_JAX_BYTELM_SOURCE``'s folder, else None (the standard
    library), as the corpus reads it. Recorded as the job's, so a rerun on other text is
    refused; and as the field's default, so a step saved before the field existed (its program
    read the same variable) resumes where the variable still names its folder."""
    named = os.environ.get(SOURCE_ENV)
    return _folder(named) if named else None


_said: set[tuple[str, ...]] = set()


def _say_environment_unread(given: list[str]) -> None:
    """Warn (once per process and set of fields) that the environment's preset and config are
    not read, as program params were given: ``PREFECT_JAX_BYTELM_PRESET=tiny`` beside one
    ``--program-param`` built the default preset, without a word."""
    if tuple(given) in _said:
        return
    _said.add(tuple(given))
    named = [v for v in (PRESET_ENV, CONFIG_ENV) if os.environ.get(v)]
    logger.warning(
        "%s not read: program params were given (%s: by this run, or by the job's trainer to "
        "an evaluator or exporter, which take those), and the environment is read only where "
        "none are; give the preset and fields as program params (--program-param preset=NAME)",
        " and ".join(named),
        ", ".join(given),
    )


_HINTS = typing.get_type_hints(Config)

ByteLMParams = create_model(
    "ByteLMParams",
    __base__=_Base,
    __doc__=(
        "The byte LM's program params: ``preset`` (of `PRESETS`), ``max_steps`` (filled by the "
        "engine) and an override of each `Config` field (see `Config` for their meaning; "
        "``decay_steps`` unset: the job's max_steps)."
    ),
    **{
        f.name: ((_HINTS[f.name] | None) if f.name == "decay_steps" else _HINTS[f.name], f.default)
        for f in dataclasses.fields(Config)
        if f.name != "source"
    },
    source=(_HINTS["source"], Field(default_factory=_source_from_env)),
)


def program(params: ByteLMParams) -> ByteLMProgram:
    """The byte LM built from its typed params (``prefect_jax.examples.bytelm:program``).

    Example:
        ```python
        from prefect_jax.examples.bytelm import ByteLMParams, program
        lm = program(ByteLMParams(preset="tiny", grad_accum=2, max_steps=500))
        ```
    """
    return ByteLMProgram(params.to_config())
