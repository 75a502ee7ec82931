"""SIGTERM, a preemption notice, while a trainer holds its job.

Spot and preemptible nodes get SIGTERM some seconds before they go. The trainer turns it into
a checkpoint of the step in flight (or lets the save in flight commit), then hands the signal
to whoever handled it before: Prefect (the run ends Crashed, or is rescheduled), or the default.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from typing import Callable


_received: int | None = None  # the signal a guard of this process took, if any


def received_signal() -> int | None:
    """The SIGTERM (as its number) a trainer of this process received, or None: what a run that
    ends with some other error in Prefect's bookkeeping really ended of."""
    return _received


def _bridge_lock():
    """The lock under which Prefect installs its SIGTERM bridge and acknowledges control intents
    (a no-op lock when Prefect's engine is not loaded)."""
    import contextlib

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
            previous(signum, None)
        elif previous in (signal.SIG_DFL, None):
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            time.sleep(5)  # the default action ends the process
