"""Every restore-or-init branch, on real Orbax checkpoints in temp dirs."""

import json
import os
import threading
import time

import jax
import numpy as np
import pytest

from prefect_jax.examples.digits import DigitsProgram
from prefect_jax.training.checkpoint_dirs import committed_steps, wait_for_new_checkpoint
from prefect_jax.training.checkpoints import Checkpoints
from prefect_jax.training.errors import CheckpointMismatchError
from prefect_jax.training.names import STEP_MANIFEST_FILE
from prefect_jax.training.trainer import Trainer, restore_or_init
from prefect_jax.training.trees import state_fingerprint


def test_new_job_initialises_at_step_zero(job_config):
    trainer = Trainer(job_config())
    assert trainer.restore_or_init() == 0
    assert trainer.job.checkpoints.committed_steps() == []


def test_init_is_the_same_state_each_time_and_on_its_device(job_config):
    # Compiled with its own options (a quick compile: it runs once), init still makes one state:
    # a rerun that initialises again (nothing committed yet) gets it bit for bit.
    from prefect_jax.training.loop import Loop

    config = job_config()
    program = DigitsProgram(hidden=(16, 16))
    first, second = (
        Loop(program, config.train).init_state(),
        Loop(program, config.train).init_state(),
    )
    assert state_fingerprint(first) == state_fingerprint(second)
    assert {leaf.sharding for leaf in jax.tree.leaves(first)} == {
        jax.sharding.SingleDeviceSharding(jax.devices()[0])
    }
    eager = program.init(jax.random.key(config.train.seed))
    assert jax.tree.structure(eager) == jax.tree.structure(first)
    # The quick compile is what runs (were the option refused, init would quietly compile slowly).
    from prefect_jax.training.compiled_steps import INIT_COMPILER_OPTIONS

    jax.jit(program.init).lower(jax.random.key(0)).compile(compiler_options=INIT_COMPILER_OPTIONS)


def test_resumes_from_latest_committed_step_with_identical_state(job_config):
    config = job_config(max_steps=40, every_steps=20)
    first = Trainer(config)
    first.restore_or_init()
    first.train_until_checkpoint()
    first.train_until_checkpoint()
    first.job.checkpoints.wait()
    expected = first.fingerprint()
    first.close()

    second = Trainer(job_config(max_steps=60, every_steps=20))
    assert second.restore_or_init() == 40
    assert second.fingerprint() == expected
    # A rerun restores: it makes no init key (the key would be its first JAX computation, a
    # compile or cache load on the way to its first step), and trains on without one.
    assert second.loop._rng is None
    assert second.train_until_checkpoint() == 60
    assert second.loop._rng is None
    second.close()


def test_a_resume_with_another_seed_is_refused_and_an_evaluator_of_any_seed_recovers(job_config):
    """The data position restores into train_data(seed): another seed would read other data."""
    from prefect_jax.training.program_params import ProgramParamsMismatchError

    first = Trainer(job_config(max_steps=20, every_steps=20))
    first.restore_or_init()
    first.train_until_checkpoint()
    first.job.checkpoints.wait()
    first.close()
    # Refused more often than the rerun budget (max_reruns_without_progress=3) allows: the
    # refusals are the input's, not reruns that failed, and the corrected rerun below resumes.
    for _ in range(4):
        other = Trainer(job_config(max_steps=40, every_steps=20, seed=7))
        with pytest.raises(ProgramParamsMismatchError, match="with seed 0, given 7: .* --seed 0"):
            other.restore_or_init()
        other.close()
    evaluator = Trainer(job_config(max_steps=40, every_steps=20, seed=7))
    assert evaluator.recover() == (True, 20)  # (it reads no train data)
    evaluator.close()
    again = Trainer(job_config(max_steps=40, every_steps=20))
    assert again.restore_or_init() == 20  # nothing was lost
    again.close()


