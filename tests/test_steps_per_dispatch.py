"""`TrainSpec.steps_per_dispatch`: K steps per jitted `lax.scan` give the same training as one
step per call (same checkpoints, logged steps and data position; state equal up to float
reassociation), and still catch a NaN at its exact step."""

import gc
from pathlib import Path

import jax
import numpy as np
import pytest

from prefect_jax.training.errors import NonFiniteLossError
from prefect_jax.training.trainer import Trainer


def _train(config) -> Trainer:
    trainer = Trainer(config)
    trainer.restore_or_init()
    while trainer.step < config.train.max_steps:
        trainer.train_until_checkpoint()
    trainer.job.checkpoints.wait()
    return trainer


def _leaves(state):
    is_key = lambda x: jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)  # noqa: E731
    return jax.tree.leaves(
        jax.tree.map(lambda x: jax.random.key_data(x) if is_key(x) else x, jax.device_get(state))
    )


def test_scanned_steps_match_one_step_per_dispatch(job_config):
    # every_steps=10 with K=4: each interval is scans of 4, 4 and a shorter one of 2.
    per_step = _train(job_config(max_steps=30, every_steps=10, job="k1"))
    scanned = _train(job_config(max_steps=30, every_steps=10, job="k4", steps_per_dispatch=4))

    assert scanned.step == per_step.step == 30
    scanned_steps = scanned.job.checkpoints.committed_steps()
    assert scanned_steps == per_step.job.checkpoints.committed_steps() == [10, 20, 30]
    # The data stream is at the same position, and the dropout key advanced the same way.
    assert scanned.data_iter.get_state() == per_step.data_iter.get_state()
    np.testing.assert_array_equal(
        jax.random.key_data(scanned.state["rng"]), jax.random.key_data(per_step.state["rng"])
    )
    # Params and Adam moments: equal up to reassociation, not necessarily bit for bit.
    for a, b in zip(_leaves(scanned.state), _leaves(per_step.state), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    # Training metrics went to MLflow at the same steps, with the same values.
    k1 = per_step.job.tracker.client.get_metric_history(per_step.job.tracker.run_id, "train/loss")
    k4 = scanned.job.tracker.client.get_metric_history(scanned.job.tracker.run_id, "train/loss")
    assert [m.step for m in k4] == [m.step for m in k1] == [10, 20, 30]
    np.testing.assert_allclose([m.value for m in k4], [m.value for m in k1], rtol=1e-4)
    per_step.close()
    scanned.close()


def test_scanned_steps_resume_from_a_checkpoint_like_one_step_per_dispatch(job_config):
    straight = _train(job_config(max_steps=20, every_steps=10, job="straight"))
    first = Trainer(job_config(max_steps=20, every_steps=10, job="resumed", steps_per_dispatch=3))
    first.restore_or_init()
    first.train_until_checkpoint()
    first.job.checkpoints.wait()
    first.close()
    resumed = _train(job_config(max_steps=20, every_steps=10, job="resumed", steps_per_dispatch=3))
    assert resumed.job.checkpoints.committed_steps() == [10, 20]
    assert resumed.data_iter.get_state() == straight.data_iter.get_state()
    for a, b in zip(_leaves(resumed.state), _leaves(straight.state), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    straight.close()
    resumed.close()


def test_scanned_steps_name_the_first_nan_step_and_keep_it_out_of_checkpoints(
    job_config, monkeypatch
):
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    trainer = Trainer(
        job_config(
            max_steps=60, every_steps=20, program="programs:diverges_at_33", steps_per_dispatch=8
        )
    )
    trainer.restore_or_init()
    assert trainer.train_until_checkpoint() == 20
    with pytest.raises(
        NonFiniteLossError, match="step 33 .*resumes from its newest checkpoint, step 20"
    ):
        trainer.train_until_checkpoint()
    trainer.job.checkpoints.wait()
    assert trainer.job.checkpoints.committed_steps() == [20]
    trainer.close()


def test_steps_per_dispatch_must_be_positive():
    from prefect_jax.training.specs import TrainSpec

    with pytest.raises(ValueError, match="steps_per_dispatch=0 must be a positive number"):
        TrainSpec(max_steps=10, steps_per_dispatch=0)


@pytest.mark.parametrize("k", [1, 4])
def test_the_steps_donate_the_train_state_so_one_copy_of_it_is_held(job_config, k):
    # As on a GPU: each step (or scan of steps) writes the new state over the old one's buffers,
    # so the device holds one copy of the state, and the CPU suite runs the path GPU jobs take.
    trainer = Trainer(
        job_config(max_steps=20, every_steps=10, job=f"donated{k}", steps_per_dispatch=k)
    )
    trainer.restore_or_init()
    started = trainer.state
    trainer.train_until_checkpoint()
    assert all(leaf.is_deleted() for leaf in jax.tree.leaves(started))
    trainer.job.checkpoints.wait()  # step 10 saved: its state is free to donate too
    gc.collect()  # (a host view of it left in a reference cycle would make JAX copy it instead)
    saved = trainer.state
    trainer.train_until_checkpoint()
    assert all(leaf.is_deleted() for leaf in jax.tree.leaves(saved))
    assert trainer.step == 20 and not any(
        leaf.is_deleted() for leaf in jax.tree.leaves(trainer.state)
    )
    trainer.close()


@pytest.mark.parametrize("k", [1, 3])
def test_the_loop_is_never_more_than_one_dispatch_ahead_of_the_device(k):
    # A real model's step is the device's work: the host could queue a whole interval in
    # milliseconds, and a backup due "1 s into the part" (or a SIGTERM's checkpoint) would be
    # judged by steps queued, not done. Whenever the loop asks whether to stop, every dispatch
    # but the newest has run.
    from programs import DeviceBound

    from prefect_jax.training.loop import Loop
    from prefect_jax.training.specs import TrainSpec

    program = DeviceBound(hidden=(16, 16), batch_size=16)
    program.work = 24  # a few ms a step here
    loop = Loop(program, TrainSpec(max_steps=60, steps_per_dispatch=k, log_every_steps=30))
    outputs = []  # each dispatch's metrics (never donated), to ask whether it has run

    def recorded(step):
        def call(*args):
            state, metrics, guard = step(*args)
            outputs.append(jax.tree.leaves(metrics)[0])
            return state, metrics, guard

        return call

    loop.train_step, loop.scan_steps = recorded(loop.train_step), recorded(loop.scan_steps)
    state, it = loop.place(loop.init_state()), loop.fresh_iter()
    running = []

    def stop() -> bool:
        running.append(sum(not m.is_ready() for m in outputs))
        return False

    interval = loop.run(state, 0, it, target=36, stop=stop)
    assert interval.step == 36 and len(running) == 36 // k
    assert max(running) <= 1, f"dispatches not yet run at each stop check: {running}"


def test_a_short_batch_in_a_dispatch_is_refused_naming_the_steps_and_the_fix(job_config):
    """An epoch's short last batch (``.batch(32).repeat()``, Keras's order) cannot be stacked
    with full ones into one scan: NumPy's "all input arrays must have the same shape" was all a
    porter got. One step per dispatch trains it (compiling that shape again)."""
    config = job_config(
        max_steps=8,
        every_steps=8,
        job="epochs",
        steps_per_dispatch=4,
        program="tests.programs:epoch_batches",
    )
    trainer = Trainer(config)
    trainer.restore_or_init()
    with pytest.raises(ValueError) as refused:
        trainer.train_until_checkpoint()
    trainer.close()
    assert str(refused.value).startswith(
        "the train batches of steps 1 and 4 have other shapes ({'x': (32, 64), 'y': (32,)} and "
        "{'x': (4, 64), 'y': (4,)}), and --steps-per-dispatch 4 (TrainSpec.steps_per_dispatch) "
        "stacks each dispatch's batches into one array: give train_data batches of one shape "
        "(.batch(n, drop_remainder=True), or .repeat() before .batch)"
    ), refused.value
    assert (
        _train(
            job_config(
                max_steps=8, every_steps=8, job="epochs-1", program="tests.programs:epoch_batches"
            )
        ).step
        == 8
    )
