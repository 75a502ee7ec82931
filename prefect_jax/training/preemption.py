"""SIGTERM, a preemption notice, while a trainer holds its job.

Spot and preemptible nodes get SIGTERM some seconds before they go. The trainer turns it into
a checkpoint of the step in flight (or lets the save in flight commit), then the signal goes on:
in a flow run, whose tasks run the trainer on its own thread, the task's wait raises Prefect's
exception on (the run ends Crashed, Cancelled or rescheduled); where the guard is the handler
(the engine used directly), to whoever handled it before, or the default.
A notice whose handler's exception Python drops (raised inside a gc callback) is delivered
again (`deliver_lost_notices`).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable

_received: int | None = (
    None  # the signal a guard of this process took (or one delivered again), if any
)
_handler_codes: set = set()  # the code of every SIGTERM handler seen (`_raised_by_a_handler`)
_exiting = False  # the interpreter is exiting: nothing is delivered again
_resumes_at: tuple[int | None] | None = None  # (`resumes_at`)
RESEND_DELAY_SECS = 0.01  # from a dropped notice's hook returning to the signal sent again


def received_signal() -> int | None:
    """The SIGTERM (as its number) a trainer of this process received, or None: what a run that
    ends with some other error in Prefect's bookkeeping really ended of."""
    return _received


def resumes_at() -> tuple[int | None] | None:
    """Where the job a preemption notice ended in this process resumes: ``(step,)`` (``(None,)``:
    from the beginning, nothing committed), or None: no trainer here said (for the command's last
    line)."""
    return _resumes_at


def note_resumes_at(step: int | None) -> None:
    """Record where the job resumes (`resumes_at`)."""
    global _resumes_at
    _resumes_at = (step,)


def forget_resumes_at() -> None:
    """Forget where a job resumes: no trainer of this process said yet (a new command)."""
    global _resumes_at
    _resumes_at = None


def note_received(signum: int) -> None:
    """Record that this process got `signum` (a handler other than a guard's: the command's); a
    SIGTERM noted stays (a Ctrl-C after it does not make the process's end forgettable)."""
    global _received
    if not (_received == signal.SIGTERM and signum == signal.SIGINT):
        _received = signum


def forget_ctrl_c() -> None:
    """Forget a Ctrl-C (SIGINT) this process received, once its `KeyboardInterrupt` reached the
    caller, who goes on (a notebook, a Python session): a later run is not taken for one that was
    stopped. A SIGTERM is kept (the process is going)."""
    global _received
    if _received == signal.SIGINT:
        _received = None


def deliver_lost_notices() -> None:
    """Deliver again a SIGTERM whose handler's exception Python drops (idempotent, process-wide;
    call it once the SIGTERM handlers that may raise are installed, or from their callers).

    A signal's Python handler runs in the main thread wherever the interpreter next checks for
    signals, and that can be a garbage-collector callback (JAX registers one, run at every
    collection), a `__del__` or a weakref callback: Python drops an exception raised there
    ("Exception ignored in: ..."). A SIGTERM whose handler raises (Prefect's bridge: its
    `TerminationSignal`, which ends the flow run Crashed; the trainer's guard forwarding to it;
    the command's `SystemExit`) was then lost: the job trained on to its end, as if no notice
    came, and on a spot node the hard kill that follows costs every step since the last
    checkpoint. Python hands such exceptions to `sys.unraisablehook`; this chains a hook there
    that, for an exception that came out of a SIGTERM handler (its traceback runs through one),
    sends SIGTERM to the process again from a helper thread once the hook has returned, so that
    the handler runs again, in ordinary code with luck (else it is dropped and sent again). Not
    for an exception raised while an earlier handler's was being handled (that one is on its
    way: Prefect's crash handling, say), nor at the interpreter's exit. Every unraisable
    exception still goes to the hook that was there before."""
    _note_handlers()
    if getattr(sys.unraisablehook, "delivers_lost_notices", False):
        return
    previous = sys.unraisablehook

    def hook(unraisable):
        _deliver_again(unraisable, previous)

    hook.delivers_lost_notices = True
    sys.unraisablehook = hook


