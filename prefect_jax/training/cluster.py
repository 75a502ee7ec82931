"""The cluster a job trains on: TensorFlow's ``TF_CONFIG``, for JAX processes.

One JAX process per host (or per GPU), all running the same program in lockstep (SPMD):
`jax.distributed.initialize` joins them, `Loop` trains data-parallel over every process's
devices, Orbax writes each process's part of a checkpoint and Grain's iterator state is saved
per process, in the same step. Process 0 is the chief: it alone holds the job's lease, writes
eval records and exports and talks to MLflow (`Job.is_primary`).

Where the cluster comes from, first match wins (`from_env`):

1. ``PREFECT_JAX_NUM_PROCESSES`` (> 1) with ``PREFECT_JAX_COORDINATOR_ADDRESS`` (``host:port``
   of process 0) and the process id in ``PREFECT_JAX_PROCESS_ID``, or else
   ``JOB_COMPLETION_INDEX`` (a Kubernetes Indexed Job or JobSet sets it per pod).
2. ``CLUSTER_SPEC`` (Vertex AI custom jobs with several replicas) or ``TF_CONFIG`` (what
   TensorFlow jobs already carry): the first host of the first pool (``workerpool0`` or
   ``chief``) coordinates; processes are numbered pool by pool.
3. ``PREFECT_JAX_NUM_PROCESSES=auto``: JAX's own cluster detection (``jax.distributed.initialize()``
   with no arguments: SLURM's ``srun`` tasks, Open MPI, a Cloud TPU slice). Opt-in: a single run
   started inside a SLURM allocation of several tasks stays one process.
4. Nothing: one process.

Example:
    ```python
    cluster = from_env({"PREFECT_JAX_NUM_PROCESSES": "2", "PREFECT_JAX_PROCESS_ID": "1",
                        "PREFECT_JAX_COORDINATOR_ADDRESS": "10.0.0.5:8476"})
    print(cluster)  # 2 processes, this is process 1, coordinator 10.0.0.5:8476 (PREFECT_JAX_*)
    ```

This module imports jax only inside the functions that need it.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import re
import secrets
import selectors
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping

logger = logging.getLogger("prefect_jax.trainer")

NUM_PROCESSES = "PREFECT_JAX_NUM_PROCESSES"
PROCESS_ID = "PREFECT_JAX_PROCESS_ID"
COORDINATOR = "PREFECT_JAX_COORDINATOR_ADDRESS"
DEFAULT_PORT = 8476  # JAX's documented default coordinator port


class ClusterConfigError(ValueError):
    """The environment describes a cluster that cannot be joined (the message names the variable)."""


@dataclass(frozen=True)
class ClusterConfig:
    """Who trains a job together: `num_processes` JAX processes, this one `process_id`.

    `coordinator_address` is process 0's ``host:port``. `auto` leaves the three to JAX's own
    detection (SLURM, Open MPI, Cloud TPU). `source` says where they came from.
    """

    num_processes: int | None
    process_id: int | None
    coordinator_address: str | None
    source: str
    auto: bool = False

    def __str__(self) -> str:
        if self.auto:
            return f"a cluster JAX detects itself ({self.source})"
        return (f"{self.num_processes} processes, this is process {self.process_id}, "
                f"coordinator {self.coordinator_address} ({self.source})")  # fmt: skip


def _int(env: Mapping[str, str], name: str, fix: str) -> int:
    raw = env.get(name, "")
    try:
        return int(raw)
    except ValueError:
        raise ClusterConfigError(f"{name}={raw!r} is not an integer: {fix}") from None


def _address(value: str, name: str) -> str:
    host, _, port = value.rpartition(":")
    if not host:
        return f"{value}:{DEFAULT_PORT}"
    if not port.isdigit():
        raise ClusterConfigError(f"{name}={value!r} is not host:port (for example 10.0.0.5:{DEFAULT_PORT})")
    return value


def _checked(n: int, pid: int, coordinator: str, source: str, pid_name: str) -> ClusterConfig:
    if n < 1:
        raise ClusterConfigError(f"{NUM_PROCESSES}={n}: the number of JAX processes must be at least 1")
    if not 0 <= pid < n:
        raise ClusterConfigError(
            f"{pid_name}={pid} is outside 0..{n - 1} for {n} processes: number the processes 0 to {n - 1} "
            "(process 0 coordinates and writes MLflow, eval records and exports)"
        )
    return ClusterConfig(n, pid, coordinator, source)


def _from_spec(raw: str, name: str) -> ClusterConfig | None:
    """``CLUSTER_SPEC`` (Vertex AI) or ``TF_CONFIG``: ``{"cluster": {pool: [host:port, ...]}, "task": {"type", "index"}}``."""
    try:
        spec = json.loads(raw)
        cluster, task = spec["cluster"], spec["task"]
        # The training pools only: Vertex's workerpool2 (parameter or reduction servers) and
        # workerpool3 (evaluators), TF's ps and evaluator tasks are not JAX training processes.
        pools = [p for p in ("chief", "master", "workerpool0", "worker", "workerpool1") if cluster.get(p)]
        kind, index = task["type"], int(task.get("index", 0))
    except (ValueError, KeyError, TypeError) as exc:
        raise ClusterConfigError(f"{name} is not a cluster spec with 'cluster' and 'task' ({exc!r}): {raw[:200]!r}") from None
    if not pools or kind not in pools:
        return None  # an evaluator or parameter server: trains alone, if at all
    hosts = [h for p in pools for h in cluster[p]]
    if len(hosts) < 2:
        return None
    pid = sum(len(cluster[p]) for p in pools[: pools.index(kind)]) + index
    return _checked(len(hosts), pid, _address(hosts[0], name), name, f"{name} task index")


def from_env(env: Mapping[str, str] | None = None) -> ClusterConfig | None:
    """The cluster this process belongs to, from its environment (see the module); None: one process.

    Raises:
        ClusterConfigError: a variable is malformed or inconsistent; the message names it.
    """
    env = os.environ if env is None else env
    if env.get(NUM_PROCESSES, "").strip().lower() == "auto":
        return ClusterConfig(None, None, None, "JAX's cluster detection (SLURM, Open MPI, Cloud TPU)", auto=True)
    if env.get(NUM_PROCESSES):
        n = _int(env, NUM_PROCESSES, "set it to the number of JAX processes that train the job together, or 'auto'")
        if n == 1:
            return None
        if env.get(PROCESS_ID):
            pid, pid_name, source = _int(env, PROCESS_ID, "set it to this process's index, 0 to N-1"), PROCESS_ID, "PREFECT_JAX_*"
        elif env.get("JOB_COMPLETION_INDEX"):
            pid_name, source = "JOB_COMPLETION_INDEX", "Kubernetes indexed job"
            pid = _int(env, pid_name, "it is set by Kubernetes for completionMode: Indexed")
        else:
            raise ClusterConfigError(
                f"{NUM_PROCESSES}={n} but this process's index is unknown: set {PROCESS_ID} (0 to {n - 1}), "
                "or run it as a pod of a Kubernetes Indexed Job (JOB_COMPLETION_INDEX)"
            )
        if not env.get(COORDINATOR):
            raise ClusterConfigError(
                f"{NUM_PROCESSES}={n} but {COORDINATOR} is not set: set it to process 0's host:port, for example "
                f"localhost:{DEFAULT_PORT} on one machine, or <job>-0.<headless service>:{DEFAULT_PORT} on Kubernetes"
            )
        return _checked(n, pid, _address(env[COORDINATOR], COORDINATOR), source, pid_name)
    for name in ("CLUSTER_SPEC", "TF_CONFIG"):
        if env.get(name):
            found = _from_spec(env[name], name)
            if found is not None:
                return found
    return None


def leads_from_env(env: Mapping[str, str] | None = None) -> bool:
    """Whether this process is process 0 of its job (or its only one), from the environment alone
    (no JAX): the process that writes the job's MLflow run. True when JAX would have to tell
    (``auto``) or a variable is malformed (the trainer's own start reports that)."""
    try:
        cluster = from_env(env)
    except ClusterConfigError:
        return True
    return cluster is None or cluster.process_id in (None, 0)


_joined: ClusterConfig | None = None


def initialize(cluster: ClusterConfig | None = None, timeout_secs: int | None = None) -> ClusterConfig | None:
    """Join the job's JAX processes (once per process; before anything asks JAX for its devices).

    On CPU the processes talk through gloo. JAX's preemption service is left off: it would take
    SIGTERM from Prefect and from the trainer, which agrees with the other processes on the step
    to save itself (`any_process`, at log points); the SIGTERM handler that was there before is
    kept in any case.
    """
    global _joined
    cluster = from_env() if cluster is None else cluster
    if cluster is None or _joined is not None:
        return _joined
    import jax
    from jax._src import distributed

    if distributed.global_state.client is not None:  # the caller initialised JAX itself
        _joined = cluster
        _start_watch()
        return cluster
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.config.update("jax_enable_preemption_service", False)
    # Process 0 joins from inside its flow run, after Prefect's pull steps: the others may wait long.
    timeout_secs = timeout_secs or int(os.environ.get("PREFECT_JAX_INIT_TIMEOUT_SECS", "600"))
    previous = signal.getsignal(signal.SIGTERM)
    # A process that died is noticed by the others within `heartbeat` seconds (JAX's default: 100).
    heartbeat = int(os.environ.get("PREFECT_JAX_HEARTBEAT_TIMEOUT_SECS", "30"))
    kwargs: dict[str, Any] = {"initialization_timeout": timeout_secs, "heartbeat_timeout_seconds": heartbeat}
    if not cluster.auto:
        kwargs.update(coordinator_address=cluster.coordinator_address, num_processes=cluster.num_processes,
                      process_id=cluster.process_id)  # fmt: skip
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
    _start_watch()
    return cluster


_finished = False
exit_code = 1  # what a process that lost another exits with (`_leave`); a command that knows its own sets it


def mark_finished() -> None:
    """This process finished its part of the job: at exit, leave the cluster JAX's way (a barrier
    every process reaches); it says goodbye to the others (`say_goodbye`)."""
    global _finished
    _finished = True
    say_goodbye()


def _leave() -> None:
    """At exit of a process that did not finish (an error, a lost peer, a preemption): skip JAX's
    shutdown barrier, which would wait for every other process, a dead one for the whole
    heartbeat timeout, and then abort this one. The job's state is in its committed checkpoints."""
    if _joined is not None and not _finished:
        try:
            from jax._src import api

            atexit.unregister(api.clean_up)
        except (ImportError, AttributeError):  # another JAX: its own exit, slow but correct
            pass
        if _lost is not None:
            # This process saw another go away (a collective's lost connection, `LostProcess`).
            # JAX's coordination service, torn down with the interpreter while calls wait on the
            # lost process, would abort this one (SIGABRT, ~5 s on; after the heartbeat timeout
            # if a thread still waits at a barrier). The run's state and logs are out (Prefect's
            # queues drain before `atexit`), the job's state is in its committed checkpoints.
            logger.warning("exiting without JAX's shutdown, which would wait for the lost process: %s", _lost)
            logging.shutdown()
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(Exception):
                    stream.flush()
            os._exit(exit_code)


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
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, LostProcess) or _LOST_PROCESS.search(f"{type(exc).__name__}: {exc}"):
            return True
        exc, seen = exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__), seen + 1
    return False


