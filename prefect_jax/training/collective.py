"""What a job whose state is sharded over several JAX processes does together: its batches
assembled from every process, the state gathered to the host, process 0's decisions told.

With a replicated state (data parallel) process 0 evaluates, exports and fingerprints its own
replica alone. A state sharded over the devices of several processes (a program's mesh, see
`prefect_jax.training.sharding`) has no whole copy in any process: each of these becomes a
collective, which every process calls at the same point, in the same order (one that only
process 0 calls would wait forever):

- the evaluation: every process runs the jitted eval step on the global sharded state with the
  same global eval batches, so the sums come out replicated (`global_batch`); process 0 decides
  whether to evaluate and tells the others (`announce`);
- the exports: the state gathered to the host, one leaf at a time, in every process
  (`host_gather`), where process 0 says an exporter may write (`announce` again, once the
  evaluation's result is known); process 0 exports its copy;
- the fingerprint: each array digested where its shards are, every process summing its own and
  the sums meeting in one small all-reduce (`spanning_fingerprint`): nothing is gathered.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec

from prefect_jax.training.digests import device_digestible, device_digests, host_digest
from prefect_jax.training.trees import fingerprint_of, from_savable, leaf_paths, to_savable

# What process 0 tells the others at an evaluation (`announce`, twice): first
EVALUATE = 1  # every process runs the eval step on the live state (or 0: none); then
# every process joins the live state's gather to the host (or 0: no export needs it);
GATHER = 2
# and how each process's part ended (`worst`): 0, 1 (process 0 stopped evaluating) or
FAILED = 2  # it raised: every process raises (a retry of the task then runs in all of them).


def spans_processes(sharded: bool, processes: int) -> bool:
    """Whether a loop's state is sharded over the devices of several processes: a program's own
    placement (`sharded`) on several JAX processes."""
    return sharded and processes > 1


def global_batch(batch, sharding):
    """A host batch that every process holds whole, as global arrays placed as `sharding` says:
    each process puts on its own devices the parts its devices hold, wherever the mesh puts
    them (no copy of the whole batch to any device)."""

    def place(x):
        x = np.asarray(x)
        return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])

    return jax.tree.map(place, batch)


@functools.lru_cache(maxsize=8)
def _made_whole(mesh):
    """An array made whole on every device of `mesh`: one jitted function per mesh, so that each
    evaluation's gather reuses the compiled copies of the last one (a new function each time
    would compile every leaf's copy again)."""
    return jax.jit(_same, out_shardings=NamedSharding(mesh, PartitionSpec()))


def _same(x):
    return x


def host_gather(tree):
    """`tree` (global arrays, sharded over several processes) as NumPy arrays in process 0, None
    in the others (a collective: every process calls it). One leaf at a time, each made whole on
    every device and copied to process 0's host only: the other hosts hold no copy of the state,
    and the device memory it takes beyond the state is one leaf's. PRNG keys gathered as their
    raw data and wrapped again."""
    from prefect_jax.training.cluster import noting_lost_peers

    primary = jax.process_index() == 0

    def gather(a):
        with noting_lost_peers():
            replicated = _made_whole(a.sharding.mesh)(a)
            replicated.block_until_ready()  # every process waits for the exchange to end
        return np.asarray(replicated.addressable_data(0)) if primary else None

    raw = jax.tree.map(gather, to_savable(tree))
    return from_savable(raw, tree) if primary else None


def spanning_fingerprint(tree) -> str | None:
    """`state_fingerprint` of a state sharded over several processes, in process 0 (None in the
    others; a collective: every process calls it). Every array is digested on the devices that
    hold its shards: no array is gathered, but one whose dtype the digest does not read there."""
    from prefect_jax.training.cluster import noting_lost_peers

    leaves = leaf_paths(to_savable(tree))
    on_devices = [i for i, (_, leaf) in enumerate(leaves) if device_digestible(leaf)]
    with noting_lost_peers():
        # One array at a time, each digest read before the next is dispatched (as `host_gather`
        # waits for each exchange): with all of them in flight at once, the 2-process test hung
        # once (programs in flight together on a CPU may pair their all-reduces differently in
        # each process).
        digests = {i: device_digests([leaves[i][1]])[0] for i in on_devices}
    gathered = {i: host_gather(leaf) for i, (_, leaf) in enumerate(leaves) if i not in digests}
    if jax.process_index() != 0:
        return None
    digests.update((i, host_digest(whole)) for i, whole in gathered.items())
    return fingerprint_of(leaves, digests)


def announce(code: int | None) -> int:
    """Process 0's `code` in every process (a collective: the others pass None)."""
    from prefect_jax.training.cluster import noting_lost_peers

    value = np.int32(code if code is not None else 0)
    with noting_lost_peers():  # a peer lost meanwhile is noted, as at every collective of the job
        return int(multihost_utils.broadcast_one_to_all(value))


def worst(code: int) -> int:
    """The largest of every process's `code` (a collective): how a step all of them took part in
    ended, where a failure in any one of them must end it in all."""
    from prefect_jax.training.cluster import noting_lost_peers

    with noting_lost_peers():
        codes = multihost_utils.process_allgather(np.int32(code))
    return int(np.max(codes))