def test_the_abstract_state_is_init_traced_with_the_seeds_key(job_config):
    from prefect_jax.training.loop import Loop

    config = job_config()
    program = DigitsProgram(hidden=(16, 16))
    loop = Loop(program, config.train)
    expected = jax.eval_shape(program.init, jax.random.key(config.train.seed))
    assert jax.tree.structure(loop.abstract_state) == jax.tree.structure(expected)
    assert [(a.shape, a.dtype) for a in jax.tree.leaves(loop.abstract_state)] == [
        (e.shape, e.dtype) for e in jax.tree.leaves(expected)
    ]
    assert loop._rng is None  # traced: no key made
    # Nor by init, which makes it inside its program from the seed: the state init makes from the
    # seed's key (compiled as init is: other options may differ in the last bits), for seeds
    # past int32 both ways (with 64-bit JAX off, as here, `jax.random.key` wraps them).
    from prefect_jax.training.compiled_steps import INIT_COMPILER_OPTIONS

    def from_key(seed):
        key = jax.random.key(seed)
        return state_fingerprint(
            jax.jit(program.init).lower(key).compile(compiler_options=INIT_COMPILER_OPTIONS)(key)
        )

    assert state_fingerprint(loop.init_state()) == from_key(config.train.seed)
    assert loop._rng is None
    for seed in (7, 2**31, -1, -(2**31) - 1):
        assert state_fingerprint(
            Loop(program, config.train.model_copy(update={"seed": seed})).init_state()
        ) == from_key(seed)


def test_resumed_run_ends_bit_for_bit_equal_to_uninterrupted_run(job_config, tmp_path):
    # Data order, dropout RNG and optimizer state come back from the checkpoint.
    straight = Trainer(job_config(max_steps=60, every_steps=20, job="straight"))
    straight.restore_or_init()
    while straight.step < 60:
        straight.train_until_checkpoint()
    expected = straight.fingerprint()

    interrupted = Trainer(job_config(max_steps=60, every_steps=20, job="resumed"))
    interrupted.restore_or_init()
    interrupted.train_until_checkpoint()
    interrupted.job.checkpoints.wait()
    interrupted.close()  # the process "goes away" after step 20
    resumed = Trainer(job_config(max_steps=60, every_steps=20, job="resumed"))
    assert resumed.restore_or_init() == 20
    while resumed.step < 60:
        resumed.train_until_checkpoint()
    assert resumed.fingerprint() == expected


def test_explicit_checkpoint_path_warm_starts_a_new_job(job_config, caplog):
    source = Trainer(job_config(job="source"))
    source.restore_or_init()
    source.job.tracker.run_id  # noqa: B018 - known (waited for) before its checkpoint records it
    source.train_until_checkpoint()
    source.job.checkpoints.wait()
    path = os.path.join(source.job.checkpoints.directory, "20")

    target = Trainer(job_config(job="target"))
    assert target.restore_or_init(checkpoint_path=path) == 20
    assert target.fingerprint() == source.fingerprint()
    # Its own MLflow run, not the source job's (which the step's metadata names)
    assert source.job.read_meta(20)["mlflow_run_id"] == source.job.tracker.run_id
    assert target.job.tracker.run_id != source.job.tracker.run_id
    # Rerun with the same path once it has its own step: it resumes, and says the path is unused.
    target.train_until_checkpoint()
    target.close()
    rerun = Trainer(job_config(job="target"))
    with caplog.at_level("WARNING"):
        assert rerun.restore_or_init(checkpoint_path=path) == 40
    assert f"resumes from step 40, and checkpoint_path {path} (a warm start" in caplog.text
    rerun.close()


def test_a_warm_start_from_another_model_names_what_trained_it(job_config):
    """A new job's warm start from another model's step (another width) is refused naming the
    program and the params that step's job was given, so that the same model can be built: the
    advice to restore with the program that wrote it, or to start a new job, did not fit a new
    job. The differing leaves follow the advice."""
    typed = dict(program="programs:typed_digits")
    source = Trainer(
        job_config(job="wide").model_copy(update={**typed, "program_params": {"width": 16}})
    )
    source.restore_or_init()
    source.train_until_checkpoint()
    source.job.checkpoints.wait()
    path = os.path.join(source.job.checkpoints.directory, "20")
    source.close()
    target = Trainer(
        job_config(job="narrow").model_copy(update={**typed, "program_params": {"width": 8}})
    )
    with pytest.raises(CheckpointMismatchError) as refused:
        target.restore_or_init(checkpoint_path=path)
    target.close()
    first, *leaves = str(refused.value).split("\n")
    assert first.startswith(
        f"checkpoint_path {path} (a warm start) holds another model's state than this job's "
        "program builds: it was trained by program programs:typed_digits with program params "
        '{"width": 16}. Warm-start from a step of the same model'
    ), first
    assert first.endswith("(--program-param KEY=VALUE)."), first  # (its leaves below it)
    assert leaves[:2] == [
        "  params/l1/bias: checkpoint float32[16], init float32[8]",
        "  params/l1/kernel: checkpoint float32[64, 16], init float32[64, 8]",
    ], leaves


