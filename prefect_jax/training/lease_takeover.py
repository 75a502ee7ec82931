"""What taking a job's lease does when the read-back of its write finds another record.

Taking a lease is a write and then a read-back. On local paths, S3 and GCS the write lands only
over the record judged (`lease_file`): a holder's beat or mark written since refuses it, and the
read-back finds that record. Elsewhere (no compare-and-set: other stores, or one that refused
the precondition) the write lands, and a holder's write may land over it. Where the read-back
does not find the taker's own record, it finds

- nothing: the holder let the job go (its release reads the lease, then deletes it: a delete
  that lands after the write): the lease is written again, a taking and no longer a takeover;
- the record of the holder just judged (`Lease.acquire`), with the same ``finishing`` mark: that
  holder is alive, and a heartbeat of its, read before the write, landed after it. Where its
  record is still one to take over (`Lease.stale_reason`: its own flow run's on another host, or
  left by this process), and it is not a live process of this flow run on this host (waited for,
  as any such), the lease is written again: the holder's next beat reads the taker's record and
  lets go, and its next `Lease.verify` stops it before it writes anything. Where the fresh beat
  makes the holder live (a lease taken over as stale), the holder keeps the job;
- that holder's record newly marked ``finishing``: it was preempted meanwhile and its last save
  may still be writing, so the lease is judged again, which waits for those writes
  (`lease_finishing.wait_while_finishing`). A mark written after the judgement and before the
  write refuses the write where the lease has a compare-and-set (then found here too); without
  one it is written over, and the holder's next beat finds the lease taken, its abandoned save
  possibly still writing. A mark after the write is refused itself (with a compare-and-set):
  the holder finds the job taken;
- another trainer's record: its later write won (`Lease.acquire` decides what follows).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from prefect_jax.training.lease import Lease

# How many times a taking writes the lease where the holder it judged writes over it, or lets go.
TAKEOVER_WRITES = 3
WRITE_AGAIN, JUDGE_AGAIN = "write again", "judge again"


def same_holder_beat(lease: Lease, judged: dict | None, now: dict | None) -> bool:
    """Whether the lease read `now`, just before the taking's write, differs from the one
    `judged` by a heartbeat of the same holder alone (same token, same ``finishing``) and is
    still one to take over (`Lease.stale_reason`: a finishing holder not waited for longer, still
    beating; its own flow run's on another host): written over, not judged again (which would
    wait out a finishing holder a second time)."""
    if not judged or not now or now.get("token") != judged.get("token"):
        return False
    return now.get("finishing") == judged.get("finishing") and lease.stale_reason(now) is not None


def after_takeover_write(lease: Lease, judged: dict | None, confirmed: dict | None) -> str | None:
    """`WRITE_AGAIN`, `JUDGE_AGAIN` or None (see the module), for `lease`'s write read back as
    `confirmed` (None: no lease) after `judged` (the lease as it was judged; None: none was)."""
    if confirmed is None:
        return WRITE_AGAIN
    token = confirmed.get("token")
    if judged is None or token == lease.token or token != judged.get("token"):
        return None
    if confirmed.get("finishing") != judged.get("finishing"):
        return JUDGE_AGAIN
    if lease.stale_reason(confirmed) is None or lease.live_duplicate(confirmed) is not None:
        return None
    return WRITE_AGAIN
