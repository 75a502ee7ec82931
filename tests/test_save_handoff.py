"""Saves handed to a thread behind a copy of the state on its devices (`save_handoff`,
`CheckpointSpec.device_copy`): on by default on an accelerator, so tried here on the CPU by
asking for it."""

from __future__ import annotations

import threading

import grain
import jax
import numpy as np
import pytest

from prefect_jax.training.checkpoints import Checkpoints
from prefect_jax.training.errors import CheckpointSaveError
from prefect_jax.training.specs import CheckpointSpec
from prefect_jax.training.trees import state_fingerprint


def _iterator():
    return iter(grain.MapDataset.range(100).shuffle(seed=3).to_iter_dataset())


def _held(ckpt: Checkpoints, fail: BaseException | None = None):
    """Hold Orbax's `save` on the hand-off thread until the returned event is set; records the
    thread it ran on."""
    release, threads, save = threading.Event(), [], ckpt.manager.save

    def held(*args, **kwargs):
        threads.append(threading.current_thread())
        assert release.wait(30)
        if fail is not None:
            raise fail
        return save(*args, **kwargs)

    ckpt.manager.save = held
    return release, threads


def test_a_handed_off_save_is_the_state_and_position_at_the_save_whatever_happens_after(tmp_path):
    # What the training thread does once `save` returns (the next step donates the state's
    # buffers; the iterator moves on) happens before Orbax reads anything here: the copy and the
    # position read at the save are what the step holds.
    ckpt = Checkpoints(str(tmp_path / "ck"), CheckpointSpec(every_steps=1, device_copy=True))
    state = {
        "w": jax.numpy.arange(12.0).reshape(3, 4),
        "key": jax.random.key(5),
        "count": jax.numpy.int32(7),
        "host": np.ones(2, np.float32),
    }
    abstract, expected = jax.eval_shape(lambda: state), state_fingerprint(state)
    it = _iterator()
    for _ in range(7):
        next(it)
    release, threads = _held(ckpt)
    ckpt.save(7, state, it, {})
    assert ckpt.saving()
    after = [next(it) for _ in range(5)]
    for leaf in jax.tree_util.tree_leaves(state):
        if isinstance(leaf, jax.Array):
            leaf.delete()  # (as the next step's donation does)
    release.set()
    ckpt.wait()
    assert threads and threads[0] is not threading.current_thread()
    assert not ckpt.saving() and ckpt.committed_steps() == [7]
    again = _iterator()
    restored, meta = ckpt.restore(7, abstract, again)
    assert state_fingerprint(restored) == expected and meta["step"] == 7
    assert [next(again) for _ in range(5)] == after
    ckpt.close()


def test_a_handed_off_save_that_fails_fails_the_wait_and_every_later_save(tmp_path):
    ckpt = Checkpoints(str(tmp_path / "ck"), CheckpointSpec(every_steps=1, device_copy=True))
    release, _ = _held(ckpt, fail=OSError(28, "No space left on device"))
    ckpt.save(3, {"w": jax.numpy.ones(4)}, _iterator(), {})
    release.set()
    with pytest.raises(CheckpointSaveError, match="step 3 did not commit") as raised:
        ckpt.wait()
    assert "No space left on device" in str(raised.value)
    with pytest.raises(CheckpointSaveError, match="step 3"):
        ckpt.save(4, {"w": jax.numpy.ones(4)}, _iterator(), {})
    assert ckpt.committed_steps() == []


def test_device_copy_is_off_on_a_cpu_unless_asked_and_refused_with_several_processes(
    tmp_path, monkeypatch
):
    from prefect_jax.training import cluster

    assert not Checkpoints(str(tmp_path / "a"), CheckpointSpec()).device_copy
    assert Checkpoints(str(tmp_path / "b"), CheckpointSpec(device_copy=True)).device_copy
    assert not Checkpoints(str(tmp_path / "c"), CheckpointSpec(device_copy=False)).device_copy
    monkeypatch.setattr(cluster, "several", lambda: True)
    assert not Checkpoints(str(tmp_path / "d"), CheckpointSpec()).device_copy
    with pytest.raises(ValueError, match=r"device_copy=True\) needs one JAX process.*False"):
        Checkpoints(str(tmp_path / "e"), CheckpointSpec(device_copy=True))


def test_a_job_saving_through_the_hand_off_resumes_bit_for_bit(job_config, monkeypatch):
    from prefect_jax.training.compiled_steps import BackgroundCompile
    from prefect_jax.training.trainer import Trainer

    def config(job: str, device_copy: bool):
        made = job_config(max_steps=60, every_steps=20, job=job)
        return made.model_copy(
            update={"checkpoint": made.checkpoint.model_copy(update={"device_copy": device_copy})}
        )

    straight = Trainer(config("straight", False))
    straight.restore_or_init()
    while straight.step < 60:
        straight.train_until_checkpoint()
    expected = straight.fingerprint()
    straight.close()

    compiled = []
    interrupted = Trainer(config("copied", True))
    assert interrupted.loop.compiling.save_copy  # its copy compiled beside the first steps
    original = BackgroundCompile.also

    def also(self, fn, *args, name="?"):
        compiled.append(name)
        return original(self, fn, *args, name=name)

    monkeypatch.setattr(BackgroundCompile, "also", also)
    interrupted.restore_or_init()
    interrupted.train_until_checkpoint()
    monkeypatch.undo()
    assert "prefect-jax-compile-save-copy" in compiled
    interrupted.job.checkpoints.wait()
    interrupted.close()  # the process "goes away" after step 20
    resumed = Trainer(config("copied", True))
    assert resumed.restore_or_init() == 20
    while resumed.step < 60:
        resumed.train_until_checkpoint()
    assert resumed.fingerprint() == expected
    resumed.close()
