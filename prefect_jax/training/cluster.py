"""The job's JAX processes, once joined: who this process is, what they agree on, and how a
process that saw another go away ends.

Where the cluster comes from (the environment: ``PREFECT_JAX_*``, ``TF_CONFIG``, Kubernetes,
SLURM) is `prefect_jax.training.cluster_config`; how a process learns that another went away
while it waits for it is `prefect_jax.training.peer_watch`. Process 0 is the chief: it alone
holds the job's lease, writes eval records and exports and talks to MLflow (`Job.is_primary`).

Example:
    ```python
    initialize()                  # from the environment; None: one process
    stop, = any_process(stop_requested)
    barrier("prefect_jax.prepare_restore")
    ```

This module imports jax only inside the functions that need it.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import re
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

from prefect_jax.training import peer_watch
from prefect_jax.training.cluster_config import ClusterConfig, ClusterConfigError, from_env
from prefect_jax.training.errors import and_its_causes
from prefect_jax.training.peer_watch import LOST_GRACE_SECS, LostProcess, say_goodbye
from prefect_jax.training.preemption import received_signal

logger = logging.getLogger("prefect_jax.trainer")

_joined: ClusterConfig | None = None

# JAX's coordination service's heartbeat timeout, unless PREFECT_JAX_HEARTBEAT_TIMEOUT_SECS says
HEARTBEAT_TIMEOUT_SECS = 30


def initialize(
    cluster: ClusterConfig | None = None, timeout_secs: int | None = None
) -> ClusterConfig | None:
    """Join the job's JAX processes (once per process; before anything asks JAX for its devices).

    On CPU the processes talk through gloo. JAX's preemption service is left off: it would take
    SIGTERM from Prefect and from the trainer, which agrees with the other processes on the step
    to save itself (`any_process`, at log points); the SIGTERM handler that was there before is
    kept in any case.
    """
    global _joined, _exit_is_ours
    cluster = from_env() if cluster is None else cluster
    if cluster is None or _joined is not None:
        return _joined
    import jax
    from jax._src import distributed

    if distributed.global_state.client is not None:  # the caller initialised JAX itself
        _joined = cluster
        _watch()
        return cluster
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.config.update("jax_enable_preemption_service", False)
    # Process 0 joins from inside its flow run, after Prefect's pull steps: the others may wait
    # long.
    timeout_secs = timeout_secs or int(os.environ.get("PREFECT_JAX_INIT_TIMEOUT_SECS", "600"))
    previous = signal.getsignal(signal.SIGTERM)
    # A process that died is noticed by the others within `heartbeat` seconds (JAX's default: 100).
    heartbeat = int(os.environ.get("PREFECT_JAX_HEARTBEAT_TIMEOUT_SECS", HEARTBEAT_TIMEOUT_SECS))
    kwargs: dict[str, Any] = {
        "initialization_timeout": timeout_secs,
        "heartbeat_timeout_seconds": heartbeat,
    }
    if not cluster.auto:
        kwargs.update(
            coordinator_address=cluster.coordinator_address,
            num_processes=cluster.num_processes,
            process_id=cluster.process_id,
        )
    logger.info("joining the job's JAX processes: %s", cluster)
    try:
        jax.distributed.initialize(**kwargs)
    except Exception as exc:
        raise ClusterConfigError(
            f"could not join the JAX processes ({cluster}): {exc}. Every process must start within "
            f"{timeout_secs}s and reach the coordinator's address; check it and the port"
        ) from exc
    if previous is not None:
        signal.signal(signal.SIGTERM, previous)
    _joined = cluster
    atexit.register(_leave)  # runs before JAX's own exit handler (registered when jax was imported)
    _exit_is_ours = True
    _watch()
    return cluster


_finished = False
# This package's exit (`_leave`), not JAX's shutdown barrier, ends a process that did not finish:
# not where the caller initialised JAX itself (every process then meets at JAX's barrier).
_exit_is_ours = False
# what a process that lost another exits with (`_leave`); a command that knows its own sets it
exit_code = 1


def mark_finished() -> None:
    """This process finished its part of the job: at exit, leave the cluster JAX's way (a barrier
    every process reaches); it says goodbye to the others (`say_goodbye`)."""
    global _finished
    _finished = True
    say_goodbye(finished=True)


def _leave() -> None:
    """At exit of a process that did not finish (an error, a lost peer, a preemption): skip JAX's
    shutdown barrier, which would wait for every other process, a dead one for the whole
    heartbeat timeout, and then abort this one; process 0 lets the others go first
    (`leave_last`). The job's state is in its committed checkpoints."""
    if _joined is not None and not _finished:
        try:
            from jax._src import api

            atexit.unregister(api.clean_up)
        except (ImportError, AttributeError):  # another JAX: its own exit, slow but correct
            pass
        try:
            leave_last()
        except BaseException:  # noqa: BLE001 - (a second SIGTERM, say) the exit below is kept
            pass
        if _lost is not None:
            # This process saw another go away (a collective's lost connection, `LostProcess`).
            # JAX's coordination service, torn down with the interpreter while calls wait on the
            # lost process, would abort this one (SIGABRT, seconds on; after the heartbeat timeout
            # if a thread still waits at a barrier). The run's state and logs are out (Prefect's
            # queues drain before `atexit`), the job's state is in its committed checkpoints.
            logger.warning(
                "exiting without JAX's shutdown, which would wait for the lost process: %s", _lost
            )
            logging.shutdown()
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(Exception):
                    stream.flush()
            os._exit(exit_code)


