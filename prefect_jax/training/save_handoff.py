"""A save handed to a thread of its own, behind a copy of the state on its devices.

Orbax's asynchronous save returns once the arrays are on the host. On an accelerator that waits,
on the thread that called it, for the steps already queued on the device and then for the whole
state's transfer: the training thread dispatches nothing meanwhile, and the device runs dry
(BENCHMARKS.md, "The byte-level LM on a GPU": the bare loop's own async save). With the hand-off
the training thread only dispatches one program that copies the state on its own devices, and a
thread of its own gives that copy to Orbax: the next steps queue behind the copy and run while it
travels to the host. The copy holds one more state's worth of device memory until Orbax has it
on the host. Left to choose (`CheckpointSpec.device_copy` None), the first save looks at the
devices' memory and copies only where a copy fits beside the process's peak use of it; False
turns it off, True copies whatever the memory.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from prefect_jax.training import cluster
from prefect_jax.training.data_positions import position_text
from prefect_jax.training.trees import own_type

logger = logging.getLogger("prefect_jax.checkpoints")

# Left to choose, the copy is made where it fits beside the peak use of device memory so far with
# this share of the device's memory to spare: the allocator's free space is fragmented, and an
# evaluation's batches may reach past the peak of the steps before the first save.
COPY_FITS_WITHIN = 0.9


def on_accelerator() -> bool:
    return jax.default_backend() != "cpu"


def memory_stats(device) -> dict | None:
    """`device`'s allocator statistics (``bytes_limit``, ``peak_bytes_in_use``, ...); None
    where the backend keeps none (a CPU)."""
    return device.memory_stats()


def device_copy_enabled(choice: bool | None) -> bool:
    """`CheckpointSpec.device_copy` for this process. None: on for one JAX process on an
    accelerator; off on a CPU, where Orbax's copy off the device is a host copy the training
    thread would make anyway, and with several processes.

    Raises:
        ValueError: True with several JAX processes (before anything is trained).
    """
    several = cluster.several()
    if choice is None:
        return not several and on_accelerator()
    if choice and several:
        raise ValueError(
            f"CheckpointSpec(device_copy=True) needs one JAX process; this job has "
            f"{jax.process_count()}: Orbax's save synchronises the processes, which must not "
            "happen on a thread beside the training's collectives. Leave device_copy at None "
            "(off with several processes) or set it to False."
        )
    return bool(choice)


def _copy_leaves(leaves):
    return [jnp.copy(x) for x in leaves]


_copy_program = jax.jit(_copy_leaves)


def copy_types(savable) -> list[jax.ShapeDtypeStruct]:
    """The types of `savable`'s arrays, as `copy_on_device` takes them (for `precompile_copy`)."""
    return [own_type(x) for x in jax.tree_util.tree_leaves(savable) if isinstance(x, jax.Array)]


def precompile_copy(types: list[jax.ShapeDtypeStruct]) -> None:
    """Compile `copy_on_device`'s program for arrays of these types, so that the first save
    compiles nothing on the training thread."""
    _copy_program.lower(types).compile()


def copy_on_device(savable):
    """`savable` with each of its arrays copied where it is (same devices, same sharding), in
    one dispatched program: returns at once; a later step that donates the originals runs after
    the copy read them. Other leaves as they are."""
    leaves, treedef = jax.tree_util.tree_flatten(savable)
    where = [i for i, x in enumerate(leaves) if isinstance(x, jax.Array)]
    if where:
        for i, copied in zip(where, _copy_program([leaves[i] for i in where]), strict=True):
            leaves[i] = copied
    return jax.tree_util.tree_unflatten(treedef, leaves)


def bytes_per_device(savable) -> dict[Any, int]:
    """The bytes of `savable`'s arrays on each of this process's devices (a copy's size, tile
    padding included: `on_device_size_in_bytes`)."""
    need: dict[Any, int] = {}
    for x in jax.tree_util.tree_leaves(savable):
        if isinstance(x, jax.Array):
            for shard in x.addressable_shards:
                size = shard.data.on_device_size_in_bytes()
                need[shard.device] = need.get(shard.device, 0) + size
    return need