_KEYS = "prefect_jax/"  # this package's keys in the coordination service (`publish`, `lookup`, `failed_processes`)
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
def _collective() -> Iterator[None]:
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

    jax = sys.modules.get("jax")
    return _joined is not None or (jax is not None and jax.process_count() > 1)


def any_process(*flags: bool) -> tuple[bool, ...]:
    """For each flag, whether it is set in any process (a collective: every process calls it at
    the same point). One process: the flags as they are."""
    if process_count() == 1:
        return tuple(bool(f) for f in flags)
    import numpy as np
    from jax.experimental import multihost_utils

    with _collective():
        gathered = multihost_utils.process_allgather(np.array([bool(f) for f in flags]))
    return tuple(bool(x) for x in np.asarray(gathered).reshape(-1, len(flags)).any(axis=0))


def from_primary(flag: bool) -> bool:
    """Process 0's `flag`, in every process (a collective). One process: `flag`."""
    if process_count() == 1:
        return bool(flag)
    import numpy as np
    from jax.experimental import multihost_utils

    with _collective():
        return bool(multihost_utils.broadcast_one_to_all(np.array(bool(flag))))


def barrier(name: str) -> None:
    """Wait until every process got here (no-op with one process)."""
    if process_count() > 1:
        from jax.experimental import multihost_utils

        with _collective():
            multihost_utils.sync_global_devices(name)


