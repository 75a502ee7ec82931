"""The byte-level transformer LM example: its corpus, train step and exports (tiny preset)."""

from __future__ import annotations

import dataclasses
import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from prefect_jax.examples.bytelm import PRESETS, ByteLMProgram, config_from_env, corpus

TINY = "prefect_jax.examples.bytelm:tiny"
DEVICES_FLAG = "--xla_force_host_platform_device_count"


def tiny(**overrides) -> ByteLMProgram:
    return ByteLMProgram(dataclasses.replace(PRESETS["tiny"], **overrides))


def test_the_corpus_is_built_once_then_read_from_the_cache(tmp_path, monkeypatch):
    first = corpus.build(32, max_files=60, cache=str(tmp_path))
    assert os.path.dirname(first.path) == str(tmp_path / "bytelm")
    assert sorted(os.listdir(tmp_path / "bytelm")) == [os.path.basename(first.path)]  # no temp left

    def no_build(*args):
        raise AssertionError("built again")

    monkeypatch.setattr(corpus, "_build_into", no_build)
    again = corpus.build(32, max_files=60, cache=str(tmp_path))
    assert again == first
    batch = corpus.train_dataset(again, 4, seed=0)[0]
    assert batch["tokens"].shape == (4, 33) and batch["tokens"].dtype == np.uint8


def test_the_split_is_by_file_and_disjoint(tmp_path):
    built = corpus.build(32, max_files=60, cache=str(tmp_path))
    train, evals = built.files["train"], built.files["eval"]
    assert not set(train) & set(evals) and len(evals) == 3
    assert sorted(train + evals) == corpus.source_files(corpus.source_root(), 60)
    assert (train, evals) == tuple(
        corpus.split_files(corpus.source_files(corpus.source_root(), 60))
    )
    assert built.windows["train"] > 10 * built.windows["eval"] > 0


def test_an_empty_corpus_folder_is_a_clear_error(tmp_path, monkeypatch):
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.setenv(corpus.SOURCE_ENV, str(empty))
    with pytest.raises(
        corpus.CorpusError, match=f"no .py files under '{empty}'.*{corpus.SOURCE_ENV}"
    ):
        corpus.build(32, cache=str(tmp_path / "cache"))
    # a folder that is not there says so (a typo in the path, not an empty folder)
    missing = tmp_path / "missing"
    with pytest.raises(corpus.CorpusError, match=f"no folder '{missing}'.*program param source"):
        corpus.build(32, cache=str(tmp_path / "cache"), source=str(missing))
    assert not (tmp_path / "cache").exists()  # nothing built of either
    # the standard library's folder (neither named) without sources: how to name another
    monkeypatch.delenv(corpus.SOURCE_ENV)
    monkeypatch.setattr(corpus.sysconfig, "get_paths", lambda: {"stdlib": str(empty)})
    with pytest.raises(
        corpus.CorpusError,
        match=f"the standard library of .*: set the program param source \\(or "
        f"\\${corpus.SOURCE_ENV}\\) to a folder",
    ):
        corpus.build(32, cache=str(tmp_path / "cache"))


def _text_folder(path, files=12):
    """A folder of text files (``.txt``: not the default ``.py``), one NUL-free paragraph each."""
    path.mkdir()
    for i in range(files):
        (path / f"doc{i:02d}.txt").write_text(f"paragraph {i}: " + "the quick brown fox. " * 40)
    (path / "skipped.md").write_text("not read: another ending\n" * 50)
    return path


def test_a_corpus_is_keyed_by_its_files_and_digests_what_it_read(tmp_path):
    """The cache was keyed by the folder's path only: text changed under it was not read again,
    without a word. Now a changed file is a new build with another digest, and the same text
    built again (another folder, other modification times) has the same digest."""
    import shutil

    text = _text_folder(tmp_path / "text")
    cache = str(tmp_path / "cache")
    first = corpus.build(32, cache=cache, source=str(text), suffixes=(".txt",))
    assert first.files["eval"] == ["doc00.txt"] and len(first.files["train"]) == 11
    again = corpus.build(32, cache=cache, source=str(text), suffixes=(".txt",))
    assert again == first  # nothing changed: read from the cache
    (text / "doc05.txt").write_text("another paragraph entirely. " * 40)
    changed = corpus.build(32, cache=cache, source=str(text), suffixes=(".txt",))
    assert changed.path != first.path and changed.digest != first.digest
    copy = shutil.copytree(tmp_path / "text", tmp_path / "copy")
    copied = corpus.build(32, cache=cache, source=str(copy), suffixes=(".txt",))
    assert copied.path != changed.path and copied.digest == changed.digest
    lm = ByteLMProgram(dataclasses.replace(PRESETS["tiny"], source=str(copy), suffixes=".txt"))
    assert lm.data_fingerprint() == (
        f"12 files, {copied.windows['train']} train and {copied.windows['eval']} eval windows of "
        f"33 bytes, digest {copied.digest}"
    )
    # .md files too: another corpus
    both = corpus.build(32, cache=cache, source=str(text), suffixes=(".txt", ".md"))
    assert "skipped.md" in both.files["train"] and both.digest != changed.digest


