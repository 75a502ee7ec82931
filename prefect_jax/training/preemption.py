"""SIGTERM, a preemption notice, while a trainer holds its job.

Spot and preemptible nodes get SIGTERM some seconds before they go. The trainer turns it into
a checkpoint of the step in flight (or lets the save in flight commit), then hands the signal
to whoever handled it before: Prefect (the run ends Crashed, or is rescheduled), or the default.
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
from typing import Callable


_received: int | None = None  # the signal a guard of this process took (or one delivered again), if any
_notice_kinds: dict[type, int] = {}  # what the handlers a guard forwarded to raised, for which signal
_previous_unraisablehook = sys.unraisablehook  # (the hook before `deliver_lost_notices`)
_exiting = False  # the interpreter is exiting: nothing is delivered again
RESEND_DELAY_SECS = 0.01  # from a dropped notice to its delivery again


def received_signal() -> int | None:
    """The SIGTERM (as its number) a trainer of this process received, or None: what a run that
    ends with some other error in Prefect's bookkeeping really ended of."""
    return _received


def _notice_in(exc: BaseException) -> int | None:
    """The signal number if `exc` is what a SIGTERM's handler raises to end the process: Prefect's
    `TerminationSignal` (its bridge), the trainer's `Preempted`, the command's `SignalExit`, or
    whatever the handler a guard forwarded the signal to raised."""
    if isinstance(exc, SignalExit):
        return exc.signum
    if getattr(exc, "_prefect_jax_signal", None) is not None:  # raised by a handler a guard forwarded to
        _notice_kinds[type(exc)] = exc._prefect_jax_signal  # (that handler, called again, raises it untagged)
        return exc._prefect_jax_signal
    for kind, signum in _notice_kinds.items():
        if isinstance(exc, kind):
            return signum
    for module, name, attribute in (("prefect.exceptions", "TerminationSignal", "signal"),
                                    ("prefect_jax.training.errors", "Preempted", "signum")):  # fmt: skip
        kind = getattr(sys.modules.get(module), name, None)
        if kind is not None and isinstance(exc, kind):
            return getattr(exc, attribute, None)
    return None


class SignalExit(SystemExit):
    """SystemExit(128 + signum) of a command ended by a signal's handler (see `deliver_lost_notices`)."""

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(128 + signum)


def _deliver_again(unraisable) -> None:
    """`sys.unraisablehook` while prefect-jax runs: a notice whose handler's exception Python
    dropped is delivered again (see `deliver_lost_notices`); anything else goes to the hook
    that was there before."""
    signum = _notice_in(unraisable.exc_value) if unraisable.exc_value is not None else None
    if signum is not None and not _exiting:
        global _received
        _received = signum
        # Not from here: the handler would run inside this hook, and Python drops what a hook raises too.
        threading.Thread(target=_send_soon, args=(signum,), name="prefect-jax-notice-again", daemon=True).start()
    _previous_unraisablehook(unraisable)
    if signum is not None and not _exiting:
        print(f"prefect-jax: the exception of signal {signum}'s handler was dropped where it was raised (above): "
              "sending the signal again", file=sys.stderr)  # fmt: skip


def _send_soon(signum: int) -> None:
    time.sleep(RESEND_DELAY_SECS)  # the main thread leaves the hook (and the callback that dropped it)
    os.kill(os.getpid(), signum)


def deliver_lost_notices() -> None:
    """Deliver again a SIGTERM whose handler's exception Python drops (idempotent, process-wide).

    A signal's Python handler runs in the main thread wherever the interpreter next checks for
    signals, and that can be a garbage-collector callback (JAX registers one, run at every
    collection), a `__del__` or a weakref callback: Python drops an exception raised there
    ("Exception ignored in: ..."). A SIGTERM whose handler raises (Prefect's bridge: its
    `TerminationSignal`, which ends the flow run Crashed; the trainer's guard forwarding to it)
    was then lost: the job trained on to its end, as if no notice came, and on a spot node the
    hard kill that follows costs every step since the last checkpoint. Python hands such
    exceptions to `sys.unraisablehook`; this puts a hook there that sends the same signal to
    the process again, from a helper thread a moment later, so that it is handled in ordinary
    code. Other unraisable exceptions go to the hook that was there before."""
    global _previous_unraisablehook
    if sys.unraisablehook is not _deliver_again:
        _previous_unraisablehook = sys.unraisablehook
        sys.unraisablehook = _deliver_again


