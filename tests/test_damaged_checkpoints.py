"""Torn and corrupt checkpoints are skipped, never partially restored: an uncommitted step, a
damaged or truncated one, a flipped bit in a step's metadata or recorded params (corruption, not
another program or other params), Orbax's temporary directories."""

import logging
import os

import pytest
from conftest import train_and_close

from prefect_jax.training.checkpoint_dirs import committed_steps
from prefect_jax.training.checkpoints import Checkpoints
from prefect_jax.training.errors import IntactStepRestoreError, RestoreFailedError, is_transient
from prefect_jax.training.names import STEP_MANIFEST_FILE, STEP_META_FILE
from prefect_jax.training.restore_failures import not_the_steps_fault
from prefect_jax.training.storage import JobStorage
from prefect_jax.training.trainer import Trainer


@pytest.fixture
def trained(job_config):
    """A job of 60 steps with committed checkpoints at 20, 40 and 60, and
    its uninterrupted fingerprint."""
    config = job_config(max_steps=60, every_steps=20)
    trainer = Trainer(config)
    trainer.restore_or_init()
    fingerprints = {}
    while trainer.step < 60:
        trainer.train_until_checkpoint()
        fingerprints[trainer.step] = trainer.fingerprint()
    trainer.finish()
    trainer.close()
    return config, fingerprints


def _ckpt_dir(config):
    return os.path.join(config.storage, config.job, "checkpoints")


def test_an_uncommitted_step_dir_is_skipped_with_a_warning(trained, caplog):
    config, prints = trained
    torn = os.path.join(_ckpt_dir(config), "80")
    os.makedirs(os.path.join(torn, "state"))
    open(os.path.join(torn, "state", "half-written"), "wb").write(b"\0" * 100)
    with caplog.at_level(logging.WARNING):
        trainer = Trainer(config)
        assert trainer.restore_or_init() == 60
    assert "checkpoint step 80" in caplog.text and "never committed" in caplog.text
    assert not os.path.exists(torn)
    assert any(n.startswith("80.uncommitted-") for n in os.listdir(_ckpt_dir(config)))
    assert trainer.fingerprint() == prints[60]