def test_a_corpus_folder_that_cannot_be_split_or_is_a_file_says_why(tmp_path):
    one = tmp_path / "one"
    one.mkdir()
    (one / "only.py").write_text("x = 1\n" * 500)
    with pytest.raises(
        corpus.CorpusError,
        match=re.escape(
            f"the train split of '{one}' (0 files, 0 bytes) holds no window of 33 bytes: one "
            "file in 20 (the 1st, the 21st, ... in path order) is an eval file, so its 1 files "
            "give 0 train and 1 eval files; give more files"
        ),
    ):
        corpus.build(32, cache=str(tmp_path / "cache"), source=str(one))
    with pytest.raises(corpus.CorpusError, match="a file, not a folder: '.*only.py'"):
        corpus.build(32, cache=str(tmp_path / "cache"), source=str(one / "only.py"))
    with pytest.raises(corpus.CorpusError, match=r"no \.txt files under .*suffixes=\.txt,\.md\)"):
        corpus.build(32, cache=str(tmp_path / "cache"), source=str(one), suffixes=(".txt",))


def test_config_from_the_environment():
    assert config_from_env({}) == PRESETS["small"]
    cfg = config_from_env(
        {"PREFECT_JAX_BYTELM_PRESET": "tiny", "PREFECT_JAX_BYTELM_CONFIG": '{"grad_accum": 2}'}
    )
    assert cfg == dataclasses.replace(PRESETS["tiny"], grad_accum=2)
    with pytest.raises(ValueError, match="unknown field"):
        config_from_env({"PREFECT_JAX_BYTELM_CONFIG": '{"width": 2}'})
    with pytest.raises(ValueError, match="not a preset"):
        config_from_env({"PREFECT_JAX_BYTELM_PRESET": "huge"})
    for given, said in [
        ('{"batch_size": "32"}', "batch_size='32': must be int"),
        ('{"dropout": true}', "dropout=True: must be float"),
        ('{"max_files": 1.5}', "max_files=1.5: must be int, or null"),
        ('{"mesh": [8]}', "mesh=[8]: must be dict, or null"),
    ]:
        with pytest.raises(ValueError, match=re.escape(said)):
            config_from_env({"PREFECT_JAX_BYTELM_CONFIG": given})


def test_config_values_a_run_could_only_fail_on_are_refused_naming_the_field():
    """An evaluation with no batch (after a checkpoint, then at every rerun), a NaN loss at the
    first step: refused as the config is made, by `Config` and the typed params alike."""
    from pydantic import ValidationError

    from prefect_jax.examples.bytelm import ByteLMParams

    for field, value, rule in [
        ("eval_sequences", -1, "must be at least 1, or null (all)"),
        ("eval_sequences", 0, "must be at least 1, or null (all)"),
        ("dropout", 1.0, "must be in [0, 1)"),
        ("learning_rate", 0.0, "must be above 0"),
        ("warmup_steps", -1, "must be at least 0"),
        ("n_heads", 0, "must be at least 1"),
        ("compute_dtype", "float16", "use 'float32' or 'bfloat16'"),
        ("attention", "flash", "use null (JAX's choice), 'xla' or 'cudnn'"),
        ("attention", "cudnn", "cuDNN's fused attention takes bfloat16 only"),
        # an axis its shardings never use: every device would hold the whole state and batch
        (
            "mesh",
            {"data": -1, "tensor": 2},
            "the byte LM places its state on the axes 'data' (FSDP",
        ),
    ]:
        message = re.escape(f"{field}={value!r}: {rule}")
        with pytest.raises(ValueError, match=message):
            tiny(**{field: value})
        with pytest.raises(ValidationError, match=message):
            ByteLMParams(preset="tiny", **{field: value})
    assert tiny(eval_sequences=None, dropout=0.0).cfg.eval_sequences is None


