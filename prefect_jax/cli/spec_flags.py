"""The command line as the job's specs: which flag sets which field of `TrainSpec`,
`CheckpointSpec` and `EvalSpec` (`SPEC_FLAGS`), the specs built from them, a spec's refusal said
by its flag, and the program's params from ``--program-params``/``--program-param``."""

from __future__ import annotations

import argparse
import json
from typing import Any

# Each spec's fields the command sets, and the flag (its ``args`` attribute) that sets each.
SPEC_FLAGS = {
    "TrainSpec": {
        "max_steps": "max_steps",
        "seed": "seed",
        "log_every_steps": "log_every_steps",
        "steps_per_dispatch": "steps_per_dispatch",
        "sigterm_grace_secs": "sigterm_grace_secs",
        "lease_timeout_secs": "lease_timeout_secs",
        "hooks": "train_hooks",
    },
    "CheckpointSpec": {
        "every_steps": "checkpoint_every_steps",
        "every_secs": "checkpoint_every_secs",
        "keep_last": "keep_last",
        "keep_every_steps": "keep_every_steps",
        "keep_every_secs": "keep_every_secs",
        "backups": "backups",
        "device_copy": "device_copy",
    },
    "EvalSpec": {
        "steps": "eval_steps",
        "name": "eval_name",
        "throttle_secs": "throttle_secs",
        "start_delay_secs": "start_delay_secs",
        "registered_model": "registered_model",
        "export_platforms": "export_platforms",
        "hooks": "eval_hooks",
    },
}


# The exporters' fields the command sets (`facade.build_specs` makes them): a refusal named by
# its flag too.
EXPORTER_FLAGS = {
    "LatestExporter": {"keep": "exports_to_keep"},
    "BestExporter": {"keep": "exports_to_keep"},
}

# `EarlyStopping`'s fields and their flags (``--early-stopping-steps`` makes one).
EARLY_STOPPING_FLAGS = {
    "max_steps_without_improvement": "early_stopping_steps",
    "metric": "early_stopping_metric",
    "mode": "early_stopping_mode",
    "min_delta": "early_stopping_min_delta",
    "min_steps": "early_stopping_min_steps",
}


def early_stopping_from_args(args: argparse.Namespace) -> dict[str, Any] | None:
    """`EvalSpec.early_stopping` from the ``--early-stopping-*`` flags: None without
    ``--early-stopping-steps`` (the others alone are refused: they would be ignored)."""
    given = {
        field: getattr(args, attr)
        for field, attr in EARLY_STOPPING_FLAGS.items()
        if getattr(args, attr, None) is not None
    }
    if given and "max_steps_without_improvement" not in given:
        flags = " ".join(
            f"{args.flag_of_dest[EARLY_STOPPING_FLAGS[f]]} {v}" for f, v in given.items()
        )
        raise ValueError(
            f"{flags} without --early-stopping-steps: early stopping needs how many steps the "
            "best value may age; give --early-stopping-steps N (e.g. 1000), or drop the others"
        )
    return given or None


def specs_from_args(args: argparse.Namespace):
    """TrainSpec, EvalSpec and CheckpointSpec from the command line.

    Raises:
        ValueError: a value the specs refuse, one line naming its flag (`flag_errors`).
    """
    from pydantic import ValidationError

    from prefect_jax.training.facade import build_specs

    train, checkpoint, evaluation = (
        {field: getattr(args, attr) for field, attr in SPEC_FLAGS[spec].items()}
        for spec in ("TrainSpec", "CheckpointSpec", "EvalSpec")
    )
    evaluation["early_stopping"] = early_stopping_from_args(args)
    try:
        return build_specs(
            train,
            checkpoint,
            evaluation,
            args.exporters,
            args.best_metric,
            args.best_mode,
            best_compare_fn=_best_compare_fn(args),
            exports_to_keep=args.exports_to_keep,
        )
    except ValidationError as exc:
        raise ValueError(flag_errors(exc, args.flag_of_dest)) from None