@atexit.register
def _at_exit() -> None:
    global _exiting
    _exiting = True  # objects torn down at exit are not the job's notice


def _bridge_lock():
    """The lock under which Prefect installs its SIGTERM bridge and acknowledges control intents
    (a no-op lock when Prefect's engine is not loaded)."""
    engine = sys.modules.get("prefect.utilities.engine")
    lock = getattr(engine, "_prefect_sigterm_bridge_lock", None)
    return lock if lock is not None else contextlib.nullcontext()


class PreemptionGuard:
    """SIGTERM (a preemption notice) while a trainer holds its job, from its restore to its finish
    (main thread only).

    Inside the training loop the signal only sets a flag: the step in flight finishes, the
    trainer checkpoints it and forwards the signal. Inside a save it is held until the save is
    handed to Orbax. Anywhere else (between intervals, during an evaluation, an export or
    Prefect's own bookkeeping) `on_signal` runs at once: it lets the saves in flight commit
    within the grace period, then forwards. Forwarding gives the signal to the handler that was
    there before (Prefect's, which ends the run Crashed or reschedules it; or the default,
    which ends the process).
    """

    def __init__(self, on_signal: Callable[[], None]):
        self.signum: int | None = None
        self.deferring = 0  # > 0 inside the loop or a save: the signal is handled there
        self.handling = False  # someone is handling the signal (a second SIGTERM changes nothing)
        self.active = False  # between install and uninstall: a finished trainer only passes it on
        self._on_signal = on_signal
        self._previous = None
        self._handler = self._handle  # one bound method: what `signal.getsignal` returns is this object

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def installed(self) -> bool:
        return signal.getsignal(signal.SIGTERM) is self._handler

    def install(self) -> None:
        """Put the guard in front of the current SIGTERM handler (again, if someone replaced it)."""
        deliver_lost_notices()  # (forwarding raises the previous handler's exception: not to be dropped)
        if threading.current_thread() is threading.main_thread() and not self.installed:
            with _bridge_lock():  # Prefect's control listener checks the handler under it
                self._previous = signal.getsignal(signal.SIGTERM)
                signal.signal(signal.SIGTERM, self._handler)
                self._stand_in_for_prefects_bridge(self._previous, self._handler)
            self.active = True

    def uninstall(self) -> None:
        self.active = False
        with _bridge_lock():
            if threading.current_thread() is threading.main_thread() and self.installed:
                signal.signal(signal.SIGTERM, self._previous)
            self._stand_in_for_prefects_bridge(self._handler, self._previous)

    @staticmethod
    def _stand_in_for_prefects_bridge(current, replacement) -> None:
        """Under ``prefect flow-run execute`` (a worker's flow run), the supervisor that gets a
        SIGTERM first asks the engine process, over its control channel, to end the run as
        rescheduled (``PREFECT_FLOW_RUN_EXECUTE_SIGTERM_BEHAVIOR``), then sends it the SIGTERM and
        waits for it. The engine agrees only while Prefect's own SIGTERM bridge is the installed
        handler (`prefect.utilities.engine.commit_control_intent_and_ack`); with the guard in front
        of it, the supervisor killed the engine outright, the step in flight lost. So, while the
        guard fronts that bridge, it is what Prefect counts as its bridge: the engine agrees, the
        SIGTERM comes to the guard, which checkpoints and hands it on to the real bridge."""
        engine = sys.modules.get("prefect.utilities.engine")  # never imported here: the engine has no prefect
        if engine is not None and getattr(engine, "_prefect_sigterm_handler", None) is current:
            engine._prefect_sigterm_handler = replacement

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

    def handle_if_pending(self) -> None:
        """Run `on_signal` if a signal came and nobody handles it (called after a deferred block)."""
        if self.signum is not None and not self.deferring and not self.handling:
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
        previous = self._previous
        if callable(previous):
            try:
                previous(signum, None)
            except BaseException as exc:
                with contextlib.suppress(AttributeError):  # what `deliver_lost_notices` sends again, if dropped
                    exc._prefect_jax_signal = signum
                raise
        elif previous in (signal.SIG_DFL, None):
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            time.sleep(5)  # the default action ends the process
