"""`SessionManager.prepare_session` for a JAX train state: restore the newest committed step,
or one explicit step, or run init; optionally wait for a first checkpoint."""

from __future__ import annotations

import logging
import os
from typing import Any, Callable

from prefect_jax.training.checkpoints import CheckpointMismatchError, Checkpoints, committed_steps, wait_for_new_checkpoint

logger = logging.getLogger("prefect_jax.trainer")


def restore_or_init(
    checkpoints: Checkpoints | None,
    init: Callable[[], Any],
    abstract_state,
    *,
    checkpoint_dir: str | None = None,
    checkpoint_path: str | None = None,
    make_data_iter: Callable[[], Any] | None = None,
    wait_for_checkpoint: bool = False,
    max_wait_secs: float = 7200,
    recovery_wait_secs: float = 30,
    on_unreadable: Callable[[int, BaseException], None] | None = None,
    list_steps: Callable[[], list[int]] | None = None,
    prepare_step: Callable[[int], None] | None = None,
    log: Callable[[str], None] = logger.info,
) -> tuple[Any, int, dict | None, Any]:
    """`SessionManager.prepare_session` for a JAX train state.

    Restores the latest committed step under `checkpoint_dir`, or the one step at
    `checkpoint_path`; with neither (or nothing committed yet), runs `init`. A newest step
    that cannot be read (truncated or missing files) is skipped with a warning naming it,
    and the next newer committed step is tried: partial state is never restored.

    Args:
        checkpoints: the job's `Checkpoints` (used for `checkpoint_dir`).
        init: builds a fresh state.
        abstract_state: ``jax.eval_shape`` of `init`: the structure a restore must match.
        checkpoint_dir: restore the latest committed step in this directory.
        checkpoint_path: restore exactly this step directory (``.../checkpoints/<step>``).
        make_data_iter: builds a fresh Grain iterator whose position is restored with the state.
        wait_for_checkpoint: if no committed step exists yet, wait for one.
        max_wait_secs: how long to wait.
        recovery_wait_secs: how often to look while waiting.
        on_unreadable: called with (step, error) for each step skipped as unreadable.
        list_steps: the committed steps (default: those in `checkpoint_dir`; remote storage
            lists its own).
        prepare_step: makes a step readable in `checkpoint_dir` before its restore (remote
            storage downloads it).

    Returns:
        (state, step, metadata of the restored checkpoint or None after init, data iterator or None).

    Raises:
        ValueError: both `checkpoint_dir` and `checkpoint_path` were given, or
            `checkpoint_path` is not a committed step directory.
        CheckpointMismatchError: the checkpoint's tree differs from `abstract_state`.
    """
    new_iter = make_data_iter or (lambda: None)
    if checkpoint_dir and checkpoint_path:
        raise ValueError(
            f"both checkpoint_dir={checkpoint_dir!r} and checkpoint_path={checkpoint_path!r} were given: "
            "pass checkpoint_dir to resume from its latest checkpoint, or checkpoint_path to restore one step, not both"
        )
    if checkpoint_path:
        path = checkpoint_path.rstrip("/")
        parent, name = os.path.split(path)
        if not name.isdigit() or int(name) not in committed_steps(parent):
            raise ValueError(
                f"checkpoint_path={checkpoint_path!r} is not a committed checkpoint step directory; "
                f"committed steps in {parent!r}: {committed_steps(parent)}. Point it at '<checkpoints>/<step>'."
            )
        source = Checkpoints(parent, read_only=True)
        try:
            data_iter = new_iter()
            state, meta = source.restore(int(name), abstract_state, data_iter)
        finally:
            source.close()
        log(f"restored step {name} from {path}")
        return state, int(name), meta, data_iter
    if checkpoint_dir:
        assert checkpoints is not None and checkpoints.directory == checkpoint_dir
        list_steps = list_steps or checkpoints.committed_steps
        if not list_steps() and wait_for_checkpoint:
            wait_for_new_checkpoint(list_steps, None, max_wait_secs, recovery_wait_secs, log)
        for step in reversed(list_steps()):
            data_iter = new_iter()
            try:
                if prepare_step is not None:
                    prepare_step(step)
                state, meta = checkpoints.restore(step, abstract_state, data_iter)
            except CheckpointMismatchError:
                raise
            except Exception as exc:  # noqa: BLE001 - a damaged step: fall back to the one before
                logger.warning(
                    "checkpoint step %d in %s is unreadable (%s: %s); falling back to the previous committed step",
                    step, checkpoint_dir, type(exc).__name__, str(exc).splitlines()[0][:300] if str(exc) else "",
                )
                if on_unreadable is not None:
                    on_unreadable(step, exc)
                continue
            log(f"restored step {step} from {checkpoint_dir}")
            return state, step, meta, data_iter
        log(f"no committed checkpoint in {checkpoint_dir}: initialising from scratch")
    return init(), 0, None, new_iter()