@pytest.mark.parametrize("damage", ["truncate", "delete"])
def test_a_damaged_newest_step_falls_back_and_training_redoes_it_exactly(trained, caplog, damage):
    config, prints = trained
    state_dir = os.path.join(_ckpt_dir(config), "60", "state")
    files = [
        os.path.join(root, f)
        for root, _, fs in os.walk(state_dir)
        for f in fs
        if "ocdbt" in root or f.startswith("manifest")
    ]
    assert files
    for path in files:
        if damage == "truncate":
            with open(path, "r+b") as f:
                f.truncate(max(0, os.path.getsize(path) // 3))
        else:
            os.remove(path)
    with caplog.at_level(logging.WARNING):
        trainer = Trainer(config)
        assert trainer.restore_or_init() == 40
    assert "checkpoint step 60" in caplog.text and "unreadable" in caplog.text
    assert committed_steps(_ckpt_dir(config)) == [20, 40]
    assert trainer.fingerprint() == prints[40]
    trainer.train_until_checkpoint()  # step 60 is written again, over nothing
    trainer.job.checkpoints.wait()
    assert trainer.fingerprint() == prints[60]
    assert committed_steps(_ckpt_dir(config)) == [20, 40, 60]


def _flip_lowest_bit(path: str, marker: bytes, offset: int) -> None:
    """Flip the lowest bit of the byte `offset` bytes into the first `marker` in the file."""
    data = bytearray(open(path, "rb").read())
    data[data.index(marker) + offset] ^= 0x01
    open(path, "wb").write(bytes(data))


def test_a_flipped_bit_in_a_steps_metadata_is_corruption_not_another_program(trained, caplog):
    """Issue 53.2: the checksums are consulted before a mismatch of the metadata with the
    program is reported (they are checked beside the restore)."""
    config, prints = trained
    # '2' (0x32) -> '3' (0x33): one bit
    _flip_lowest_bit(os.path.join(_ckpt_dir(config), "60", STEP_META_FILE), b"float32", 6)
    with caplog.at_level(logging.WARNING):
        trainer = Trainer(config)
        assert trainer.restore_or_init() == 40
    assert "is corrupt" in caplog.text and "program changed" not in caplog.text
    assert [n for n in os.listdir(_ckpt_dir(config)) if n.startswith("60.corrupt-")]
    assert trainer.fingerprint() == prints[40]
    trainer.train_until_checkpoint()
    trainer.job.checkpoints.wait()
    assert trainer.fingerprint() == prints[60]
    trainer.finish()
    trainer.close()


def test_orbax_temporary_dirs_are_not_steps_and_the_writer_removes_them(trained):
    config, _ = trained
    # (a save killed part-way, as Orbax names it now and as it did with a time after it)
    for name in ("80.orbax-checkpoint-tmp", "70.orbax-checkpoint-tmp-1234"):
        os.makedirs(os.path.join(_ckpt_dir(config), name, "state"))
    assert committed_steps(_ckpt_dir(config)) == [20, 40, 60]
    trainer = Trainer(config)
    try:
        assert trainer.restore_or_init() == 60
        # (a step's size on disk each, which Orbax removes only if it saves that step again)
        assert not [n for n in os.listdir(_ckpt_dir(config)) if "orbax-checkpoint-tmp" in n]
    finally:
        trainer.close()


def test_a_flipped_bit_in_a_steps_recorded_params_is_corruption_not_other_params(
    job_config, caplog
):
    """Issue 53.2 for typed program params: a bit flipped in the params a step recorded reads as
    "trained with other params"; the checksums tell damage apart, so the step is moved aside and
    the job falls back instead of refusing every rerun."""
    config = job_config(max_steps=40, every_steps=20, program="programs:typed_digits")
    config = config.model_copy(update={"program_params": {"width": 24}})
    train_and_close(config)
    # '4' (0x34) -> '5' (0x35): one bit
    _flip_lowest_bit(os.path.join(_ckpt_dir(config), "40", STEP_META_FILE), b'"width": 24', 10)
    with caplog.at_level(logging.WARNING):
        again = Trainer(config)
        assert again.restore_or_init() == 20
    assert "is corrupt" in caplog.text and "other program params" not in caplog.text
    assert [n for n in os.listdir(_ckpt_dir(config)) if n.startswith("40.corrupt-")]
    again.close()


def _fail_restores_with(monkeypatch, error: BaseException) -> None:
    """Every restore fails with `error` where Orbax is called, as a machine out of device
    memory or a storage read cut off fails it: the step's files are not the cause."""

    def fail(self, step, abstract_state, data_iter):
        raise error

    monkeypatch.setattr(Checkpoints, "_restore_unverified", fail)


def _remove_checksums(config, steps) -> None:
    """`steps` as written before prefect-jax wrote checksums: nothing tells them intact."""
    for step in steps:
        os.remove(os.path.join(_ckpt_dir(config), str(step), STEP_MANIFEST_FILE))


def _resumes_exactly_at_60(config, prints) -> None:
    """The cause gone (the test's monkeypatch undone), the next run resumes from step 60."""
    trainer = Trainer(config)
    assert trainer.restore_or_init() == 60
    assert trainer.fingerprint() == prints[60]
    trainer.close()


def _failing_alike_without_checksums(config, monkeypatch, steps) -> RestoreFailedError:
    """What the job's restore raises where `steps` have no checksums and every restore fails with
    the error a step of another layout of processes gives."""
    _remove_checksums(config, steps)
    _fail_restores_with(monkeypatch, ValueError("File data/process_1-of-2.json does not exist"))
    trainer = Trainer(config)
    with pytest.raises(RestoreFailedError) as err:
        trainer.restore_or_init()
    trainer.close()
    return err.value


def _set_aside(config) -> list[str]:
    return [n for n in os.listdir(_ckpt_dir(config)) if not n.isdigit()]


def test_an_intact_step_that_fails_to_restore_is_raised_not_set_aside(trained, monkeypatch):
    """A failure that is not the step's (its files match their checksums) would meet every older
    step too: passing over them all would set the job's progress aside and start it from scratch.
    It is raised, naming the step, and the next run resumes from that step once the cause is
    gone."""
    config, prints = trained
    _fail_restores_with(monkeypatch, ConnectionResetError(104, "Connection reset by peer"))
    trainer = Trainer(config)
    with pytest.raises(IntactStepRestoreError) as err:
        trainer.restore_or_init()
    trainer.close()
    message = str(err.value)
    assert os.path.join(_ckpt_dir(config), "60") in message and "is intact" in message
    assert "ConnectionResetError" in message and "Nothing was set aside" in message
    assert is_transient(err.value)  # (retried as its cause is: an I/O error)
    assert not is_transient(IntactStepRestoreError("s", ValueError("x")))
    assert committed_steps(_ckpt_dir(config)) == [20, 40, 60] and not _set_aside(config)

    monkeypatch.undo()  # the cause gone, the next run resumes from the same step, exactly
    _resumes_exactly_at_60(config, prints)


def test_out_of_memory_in_a_restore_is_raised_even_for_a_step_without_checksums(
    trained, monkeypatch
):
    """A step written before prefect-jax wrote checksums cannot be told intact; an error that is
    the machine's (XLA's out of memory) still sets nothing aside. Any other error falls back."""
    config, _ = trained
    _remove_checksums(config, [60])
    _fail_restores_with(
        monkeypatch, RuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 1.13GiB")
    )
    trainer = Trainer(config)
    with pytest.raises(RuntimeError, match="^RESOURCE_EXHAUSTED"):
        trainer.restore_or_init()
    trainer.close()
    assert committed_steps(_ckpt_dir(config)) == [20, 40, 60] and not _set_aside(config)
    try:  # (however wrapped)
        raise OSError("restore failed") from RuntimeError("RESOURCE_EXHAUSTED: Out of memory")
    except OSError as wrapped:
        assert not_the_steps_fault(wrapped)
    try:  # (the host's, too)
        raise OSError("restore failed") from MemoryError()
    except OSError as wrapped:
        assert not_the_steps_fault(wrapped)
    assert not not_the_steps_fault(OSError("restore failed"))


def test_reruns_that_fail_in_their_restore_spend_the_rerun_budget(trained, job_config, monkeypatch):
    """A machine out of memory while it restores fails every rerun the same way, before any
    step: each rerun is counted once it holds the lease, before its restore, so an automation
    that reruns crashed runs stops after `max_reruns_without_progress` of them."""
    from prefect_jax.training.errors import NoProgressError

    longer = job_config(max_steps=80, max_reruns_without_progress=1)  # (the job of `trained`)
    _fail_restores_with(monkeypatch, RuntimeError("RESOURCE_EXHAUSTED: Out of memory"))
    for _ in range(2):  # the first run, then one rerun without progress
        trainer = Trainer(longer)
        with pytest.raises(IntactStepRestoreError, match="RESOURCE_EXHAUSTED"):
            trainer.restore_or_init()
        trainer.close()
    # The last rerun takes over the lease of a holder that died (SIGKILLed on another machine).
    dead = {"token": "dead", "flow_run_id": "run-killed", "host": "gone", "pid": 4242}
    storage = JobStorage(longer.storage, longer.job)
    storage.write_json(storage.path("lease.json"), {**dead, "heartbeat": 0, "timeout_secs": 60})
    trainer = Trainer(longer)
    with pytest.raises(NoProgressError, match="rerun 2 times without getting past step 60 "):
        trainer.restore_or_init()
    assert not trainer.job.lease.held  # (a flow's failure hook finishes nothing again)
    trainer.close()
    assert committed_steps(_ckpt_dir(longer)) == [20, 40, 60] and not _set_aside(longer)
    # The refusal closes the job's MLflow run FAILED, saying why (found by its job tag: nothing
    # was restored), whatever closes the trainer after it; the killed holder is recorded too.
    run = _mlflow_run(longer)
    assert run.info.status == "FAILED"
    assert "rerun 2 times without getting past step 60" in run.data.tags["prefect_jax.stop_reason"]
    killed = run.data.tags["prefect_jax.killed.1"]
    assert "pid 4242" in killed and "run-killed" in killed, killed
    assert "a rerun refused to train on" in killed and "RUNNING again" not in killed, killed


@pytest.mark.parametrize("max_steps", [100, 80])
def test_a_rerun_that_waited_for_a_finishing_holder_counts_the_step_it_committed(
    trained, job_config, max_steps
):
    """A rerun that waits for the job's lease while its preempted holder finishes a save counts
    the step that save committed, not the one it read before the wait: the holder's progress is
    not a rerun without any. Where that step is the job's last, the rerun compiles nothing."""
    import json
    import threading
    import time

    from prefect_jax.training.lease_finishing import release_after

    # (the job of `trained`)
    longer = job_config(max_steps=max_steps, max_reruns_without_progress=1)
    holder = Trainer(longer)
    assert holder.restore_or_init() == 60
    saved = threading.Event()  # its notice came: the lease says "finishing" until its save ends
    release_after(holder.job.lease, saved.wait, "step 80")
    rerun, restored = Trainer(longer), []
    waiting = threading.Thread(target=lambda: restored.append(rerun.restore_or_init()))
    waiting.start()
    deadline = time.monotonic() + 60
    while not rerun.job.lease.waited_for_holder:  # (it read step 60, then met the holder)
        assert time.monotonic() < deadline and waiting.is_alive()
        time.sleep(0.05)
    assert holder.train_until_checkpoint() == 80
    holder.job.wait_committed()
    saved.set()  # the lease is freed: the rerun takes it
    waiting.join(60)
    assert restored == [80]
    assert rerun.loop.compiling.started == (max_steps > 80)  # (nothing left to train at 80)
    rerun.close()
    holder.close()
    attempts = json.load(open(os.path.join(longer.storage, longer.job, "attempts.json")))
    # (a rerun that finds the job finished spends no budget: no attempt recorded)
    assert attempts["step"] == (80 if max_steps > 80 else 60), attempts
    assert attempts["reruns_without_progress"] == 0, attempts


def _mlflow_run(config):
    from mlflow import MlflowClient

    from prefect_jax.training.names import JOB_TAG

    client = MlflowClient(config.mlflow_tracking_uri)
    experiment = client.get_experiment_by_name(config.mlflow_experiment)
    job_dir = JobStorage(config.storage, config.job).job_dir
    (run,) = client.search_runs(
        [experiment.experiment_id], filter_string=f"tags.`{JOB_TAG}` = '{job_dir}'"
    )
    return run


def test_the_same_failure_on_two_steps_in_a_row_is_the_runs_and_is_raised(trained, monkeypatch):
    """Without checksums to tell (steps written before them), a failure that the step before
    meets too is the run's (another layout of processes, a library that cannot read them): it is
    raised at the second step with nothing set aside, where every step used to be set aside and
    the job started again from scratch."""
    config, prints = trained
    err = _failing_alike_without_checksums(config, monkeypatch, steps=(20, 40, 60))
    message = str(err)
    assert f"{_ckpt_dir(config)}/60 did not restore (ValueError: File data/process_1" in message
    assert "step 40 before it failed the same way" in message and "Nothing was set aside" in message
    assert f"move {_ckpt_dir(config)}/60 aside by hand" in message
    assert not is_transient(err)  # (as its cause, a ValueError, is not)
    assert committed_steps(_ckpt_dir(config)) == [20, 40, 60] and not _set_aside(config)

    monkeypatch.undo()
    _resumes_exactly_at_60(config, prints)


def test_steps_that_each_fail_their_own_way_with_none_restored_are_raised_not_set_aside(
    trained, monkeypatch
):
    """No step restored to tell whether the steps or the run are at fault, and no checksums
    found damage: nothing is set aside (the job is not started again from scratch)."""
    config, _ = trained
    _remove_checksums(config, (20, 40, 60))
    errors = {60: ValueError("bad 60"), 40: KeyError("bad 40"), 20: TypeError("bad 20")}

    def fail(self, step, abstract_state, data_iter):
        raise errors[step]

    monkeypatch.setattr(Checkpoints, "_restore_unverified", fail)
    trainer = Trainer(config)
    with pytest.raises(
        RestoreFailedError, match="/60 did not restore .* no step before it restored"
    ):
        trainer.restore_or_init()
    trainer.close()
    assert committed_steps(_ckpt_dir(config)) == [20, 40, 60] and not _set_aside(config)


def _truncate_state_files(config, step: int) -> None:
    for root, _, files in os.walk(os.path.join(_ckpt_dir(config), str(step), "state")):
        for f in files:
            with open(os.path.join(root, f), "r+b") as handle:
                handle.truncate(max(0, os.path.getsize(os.path.join(root, f)) // 3))


def test_steps_that_their_checksums_find_damaged_are_set_aside_and_the_job_starts_again(trained):
    config, _ = trained
    for step in (20, 40, 60):
        _truncate_state_files(config, step)
    trainer = Trainer(config)
    assert trainer.restore_or_init() == 0
    trainer.close()
    assert committed_steps(_ckpt_dir(config)) == []
    assert sorted(n.split(".")[0] for n in _set_aside(config)) == ["20", "40", "60"]


def test_a_damaged_step_is_set_aside_and_the_runs_failure_of_the_two_before_it_is_raised(
    trained, monkeypatch
):
    """The newest step found damaged by its checksums is set aside; the two before it, without
    checksums, fail the same way: that is raised, naming the step the next run resumes from."""
    config, _ = trained
    _truncate_state_files(config, 60)
    message = str(_failing_alike_without_checksums(config, monkeypatch, steps=(20, 40)))
    assert f"{_ckpt_dir(config)}/40 did not restore (ValueError: File data" in message
    assert "step 20 before it failed the same way" in message
    assert committed_steps(_ckpt_dir(config)) == [20, 40]
    assert [n.split(".")[0] for n in _set_aside(config)] == ["60"]