def publish(key: str, value: str) -> None:
    """Put `value` in the coordination service's key-value store (process 0 tells the others)."""
    from jax._src import distributed

    distributed.global_state.client.key_value_set(f"{_KEYS}{key}", value, allow_overwrite=True)


def lookup(key: str, timeout_secs: float = 300) -> str:
    """A value `publish` put (waits for it)."""
    from jax._src import distributed

    return distributed.global_state.client.blocking_key_value_get(f"{_KEYS}{key}", int(timeout_secs * 1000))


# -- the peer watch ---------------------------------------------------------------------------
#
# A process whose peer died is told so by its next collective (gloo reads a closed socket: "Connection reset
# by peer"). Not while it waits for Orbax's commit (its "saving in progress" flag is set behind two barriers
# of JAX's coordination service, which notices a dead process only when its heartbeats stop for
# `PREFECT_JAX_HEARTBEAT_TIMEOUT_SECS` (30 s), and then aborts every process: SIGABRT, the run Crashed, its
# cause unsaid). So each process holds one TCP connection to process 0, which the kernel closes when either
# process dies; a process whose part is done says goodbye first (`say_goodbye`), and process 0 tells the
# others when one went away. `wait_unless_lost` runs such a wait and ends it with `LostProcess` when a
# process went away. A machine lost without a word (no FIN) is still noticed by the heartbeat timeout only.