# The longest process 0 waits at its exit for the others to go first: the ones ending with it
# report their run's end and flush their logs, seconds under load.
LEAVE_LAST_SECS = 10.0


def leave_last() -> None:
    """Process 0, ending with the others (a process of the job was lost, or the job preempted):
    let them exit first (`peer_watch.outlive_the_others`), 10 s at most. The coordination service
    runs here, and JAX aborts a process whose service went away, one still reporting its run's end
    to Prefect too. Called at exit (`_leave`) and by the flows' crash hook: a flow run that Prefect
    ends for a SIGTERM is killed by the signal once its hooks ran, without any exit handler. Not
    after a failure of process 0's own: the others may be waiting for it in a collective, which
    ends only once it has gone. Returns at once in the other processes (none is counted there)
    and once they are gone. (At exit: nothing is imported here, and no JAX call, which could
    start a backend.)"""
    if not _exit_is_ours or (_lost is None and received_signal() is None):
        return
    if not peer_watch.outlive_the_others(LEAVE_LAST_SECS):
        logger.warning(
            "exiting while other processes of the job are still running (%.0fs waited): JAX "
            "may abort them as the coordination service goes with this process",
            LEAVE_LAST_SECS,
        )


# What a collective raises in a process whose peer died (SIGKILL, a lost node, an OOM kill), with
# its transport named: gloo on CPUs ("UNKNOWN: Gloo AllGather failed: [.../pair.cc:538] Read error
# [127.0.0.1]:47312: Connection reset by peer", "... Connection closed by peer", seen here), NCCL on
# GPUs ("remote process exited or there was a network error"), JAX's coordination service ("Failed
# to send RPC to coordination service. Either the leader task was preempted/died/restarted",
# "... heartbeat timeout"). A storage's "503 Service Unavailable", a lease's heartbeat or a refused
# connection of the program's own are no peer's death.
_LOST_PROCESS = re.compile(
    r"gloo\b[^\n]*(connection (reset|closed|refused)|closed by peer|broken pipe|(read|write) error)"
    r"|nccl\b[^\n]*(remote process|network error|abort)"
    r"|coordination service[^\n]*(unavailable|preempted|died|stopped|heartbeat)"
    r"|unavailable[^\n]*coordination service|task[^\n]*heartbeat time ?d? ?out",
    re.IGNORECASE,
)


def lost_a_process(exc: BaseException) -> bool:
    """Whether `exc` (or an exception it came from) says another process of the job went away,
    as a collective reports it: the job was cut short by a kill without notice somewhere."""
    return any(
        isinstance(e, LostProcess) or _LOST_PROCESS.search(f"{type(e).__name__}: {e}")
        for e in and_its_causes(exc)
    )


# this package's keys in the coordination service (`publish`, `lookup`, `failed_processes`)
_KEYS = "prefect_jax/"
_lost: str | None = None  # the first error of this process that said another process went away


def note_failure(exc: BaseException) -> None:
    """This process of a multi-process job failed with `exc`. If it says another process went
    away (`lost_a_process`), remember it (`lost_process`); else it is this process's own failure:
    tell the others (`failed_processes`), so that theirs, which follows from it, is not taken for
    a kill. The collectives here call it; the trainer too, for its restore and training."""
    global _lost
    if not several():
        return
    if lost_a_process(exc):
        if _lost is None:
            _lost = str(exc).splitlines()[0][:300] if str(exc) else type(exc).__name__
        return
    try:
        publish(f"failed/{process_index()}", f"{type(exc).__name__}: {exc}"[:500])
    except Exception:  # noqa: BLE001 - the coordination service itself may be gone
        pass


def lost_process() -> str | None:
    """The error by which this process saw another process of its job go away, if it did."""
    return _lost


def forget_lost() -> None:
    """A new trainer in this process: what an earlier one saw is not its attempt's."""
    global _lost
    _lost = None


