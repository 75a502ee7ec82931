"""Saves handed to a thread behind a copy of the state on its devices (`save_handoff`,
`CheckpointSpec.device_copy`): on by default on an accelerator, so tried here on the CPU by
asking for it."""

from __future__ import annotations

import logging
import threading

import grain
import jax
import numpy as np
import pytest
from process_helpers import json_on_cpu_devices

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
        if fail is not None and len(threads) == 1:  # (the first save only)
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


@pytest.mark.parametrize("first", ["another thread's wait", "a reload", "nobody"])
def test_a_handed_off_save_that_fails_fails_each_thread_s_wait_and_every_later_save(
    tmp_path, first
):
    # Whoever else looks first (the commit announcer's thread waits; a read of a step's metadata
    # joins the hand-off), the training thread's own wait (the final step's) still raises: a save
    # that did not commit must fail the task that made it.
    ckpt = Checkpoints(str(tmp_path / "ck"), CheckpointSpec(every_steps=1, device_copy=True))
    release, _ = _held(ckpt, fail=OSError(28, "No space left on device"))
    ckpt.save(3, {"w": jax.numpy.ones(4)}, _iterator(), {})
    release.set()
    if first == "another thread's wait":
        seen = []

        def wait():
            try:
                ckpt.wait()
            except CheckpointSaveError as exc:
                seen.append(exc)

        other = threading.Thread(target=wait)
        other.start()
        other.join()
        assert len(seen) == 1 and seen[0].step == 3
    elif first == "a reload":
        ckpt.reload()
    with pytest.raises(CheckpointSaveError, match="step 3 did not commit") as raised:
        ckpt.wait()
    assert "No space left on device" in str(raised.value)
    ckpt.wait()  # (once to each thread, as Orbax raises its own)
    with pytest.raises(CheckpointSaveError, match="step 3"):
        ckpt.save(4, {"w": jax.numpy.ones(4)}, _iterator(), {})
    assert ckpt.committed_steps() == []
    # A restore starts over from the committed steps: the next save goes through.
    ckpt.forget_failed_save()
    ckpt.reload()
    ckpt.save(4, {"w": jax.numpy.ones(4)}, _iterator(), {})
    ckpt.wait()
    assert ckpt.committed_steps() == [4]
    ckpt.close()


def test_a_copy_that_fails_on_the_device_saves_without_it(tmp_path, monkeypatch, caplog):
    from prefect_jax.training import save_handoff

    def out_of_memory(savable):
        raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate")

    monkeypatch.setattr(save_handoff, "copy_on_device", out_of_memory)
    ckpt = Checkpoints(str(tmp_path / "ck"), CheckpointSpec(every_steps=1, device_copy=True))
    ckpt.save(1, {"w": jax.numpy.ones(4)}, _iterator(), {})
    ckpt.wait()
    assert ckpt.committed_steps() == [1] and not ckpt.device_copy
    assert "saving it, and every later step, without the copy" in caplog.text
    assert "--no-device-copy" in caplog.text
    ckpt.close()


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


def test_a_job_saving_through_the_hand_off_resumes_bit_for_bit(job_config, caplog):
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

    interrupted = Trainer(config("copied", True))
    assert interrupted.loop.compiling.save_copy
    # The copy's program is compiled once, beside the first steps, from the live state's types:
    # the save calls the same program and compiles nothing on the training thread.
    caplog.set_level(logging.WARNING, logger="jax._src.interpreters.pxla")
    jax.config.update("jax_log_compiles", True)  # (every thread's: `jax.log_compiles` is one's)
    try:
        interrupted.restore_or_init()
        interrupted.train_until_checkpoint()
    finally:
        jax.config.update("jax_log_compiles", False)
    compiled = [
        r.threadName
        for r in caplog.records
        if r.getMessage().startswith("Compiling jit(_copy_leaves)")
    ]
    assert compiled == ["prefect-jax-compile-save-copy"], compiled
    interrupted.job.checkpoints.wait()
    interrupted.close()  # the process "goes away" after step 20
    resumed = Trainer(config("copied", True))
    assert resumed.restore_or_init() == 20
    while resumed.step < 60:
        resumed.train_until_checkpoint()
    assert resumed.fingerprint() == expected
    resumed.close()


