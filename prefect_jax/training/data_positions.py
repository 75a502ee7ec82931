"""A Grain iterator over a dataset (`iterate`), and its position as a checkpoint's ``data`` item
holds it: one text file per process (``process_<i>-of-<n>.json``, Grain's own format), and a step
written by another number of processes than the job has now."""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterator

import grain
import jax
import numpy as np

logger = logging.getLogger("prefect_jax.checkpoints")


def iterate(dataset, read_options=None):
    """An iterator (with get_state/set_state) over a Grain MapDataset (read with `read_options`,
    default Grain's) or IterDataset."""
    if hasattr(dataset, "to_iter_dataset"):
        dataset = (
            dataset.to_iter_dataset(read_options)
            if read_options is not None
            else dataset.to_iter_dataset()
        )
    return iter(dataset)


_REPEAT_IT = (
    "it must never end (training stops at max_steps), so repeat it: a Grain dataset's "
    ".repeat(), as TF's input_fn repeats its tf.data.Dataset"
)


def refuse_fewer_batches_than_steps(dataset, max_steps: int | None) -> None:
    """Refuse, as its iterator is made, a `train_data` MapDataset with fewer batches than
    `max_steps`: it would end before training does (`next_batch`), an interval or more later. An
    IterDataset's length is unknown until it ends.

    Raises:
        ProgramError: the dataset's length, max_steps and the fix.
    """
    if max_steps is None or not isinstance(dataset, grain.MapDataset):
        return
    try:
        batches = len(dataset)
    except TypeError:  # (a MapDataset whose source has no length)
        return
    if batches < max_steps:
        from prefect_jax.training.program import ProgramError

        raise ProgramError(
            f"the program's train_data(seed) has {batches} batches, fewer than max_steps="
            f"{max_steps}, so it would end at step {batches}: {_REPEAT_IT}"
        )


def next_batch(data_iter, step: int):
    """The next training batch. Raises ProgramError (a retry would end the same way) where the
    program's `train_data` has ended: training ends at max_steps, never with the data."""
    try:
        return next(data_iter)
    except StopIteration:
        from prefect_jax.training.program import ProgramError

        raise ProgramError(
            f"the program's train_data(seed) ended before step {step + 1}: {_REPEAT_IT}"
        ) from None


def position_text(data_iter) -> str:
    """A Grain iterator's position as Grain's handler writes it: a dataset iterator's state as
    JSON, a DataLoader's bytes as text. `set_position` reads it back."""
    if isinstance(data_iter, grain.DatasetIterator):
        return json.dumps(data_iter.get_state(), indent=4)
    return data_iter.get_state().decode()


def set_position(data_iter, text: str) -> None:
    data_iter.set_state(
        json.loads(text) if isinstance(data_iter, grain.DatasetIterator) else text.encode()
    )


def written_by_other_processes(checkpoint_dir: str, step: int) -> str | None:
    """The iterator state file of process 0 of a step (a local path or a URL) written by another
    number of JAX processes than this job has now (None: the same number, each process restores
    its own with Grain)."""
    from etils import epath  # Orbax's own paths: a local folder, or gcsfs underneath for gs://

    # One glob, decided by the names: a fresh listing (gcsfs caches `exists`); a step without a
    # data folder lists nothing.
    data = epath.Path(checkpoint_dir) / str(step) / "data"
    names = {p.name: str(p) for p in data.glob("process_*-of-*.json")}
    if _own_file() in names:
        return None
    first = sorted(path for name, path in names.items() if name.startswith("process_0-of-"))
    return first[0] if first else None


def _own_file() -> str:
    return f"process_{jax.process_index()}-of-{jax.process_count()}.json"


def restore_position_of_process_0(data_iter, path: str, step: int) -> None:
    """Every process of a job reads the same batches (the loop splits each one over the
    devices), so process 0's position (`path`, local or a URL) is every process's, on any number
    of processes."""
    from etils import epath

    set_position(data_iter, epath.Path(path).read_text())
    name = path.rsplit("/", 1)[-1]
    logger.warning(
        "step %d was written by %s processes, restored into %d: the data position of its "
        "process 0 (%s) applies to each",
        step,
        name.split("-of-")[1].split(".")[0],
        jax.process_count(),
        name,
    )


@contextlib.contextmanager
def positions_explained(data_iter, checkpoint_dir: str, step: int, other_layout) -> Iterator:
    """Around the restore of a step's data position into `data_iter` (a fresh iterator of the
    program's `train_data(seed)`; None: not restored): where Grain fails and the saved position's
    keys differ from a new iterator's (a ``mix`` added, say), it is another pipeline's step.
    Grain's own error (``KeyError: 'parents'``) was reported as an intact step to move aside by
    hand. Compared only after a failure: Grain takes positions whose keys differ in ways it knows
    (one written before a key was added), and a new iterator's state may take threads to build.

    Raises:
        CheckpointMismatchError: naming both positions' keys and the fix (else Grain's error).
    """
    try:
        yield
    except Exception:
        if data_iter is not None:
            _refuse_another_pipeline(data_iter, checkpoint_dir, step, other_layout)
        raise


def _refuse_another_pipeline(data_iter, checkpoint_dir: str, step: int, other_layout) -> None:
    from etils import epath

    if not isinstance(data_iter, grain.DatasetIterator):  # (a DataLoader's state is bytes)
        return
    path = other_layout or epath.Path(checkpoint_dir) / str(step) / "data" / _own_file()
    try:
        saved = json.loads(epath.Path(path).read_text())
        fresh = data_iter.get_state()
    except Exception:  # noqa: BLE001 - not readable: Grain's error is the one to see
        return
    if _keys(saved) == _keys(fresh):
        return
    from prefect_jax.training.errors import CheckpointMismatchError

    raise CheckpointMismatchError(
        f"checkpoint {checkpoint_dir}/{step}: its data position does not fit the program's "
        f"train_data(seed) now (saved: {_shown(saved)}; a new iterator's: {_shown(fresh)}): "
        "train_data changed since this step was written. Resume it with the train_data that "
        "wrote it, or start a new job (another job name or storage), or warm-start one from this "
        "step's state (--checkpoint-path, which leaves its data position)."
    )


def _keys(state):
    """A Grain iterator state's shape: its dicts' keys, all the way down (not its values)."""
    if isinstance(state, dict):
        return {k: _keys(v) for k, v in state.items()}
    if isinstance(state, list):
        return [_keys(v) for v in state]
    return None


def _shown(state) -> str:
    return json.dumps(_keys(state)).replace("null", "…")[:300]


def stack(batches: list, step: int = 0):
    """K host batches (pytrees of arrays) as one pytree with a leading axis of K, one scan's
    input, the first the batch of step ``step + 1``. Batches of another shape (an epoch's short
    last batch: ``.batch(n).repeat()``) cannot share one: refused, naming them and the fix."""
    try:
        return jax.tree.map(lambda *xs: np.stack(xs), *batches)
    except ValueError:
        shapes = [jax.tree.map(np.shape, b) for b in batches]
        k = next((i for i, s in enumerate(shapes) if s != shapes[0]), None)
        if k is None:
            raise
        raise ValueError(
            f"the train batches of steps {step + 1} and {step + k + 1} have other shapes "
            f"({shapes[0]} and {shapes[k]}), and --steps-per-dispatch {len(batches)} "
            "(TrainSpec.steps_per_dispatch) stacks each dispatch's batches into one array: give "
            "train_data batches of one shape (.batch(n, drop_remainder=True), or .repeat() "
            "before .batch), or --steps-per-dispatch 1 (a batch of another shape compiles the "
            "step again)"
        ) from None
