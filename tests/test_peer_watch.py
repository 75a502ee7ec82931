"""Process 0's side of the peer watch over real sockets, without JAX: which processes it waits for
at its exit (`peer_watch.outlive_the_others`: JAX aborts the processes still running when process
0, where the coordination service runs, exits), and which leavings are a loss (`peer_gone`).
The processes themselves: test_multiprocess.py's peer-watch test."""

import socket
import threading
import time

import pytest

from prefect_jax.training import peer_watch

TOKEN = "t0ken"


def _until(predicate, what: str, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


@pytest.fixture
def connect(monkeypatch):
    """Process 0's watch of a 4-process job on a loopback port; `connect(line)` opens a
    connection as another process would and sends `line` first."""
    monkeypatch.setattr(peer_watch, "_staying", 0)
    monkeypatch.setattr(peer_watch, "_gone", None)
    monkeypatch.setattr(peer_watch, "_watch_socks", [])
    server = socket.create_server(("127.0.0.1", 0))
    threading.Thread(
        target=peer_watch._watch_as_process_0, args=(server, 4, TOKEN), daemon=True
    ).start()
    opened = []

    def open_one(line: str) -> socket.socket:
        sock = socket.create_connection(server.getsockname()[:2])
        sock.sendall(line.encode())
        opened.append(sock)
        return sock

    yield open_one
    for sock in opened:
        sock.close()
    # (the watch has handled every close before the next test's counts start)
    deadline = time.monotonic() + 5
    while peer_watch._watch_socks and time.monotonic() < deadline:
        time.sleep(0.01)
    server.close()


def _all_closed_seen() -> None:
    _until(lambda: not peer_watch._watch_socks, "every close handled")


def test_process_0_outlives_the_processes_leaving_with_it_but_not_a_finished_one(connect):
    one, two, three = (connect(f"{k} {TOKEN}\n") for k in (1, 2, 3))
    _until(lambda: peer_watch._staying == 3, "three processes counted")
    assert peer_watch.outlive_the_others(0.1) is False  # all three still running

    one.sendall(b"done\n")  # finished: it meets process 0 at JAX's shutdown barrier instead
    _until(lambda: peer_watch._staying == 2, "the finished one not waited for")
    two.sendall(b"bye\n")  # preempted: it reports its run's end, then exits
    assert peer_watch.outlive_the_others(0.1) is False

    waited: list[bool] = []
    waiter = threading.Thread(target=lambda: waited.append(peer_watch.outlive_the_others(10)))
    waiter.start()
    two.close()
    three.close()  # without a goodbye: gone, and no longer waited for either
    waiter.join(10)
    assert waited == [True]
    # (told before process 0 may go: the count drops last)
    assert "process 3 of the job's 4 went away" in (peer_watch.peer_gone() or "")

    one.close()  # the finished process exits: counted once only
    _all_closed_seen()
    assert peer_watch._staying == 0 and peer_watch.outlive_the_others(0) is True


def test_goodbyes_are_no_loss_and_a_stranger_is_not_waited_for(connect):
    stranger = connect("1 not-the-token\n")  # not one of the job's processes: closed, not counted
    stranger.settimeout(5)
    one = connect(f"1 {TOKEN}\nbye\n")  # the hello and a goodbye in one read
    two = connect(f"2 {TOKEN}\n")
    three = connect(f"3 {TOKEN}\ndone\n")  # finished already: never waited for
    _until(lambda: peer_watch._staying == 2, "two processes counted")
    assert stranger.recv(16) == b""  # process 0 closed it
    two.sendall(b"done\n")
    _until(lambda: peer_watch._staying == 1, "the finished one not waited for")
    one.close()
    assert peer_watch.outlive_the_others(5) is True
    two.close()
    three.close()
    _all_closed_seen()
    assert peer_watch.peer_gone() is None and peer_watch._staying == 0


@pytest.mark.parametrize(
    "ours, lost, signum, waits",
    [
        (True, "process 2 went away", None, True),
        (True, None, 15, True),  # preempted: all the processes are ending
        (True, None, None, False),  # process 0's own failure: the others may wait for it
        # one process, or JAX initialised by the caller: its shutdown barrier ends every process
        (False, "process 2 went away", 15, False),
    ],
)
def test_process_0_waits_only_where_the_others_are_ending_with_it(
    monkeypatch, ours, lost, signum, waits
):
    from prefect_jax.training import cluster

    waited: list[float] = []
    monkeypatch.setattr(cluster, "_exit_is_ours", ours)
    monkeypatch.setattr(cluster, "_lost", lost)
    monkeypatch.setattr(cluster, "received_signal", lambda: signum)
    monkeypatch.setattr(peer_watch, "outlive_the_others", lambda secs: waited.append(secs) or True)
    cluster.leave_last()
    assert waited == ([cluster.LEAVE_LAST_SECS] if waits else [])