def _deliver_again(unraisable, previous) -> None:
    global _received
    exc, sent = unraisable.exc_value, None
    try:
        if _a_lost_notice(exc, unraisable.err_msg):
            with contextlib.suppress(AttributeError):
                exc._prefect_jax_sent_again = True  # (once, if hooks of this kind are chained)
            _received = signal.SIGTERM
            sent = _send_when_set(signal.SIGTERM)
        previous(unraisable)
        if sent is not None:
            print(
                "prefect-jax: the exception of the SIGTERM handler above was dropped where it was "
                "raised: sending SIGTERM again",
                file=sys.stderr,
            )
    except BaseException as again:
        # A SIGTERM sent again (for another drop) whose handler ran in here: Python would drop it
        # too.
        if not _a_lost_notice(again, None):
            raise
        _received = signal.SIGTERM
        sent = sent or _send_when_set(signal.SIGTERM)
    finally:
        if sent is not None:
            sent.set()  # the signal's handler must not run inside this hook


def _a_lost_notice(exc: BaseException | None, err_msg: str | None) -> bool:
    if (
        exc is None
        or _exiting
        or sys.is_finalizing()
        or (err_msg or "").startswith("Exception ignored in atexit")
    ):
        return False
    _note_handlers()
    if getattr(exc, "_prefect_jax_sent_again", False) or not _raised_by_a_handler(exc):
        return False
    seen, context = {id(exc)}, exc.__context__
    while (
        context is not None and id(context) not in seen
    ):  # raised while an earlier notice was being handled
        if _raised_by_a_handler(context):
            return False
        seen.add(id(context))
        context = context.__context__
    return True


def _raised_by_a_handler(exc: BaseException) -> bool:
    """Whether `exc` came out of a SIGTERM handler: its traceback runs through the code of one
    `_note_handlers` saw."""
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code in _handler_codes:
            return True
        tb = tb.tb_next
    return False


def _note_handlers() -> None:
    """Remember the code of the SIGTERM handler in place and of Prefect's bridge."""
    engine = sys.modules.get("prefect.utilities.engine")
    for handler in (
        signal.getsignal(signal.SIGTERM),
        getattr(engine, "_prefect_sigterm_handler", None),
    ):
        if isinstance(handler, int) or not callable(
            handler
        ):  # SIG_DFL, SIG_IGN (an IntEnum: its class's call is Enum's)
            continue
        function = getattr(handler, "__func__", handler)  # (a bound method: its function)
        code = getattr(function, "__code__", None)
        if code is None:  # an object with a __call__ of its own class's (never its metaclass's)
            import inspect

            code = getattr(
                inspect.getattr_static(type(handler), "__call__", None), "__code__", None
            )
        if code is not None:
            _handler_codes.add(code)


def _send_when_set(signum: int) -> threading.Event:
    """Send `signum` to this process `RESEND_DELAY_SECS` after the event returned is set; once,
    for every drop until then (two would break into the handling of the first)."""
    global _sending
    with _sending_lock:
        if _sending is not None:
            return _sending
        ready = _sending = threading.Event()

    def send() -> None:
        global _sending
        ready.wait()
        time.sleep(
            RESEND_DELAY_SECS
        )  # the main thread leaves the callback (or `__del__`) that dropped it
        with _sending_lock:
            _sending = None  # (a drop of this one is sent again)
        os.kill(os.getpid(), signum)

    threading.Thread(target=send, name=RESEND_THREAD, daemon=True).start()
    return ready


RESEND_THREAD = "prefect-jax-sigterm-again"
_sending: threading.Event | None = None  # a signal to be sent again, not sent yet
_sending_lock = (
    threading.RLock()
)  # (re-entrant: a collection inside it may drop a notice, whose hook comes here)


def _at_exit() -> None:
    global _exiting
    _exiting = True  # objects torn down at exit are not the job's notice


# At the interpreter's exit: before it waits for threads and runs the atexit callbacks, if it can
# say so.
getattr(threading, "_register_atexit", atexit.register)(_at_exit)