def test_checkpoint_dir_and_path_together_is_an_error(job_config):
    program = DigitsProgram(hidden=(8, 8))
    rng = jax.random.key(0)
    with pytest.raises(ValueError, match="pass checkpoint_dir .* or checkpoint_path .* not both"):
        restore_or_init(
            None, lambda: program.init(rng), None, checkpoint_dir="/a", checkpoint_path="/a/10"
        )


def test_checkpoint_path_that_is_not_a_committed_step_is_an_error(tmp_path):
    program = DigitsProgram(hidden=(8, 8))
    rng = jax.random.key(0)
    (tmp_path / "7").mkdir()
    with pytest.raises(
        ValueError, match=r"not a committed checkpoint step directory; committed steps in .*: \[\]"
    ):
        restore_or_init(None, lambda: program.init(rng), None, checkpoint_path=str(tmp_path / "7"))


def test_integer_dirs_without_commit_are_not_steps(tmp_path):
    (tmp_path / "100").mkdir()
    (tmp_path / "100" / "state").mkdir()
    assert committed_steps(str(tmp_path)) == []


def test_wait_for_checkpoint_gives_up_at_the_deadline_then_inits(job_config):
    trainer = Trainer(job_config())
    start = time.monotonic()
    assert (
        trainer.restore_or_init(wait_for_checkpoint=True, max_wait_secs=0.6, recovery_wait_secs=0.2)
        == 0
    )
    assert 0.55 <= time.monotonic() - start < 10


def test_wait_for_checkpoint_restores_one_committed_while_waiting(job_config):
    config = job_config()
    writer = Trainer(config)
    writer.restore_or_init()
    writer.train_until_checkpoint()
    writer.job.checkpoints.wait()
    expected = writer.fingerprint()
    # one writer per job: the step is written first, and appears while the waiter waits
    writer.close()
    checkpoints = os.path.join(config.storage, config.job, "checkpoints")
    os.rename(os.path.join(checkpoints, "20"), os.path.join(checkpoints, ".not-yet-20"))

    def commit_later():
        time.sleep(0.5)
        os.rename(os.path.join(checkpoints, ".not-yet-20"), os.path.join(checkpoints, "20"))

    waiter = Trainer(config)
    thread = threading.Thread(target=commit_later)
    thread.start()
    start = time.monotonic()
    try:
        step = waiter.restore_or_init(
            wait_for_checkpoint=True, max_wait_secs=60, recovery_wait_secs=0.1
        )
    finally:
        thread.join()
    assert step == 20 and time.monotonic() - start >= 0.4
    assert waiter.fingerprint() == expected


def test_a_step_committed_while_torn_ones_are_looked_for_is_kept(job_config, monkeypatch):
    """The writer commits a step just as a waiting trainer looks for torn steps to move aside (what
    the test above hit once on busy cores): the step is committed, and kept."""
    from prefect_jax.training import checkpoints as module

    config = job_config()
    writer = Trainer(config)
    writer.restore_or_init()
    writer.train_until_checkpoint()
    writer.close()
    checkpoints = os.path.join(config.storage, config.job, "checkpoints")
    os.rename(os.path.join(checkpoints, "20"), os.path.join(checkpoints, ".not-yet-20"))
    listed = module.step_dirs

    def list_then_commit(directory):
        steps = listed(directory)
        if os.path.exists(
            os.path.join(checkpoints, ".not-yet-20")
        ):  # committed just after the first listing
            os.rename(os.path.join(checkpoints, ".not-yet-20"), os.path.join(checkpoints, "20"))
        return steps

    monkeypatch.setattr(module, "step_dirs", list_then_commit)
    waiter = Checkpoints(checkpoints)
    try:
        waiter.quarantine_uncommitted()
    finally:
        waiter.close()
    assert committed_steps(checkpoints) == [20], os.listdir(checkpoints)