def room_for_a_copy(savable) -> tuple[bool, str]:
    """Whether a copy of `savable`'s arrays fits, on each of its devices, beside this process's
    peak use of that device's memory so far (the state, the steps trained and their
    activations; also whatever else the process ran before), and the figures of the fullest
    device. Devices that keep no statistics (a CPU) take the copy."""
    fullest = None
    for device, nbytes in bytes_per_device(savable).items():
        stats = memory_stats(device) or {}
        limit = stats.get("bytes_limit")
        if not limit:
            continue
        peak = stats.get("peak_bytes_in_use", stats.get("bytes_in_use", 0))
        share = (peak + nbytes) / limit
        if fullest is None or share > fullest[0]:
            fullest = (share, device, nbytes, peak, limit)
    if fullest is None:
        return True, "its devices keep no memory statistics"
    share, device, nbytes, peak, limit = fullest
    return share <= COPY_FITS_WITHIN, (
        f"on {device} a copy of the state ({nbytes / 2**30:.2f} GiB) beside the process's peak use "
        f"of its memory so far ({peak / 2**30:.2f} GiB) makes {share:.1%} of its "
        f"{limit / 2**30:.2f} GiB, against {COPY_FITS_WITHIN:.0%} at most"
    )


def copy_has_room(step: int, savable) -> bool:
    """For `CheckpointSpec.device_copy` left to choose, at the first save (after steps were
    trained, so the peak counts their activations; a later peak would count the copy itself):
    whether to copy at all. Said once, with the figures; where the devices' statistics cannot be
    read, no copy."""
    try:
        fits, figures = room_for_a_copy(savable)
    except Exception as exc:  # noqa: BLE001 - a save must not fail for want of a statistic
        fits, figures = (
            False,
            f"the devices' memory could not be read ({type(exc).__name__}: {exc})",
        )
    if fits:
        logger.info("saves handed off behind a copy of the state on its devices: %s", figures)
    else:
        logger.warning(
            "saves are not handed off behind a copy of the state on its devices: at step %d, %s. "
            "Each save waits on the training thread for the state's transfer to the host "
            "instead. CheckpointSpec(device_copy=True) (the command's --device-copy) copies "
            "anyway.",
            step,
            figures,
        )
    return fits


def copy_for_save(step: int, savable, data_iter) -> tuple[Any, str] | None:
    """What a save handed off gives Orbax: `savable` copied on its devices and the iterator's
    position, read now, before the caller's next step donates the state or moves the iterator
    on. None where the copy failed (out of device memory, say): said once, and the caller saves
    without it from then on."""
    try:
        return copy_on_device(savable), position_text(data_iter)
    except Exception as exc:  # noqa: BLE001 - the save goes on without the copy
        logger.warning(
            "copying the state on its devices for the save of step %d failed (%s: %s): saving "
            "it, and every later step, without the copy. CheckpointSpec(device_copy=False) (the "
            "command's --no-device-copy) saves so from the start.",
            step,
            type(exc).__name__,
            str(exc).splitlines()[0][:300] if str(exc) else "",
        )
        return None


class HandOff:
    """The save handed to a thread of its own, one at a time (not a daemon: a process must not
    exit between Orbax's writes)."""

    def __init__(self):
        self._thread: threading.Thread | None = None
        # The step of the save started last, and what it raised (kept until the next `start`)
        self._step: int | None = None
        self._error: BaseException | None = None

    def start(self, step: int, save: Callable[[], Any]) -> None:
        """`save()` on a new thread; the one before must have been joined."""
        self._step, self._error = step, None

        def run() -> None:
            try:
                save()
            except BaseException as exc:  # noqa: BLE001 - raised to whoever waits for the save
                self._error = exc

        # (daemon=False said outright: started from the trainer's thread, a daemon, it would be one)
        thread = threading.Thread(target=run, name=f"prefect-jax-save-{step}", daemon=False)
        try:
            thread.start()
        except RuntimeError:  # (no thread to be had: a pids limit, say) saved here, then
            logger.debug("no thread for the save of step %d: saved on the caller's", step)
            self._thread = None
            save()
            return
        self._thread = thread

    def running(self) -> bool:
        thread = self._thread
        return thread is not None and thread.is_alive()

    def join(self) -> tuple[int, BaseException] | None:
        """Wait for the save started last, if any: its step and what it raised, if it failed (to
        every caller, until the next `start`)."""
        thread = self._thread
        if thread is not None:
            thread.join()
        error = self._error
        return None if error is None or self._step is None else (self._step, error)

    def forget(self) -> None:
        """Forget the last save's failure (a restore starts over from the committed steps)."""
        self._step = self._error = None