def failed_processes() -> dict[str, str]:
    """The processes of this job that said they failed on their own (`note_failure`): the key
    ``failed/<index>`` and the error, from the coordination service; empty if it cannot answer."""
    try:
        from jax._src import distributed

        found = distributed.global_state.client.key_value_dir_get(f"{_KEYS}failed/")
        return {k.removeprefix(_KEYS): v for k, v in found}
    except Exception:  # noqa: BLE001 - gone with the others, or no client
        return {}


@contextlib.contextmanager
def noting_lost_peers() -> Iterator[None]:
    """Around a collective call: a failure there (a peer lost meanwhile) is noted for the job."""
    try:
        yield
    except Exception as exc:
        note_failure(exc)
        raise


def joined() -> ClusterConfig | None:
    """The cluster `initialize` joined in this process, if any."""
    return _joined


def process_index() -> int:
    import jax

    return jax.process_index()


def process_count() -> int:
    import jax

    return jax.process_count()


def several() -> bool:
    """Whether this process is one of several JAX processes (joined here, or by the caller's own
    `jax.distributed.initialize`); never imports jax."""
    import sys

    # (a module another thread is still importing has no process_count yet: not joined)
    process_count = getattr(sys.modules.get("jax"), "process_count", None)
    return _joined is not None or (process_count is not None and process_count() > 1)


def any_process(*flags: bool) -> tuple[bool, ...]:
    """For each flag, whether it is set in any process (a collective: every process calls it at
    the same point). One process: the flags as they are."""
    if process_count() == 1:
        return tuple(bool(f) for f in flags)
    import numpy as np
    from jax.experimental import multihost_utils

    with noting_lost_peers():
        gathered = multihost_utils.process_allgather(np.array([bool(f) for f in flags]))
    return tuple(bool(x) for x in np.asarray(gathered).reshape(-1, len(flags)).any(axis=0))


def from_primary(flag: bool) -> bool:
    """Process 0's `flag`, in every process (a collective). One process: `flag`."""
    if process_count() == 1:
        return bool(flag)
    import numpy as np
    from jax.experimental import multihost_utils

    with noting_lost_peers():
        return bool(multihost_utils.broadcast_one_to_all(np.array(bool(flag))))


def barrier(name: str) -> None:
    """Wait until every process got here (no-op with one process)."""
    if process_count() > 1:
        from jax.experimental import multihost_utils

        with noting_lost_peers():
            multihost_utils.sync_global_devices(name)


def publish(key: str, value: str) -> None:
    """Put `value` in the coordination service's key-value store (process 0 tells the others)."""
    from jax._src import distributed

    distributed.global_state.client.key_value_set(f"{_KEYS}{key}", value, allow_overwrite=True)


def lookup(key: str, timeout_secs: float = 300) -> str:
    """A value `publish` put (waits for it)."""
    from jax._src import distributed

    return distributed.global_state.client.blocking_key_value_get(
        f"{_KEYS}{key}", int(timeout_secs * 1000)
    )


def _watch() -> None:
    """Start the peer watch; once it runs, exit without waiting for a lost process's saves."""
    if peer_watch.start(publish, lookup):
        # (CPython's: as Prefect's own queue services use it)
        register = getattr(threading, "_register_atexit", None)
        if register is not None:
            register(_exit_without_lost_waits)


def _exit_without_lost_waits() -> None:
    """At exit, before Python joins the threads that are not daemons: if this process saw another
    go away (`lost_process`) and did not finish, Orbax's save threads wait for it at their
    barriers until JAX's heartbeat timeout aborts the process (SIGABRT). Exit without
    joining them: what they were saving is no commit, and the job's committed steps are on
    storage."""
    locks, guard = (
        getattr(threading, "_shutdown_locks", None),
        getattr(threading, "_shutdown_locks_lock", None),
    )
    if _lost is None or _finished or locks is None or guard is None:
        return
    for thread in threading.enumerate():
        target = getattr(thread, "_target", None)
        module = getattr(target, "__module__", None) or type(thread).__module__
        if thread.daemon or not module.startswith("orbax."):
            continue
        logger.warning("not waiting at exit for %s (%s): %s", thread.name, module, _lost)
        with guard:
            locks.discard(getattr(thread, "_tstate_lock", None))


def wait_unless_lost(
    wait: Callable[[], None], what: str, grace_secs: float = LOST_GRACE_SECS
) -> None:
    """Run `wait` (one that waits for the other processes, such as Orbax's commit) to its end, or
    raise `LostProcess` when another process went away and `wait` did not end within
    `grace_secs` of it (see `peer_watch.wait_unless_lost`); the loss is noted (`note_failure`).
    One process: `wait()`."""
    if not several():
        wait()
        return
    peer_watch.wait_unless_lost(wait, what, grace_secs, on_lost=note_failure)