def test_wait_polls_with_fake_clock():
    now = [0.0]
    sleeps = []

    def sleep(s):
        sleeps.append(s)
        now[0] += s

    steps = iter([[], [], [5, 10]])
    assert (
        wait_for_new_checkpoint(
            lambda: next(steps),
            None,
            100,
            30,
            log=lambda m: None,
            sleep=sleep,
            clock=lambda: now[0],
        )
        == 10
    )
    assert sleeps == [30, 30]
    assert (
        wait_for_new_checkpoint(
            lambda: [3], 3, 45, 30, log=lambda m: None, sleep=sleep, clock=lambda: now[0]
        )
        is None
    )
    assert sleeps[2:] == [30, 15]


def _refused_restore(config, program) -> str:
    """The `CheckpointMismatchError` a trainer of `config`'s job with `program` restores into."""
    trainer = Trainer(config, program=program)
    try:
        with pytest.raises(CheckpointMismatchError) as refused:
            trainer.restore_or_init()
    finally:
        trainer.close()
    return str(refused.value)


def test_mismatched_tree_lists_differing_leaves_by_path(job_config, tmp_path):
    config = job_config()
    trainer = Trainer(config)
    trainer.restore_or_init()
    trainer.train_until_checkpoint()
    trainer.job.checkpoints.wait()

    other = DigitsProgram(hidden=(32, 16))  # l2 and l3 change shape
    checkpoints = Checkpoints(trainer.job.checkpoints.directory, read_only=True)
    abstract = jax.eval_shape(other.init, jax.random.key(0))
    with pytest.raises(CheckpointMismatchError) as err:
        checkpoints.restore(20, abstract)
    message = str(err.value)
    assert "params/l2/kernel: checkpoint float32[32, 32], init float32[32, 16]" in message
    assert "params/l3/kernel: checkpoint float32[32, 10], init float32[16, 10]" in message
    assert "opt/0/mu/l2/bias" in message
    assert "params/l1/kernel" not in message  # unchanged leaves are not listed

    # A job's run given another program (an evaluator given its trainer's sibling, the roles
    # probe's): the program that wrote the step is named, and what to run it with.
    checkpoints.close()
    trainer.close()
    said = _refused_restore(config, other)
    assert said.startswith(f"step 20 of this job was written by program {config.program}"), said
    assert "run it with the program and params that wrote it" in said, said
    assert "params/l2/kernel: checkpoint float32[32, 32], init float32[32, 16]" in said, said


def test_a_train_step_that_returns_another_state_is_refused_naming_the_leaf(job_config):
    """A train_step whose returned state has a leaf init's lacks: refused as the step is traced,
    naming the leaf (jit said it about out_shardings, in pytree terms), never retried, and
    nothing saved."""
    from programs import ExtraLeaf

    from prefect_jax.training.program import ProgramError

    trainer = Trainer(job_config(), program=ExtraLeaf())
    trainer.restore_or_init()
    with pytest.raises(
        ProgramError, match=r"must return the state it was given, as init made it"
    ) as err:
        trainer.train_until_checkpoint()
    assert "lr: in the state it returns, not in init's state" in str(err.value)
    assert trainer.committed_steps() == []


@pytest.mark.parametrize(
    ("program", "said"),
    [
        ("StateOnly", r"must return a pair \(state, metrics\), e\.g\. .*: it returned a dict"),
        ("PerExampleLoss", r"metric 'loss' has shape \(32,\): each metric must be a scalar"),
    ],
)
def test_a_train_step_that_returns_no_metrics_or_no_scalars_is_refused_before_a_step(
    job_config, program, said
):
    """It failed with jit's KeyError: 1 (a state alone), or after an interval's training as its
    first log point was read (a per-example loss), naming neither train_step nor the fix."""
    import programs

    from prefect_jax.training.program import ProgramError

    trainer = Trainer(job_config(), program=getattr(programs, program)())
    trainer.restore_or_init()
    with pytest.raises(ProgramError, match=said):
        trainer.train_until_checkpoint()
    assert trainer.committed_steps() == [] and not trainer.step