class PreemptionGuard:
    """SIGTERM (a preemption notice) while a trainer holds its job, from its restore to its finish.

    Inside the training loop the signal only sets a flag: the step in flight finishes, the
    trainer checkpoints it and forwards the signal. Inside a save it is held until the save is
    handed to Orbax. Anywhere else (between intervals, during an evaluation or an export)
    `on_signal` runs: it lets the saves in flight commit within the grace period, then forwards.

    A trainer on the main thread (the engine used directly) installs the guard as the SIGTERM
    handler, in front of the one there before; forwarding gives the signal to that one (or to the
    default, which ends the process). A trainer on the trainer thread (a flow run's tasks:
    `prefect_jax.training.trainer_thread`) installs nothing: Prefect's bridge stays the handler,
    its exception lands in the caller's wait, and the caller tells the guard (`notice`), has it
    run `on_signal` where the trainer was not in its loop or a save, and raises the notice on
    itself (`prefect_jax.tasks.notices`).
    """

    def __init__(self, on_signal: Callable[[], None]):
        self.signum: int | None = None
        self.deferring = 0  # > 0 inside the loop or a save: the signal is handled there
        self.handling = False  # someone is handling the signal (a second SIGTERM changes nothing)
        self.active = False  # between install and uninstall: a finished trainer only passes it on
        self.driven = False  # told by its caller (`notice`), which raises the notice on itself
        self.adopted = False  # the notice was another process's (`adopt`)
        self._stale = False  # (`notice`)
        self._on_signal = on_signal
        # (the caller's thread and the trainer's may both ask `handle_if_pending`)
        self._handling_lock = threading.Lock()
        self._previous = None
        self._handler = (
            self._handle
        )  # one bound method: what `signal.getsignal` returns is this object

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def installed(self) -> bool:
        return signal.getsignal(signal.SIGTERM) is self._handler

    def install(self) -> None:
        """Put the guard in front of the current SIGTERM handler (again, if someone replaced it).

        Off the main thread (a trainer on the trainer thread, `prefect_jax.training.trainer_thread`)
        it installs no handler: the SIGTERM's handler stays whoever's it is (Prefect's bridge, whose
        exception lands in the caller's wait), and the caller tells the guard (`notice`)."""
        # (forwarding raises the previous handler's exception, Prefect's: not to be dropped)
        deliver_lost_notices()
        self.drop_stale_notice()
        if threading.current_thread() is not threading.main_thread():
            self.driven = not self.installed  # (else its handler, installed before, takes it)
            self.active = True
        elif not self.installed:
            self.driven = False
            self._previous = signal.getsignal(signal.SIGTERM)
            signal.signal(signal.SIGTERM, self._handler)
            self.active = True

    def uninstall(self) -> None:
        self.active = False
        if threading.current_thread() is threading.main_thread() and self.installed:
            signal.signal(signal.SIGTERM, self._previous)

    def notice(self, signum: int) -> None:
        """A SIGTERM met by the trainer's caller (the guard installs no handler off the main
        thread): recorded, as the handler would; the trainer checkpoints the step in flight at its
        next step or once its save is handed off, an evaluation gives up at its next batch, or the
        caller has it let the saves in flight commit (`handle_if_pending`). The caller then raises
        the notice on."""
        with self._handling_lock:
            if self.signum is None:
                self.signum = signum
                # (a trainer not holding its job, an evaluator's, only gives up its evaluation)
                self._stale = not self.active

    def drop_stale_notice(self) -> None:
        """Forget a notice `notice` gave this guard while its trainer did not hold its job (its
        evaluation had the time to give up): in a process that goes on, the trainer's next
        evaluation, or attempt, starts with no notice."""
        with self._handling_lock:
            if self._stale and not self.active:
                self.signum, self._stale = None, False

    def _handle(self, signum, frame):
        if not self.active:  # left in a chain of handlers by a trainer that has finished
            self._pass_on(signum)
            return
        global _received
        self.signum = _received = signum
        self.handle_if_pending()

    def adopt(self, signum: int) -> None:
        """Take another process's preemption notice as this one's (several JAX processes agree on
        it): the trainer checkpoints the same step, and the signal goes on as if it came here."""
        global _received
        if self.signum is None:
            self.signum = _received = signum
            self.adopted = True

    def handle_if_pending(self) -> None:
        """Run `on_signal` if a signal came and nobody handles it (called after a deferred
        block)."""
        with self._handling_lock:
            if self.signum is None or self.deferring or self.handling:
                return
            self.handling = True
        self._on_signal()

    def deferred(self):
        """A block in which the signal is only recorded (checked with `requested` afterwards)."""
        guard = self

        class _Deferred:
            def __enter__(self):
                guard.deferring += 1
                return guard

            def __exit__(self, *exc):
                guard.deferring -= 1
                return False

        return _Deferred()

    def forward(self) -> None:
        """Deliver the signal to the handler that was installed before us."""
        self.uninstall()
        self._pass_on(self.signum)

    def _pass_on(self, signum: int) -> None:
        if self.driven:  # the caller that told the guard raises the notice on
            return
        previous = self._previous
        if callable(previous):
            previous(signum, None)
        elif previous in (signal.SIG_DFL, None):
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            time.sleep(5)  # the default action ends the process


_handler_codes.add(
    PreemptionGuard._handle.__code__
)  # the guard is a SIGTERM handler too (`_raised_by_a_handler`)