def test_a_config_field_of_bool_or_list_is_checked_and_another_type_named():
    """A field a developer adds to `Config`: a bool or a list is checked as the numbers are (a
    bool is no number, a number no bool); a type the check does not know is named with the fix,
    not a KeyError as the presets are built (which broke importing the example)."""
    import dataclasses

    from prefect_jax.examples.bytelm.config import Config

    @dataclasses.dataclass(frozen=True)
    class Grown(Config):
        tie_embeddings: bool = False
        layer_widths: list | None = None

    assert Grown(tie_embeddings=True, layer_widths=[1, 2]).tie_embeddings is True
    for field, value, rule in [
        ("tie_embeddings", 1, "must be bool"),
        ("layer_widths", "1,2", "must be list, or null"),
        ("n_layers", True, "must be int"),
    ]:
        with pytest.raises(ValueError, match=re.escape(f"{field}={value!r}: {rule}")):
            Grown(**{field: value})

    @dataclasses.dataclass(frozen=True)
    class Odd(Config):
        scale: complex = 1j

    with pytest.raises(TypeError, match=r"annotated 'complex'.*add it to bytelm.config._TYPES"):
        Odd()


def test_the_corpus_folder_is_a_param_the_environment_fills(tmp_path, monkeypatch):
    """``$PREFECT_JAX_BYTELM_SOURCE`` is recorded as the job's ``source`` (absolute), so a rerun
    on other text is refused like any other param; the standard library stays null, the same
    corpus on every machine; and the folder named is the one the corpus is built from."""
    from prefect_jax.examples.bytelm import ByteLMParams, program

    assert ByteLMParams(preset="tiny").source is None
    folder = tmp_path / "text"
    folder.mkdir()
    (folder / "a.py").write_text("".join(f"value_{i} = {i}\n" for i in range(400)))
    (folder / "b.py").write_text("print('b')\n" * 100)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(corpus.SOURCE_ENV, "text")
    params = ByteLMParams(preset="tiny", max_files=None)
    assert params.source == str(folder)
    monkeypatch.delenv(corpus.SOURCE_ENV)
    lm = program(params)
    assert lm.corpus().files == {"train": ["b.py"], "eval": ["a.py"]}
    assert ByteLMParams(preset="tiny", source="text").source == str(folder)
    with pytest.raises(ValueError, match=re.escape("source=' ': must be a folder of text files")):
        ByteLMParams(preset="tiny", source=" ")


def test_the_presets_sizes():
    from prefect_jax.examples import bytelm

    assert 1_000 < bytelm.tiny.param_count < 50_000
    assert 1_000_000 < bytelm.small.param_count < 10_000_000
    assert (
        bytelm.gpu100m.param_count >= 100_000_000 and bytelm.gpu100m.cfg.compute_dtype == "bfloat16"
    )


def test_train_steps_lower_the_loss_on_a_repeated_batch():
    program = tiny(warmup_steps=1)
    state = program.init(jax.random.key(0))
    batch = program.train_data(0)[0]
    step = jax.jit(program.train_step)
    losses = []
    for _ in range(30):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    assert losses[-1] < losses[0] - 0.5
    assert int(state["step"]) == 30


def test_bfloat16_compute_keeps_float32_master_weights():
    program = tiny(compute_dtype="bfloat16", n_layers=1)
    state = program.init(jax.random.key(0))
    state, metrics = jax.jit(program.train_step)(state, program.train_data(0)[0])
    dtypes = {leaf.dtype for leaf in jax.tree.leaves(state["params"])}
    assert dtypes == {jnp.dtype(jnp.float32)}
    assert program.apply(state["params"], jnp.zeros((1, 8), jnp.int32)).dtype == jnp.float32
    assert np.isfinite(float(metrics["loss"]))


def test_gradient_accumulation_equals_one_larger_batch():
    # Plain SGD: the parameter change is the gradient itself (Adam would amplify rounding
    # differences of near-zero gradients into whole steps).
    whole, accumulated = (
        tiny(dropout=0.0, batch_size=8),
        tiny(dropout=0.0, batch_size=2, grad_accum=4),
    )
    for program in (whole, accumulated):
        program.tx = optax.sgd(1.0)
    batch = whole.train_data(0)[0]
    assert batch["tokens"].shape == accumulated.train_data(0)[0]["tokens"].shape == (8, 33)
    state = whole.init(jax.random.key(0))
    one, m1 = jax.jit(whole.train_step)(state, batch)
    four, m4 = jax.jit(accumulated.train_step)(state, batch)
    np.testing.assert_allclose(float(m1["loss"]), float(m4["loss"]), rtol=1e-5)
    for a, b in zip(jax.tree.leaves(one["params"]), jax.tree.leaves(four["params"]), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)


