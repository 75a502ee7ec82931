"""Ctrl-C in a notebook or a Python session that calls a flow: the step in flight is
checkpointed, the `KeyboardInterrupt` reaches the caller, and the next call of the flow in the
same process resumes that step exactly (as TensorFlow's `BackupAndRestore` lets a second
``fit`` go on after an interrupted one)."""

from __future__ import annotations

import logging
import signal
import threading
import time

import pytest
from conftest import TINY, straight_fingerprint

from prefect_jax.training.checkpoint_dirs import committed_steps
from prefect_jax.training.specs import CheckpointSpec, TrainSpec

MAX_STEPS, EVERY, AT = 60, 40, 20


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def test_ctrl_c_checkpoints_the_step_in_flight_and_the_next_call_resumes_it_exactly(
    prefect_server, tmp_path, mlflow_uri, monkeypatch
):
    from prefect_jax import flows
    from prefect_jax.training import preemption
    from prefect_jax.training.progress import add_progress_listener

    # The process's noted signal, as it was, for the tests after this one, whatever happens here.
    monkeypatch.setattr(preemption, "_received", None)

    storage = tmp_path / "storage"
    job = dict(program=TINY, job="nb", storage=str(storage), mlflow_tracking_uri=mlflow_uri)
    specs = dict(
        train_spec=TrainSpec(max_steps=MAX_STEPS, log_every_steps=10),
        checkpoint_spec=CheckpointSpec(every_steps=EVERY),
    )
    sent: list[int] = []

    def ctrl_c_at(step, max_steps, metrics):  # (on the trainer's thread, in the loop)
        if step == AT and not sent:
            sent.append(step)
            # What a terminal's Ctrl-C sends: SIGINT, taken by the main thread (waiting there).
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
            # (the loop goes on meanwhile: on a busy machine the main thread, which handles it,
            # could be descheduled until the interval ended, and its checkpoint was the regular one)
            deadline = time.monotonic() + 10
            while preemption.received_signal() is None and time.monotonic() < deadline:
                time.sleep(0.001)
            time.sleep(0.1)  # (noted first, then told to the trainers: `notices.end_on_notice`)

    lines = _Lines()
    logging.getLogger("prefect_jax.trainer").addHandler(lines)
    remove = add_progress_listener(ctrl_c_at)
    # Python's own Ctrl-C handler, as a notebook or a session has it, whatever the process was
    # started with (a shell's background job ignores SIGINT) or an earlier test left.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            flows.train_and_evaluate(**job, **specs)
    finally:
        signal.signal(signal.SIGINT, previous)
        remove()
        logging.getLogger("prefect_jax.trainer").removeHandler(lines)
    assert sent == [AT] and preemption.received_signal() == signal.SIGINT
    steps = committed_steps(str(storage / "nb" / "checkpoints"))
    assert len(steps) == 1 and AT <= steps[0] < EVERY, steps  # the step in flight, off cadence
    assert f"SIGINT at step {steps[0]}: checkpointing it" in "\n".join(lines.lines), lines.lines

    summary = flows.train_and_evaluate(**job, **specs)
    assert summary["final_step"] == MAX_STEPS
    assert preemption.received_signal() is None  # a later run that fails is not taken for stopped
    straight = straight_fingerprint(TINY, MAX_STEPS, EVERY, tmp_path / "straight", mlflow_uri)
    assert summary["state_fingerprint"] == straight