def flag_errors(exc, flag_of_dest: dict[str, str]) -> str:
    """A spec's `pydantic.ValidationError` as the command's user reads it: one line, each error
    led by the flag (as typed: `flag_of_dest`, from `arguments.add_training_args`) and value that
    caused it (``--checkpoint-every-steps 0: ...``), without pydantic's headings and links. An
    error of no single flag keeps the spec's name."""
    flags = SPEC_FLAGS.get(exc.title) or EXPORTER_FLAGS.get(exc.title, {})
    said = []
    for error in exc.errors():
        field = error["loc"][0] if error["loc"] else None
        message = error["msg"].removeprefix("Value error, ")
        of = flags
        if field == "early_stopping" and len(error["loc"]) > 1:  # (a field of its own flag)
            field, of = error["loc"][1], EARLY_STOPPING_FLAGS
        if field in of:
            said.append(f"{flag_of_dest[of[field]]} {error.get('input')!r}: {message}")
        else:
            where = ".".join(str(part) for part in error["loc"])
            said.append(f"{exc.title}{'.' + where if where else ''}: {message}")
    return "; ".join(said)


def unread_flags_given(args: argparse.Namespace) -> str | None:
    """A warning naming the flags given to this role that it does not read (left out of its
    ``--help``: `arguments.add_training_args`), and the roles that do; None where none was. A
    flag is given where it was typed (even with its default's value, as the command's argv
    says) or its value is not the default's (`args` parsed without that argv).
    A porter puts TF's early stopping on the trainer (its hook was the chief's); here the
    evaluator decides it, and the trainer stops when asked."""
    argv = getattr(args, "argv", [])
    typed = {
        token.partition("=")[0] for token in argv[: argv.index("--") if "--" in argv else None]
    }
    given = [
        (flag, readers)
        for dest, (flag, default, readers) in getattr(args, "unread_flags", {}).items()
        if flag in typed or getattr(args, dest, default) != default
    ]
    if not given:
        return None
    command = getattr(args, "command", "this role")
    by_readers: dict[str, list[str]] = {}
    for flag, readers in given:
        by_readers.setdefault(readers, []).append(flag)
    said = "; ".join(f"{', '.join(flags)} (read by {r})" for r, flags in by_readers.items())
    return (
        f"prefect-jax {command}: warning: {command} does not read {said}: no effect here; give "
        "them to the job's role that reads them"
        + (
            " (its trainer stops when its evaluator asks)"
            if command == "train" and any(f.startswith("--early-stopping") for f, _ in given)
            else ""
        )
    )


def program_params_from_args(args: argparse.Namespace) -> dict[str, Any] | None:
    """The program's params from ``--program-params JSON`` and each ``--program-param KEY=VALUE``
    (a VALUE that is not JSON is a string: ``preset=tiny`` and ``preset='"tiny"'`` agree);
    None where neither was given."""
    params: dict[str, Any] = {}
    raw = getattr(args, "program_params", None)
    if raw is not None:
        try:
            params = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise ValueError(
                f"--program-params {raw!r} is not JSON ({exc}); give an object, e.g. "
                "'{\"batch_size\": 32}'"
            ) from None
        if not isinstance(params, dict):
            raise ValueError(
                f"--program-params {raw!r} must be a JSON object of the program's parameters, "
                "e.g. '{\"batch_size\": 32}'"
            )
    for item in getattr(args, "program_param", None) or []:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(
                f"--program-param {item!r} is not KEY=VALUE; e.g. --program-param batch_size=32"
            )
        try:
            params[key.strip()] = json.loads(text)
        except json.JSONDecodeError:
            params[key.strip()] = text
    return params if (params or raw is not None) else None


def _best_compare_fn(args: argparse.Namespace) -> str | None:
    """``--best-compare-fn``, refused beside ``--best-metric`` or ``--best-mode``."""
    fn = args.best_compare_fn
    given = [
        f"--{flag.replace('_', '-')} {getattr(args, flag)}"
        for flag in ("best_metric", "best_mode")
        if getattr(args, flag) is not None
    ]
    if fn is not None and given:
        raise ValueError(
            f"--best-compare-fn {fn} and {' '.join(given)}: the compare function alone decides "
            "which evaluation is better; give --best-compare-fn, or --best-metric/--best-mode, "
            "not both"
        )
    return fn