def test_eval_metrics_are_exact_sums_over_batches_of_any_size():
    from prefect_jax.training.evaluation import aggregate

    program = tiny(eval_sequences=40)  # batches of 16, 16 and 8
    state = program.init(jax.random.key(0))
    data = program.eval_data()
    assert [len(data[i]["tokens"]) for i in range(len(data))] == [16, 16, 8]
    eval_step = jax.jit(program.eval_step)
    metrics, batches, tokens = aggregate(
        eval_step, state, (data[i] for i in range(len(data))), None
    )
    assert (batches, tokens) == (3, 40 * 32)
    whole = {"tokens": np.concatenate([data[i]["tokens"] for i in range(len(data))])}
    sums = jax.device_get(eval_step(state, whole))  # the 40 sequences as one batch
    for name in ("loss", "bits_per_byte", "accuracy"):
        assert metrics[name] == pytest.approx(sums[name][0] / sums[name][1], rel=1e-5)
    assert metrics["bits_per_byte"] == pytest.approx(metrics["loss"] / np.log(2), rel=1e-6)


def test_the_eval_windows_are_spread_over_the_whole_eval_split():
    """`eval_sequences` windows evenly spread, not the first ones in order (the start of one file:
    an eval loss judged on 2 KB of ``__future__.py``); the same ones every time."""
    from prefect_jax.examples.bytelm import corpus as lm_corpus

    program = tiny(eval_sequences=8)
    built = program.corpus()
    total = built.windows["eval"]
    reader = lm_corpus.ReadWindows(built.shards["eval"], built.window)
    every = reader(np.arange(total))["tokens"]
    data = program.eval_data()
    taken = np.concatenate([data[i]["tokens"] for i in range(len(data))])
    expected = [i * total // 8 for i in range(8)]
    np.testing.assert_array_equal(taken, every[expected])
    assert expected[-1] > total * 3 // 4  # (its last quarter too)


def test_exact_resume_through_the_engine(job_config):
    """2N steps in one trainer, and N steps, a fresh trainer restoring step N, N more: the same
    state (data position, dropout key, step and optimizer state come back from the checkpoint)."""
    from prefect_jax.training.trainer import Trainer

    straight = Trainer(job_config(max_steps=20, every_steps=10, job="straight", program=TINY))
    straight.restore_or_init()
    while straight.step < 20:
        straight.train_until_checkpoint()
    expected = straight.fingerprint()
    straight.close()

    first = Trainer(job_config(max_steps=20, every_steps=10, job="resumed", program=TINY))
    first.restore_or_init()
    first.train_until_checkpoint()
    first.job.checkpoints.wait()
    first.close()
    second = Trainer(job_config(max_steps=20, every_steps=10, job="resumed", program=TINY))
    assert second.restore_or_init() == 10
    while second.step < 20:
        second.train_until_checkpoint()
    assert second.fingerprint() == expected
    second.close()


def test_the_export_maps_token_ids_to_next_token_logits():
    from prefect_jax.training.exporters import serialize_serving

    program = tiny()
    state = program.init(jax.random.key(0))
    served = jax.export.deserialize(bytearray(serialize_serving(program, state, ["cpu"])))
    tokens = np.arange(3 * 32, dtype=np.int32).reshape(3, 32) % 256
    logits = served.call(tokens)
    assert logits.shape == (3, 32, 256) and logits.dtype == jnp.float32
    one = served.call(tokens[:1])  # the batch is symbolic
    np.testing.assert_allclose(np.asarray(one), np.asarray(logits[:1]), rtol=1e-5, atol=1e-5)
    assert program.serving_example().shape == (2, 32)


def test_the_mlflow_model_names_its_input_when_a_sequence_is_too_long(tmp_path):
    """Learned positions: past the table, JAX's own error names no input ("Error refining
    shapes", the constraint lost when the export was serialized); the pyfunc's names the shape
    it takes, the constraint the export recorded, and the shape it was given. A token id outside
    the vocabulary (NaN logits from the embedding, every position) is refused, naming the
    range the program declared."""
    import json
    from types import SimpleNamespace

    from prefect_jax.training.exporters import serialize_serving
    from prefect_jax.training.pyfunc_model import JaxExportModel
    from prefect_jax.training.serving import serving_record

    program = tiny(positions="learned")
    artifact = tmp_path / "model.jax_export"
    artifact.write_bytes(serialize_serving(program, program.init(jax.random.key(0)), ["cpu"]))
    recorded = serving_record(program)
    assert recorded == [
        {
            "name": None,
            "shape": ["b", "seq"],
            "dtype": "int32",
            "constraints": ["seq <= 32"],
            "values": [0, 256],
        }
    ]
    record = tmp_path / "export.json"
    record.write_text(json.dumps({"program": "bytelm", "inputs": recorded}))
    model = JaxExportModel()
    model.load_context(
        SimpleNamespace(artifacts={"jax_export": str(artifact), "export_info": str(record)})
    )
    assert model.predict(None, np.zeros((2, 32), np.int32)).shape == (2, 32, 256)
    with pytest.raises(
        ValueError, match=re.escape("takes int32[b,seq] where seq <= 32 (named")
    ) as got:
        model.predict(None, np.zeros((2, 40), np.int32))
    assert str(got.value).endswith(
        "given int32[2,40]: Error refining shapes; cut a dimension past its bound (a sequence: "
        "keep its last elements)"
    ), got.value
    bad = np.full((1, 4), 7, np.int32)
    bad[0, 2] = 300
    with pytest.raises(ValueError, match=re.escape("the input takes values 0 <= x < 256; given")):
        model.predict(None, bad)
    assert np.isnan(np.asarray(model.exported.call(bad))).all()  # what it would have answered
    with pytest.raises(ValueError, match="given values from -1 to 7"):
        model.predict(None, np.where(bad == 300, -1, bad))

    # A model registered before the export recorded its inputs: JAX's refusal, the shapes named.
    model.load_context(SimpleNamespace(artifacts={"jax_export": str(artifact)}))
    with pytest.raises(ValueError, match=re.escape("takes int32[b,seq] (named dimensions")) as got:
        model.predict(None, np.zeros((2, 40), np.int32))
    assert "given int32[2,40]: " in str(got.value)
    with pytest.raises(ValueError, match=re.escape("takes int32[b,seq]")) as got:
        model.predict(None, np.zeros((2, 3, 4), np.int32))
    assert "Rank mismatch" in str(got.value)
    # a refusal that is not about the input is JAX's own
    artifact.write_bytes(serialize_serving(program, program.init(jax.random.key(0)), ["cuda"]))
    model.load_context(SimpleNamespace(artifacts={"jax_export": str(artifact)}))
    with pytest.raises(ValueError, match=r"^Function 'serving' was exported for platforms"):
        model.predict(None, np.zeros((2, 32), np.int32))


# -- typed program params ----------------------------------------------------------------

PROGRAM = "prefect_jax.examples.bytelm:program"


def test_the_schedules_horizon_is_the_jobs_max_steps_unless_decay_steps_is_given():
    from prefect_jax.training.program import load_program

    short = load_program(PROGRAM, {"preset": "tiny"}, max_steps=120)
    long = load_program(PROGRAM, {"preset": "tiny"}, max_steps=5000)
    peak, floor = 3e-3, 3e-3 * PRESETS["tiny"].min_lr_ratio
    assert short.cfg.decay_steps == 120 and long.cfg.decay_steps == 5000
    assert float(short.schedule(120)) == pytest.approx(floor)
    assert float(long.schedule(120)) > 0.9 * peak  # still near the peak at step 120
    pinned = load_program(PROGRAM, {"preset": "tiny", "decay_steps": 300}, max_steps=120)
    assert pinned.cfg.decay_steps == 300 and float(pinned.schedule(300)) == pytest.approx(floor)
    # No job (the program built by hand): the preset's horizon.
    assert load_program(PROGRAM, {"preset": "tiny"}).cfg.decay_steps == PRESETS["tiny"].decay_steps


def test_the_environment_is_the_fallback_where_no_params_are_given(monkeypatch, caplog):
    from prefect_jax.examples.bytelm import params as lm_params
    from prefect_jax.training.program import load_program_with_params

    monkeypatch.setattr(lm_params, "_said", set())  # (said once per process)
    monkeypatch.setenv("PREFECT_JAX_BYTELM_PRESET", "tiny")
    monkeypatch.setenv("PREFECT_JAX_BYTELM_CONFIG", '{"grad_accum": 2}')
    program, recorded = load_program_with_params(PROGRAM, None, max_steps=40)
    assert program.cfg == dataclasses.replace(PRESETS["tiny"], grad_accum=2, decay_steps=40)
    assert recorded.values["preset"] == "tiny" and recorded.values["grad_accum"] == 2
    assert "not read" not in caplog.text
    given, _ = load_program_with_params(PROGRAM, {"preset": "tiny", "n_layers": 1}, max_steps=40)
    assert given.cfg.grad_accum == 1 and given.cfg.n_layers == 1  # params given: env unused
    assert (
        "PREFECT_JAX_BYTELM_PRESET and PREFECT_JAX_BYTELM_CONFIG not read: program params were "
        "given (n_layers, preset: "
    ) in caplog.text, caplog.text


@pytest.mark.slow
def test_a_resume_with_other_params_is_refused_before_any_training(job_config):
    from prefect_jax.training.program_params import ProgramParamsMismatchError
    from prefect_jax.training.trainer import Trainer

    def config(**params):
        made = job_config(max_steps=8, every_steps=4, job="lm-params", program=PROGRAM)
        return made.model_copy(update={"program_params": {"preset": "tiny", **params}})

    first = Trainer(config(learning_rate=0.01))
    first.restore_or_init()
    first.train_until_checkpoint()
    first.job.checkpoints.wait()
    first.close()
    # The same shapes, another learning rate: the restore would succeed; it is refused.
    second = Trainer(config(learning_rate=0.02))
    with pytest.raises(
        ProgramParamsMismatchError,
        match=r"job 'lm-params' was trained to step 4 with other program params.*"
        r"learning_rate: saved 0\.01, given 0\.02.*--program-param learning_rate=0\.01.*new job",
    ):
        second.restore_or_init()
    second.close()
    # An exempt field (reading threads) changes nothing computed: resumed.
    third = Trainer(config(learning_rate=0.01, read_threads=1))
    assert third.restore_or_init() == 4 and third.job.committed_steps() == [4]
    third.close()


def test_a_flow_runs_trainer_names_the_program_param_of_a_mesh_that_does_not_fit(job_config):
    """A deployment's flow run has no command preflight: its trainer's refusal names the param
    the user set (``program_params['mesh']``), not the program's ``mesh_axes``."""
    from prefect_jax.training.sharding import ShardingError
    from prefect_jax.training.trainer import Trainer

    made = job_config(max_steps=8, every_steps=4, job="lm-mesh", program=PROGRAM)
    config = made.model_copy(update={"program_params": {"preset": "tiny", "mesh": {"data": 3}}})
    with pytest.raises(ShardingError) as refused:
        Trainer(config)
    assert str(refused.value).endswith(
        'The program param mesh={"data": 3} set it: --program-param mesh=... in a command, '
        "program_params['mesh'] in a flow; left out, the program's default"
    ), refused.value


@pytest.mark.slow
def test_a_job_resumed_on_changed_text_is_refused_and_resumes_on_its_own_text(
    job_config, tmp_path, prefect_server, mlflow_uri
):
    """The probe's LM user added files to their corpus folder and reran: the job trained on,
    its restored input position indexing other records, its eval set changed under @best. Each
    step records its corpus's digest; a resume on other text is refused (the flow's restore and
    the command's preflight), and the same text again resumes."""
    import subprocess
    import sys

    from prefect_jax.training.checkpoint_dirs import committed_steps, read_meta_file
    from prefect_jax.training.resume_checks import DataChangedError
    from prefect_jax.training.trainer import Trainer

    text = _text_folder(tmp_path / "text")
    given = {"preset": "tiny", "source": str(text), "suffixes": ".txt"}

    def trainer():
        made = job_config(max_steps=8, every_steps=4, job="lm-text", program=PROGRAM)
        return Trainer(made.model_copy(update={"program_params": given}))

    first = trainer()
    first.restore_or_init()
    first.train_until_checkpoint()
    first.job.checkpoints.wait()
    first.close()
    digest, steps_dir = first.program.data_fingerprint(), first.job.checkpoints.directory
    assert read_meta_file(steps_dir, 4)["data_fingerprint"] == digest
    original = (text / "doc05.txt").read_text()
    (text / "doc05.txt").write_text("an edited paragraph. " * 40)
    second = trainer()
    with pytest.raises(DataChangedError) as refused:
        second.restore_or_init()
    second.close()
    now = second.program.data_fingerprint()
    assert str(refused.value).startswith(
        f"job 'lm-text' was trained to step 4 on other data than the program reads now (its "
        f"data_fingerprint() was '{digest}', now '{now}'): the restored input position would "
        "index other records"
    ), refused.value
    assert "nothing was restored or trained" in str(refused.value)
    # The command refuses it before its flow run, in one line.
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "XLA_FLAGS")}
    args = ["run", "--program", PROGRAM, "--job", "lm-text", "--storage", str(tmp_path / "storage")]
    args += ["--max-steps", "8", "--checkpoint-every-steps", "4", "--no-progress"]
    args += ["--mlflow-tracking-uri", mlflow_uri, "--program-params", json.dumps(given)]
    proc = subprocess.run(
        [sys.executable, "-m", "prefect_jax.cli", *args],
        capture_output=True,
        text=True,
        env={**env, "PREFECT_API_URL": prefect_server},
        timeout=600,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    # One line of ours; CI once printed another line beside it (not kept: the message shows it).
    said = [line for line in proc.stderr.splitlines() if line.startswith("prefect-jax run:")]
    assert len(said) == 1, proc.stderr[-3000:]
    assert said[0].startswith(
        "prefect-jax run: error: job 'lm-text' was trained to step 4 on other"
    ), proc.stderr[-3000:]
    assert committed_steps(steps_dir) == [4]
    # Its own text again (written anew: another modification time, built again): it resumes.
    (text / "doc05.txt").write_text(original)
    third = trainer()
    assert third.restore_or_init() == 4
    third.close()


@pytest.mark.slow
def test_a_step_saved_before_source_existed_resumes_on_the_folder_the_environment_names(
    tmp_path, monkeypatch
):
    """Its program read ``$PREFECT_JAX_BYTELM_SOURCE`` too: the variable's folder is the
    field's default, so that step compares equal to it, and to no other folder."""
    from prefect_jax.training.program import load_program_with_params
    from prefect_jax.training.program_params import (
        META_KEY,
        ProgramParamsMismatchError,
        check_restore,
    )

    monkeypatch.setenv(corpus.SOURCE_ENV, str(tmp_path))
    _, params = load_program_with_params(PROGRAM, {"preset": "tiny"}, 8)
    assert params.values["source"] == str(tmp_path)
    saved = params.as_meta()
    del saved["values"]["source"], saved["defaults"]["source"]
    check_restore({META_KEY: saved}, params, "lm", 4)
    for other in (str(tmp_path / "b"), None):
        _, given = load_program_with_params(PROGRAM, {"preset": "tiny", "source": other}, 8)
        with pytest.raises(ProgramParamsMismatchError, match=r"source: saved '<unset>', given"):
            check_restore({META_KEY: saved}, given, "lm", 4)


def test_cli_params_reach_the_model_mlflow_checkpoints_and_status(
    tmp_path, prefect_server, mlflow_uri
):
    import json
    import subprocess
    import sys

    from mlflow.tracking import MlflowClient

    from prefect_jax.training.checkpoint_dirs import committed_steps, read_meta_file

    storage = str(tmp_path / "s")

    def cli(*args, **extra_env):
        env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "XLA_FLAGS")}
        env.update(PREFECT_API_URL=prefect_server, **extra_env)
        env.pop("PREFECT_JAX_BYTELM_PRESET", None)
        return subprocess.run(
            [sys.executable, "-m", "prefect_jax.cli", *args],
            capture_output=True,
            text=True,
            env=env,
            timeout=600,
        )

    run = ["run", "--program", PROGRAM, "--job", "lm", "--storage", storage]
    run += ["--checkpoint-every-steps", "4", "--exporters", "--eval-steps", "1"]
    run += ["--mlflow-tracking-uri", mlflow_uri, "--json", "--no-progress"]
    params = ["--program-params", '{"preset": "tiny", "n_layers": 1}']
    params += ["--program-param", "d_model=24", "--program-param", "positions=learned"]
    proc = cli(*run, "--max-steps", "4", *params)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    logged = MlflowClient(mlflow_uri).get_run(summary["mlflow_run_id"]).data.params
    assert logged["program.d_model"] == "24" and logged["program.positions"] == "learned"
    assert logged["program.preset"] == "tiny" and logged["program.max_steps"] == "4"
    assert logged["program_config.d_model"] == "24"  # the model was built with it
    assert logged["program_config.n_layers"] == "1" and logged["program_config.decay_steps"] == "4"
    meta = read_meta_file(summary["checkpoint_dir"], 4)["program_params"]
    assert meta["type"] == "ByteLMParams" and meta["values"]["d_model"] == 24
    assert meta["filled"] == ["max_steps"]

    # Other params on the same job: refused before anything runs, the checkpoint kept.
    proc = cli(*run, "--max-steps", "8", *params[:2], "--program-param", "d_model=16")
    assert proc.returncode == 2
    assert "d_model: saved 24, given 16" in proc.stderr and "positions: saved 'learned'" in (
        proc.stderr
    )
    assert "new job name" in proc.stderr
    assert committed_steps(summary["checkpoint_dir"]) == [4]
    proc = cli(*run, "--max-steps", "8", *params, "--seed", "7")  # another data order
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "prefect-jax run: error: job 'lm' was trained to step 4 with seed 0, given 7: "
        "train_data(seed) orders its data by it, so the resume would read other data than the "
        "run it continues; nothing was restored or trained. Resume it with --seed 0 "
        "(TrainSpec(seed=0)), or train seed 7 under a new job name"
    ], proc.stderr[-3000:]

    # The job's rerun on another mesh or device count, or on a corpus folder that is empty:
    # refused before its flow run, in one line; a batch the new mesh cannot split names the mesh
    # the job trained on (the step recorded it).
    assert read_meta_file(summary["checkpoint_dir"], 4)["mesh"] == {"data": 1}
    proc = cli(*run, "--max-steps", "8", *params, "--program-param", 'mesh={"data": 3}')
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "prefect-jax run: error: the program's mesh_axes={'data': 3} multiply to 3, not the 1 "
        "devices; give sizes whose product is 1 (the devices), with at most one -1 for the "
        'rest. The program param mesh={"data": 3} set it: --program-param mesh=... in a '
        "command, program_params['mesh'] in a flow; left out, the program's default"
    ]
    proc = cli(*run, "--max-steps", "8", *params, XLA_FLAGS=f"{DEVICES_FLAG}=3")
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "prefect-jax run: error: a train batch leaf 'tokens' of shape (8, 33) cannot be split "
        "into 3 parts along dimension 0 (mesh axes ('data',) of {'data': 3}): the job trained "
        "on the mesh {'data': 1}: give it a mesh whose axes divide its batch (the program's "
        "mesh, the number of devices), or start a new job"
    ]
    # Other text (the job trained on the standard library): its folder is a param, compared.
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "a.py").write_text("x = 1\n" * 1000)
    proc = cli(*run, "--max-steps", "8", *params, PREFECT_JAX_BYTELM_SOURCE=str(tmp_path / "other"))
    assert proc.returncode == 2, proc.stderr[-3000:]
    (said,) = proc.stderr.strip().splitlines()  # one line: no flow run, no traceback
    assert said.startswith("prefect-jax run: error: job 'lm' was trained to step 4 with other ")
    assert "source" in said and str(tmp_path / "other") in said
    # A new job on an empty folder: one line too, and nothing of it written.
    (tmp_path / "empty").mkdir()
    new_job = [*run[:4], "lm-empty", *run[5:]]
    proc = cli(
        *new_job, "--max-steps", "8", *params, PREFECT_JAX_BYTELM_SOURCE=str(tmp_path / "empty")
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    (said,) = proc.stderr.strip().splitlines()
    assert said.startswith(f"prefect-jax run: error: no .py files under '{tmp_path / 'empty'}'")
    assert json.loads(proc.stdout.strip().splitlines()[-1])["exit_code"] == 2
    assert not os.path.exists(os.path.join(storage, "lm-empty"))
    assert committed_steps(summary["checkpoint_dir"]) == [4]
    # cuDNN's attention on a machine without a GPU: one line before the run, not the first step.
    cudnn = ["--program-param", "attention=cudnn", "--program-param", "compute_dtype=bfloat16"]
    proc = cli(*[*run[:4], "lm-cudnn", *run[5:]], "--max-steps", "8", *params, *cudnn)
    assert proc.returncode == 2, proc.stderr[-3000:]
    (said,) = proc.stderr.strip().splitlines()
    assert said.startswith("prefect-jax run: error: attention='cudnn' runs on NVIDIA GPUs only")
    assert not os.path.exists(os.path.join(storage, "lm-cudnn"))

    proc = cli("status", "--job", "lm", "--storage", storage, "--json")
    status = json.loads(proc.stdout.strip().splitlines()[-1])
    assert status["program_params"]["d_model"] == 24
    assert (
        status["data_fingerprint"].startswith("400 files, ")
        and " digest " in (status["data_fingerprint"])
    )
    text = cli("status", "--job", "lm", "--storage", storage).stdout
    assert 'program params (newest step): preset="tiny"' in text and "d_model=24" in text