def test_a_step_whose_data_position_does_not_fit_the_train_data_now_is_refused_as_such(
    job_config,
):
    """train_data became a mix: Grain failed inside the restore (KeyError: 'parents'), reported as
    an intact step that would not restore, to be moved aside by hand. It is another pipeline's
    step: refused naming both positions, the step kept, the rerun budget not spent."""
    from programs import MixedTrainData

    from prefect_jax.training.storage import JobStorage

    trainer = Trainer(job_config())
    trainer.restore_or_init()
    trainer.train_until_checkpoint()
    trainer.close()
    config = job_config(job="tiny")
    attempts = JobStorage(config.storage, config.job).path("attempts.json")
    before = open(attempts).read()
    said = _refused_restore(config, MixedTrainData())
    assert "its data position does not fit the program's train_data(seed) now" in said, said
    assert 'saved: {"next_index": …}' in said and '"parents": [' in said, said
    checkpoint_dir = JobStorage(config.storage, config.job).checkpoint_dir
    assert committed_steps(checkpoint_dir) == [20] and open(attempts).read() == before
    # The way out it names: a new job warm-started from the step's state, its own data from the
    # start (the source's position is not restored: it was, and failed the same way).
    step_dir = f"{JobStorage(config.storage, config.job).checkpoint_dir}/20"
    fresh = Trainer(job_config(job="mixed"), program=MixedTrainData())
    try:
        assert fresh.restore_or_init(checkpoint_path=step_dir) == 20
    finally:
        fresh.close()


def test_typed_prng_keys_survive_a_checkpoint(tmp_path):
    from prefect_jax.training.checkpoints import CheckpointSpec

    state = {"key": jax.random.key(7), "w": np.arange(4, dtype=np.float32)}
    ckpt = Checkpoints(str(tmp_path / "ck"), CheckpointSpec(every_steps=1))
    import grain

    it = iter(grain.MapDataset.range(10).to_iter_dataset())
    ckpt.save(1, state, it, {})
    ckpt.wait()
    restored, meta = ckpt.restore(1, jax.eval_shape(lambda: state))
    assert jax.dtypes.issubdtype(restored["key"].dtype, jax.dtypes.prng_key)
    assert state_fingerprint(restored) == state_fingerprint(state)
    assert meta["step"] == 1 and meta["tree"]["key"] == [[2], "uint32"]


def test_retention_deletes_steps_without_orbax_s_polling_thread_pool(tmp_path, monkeypatch):
    # Left to Orbax, a machine of 4 or more CPUs (a GPU machine's 16, not CI's 2) deletes each old
    # step in the commit with a thread pool that polls every 0.1 s; the next save waits for it.
    import grain
    from orbax.checkpoint._src.path import deleter

    from prefect_jax.training.checkpoints import CheckpointSpec

    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    pooled = []
    monkeypatch.setattr(
        deleter._ParallelDirectoryDeleter, "delete", lambda self, path: pooled.append(path)
    )
    ckpt = Checkpoints(str(tmp_path / "ck"), CheckpointSpec(every_steps=1, keep_last=1))
    it = iter(grain.MapDataset.range(10).to_iter_dataset())
    for step in (1, 2, 3):
        ckpt.save(step, {"w": np.full(4, step, np.float32)}, it, {})
    ckpt.wait()
    assert ckpt.committed_steps() == [3] and sorted(os.listdir(tmp_path / "ck")) == ["3"]
    assert pooled == []