@pytest.mark.parametrize(
    "device_copy, peak, copied",
    [
        (None, 4892, True),  # 4892 + 4108 bytes of state = 9000: 90% of 10000, the limit
        (None, 4893, False),  # one byte past it
        (True, 10_000, True),  # asked for: copied whatever the memory
    ],
)
def test_left_to_choose_a_save_is_copied_only_where_the_copy_fits_beside_the_peak(
    tmp_path, monkeypatch, caplog, device_copy, peak, copied
):
    # On an accelerator the copy holds a second state in device memory while the next steps
    # run: left to choose, the first save copies only where that fits beside the peak use so far
    # (which, after a copied save, counts the copy itself: so it is decided once).
    from prefect_jax.training import save_handoff

    stats = {"bytes_limit": 10_000, "peak_bytes_in_use": peak, "bytes_in_use": 4108}
    monkeypatch.setattr(save_handoff, "on_accelerator", lambda: True)
    monkeypatch.setattr(save_handoff, "memory_stats", lambda device: dict(stats))
    ckpt = Checkpoints(str(tmp_path / "ck"), CheckpointSpec(every_steps=1, device_copy=device_copy))
    assert ckpt.device_copy
    release, threads = _held(ckpt)
    release.set()
    state = {
        "w": jax.numpy.arange(1024, dtype=jax.numpy.float32),  # 4096 bytes
        "count": jax.numpy.int32(1),  # 4
        "key": jax.random.key(0),  # 8 (two uint32)
        "host": np.ones(2, np.float32),  # not on a device: no copy, not counted
    }
    ckpt.save(1, state, _iterator(), {})
    ckpt.wait()
    assert ckpt.device_copy == copied
    assert (threads[0] is not threading.current_thread()) == copied
    said = "saves are not handed off behind a copy of the state on its devices: at step 1" in (
        caplog.text
    )
    assert said == (not copied)
    if not copied:
        assert "memory so far (0.00 GiB) makes 90.0% of its 0.00 GiB, against 90% at most" in (
            caplog.text
        )
        assert "--device-copy" in caplog.text
    stats["peak_bytes_in_use"] = 10_000  # (a peak with the copy beside the steps)
    ckpt.save(2, state, _iterator(), {})
    ckpt.wait()
    assert ckpt.device_copy == copied and (threads[1] is not threading.current_thread()) == copied
    restored, _ = ckpt.restore(2, jax.eval_shape(lambda: state))
    assert state_fingerprint(restored) == state_fingerprint(state)
    ckpt.close()


def test_without_memory_statistics_left_to_choose_copies_on_an_accelerator(tmp_path, monkeypatch):
    from prefect_jax.training import save_handoff

    monkeypatch.setattr(save_handoff, "on_accelerator", lambda: True)
    ckpt = Checkpoints(str(tmp_path / "ck"), CheckpointSpec(every_steps=1))
    ckpt.save(1, {"w": jax.numpy.ones(4)}, _iterator(), {})  # (a CPU keeps no statistics)
    ckpt.wait()
    assert ckpt.device_copy and ckpt.committed_steps() == [1]
    ckpt.close()


def test_memory_statistics_that_cannot_be_read_decline_the_copy_and_the_save_goes_on(
    tmp_path, monkeypatch, caplog
):
    from prefect_jax.training import save_handoff

    def unreadable(device):
        raise RuntimeError("INTERNAL: the allocator's statistics are gone")

    monkeypatch.setattr(save_handoff, "on_accelerator", lambda: True)
    monkeypatch.setattr(save_handoff, "memory_stats", unreadable)
    ckpt = Checkpoints(str(tmp_path / "ck"), CheckpointSpec(every_steps=1))
    ckpt.save(1, {"w": jax.numpy.ones(4)}, _iterator(), {})
    ckpt.wait()
    assert not ckpt.device_copy and ckpt.committed_steps() == [1]
    assert "the devices' memory could not be read (RuntimeError: INTERNAL" in caplog.text
    ckpt.close()


_SHARDED = """
import json
import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from prefect_jax.training import save_handoff

mesh = jax.make_mesh((4,), ("data",))
state = {
    "w": jax.device_put(np.ones((64, 8), np.float32), NamedSharding(mesh, P("data"))),  # 512 each
    "r": jax.device_put(np.ones(10, np.float32), NamedSharding(mesh, P())),  # 40 on each
}
out = {"bytes": sorted(save_handoff.bytes_per_device(state).values())}
for peak in (6800, 8449):  # on the third device; the others at 0
    save_handoff.memory_stats = lambda d, peak=peak: {
        "bytes_limit": 10_000, "peak_bytes_in_use": peak if d.id == 2 else 0
    }
    out[str(peak)] = save_handoff.room_for_a_copy(state)
print(json.dumps(out))
"""


@pytest.mark.slow
def test_a_sharded_copy_is_counted_on_each_device_against_that_device_s_memory():
    # FSDP over 4 devices: each holds a quarter of `w` and all of `r`, 552 bytes; counted in total
    # (2,208) a peak of 6,800 would decline, and a device's own peak of 8,449 must.
    out = json_on_cpu_devices(_SHARDED, 4)
    assert out["bytes"] == [552] * 4, out
    assert out["6800"][0] is True, out
    assert out["8449"][0] is False and out["8449"][1].startswith("on cpu:2 "), out
