"""The peer watch: how a process of a multi-process job learns that another one went away.

A process whose peer died is told so by its next collective (gloo reads a closed socket:
"Connection reset by peer"). Not while it waits for Orbax's commit (its "saving in progress"
flag is set behind two barriers of JAX's coordination service, which notices a dead process only
when its heartbeats stop for `PREFECT_JAX_HEARTBEAT_TIMEOUT_SECS` (30 s), and then aborts every
process: SIGABRT, the run Crashed, its cause unsaid). So each process holds one TCP connection
to process 0, which the kernel closes when either process dies; a process whose part is done
says goodbye first (`say_goodbye`), and process 0 tells the others when one went away.
`wait_unless_lost` runs such a wait and ends it with `LostProcess` when a process went away. A
machine lost without a word (no FIN) is still noticed by the heartbeat timeout only.

The coordination service runs in process 0: when process 0 exits, JAX aborts every other process
still running (SIGABRT, "Socket closed"), even one that is only reporting its run's end. So
process 0, leaving with the others (a lost peer, a preemption), waits for them to go first
(`outlive_the_others`); the connections tell it when they have.

This module imports jax only inside the functions that need it; `cluster` starts the watch when
it joins the job's processes.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import selectors
import socket
import threading
import time
from collections.abc import Callable

logger = logging.getLogger("prefect_jax.trainer")

_BYE = b"bye"  # leaving: preempted, its checkpoint committed
# Finished: it exits through JAX's shutdown barrier, which waits for process 0 too, so it cannot
# go first (its run's end is reported by then).
_DONE = b"done"
_WATCH_KEY = "watch/port"
# How another process of the job went away (its watch connection closed), if it did
_gone: str | None = None
_gone_at = 0.0  # when (time.monotonic())
_watch_socks: list[socket.socket] = []
# a wait that ends on its own within this long after a peer's connection closed was not lost
LOST_GRACE_SECS = 2.0
# How many other processes are connected and neither finished nor gone (under `_departures`,
# notified as it changes): counted in process 0 alone, so 0 in the others.
_departures = threading.Condition()
_staying = 0


class LostProcess(ConnectionError):
    """Another process of the job went away (killed, or it failed) while this one waited for it."""


def say_goodbye(finished: bool = False) -> None:
    """This process's part of the job is done (`finished`, or preempted with its checkpoint
    committed): its leaving is no loss to the others (`peer_gone`). A finished process waits
    for process 0 at JAX's shutdown barrier, so process 0 does not wait for it to go first
    (`outlive_the_others`)."""
    for sock in list(_watch_socks):
        with contextlib.suppress(OSError):
            sock.sendall((_DONE if finished else _BYE) + b"\n")


def outlive_the_others(timeout_secs: float) -> bool:
    """Process 0, leaving without finishing: wait until every other process that has not
    finished closed its connection (it exited), at most `timeout_secs`; whether they all did.
    Call it only where the others are ending too (a lost peer, a preemption): one still training
    waits for process 0 in its next collective. Returns at once in the other processes."""
    with _departures:
        return _departures.wait_for(lambda: _staying == 0, timeout_secs)


def _count_staying(change: int) -> None:
    global _staying
    with _departures:
        _staying += change
        _departures.notify_all()


def peer_gone() -> str | None:
    """How another process of this job went away without finishing (its watch connection to or
    from process 0 closed with no goodbye), if one did; None while all are there."""
    return _gone


def _note_gone(what: str) -> None:
    global _gone, _gone_at
    if _gone is None:
        _gone, _gone_at = what, time.monotonic()
        logger.warning("%s", what)


def start(publish: Callable[[str, str], None], lookup: Callable[..., str]) -> bool:
    """Join the peer watch (no-op with one process): process 0 listens and publishes its port (and
    a token) in the coordination service; each other process connects and sends its index and
    the token before this returns (a process killed from here on is noticed); a daemon thread
    then reads. Any failure is one warning: the job runs on, noticing a lost process as before.
    `publish` and `lookup` reach the coordination service's key-value store (`cluster.publish`).
    Returns whether the watch runs."""
    from jax._src import distributed

    state = distributed.global_state
    if state.num_processes < 2 or state.client is None:
        return False
    try:
        if state.process_id == 0:
            token = secrets.token_hex(8)
            try:
                if socket.has_dualstack_ipv6():
                    server = socket.create_server(
                        ("", 0), family=socket.AF_INET6, dualstack_ipv6=True
                    )
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
    # No watch: a lost process is noticed by collectives and heartbeats only.
    except Exception as exc:  # noqa: BLE001
        logger.warning(
            "no peer watch (a lost process is noticed by the next collective, or after the "
            "heartbeat timeout): %r",
            exc,
        )
        return False
    threading.Thread(target=target, args=args, name="prefect-jax-peer-watch", daemon=True).start()
    return True


def _watch_as_process_0(server: socket.socket, count: int, token: str) -> None:
    """Process 0: accept the other processes' connections (each sends ``<index> <token>`` first;
    any other is closed and ignored), note one that closes without a goodbye, and tell the rest.
    It counts the processes still to leave for `outlive_the_others`."""
    selector = selectors.DefaultSelector()
    selector.register(server, selectors.EVENT_READ)
    peers: dict[socket.socket, int] = {}  # the connections that named their process
    finished: set[socket.socket] = set()  # those whose process said it finished (`_DONE`)
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
            hello, *said = bytes(received).split(b"\n")[:-1] or [bytes(received)]
            if data and conn not in peers and (b"\n" in received or len(received) > 256):
                first = hello.decode(errors="replace").split()
                if (
                    len(first) == 2
                    and first[1] == token
                    and first[0].isdigit()
                    and 0 < int(first[0]) < count
                ):
                    peers[conn] = int(first[0])
                    _watch_socks.append(conn)
                    _count_staying(+1)
                else:
                    data = b""  # not one of the job's processes: close it, and it is no loss
            if conn in peers and _DONE in said and conn not in finished:
                finished.add(conn)
                _count_staying(-1)
            if data:
                continue
            selector.unregister(conn)
            conn.close()
            index = peers.pop(conn, None)
            with contextlib.suppress(ValueError):  # closed: no goodbye of this process's goes to it
                _watch_socks.remove(conn)
            if index is None:
                continue
            if _BYE not in said and _DONE not in said:
                _note_gone(
                    f"process {index} of the job's {count} went away: its connection to process 0 "
                    "closed without a goodbye (it was killed, or it failed)"
                )
                for other in list(peers):
                    with contextlib.suppress(OSError):
                        other.sendall(f"gone {index}\n".encode())
            # last: once none is left, process 0 may exit (`outlive_the_others`), the loss told
            if conn in finished:
                finished.discard(conn)
            else:
                _count_staying(-1)


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
            if line in (_BYE, _DONE):
                bye = True
            elif line.startswith(b"gone "):
                _note_gone(
                    f"process {line[5:].decode(errors='replace')} of the job went away (process 0 "
                    "saw its connection close without a goodbye: it was killed, or it failed)"
                )
    if not bye:
        _note_gone(
            "process 0 of the job went away: its connection to this process closed without a "
            "goodbye (it was killed, or it failed)"
        )


def wait_unless_lost(
    wait: Callable[[], None],
    what: str,
    grace_secs: float = LOST_GRACE_SECS,
    on_lost: Callable[[LostProcess], None] | None = None,
) -> None:
    """Run `wait` (one that waits for the other processes, such as Orbax's commit) to its end, or
    raise `LostProcess` when another process went away (`peer_gone`) and `wait` did not end
    within `grace_secs` of it (a peer that finished its part may leave just before the barrier
    it passed returns here). `on_lost` is told of the `LostProcess` before it is raised.
    (`cluster.wait_unless_lost` runs this with several processes only.)"""
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
            if on_lost is not None:
                on_lost(exc)
            raise exc
    if failed:
        raise failed[0]