def test_the_data_position_is_written_in_the_commit_not_before_save_returns(tmp_path, monkeypatch):
    # Grain's own handler is synchronous: Orbax made `save` wait for its file, behind the
    # creation of every item's directory (a large part of a save). The position is read at the
    # save and written by the commit: the iterator moving on after `save` does not change it.
    import grain
    from etils import epath

    from prefect_jax.training.checkpoints import CheckpointSpec

    released, write_text = threading.Event(), epath.Path.write_text
    written_while_held = []

    def gated(self, *args, **kwargs):
        if self.name.startswith("process_"):
            released.wait(5)
            written_while_held.append(not released.is_set() or None)
        return write_text(self, *args, **kwargs)

    monkeypatch.setattr(epath.Path, "write_text", gated)
    ckpt = Checkpoints(str(tmp_path / "ck"), CheckpointSpec(every_steps=1))
    it = iter(grain.MapDataset.range(100).shuffle(seed=3).to_iter_dataset())
    for _ in range(7):
        next(it)
    ckpt.save(7, {"w": np.ones(3, np.float32)}, it, {})
    returned_while_held = not released.is_set()
    after = [next(it) for _ in range(5)]  # moves on while the commit is held
    released.set()
    ckpt.wait()
    assert returned_while_held and written_while_held == [None]
    again = iter(grain.MapDataset.range(100).shuffle(seed=3).to_iter_dataset())
    ckpt.restore(7, jax.eval_shape(lambda: {"w": np.ones(3, np.float32)}), again)
    assert [next(again) for _ in range(5)] == after
    with open(tmp_path / "ck" / "7" / STEP_MANIFEST_FILE) as f:
        assert (
            "data/process_0-of-1.json" in json.load(f)["files"]
        )  # checksummed with the rest of the step


def _shuffled_iterator(kind: str):
    """50 shuffled records: a dataset iterator (its state a dict) or a DataLoader's (bytes)."""
    import grain

    if kind == "dataset":
        return iter(grain.MapDataset.range(50).shuffle(seed=1).to_iter_dataset())
    sampler = grain.samplers.IndexSampler(50, shuffle=True, seed=1, num_epochs=1)
    return iter(grain.DataLoader(data_source=list(range(50)), sampler=sampler, worker_count=0))


@pytest.mark.parametrize("writer", ["grain", "prefect_jax"])
def test_a_data_position_reads_back_whichever_handler_wrote_it(tmp_path, writer):
    # Steps written by an earlier prefect-jax (Grain's own handler) restore here, and an
    # evaluator or trainer still on it reads the steps this one writes: one file, one format.
    import grain
    import orbax.checkpoint as ocp

    from prefect_jax.training.checkpoints import IteratorRestore, IteratorSave, _handlers

    def manager(handlers):
        return ocp.CheckpointManager(str(tmp_path / "ck"), item_handlers=handlers)

    grains = dict(_handlers(), data=grain.checkpoint.CheckpointHandler())
    save_with, restore_with = (grains, _handlers()) if writer == "grain" else (_handlers(), grains)
    save_args, restore_args = (
        (grain.checkpoint.CheckpointSave, IteratorRestore)
        if writer == "grain"
        else (IteratorSave, grain.checkpoint.CheckpointRestore)
    )
    for step, kind in ((9, "dataset"), (12, "loader")):
        data = lambda kind=kind: _shuffled_iterator(kind)  # noqa: E731
        it = data()
        for _ in range(step):
            next(it)
        with manager(save_with) as m:
            m.save(
                step,
                args=ocp.args.Composite(data=save_args(it), meta=ocp.args.JsonSave({"step": step})),
            )
        want = [next(it) for _ in range(3)]
        again = data()
        with manager(restore_with) as m:
            m.restore(step, args=ocp.args.Composite(data=restore_args(again)))
        assert [next(again) for _ in range(3)] == want
    assert json.loads((tmp_path / "ck" / "9" / "data" / "process_0-of-1.json").read_text()) == {
        "next_index": 9
    }