_BYE = b"bye"
_WATCH_KEY = "watch/port"
_gone: str | None = None  # how another process of the job went away (its watch connection closed), if it did
_gone_at = 0.0  # when (time.monotonic())
_watch_socks: list[socket.socket] = []
LOST_GRACE_SECS = 2.0  # a wait that ends on its own within this long after a peer's connection closed was not lost


class LostProcess(ConnectionError):
    """Another process of the job went away (killed, or it failed) while this one waited for it."""


def say_goodbye() -> None:
    """This process's part of the job is done (finished, or preempted with its checkpoint
    committed): its leaving is no loss to the others (`peer_gone`)."""
    for sock in list(_watch_socks):
        with contextlib.suppress(OSError):
            sock.sendall(_BYE + b"\n")


def peer_gone() -> str | None:
    """How another process of this job went away without finishing (its watch connection to or
    from process 0 closed with no goodbye), if one did; None while all are there."""
    return _gone


def _note_gone(what: str) -> None:
    global _gone, _gone_at
    if _gone is None:
        _gone, _gone_at = what, time.monotonic()
        logger.warning("%s", what)


def _start_watch() -> None:
    """Join the peer watch (no-op with one process): process 0 listens and publishes its port (and
    a token) in the coordination service; each other process connects and sends its index and
    the token before this returns (a process killed from here on is noticed); a daemon thread
    then reads. Any failure is one warning: the job runs on, noticing a lost process as before."""
    from jax._src import distributed

    state = distributed.global_state
    if state.num_processes < 2 or state.client is None:
        return
    try:
        if state.process_id == 0:
            token = secrets.token_hex(8)
            try:
                if socket.has_dualstack_ipv6():
                    server = socket.create_server(("", 0), family=socket.AF_INET6, dualstack_ipv6=True)
                else:
                    server = socket.create_server(("", 0))
            except OSError:
                publish(_WATCH_KEY, "none")  # the others do not wait for it
                raise
            publish(_WATCH_KEY, f"{server.getsockname()[1]} {token}")
            target, args = _watch_as_process_0, (server, state.num_processes, token)
        else:
            found = lookup(_WATCH_KEY, timeout_secs=60).split()
            if len(found) != 2:
                raise ConnectionError("process 0 opened no port for it")
            host = (state.coordinator_address or "").rsplit(":", 1)[0].strip("[]")
            sock = socket.create_connection((host, int(found[0])), timeout=5)
            sock.settimeout(None)
            sock.sendall(f"{state.process_id} {found[1]}\n".encode())
            _watch_socks.append(sock)
            target, args = _watch_process_0, (sock,)
    except Exception as exc:  # noqa: BLE001 - no watch: a lost process is noticed by collectives and heartbeats only
        logger.warning("no peer watch (a lost process is noticed by the next collective, or after the heartbeat timeout): %r", exc)
        return
    threading.Thread(target=target, args=args, name="prefect-jax-peer-watch", daemon=True).start()
    register = getattr(threading, "_register_atexit", None)  # (CPython's: as Prefect's own queue services use it)
    if register is not None:
        register(_exit_without_lost_waits)


