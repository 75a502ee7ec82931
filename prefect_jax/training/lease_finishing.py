"""A lease kept past its attempt's end while the attempt's last save may still be written.

A preemption notice gives the save of the live step `sigterm_grace_secs` to commit. One that
does not is abandoned by the attempt, not stopped: Orbax's threads (and on `gs://`, where a step
is written in place, its objects) go on until the process ends, which may be seconds after the
attempt gives up (a flow-run process ends its Prefect run first). Freed at once, the lease would
let a rerun start then: a rerun of the same flow run on another machine takes its own run's lease
at once; it would move the half-written step aside, and the old writer's last objects, its commit
file among them, would land after it, on a step that counts. So the holder keeps the lease, marked
``finishing``, its heartbeat going, until those writes end (`release_after`), and a trainer that
wants the job waits for that (`wait_while_finishing`): until the lease is freed, or its heartbeat
goes stale (the process is gone: its writes ended with it), or its process on this host is gone,
or the lease's timeout has passed (a commit that stalled in a process that lives on).
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from prefect_jax.training.local_processes import holder_gone
from prefect_jax.training.redaction import redact_url

if TYPE_CHECKING:
    from prefect_jax.training.lease import Lease

logger = logging.getLogger("prefect_jax.lease")

# How often a trainer that wants the job looks whether the finishing holder let it go.
FINISHING_POLL_SECS = 0.5


def release_after(lease: Lease, writes_end: Callable[[], object], what: str) -> None:
    """Keep `lease` (held) marked as finishing `what` (``"step 120"``), and free it once
    `writes_end` returns or raises, on a thread of its own; no other `release` frees it before
    that. The thread is a daemon, so the lease does not keep the process alive: a process that
    exits normally frees it at its exit (`atexit` runs after the interpreter joined its other
    threads, Orbax's among them), and one killed leaves it to go stale with its heartbeat."""
    if not lease.held:
        return
    lease.finishing = what
    try:
        lease.write_beat()  # (the mark is seen at once, not at the next heartbeat)
    except Exception:  # noqa: BLE001 - the heartbeat writes it again
        logger.exception("could not mark the lease as finishing %s", what)

    def free_when_written() -> None:
        try:
            writes_end()
        except Exception:  # noqa: BLE001 - failed or not, this process writes no more
            pass
        finally:
            lease.release(writes_ended=True)

    atexit.register(lease.release, writes_ended=True)
    threading.Thread(target=free_when_written, name="prefect-jax-lease-finish", daemon=True).start()


def finishing(current: dict | None, timeout_secs: float) -> str | None:
    """What the holder recorded in `current` (the lease as read) may still be writing, or None:
    nothing, or the holder is gone (`holder_gone`: its writes ended with it)."""
    what = (current or {}).get("finishing")
    return what if what and holder_gone(current, timeout_secs) is None else None


def wait_while_finishing(lease: Lease, current: dict | None) -> dict | None:
    """While the holder in `current` may still be writing (`finishing`), wait, reading the
    lease again, for the lease's timeout at most (a commit that stalls in a process that lives
    on would keep it fresh for ever); return it as it then is. `Lease.acquire` calls this
    before it judges the holder."""
    what = finishing(current, lease.timeout_secs)
    if what is None:
        return current
    lease.waited_for_holder = True
    job = redact_url(lease.storage.job_dir)
    logger.warning(
        "job %s: its last holder (flow run %s, host %s, pid %s) got a preemption notice and may "
        "still be writing %s: waiting until it lets the job go, %.0fs at most",
        job,
        current.get("flow_run_id"),
        current.get("host"),
        current.get("pid"),
        what,
        lease.timeout_secs,
    )
    started = time.monotonic()
    while finishing(current, lease.timeout_secs) is not None:
        if time.monotonic() - started > lease.timeout_secs:
            waited = time.monotonic() - started
            logger.warning(
                "job %s: still finishing %s after %.0fs: not waiting longer", job, what, waited
            )
            return current
        time.sleep(FINISHING_POLL_SECS)
        current = lease.read()
    logger.warning("job %s: its last holder let it go after %.1fs", job, time.monotonic() - started)
    return current