@pytest.mark.parametrize("kind", ["dataset", "loader"])
def test_a_step_of_another_process_count_restores_either_iterator_s_position(tmp_path, kind):
    # Written by 2 processes, restored by 1: process 0's position applies (every process reads
    # the same batches). A DataLoader's position is bytes, a dataset iterator's a dict.
    from prefect_jax.training.checkpoints import CheckpointSpec
    from prefect_jax.training.checksums import write_manifest

    data = lambda: _shuffled_iterator(kind)  # noqa: E731
    ckpt = Checkpoints(str(tmp_path / "ck"), CheckpointSpec(every_steps=1))
    it = data()
    for _ in range(6):
        next(it)
    state = {"w": np.ones(3, np.float32)}
    ckpt.save(6, state, it, {})
    ckpt.wait()
    want = [next(it) for _ in range(3)]
    step_dir = tmp_path / "ck" / "6"
    (step_dir / "data" / "process_0-of-1.json").rename(step_dir / "data" / "process_0-of-2.json")
    write_manifest(str(step_dir))  # as two processes' commit would have listed it
    again = data()
    ckpt.restore(6, jax.eval_shape(lambda: state), again)
    assert [next(again) for _ in range(3)] == want


def test_a_step_names_a_public_handler_for_its_data_position(tmp_path):
    # Each step records its items' handlers (`_CHECKPOINT_METADATA`): a stable, importable name.
    import importlib

    import grain

    from prefect_jax.training.checkpoints import CheckpointSpec, IteratorHandler

    ckpt = Checkpoints(str(tmp_path / "ck"), CheckpointSpec(every_steps=1))
    ckpt.save(
        1, {"w": np.ones(3, np.float32)}, iter(grain.MapDataset.range(5).to_iter_dataset()), {}
    )
    ckpt.wait()
    with open(tmp_path / "ck" / "1" / "_CHECKPOINT_METADATA") as f:
        name = json.load(f)["item_handlers"]["data"]
    module, _, attr = name.rpartition(".")
    assert (
        name == "prefect_jax.training.checkpoints.IteratorHandler"
        and getattr(importlib.import_module(module), attr) is IteratorHandler
    )


def test_a_resume_on_other_data_is_refused_and_a_failing_fingerprint_damages_no_step(
    job_config, monkeypatch
):
    """The contract's ``data_fingerprint()``: recorded in each step, compared when a trainer
    resumes one of its job's steps. Its own failure (a bucket listing that timed out) is the
    program's error, raised as it is: asked inside the restore, it set the newest step aside as
    unreadable and resumed the one before. A job at its max_steps trains no more: not refused."""
    from programs import DATA

    from prefect_jax.training.checkpoint_dirs import committed_steps, read_meta_file
    from prefect_jax.training.resume_checks import DataChangedError

    monkeypatch.setitem(DATA, "fingerprint", "digits v1")
    config = job_config(max_steps=20, every_steps=10, program="programs:data_of_record")
    first = Trainer(config)
    first.restore_or_init()
    while first.step < 20:
        first.train_until_checkpoint()
    first.job.checkpoints.wait()
    first.close()
    steps_dir = first.job.checkpoints.directory
    assert read_meta_file(steps_dir, 20)["data_fingerprint"] == "digits v1"
    longer = config.model_copy(update={"train": config.train.model_copy(update={"max_steps": 30})})

    monkeypatch.setitem(DATA, "fingerprint", OSError("bucket listing timed out"))
    failing = Trainer(longer)
    with pytest.raises(OSError, match="bucket listing timed out"):
        failing.restore_or_init()
    failing.close()
    assert committed_steps(steps_dir) == [10, 20]  # nothing set aside

    monkeypatch.setitem(DATA, "fingerprint", "digits v2")
    other = Trainer(longer)
    with pytest.raises(
        DataChangedError, match="its data_fingerprint\\(\\) was 'digits v1', now 'digits v2'"
    ):
        other.restore_or_init()
    other.close()
    assert committed_steps(steps_dir) == [10, 20]
    finished = Trainer(config)  # at its max_steps: nothing is read, nothing refused
    assert finished.restore_or_init() == 20
    finished.close()
    monkeypatch.setitem(DATA, "fingerprint", OSError("bucket listing timed out"))
    finished = Trainer(config)  # (nor asked)
    assert finished.restore_or_init() == 20
    finished.close()
    monkeypatch.setitem(DATA, "fingerprint", "digits v1")
    resumed = Trainer(longer)
    assert resumed.restore_or_init() == 20
    resumed.close()