def _exit_without_lost_waits() -> None:
    """At exit, before Python joins the threads that are not daemons: if this process saw another
    go away (`lost_process`) and did not finish, Orbax's save threads wait for it at their
    barriers until JAX's heartbeat timeout aborts the process (SIGABRT, ~30 s on). Exit without
    joining them: what they were saving is no commit, and the job's committed steps are on storage."""
    locks, guard = getattr(threading, "_shutdown_locks", None), getattr(threading, "_shutdown_locks_lock", None)
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


def _watch_as_process_0(server: socket.socket, count: int, token: str) -> None:
    """Process 0: accept the other processes' connections (each sends ``<index> <token>`` first;
    any other is closed and ignored), note one that closes without a goodbye, and tell the rest."""
    selector = selectors.DefaultSelector()
    selector.register(server, selectors.EVENT_READ)
    peers: dict[socket.socket, int] = {}  # the connections that named their process
    while True:
        for key, _ in selector.select():
            if key.fileobj is server:
                conn, _ = server.accept()
                selector.register(conn, selectors.EVENT_READ, data=bytearray())
                continue
            conn, received = key.fileobj, key.data
            try:
                data = conn.recv(256)
            except OSError:
                data = b""
            received += data
            if data and conn not in peers and (b"\n" in received or len(received) > 256):
                first = bytes(received).split(b"\n", 1)[0].decode(errors="replace").split()
                if len(first) == 2 and first[1] == token and first[0].isdigit() and 0 < int(first[0]) < count:
                    peers[conn] = int(first[0])
                    _watch_socks.append(conn)
                    continue
                data = b""  # not one of the job's processes: close it, and it is no loss
            if data:
                continue
            selector.unregister(conn)
            conn.close()
            index = peers.pop(conn, None)
            with contextlib.suppress(ValueError):  # closed: no goodbye of this process's goes to it
                _watch_socks.remove(conn)
            if index is None or b"\n" + _BYE + b"\n" in received:
                continue
            _note_gone(f"process {index} of the job's {count} went away: its connection to process 0 closed without "
                       "a goodbye (it was killed, or it failed)")  # fmt: skip
            for other in list(peers):
                with contextlib.suppress(OSError):
                    other.sendall(f"gone {index}\n".encode())


def _watch_process_0(sock: socket.socket) -> None:
    """Another process: note if process 0's connection closes without a goodbye, or if process 0
    says another process went away."""
    received, bye = bytearray(), False
    while not bye:
        try:
            data = sock.recv(256)
        except OSError:
            data = b""
        if not data:
            break
        *lines, rest = bytes(received + data).split(b"\n")
        received = bytearray(rest)
        for line in lines:
            if line == _BYE:
                bye = True
            elif line.startswith(b"gone "):
                _note_gone(f"process {line[5:].decode(errors='replace')} of the job went away (process 0 saw its "
                           "connection close without a goodbye: it was killed, or it failed)")  # fmt: skip
    if not bye:
        _note_gone("process 0 of the job went away: its connection to this process closed without a goodbye "
                   "(it was killed, or it failed)")  # fmt: skip


def wait_unless_lost(wait: Callable[[], None], what: str, grace_secs: float = LOST_GRACE_SECS) -> None:
    """Run `wait` (one that waits for the other processes, such as Orbax's commit) to its end, or
    raise `LostProcess` when another process went away (`peer_gone`) and `wait` did not end
    within `grace_secs` of it (a peer that finished its part may leave just before the barrier
    it passed returns here). One process: `wait()`."""
    if not several():
        wait()
        return
    done, failed = threading.Event(), []

    def run() -> None:
        try:
            wait()
        except BaseException as exc:  # noqa: BLE001 - raised on the caller's thread below
            failed.append(exc)
        finally:
            done.set()

    threading.Thread(target=run, name="prefect-jax-wait", daemon=True).start()
    while not done.wait(0.05):
        if _gone is not None and time.monotonic() - _gone_at >= grace_secs:
            exc = LostProcess(f"{_gone}; this process stopped waiting for {what}")
            note_failure(exc)
            raise exc
    if failed:
        raise failed[0]
