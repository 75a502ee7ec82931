"""A Grain iterator over a dataset (`iterate`), and its position as a checkpoint's ``data`` item
holds it: one text file per process (``process_<i>-of-<n>.json``, Grain's own format), and a step
written by another number of processes than the job has now."""

from __future__ import annotations

import glob
import json
import logging
import os

import grain
import jax

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
    """The iterator state file of process 0 of a local step written by another number of JAX
    processes than this job has now (None: the same number, each process restores its own with
    Grain; or not local)."""
    data = os.path.join(checkpoint_dir, str(step), "data")
    own = os.path.join(data, f"process_{jax.process_index()}-of-{jax.process_count()}.json")
    if "://" in checkpoint_dir or not os.path.isdir(data) or os.path.exists(own):
        return None
    first = sorted(glob.glob(os.path.join(glob.escape(data), "process_0-of-*.json")))
    return first[0] if first else None


def restore_position_of_process_0(data_iter, path: str, step: int) -> None:
    """Every process of a job reads the same batches (the loop splits each one over the
    devices), so process 0's position (`path`) is every process's, on any number of processes."""
    with open(path) as f:
        set_position(data_iter, f.read())
    logger.warning(
        "step %d was written by %s processes, restored into %d: the data position of its "
        "process 0 (%s) applies to each",
        step,
        os.path.basename(path).split("-of-")[1].split(".")[0],
        jax.process_count(),
        os.path.basename(path),
    )
