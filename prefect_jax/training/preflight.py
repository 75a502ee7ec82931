"""Checks of a job's input that need no training: run by `check_job` (`facade.preflight`) before
anything starts, so that a bad value is one error line naming the flag, the value and the fix,
not a failed flow run with a traceback after a job directory was made and an interval trained.

The refusals made here are ``ValueError``s (the command exits 2); `check_job` lets the engine's
own refusals through as they are (`facade.preflight` lists them). The engine checks the same
things again where it meets them (a deployment's runs do not come through the command).
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Iterator
from typing import Any

from prefect_jax.training.errors import EvalOutputError
from prefect_jax.training.eval_specs import compared_metrics
from prefect_jax.training.evaluation import check_pairs
from prefect_jax.training.redaction import redact_url
from prefect_jax.training.storage import JobStorage


class BadInputError(ValueError):
    """A value given to the job is refused before anything starts; the message names the flag,
    the value and the fix."""


@contextlib.contextmanager
def storage_errors(
    js: JobStorage,
    shown: str,
    named: str = "--storage",
    doing: str = "checking that the storage is writable",
) -> Iterator[None]:
    """Turn what opening, listing or writing the job's storage raised into an error that names
    the input (`named`), its value and the fix.

    Args:
        js: The job's storage.
        shown: What the user gave as the storage (a URL or a block's name), for messages.
        named: What the user gave it as: the command's ``--storage``, or a flow's (and the
            Python API's) ``storage``.
        doing: What was being done, for the message.

    Raises:
        BadInputError: A local root that cannot be made (a file in the way).
        RemoteConfigError: Unknown protocol, options the filesystem rejects, a missing bucket,
            refused credentials.
        RemoteUnreachableError: The endpoint does not answer.
    """
    from prefect_jax.training.remote_errors import RemoteStorageError, storage_error

    shown = redact_url(shown)
    try:
        yield
    except PermissionError:
        raise  # (StorageNotWritableError names the storage already)
    except RemoteStorageError as exc:
        if str(exc).startswith(f"{named} "):
            raise
        raise type(exc)(f"{named} {shown}: {exc}", exc.url) from None
    except OSError as exc:
        if js.protocol == "file" and exc.errno in (errno.ENOENT, errno.ENOTDIR, errno.EEXIST):
            raise BadInputError(
                f"{named} {shown}: the job's directory {js.job_dir} cannot be made there "
                f"({type(exc).__name__}: {exc.strerror}); give {named} a directory this user "
                "can create and write to (the folders it names that do not exist are made; "
                "none may be a file)"
            ) from None
        clear = storage_error(js, exc, shown, named, doing)
        if clear is None:
            raise
        raise clear from None
    except Exception as exc:  # (a filesystem's own errors: botocore's NoCredentialsError, say)
        clear = storage_error(js, exc, shown, named, doing)
        if clear is None:
            raise
        raise clear from None


def check_checkpoint_path(path: str) -> None:
    """Refuse a ``--checkpoint-path`` that is not a committed checkpoint step directory.

    Raises:
        BadInputError: It does not exist, or is not ``<checkpoints>/<step>`` committed.
    """
    from prefect_jax.training.checkpoint_dirs import committed_steps

    given = path.rstrip("/")
    parent, name = os.path.split(given)
    committed = committed_steps(parent)
    fix = "point it at a committed step directory, '<storage>/<job>/checkpoints/<step>'"
    if not os.path.exists(given):
        near = f" (committed steps in {parent}: {committed})" if committed else ""
        raise BadInputError(f"--checkpoint-path {path!r} does not exist{near}: {fix}")
    for steps_dir in (given, os.path.join(given, "checkpoints")):  # (TF took a model dir)
        inside = committed_steps(steps_dir) if os.path.isdir(steps_dir) else []
        if inside:
            newest = os.path.join(steps_dir, str(inside[-1]))
            raise BadInputError(
                f"--checkpoint-path {path!r} is a directory of checkpoint steps ({inside}), not "
                f"one step: give the step to start from, e.g. the newest, {newest!r}"
            )
    if not name.isdigit() or int(name) not in committed:
        raise BadInputError(
            f"--checkpoint-path {path!r} is not a committed checkpoint step directory "
            f"(committed steps in {parent}: {committed}): {fix}"
        )


def eval_metric_names(program: Any, one_process: bool = True) -> list[str]:
    """The metric names the program's evaluation produces, found without computing: the
    program's optional ``eval_metric_names`` (a sequence, or a function returning one), else the
    shapes of `eval_step` on the abstract state and the first eval batch (``jax.eval_shape``;
    a program that declares its sharding traced under its mesh, which only `one_process` can
    build before the flow run); and the names the program's optional ``derive_metrics(means)``
    adds to them.

    Raises:
        LookupError: not knowable here (a sharded program of several processes).
    """
    declared = getattr(program, "eval_metric_names", None)
    if declared is not None:  # the program says, and nothing is traced or read
        names = set(declared() if callable(declared) else declared)
        derive = getattr(program, "derive_metrics", None)
        if callable(derive):
            names |= set(derive(dict.fromkeys(names, 1.0)) or {})
        return sorted(names)
    import grain
    import jax
    import numpy as np

    from prefect_jax.training.sharded_state import sharded_abstract_state
    from prefect_jax.training.sharding import declares_sharding, placement, under_mesh

    eval_step = program.eval_step
    if declares_sharding(program):  # (its annotated model is built under its mesh only)
        if not one_process:
            raise LookupError("a sharded program of several processes: its mesh spans them all")
        mesh = placement(program, jax.devices(), 1)[0]
        state, _ = sharded_abstract_state(program, mesh, 0)
        eval_step = under_mesh(eval_step, mesh)
    else:
        state = jax.eval_shape(lambda: program.init(jax.random.key(0)))
    data = program.eval_data()
    batch = data[0] if isinstance(data, grain.MapDataset) else next(iter(data))
    spec = jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), np.asarray(a).dtype), batch)
    out = jax.eval_shape(eval_step, state, spec)
    check_pairs(out)  # (a traced output that is no (sum, count) pairs: refused now)
    names = set(out)
    derive = getattr(program, "derive_metrics", None)
    if callable(derive):
        names |= set(derive(dict.fromkeys(names, 1.0)) or {})
    return sorted(names)


def check_evaluation(
    program: Any, eval_spec: Any, one_process: bool = True, flags: bool = True
) -> bool:
    """Refuse an evaluation that could not end or compare what it is asked to: an endless
    `eval_data()` read whole (`evaluation.refuse_endless_eval_data`: it ran until killed; at the
    command's start-up, `flags`, not for a program that declares its `eval_metric_names`, whose
    eval data it does not read: its first evaluation refuses it), and a best exporter's or early
    stopping's metric that the evaluation does not produce (where `eval_metric_names` can find
    them: see `one_process` there). `flags`: the message names the command's flag (else the
    spec's field, for a program run from Python). Whether the metrics were checked (False: not
    knowable before an evaluation, which checks them).

    Raises:
        EndlessEvalDataError: `eval_data()` never ends and `eval_spec.steps` is None.
        BadInputError: The metric is not among `eval_metric_names`; the message names them.
    """
    from prefect_jax.training.evaluation import refuse_endless_eval_data

    if not flags or getattr(program, "eval_metric_names", None) is None:
        try:
            eval_data = program.eval_data()
        except Exception:  # noqa: BLE001 - its own error, where the engine reads it (a resume's
            eval_data = None  # other params are refused first, say)
        refuse_endless_eval_data(eval_data, eval_spec.steps)

    def named_by(exporter: str | None) -> str:
        if exporter is None:
            return "--early-stopping-metric" if flags else "early_stopping.metric"
        return (
            f"--best-metric (exporter {exporter!r})"
            if flags
            else f"BestExporter {exporter!r} metric"
        )

    asked = [(named_by(exporter), metric) for exporter, metric in compared_metrics(eval_spec)]
    if not asked:
        return True
    try:
        names = eval_metric_names(program, one_process)
    except EvalOutputError:
        raise
    except Exception:  # noqa: BLE001 - not knowable without running: the engine checks it then
        return False
    for flag, metric in asked:
        if metric not in names:
            # Keras logs its validation metrics as val_<name>; MLflow shows these as eval/<name>
            bare = metric.removeprefix("val_").removeprefix("eval/")
            meant = f" ({bare!r}: the names eval_step returns)" if bare in names else ""
            raise BadInputError(
                f"{flag} {metric!r} is not a metric the evaluation produces (its eval_step and "
                f"derive_metrics): it produces {names}; set it to one of those{meant}"
            )
    return True


def check_job_parts(program: Any, program_ref: str, exporters: list, hooks: list) -> Any:
    """Refuse, as the job's trainer is made (and a command's preflight before it), `exporters`
    that `program` cannot serve, a best exporter's ``compare_fn`` and a train hook (`hooks`) that
    cannot be loaded; returns the hooks loaded (`TrainHooks`).

    Raises:
        ProgramError: one of them, named, with the fix.
    """
    from prefect_jax.training.best import load_compare_fn
    from prefect_jax.training.program import ProgramError, has_serving
    from prefect_jax.training.train_hooks import TrainHooks

    if exporters and not has_serving(program):
        lacks = " and ".join(
            m
            for m in ("serve(state, inputs)", "serving_input()")
            if not callable(getattr(program, m.split("(")[0], None))
        )
        raise ProgramError(
            f"exporters {[e.name for e in exporters]} are configured, but program "
            f"{program_ref!r} has no {lacks} (exports need both, docs/program.md): add them, "
            "or run without exporters (--exporters with no names, EvalSpec(exporters=[]))"
        )
    for exporter in exporters:  # a bad path refused now, not at an export
        if getattr(exporter, "compare_fn", None):
            load_compare_fn(exporter.compare_fn)
    return TrainHooks(hooks)


def make_local_dir(flag: str, path: str) -> None:
    """Make a local directory a flag names (or find it there), or refuse the flag's value.

    Raises:
        BadInputError: It cannot be made: a file in the way, no permission.
    """
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        raise BadInputError(
            f"{flag} {path}: the directory cannot be made ({type(exc).__name__}: "
            f"{exc.strerror}); give {flag} a directory this user can create and write to (the "
            "folders it names that do not exist are made; none may be a file)"
        ) from None


def check_compilation_cache(named: str, setting: str | None) -> None:
    """Refuse a compilation-cache setting (``job``, a directory or a URL) that cannot be used,
    before any work: a local directory is made (or found), a URL's protocol must be one fsspec
    knows (the cache alone found out, as warnings, while the job trained uncached).

    Raises:
        BadInputError: naming `named` (``--compilation-cache``, ``compilation_cache_dir``), the
            value and the fix.
    """
    if not setting or setting == "job":
        return
    if "://" not in setting:
        make_local_dir(named, os.path.abspath(setting))
        return
    import fsspec

    protocol = setting.split("://", 1)[0]
    if protocol not in fsspec.available_protocols():
        raise BadInputError(
            f"{named} {redact_url(setting)}: fsspec knows no protocol {protocol!r}; give a "
            "directory, 'job' (under the job's storage), or a URL of a known one (s3://, gs://, "
            "...)"
        )
