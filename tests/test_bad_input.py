"""Bad input on the command line and to the engine: one clear error line naming the value and
the fix, a non-zero exit, no Prefect flow run failing with a traceback first, nothing saved lost."""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import subprocess

import pytest
from conftest import train_to_end
from process_helpers import run_cli as run_to_end

TINY = "prefect_jax.examples.digits:tiny"
# (refusals come before any work: a command still going after 300 s is a failure here)
run_cli = functools.partial(run_to_end, timeout=300)


def _one_error_line(proc: subprocess.CompletedProcess, command: str) -> str:
    """The command's stderr is exactly one line, its error (no traceback, no flow-run logs)."""
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith(f"prefect-jax {command}: error: "), lines[0]
    return lines[0]


def _tree_digest(root) -> dict[str, str]:
    """Every file under `root` with the hash of its bytes."""
    out = {}
    for folder, _, files in os.walk(root):
        for name in files:
            path = os.path.join(folder, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, root)] = hashlib.sha256(f.read()).hexdigest()
    return out


@pytest.fixture(scope="module")
def trained(tmp_path_factory, mlflow_uri):
    """A job with steps 20 and 40 committed, evaluated and exported (shared by this module)."""
    from prefect_jax.training.specs import (
        CheckpointSpec,
        EvalSpec,
        FinalExporter,
        JobConfig,
        TrainSpec,
    )
    from prefect_jax.training.trainer import Trainer

    storage = tmp_path_factory.mktemp("bad-input") / "storage"
    config = JobConfig(
        program=TINY,
        job="j",
        storage=str(storage),
        train=TrainSpec(max_steps=40, log_every_steps=10),
        checkpoint=CheckpointSpec(every_steps=20),
        eval=EvalSpec(exporters=[FinalExporter()]),
        mlflow_tracking_uri=mlflow_uri,
    )
    trainer = Trainer(config)
    trainer.restore_or_init()
    train_to_end(trainer)
    trainer.finish()
    trainer.close()
    return config, storage


def test_max_steps_below_the_committed_step_is_refused_by_the_cli_and_the_engine(
    trained, mlflow_uri
):
    from prefect_jax.training.errors import PastMaxStepsError
    from prefect_jax.training.trainer import Trainer

    config, storage = trained
    before = _tree_digest(storage)
    proc = run_cli(
        "run",
        "--program",
        TINY,
        "--job",
        "j",
        "--storage",
        str(storage),
        "--max-steps",
        "30",
        "--mlflow-tracking-uri",
        mlflow_uri,
        "--json",
    )
    assert proc.returncode == 2
    line = _one_error_line(proc, "run")
    assert (
        "max_steps=30 is below step 40" in line and "--max-steps" in line and "above 40" in line
    ), line
    # no summary claiming a final step above max_steps: the error, as --json gives one
    error = line[len("prefect-jax run: error: ") :]
    assert json.loads(proc.stdout) == {"error": error, "exit_code": 2}

    # A deployment's run does not come through the CLI: the engine refuses it too, before the lease.
    trainer = Trainer(
        config.model_copy(update={"train": config.train.model_copy(update={"max_steps": 30})})
    )
    try:
        with pytest.raises(PastMaxStepsError, match="max_steps=30 is below step 40"):
            trainer.restore_or_init()
    finally:
        trainer.close()
    assert (
        _tree_digest(storage) == before
    )  # nothing saved lost, nothing written (no lease, no attempt)
    # The evaluator is not refused for it: it follows its trainer's (`following_the_trainer`).
    from prefect_jax.training.facade import preflight

    preflight(TINY, "j", str(storage), 30, train_spec=None, tracking_uri=mlflow_uri)
    with pytest.raises(PastMaxStepsError):
        preflight(TINY, "j", str(storage), 30, train_spec=config.train, tracking_uri=mlflow_uri)
    # Another program's job (a job name reused) is said as such first: a max_steps above 40
    # would only have met that refusal (the platform probe's deployment run).
    from prefect_jax.training.program_params import ProgramParamsMismatchError

    lm, lm_params = "prefect_jax.examples.bytelm:program", {"preset": "tiny"}
    with pytest.raises(ProgramParamsMismatchError, match="by a program with no program params"):
        preflight(
            lm, "j", str(storage), 30, program_params=lm_params, train_spec=config.train,
            tracking_uri=mlflow_uri,
        )  # fmt: skip
    other = config.model_copy(
        update={
            "program": lm,
            "program_params": lm_params,
            "train": config.train.model_copy(update={"max_steps": 30}),
        }
    )
    trainer = Trainer(other)
    try:
        with pytest.raises(ProgramParamsMismatchError, match="by a program with no program params"):
            trainer.restore_or_init()
    finally:
        trainer.close()
    assert _tree_digest(storage) == before


def test_a_warm_start_past_max_steps_is_refused_and_a_relative_checkpoint_path_warm_starts(
    trained, mlflow_uri, tmp_path
):
    """The TF porter's warm start from step 40 with max_steps 30 trained nothing and exited 0
    (`status` then showed the other job's step evaluated as this one's); a warm start keeps its
    step, so it is refused, by the command and the engine, saying so. And their relative
    --checkpoint-path failed in Orbax ("should be absolute"), the error blaming the machine."""
    from prefect_jax.training.errors import PastMaxStepsError
    from prefect_jax.training.trainer import Trainer

    config, storage = trained
    step = str(storage / "j" / "checkpoints" / "40")
    new = tmp_path / "s"
    args = ["--program", TINY, "--job", "warm", "--storage", str(new), "--max-steps", "30"]
    proc = run_cli("run", *args, "--checkpoint-path", step, "--mlflow-tracking-uri", mlflow_uri)
    assert proc.returncode == 2
    line = _one_error_line(proc, "run")
    assert f"max_steps=30 is below step 40 of the warm start's checkpoint_path {step}" in line
    assert "a warm start keeps its step" in line and "(70 for 30 steps from it)" in line, line
    assert not (new / "warm").exists()

    def warm(max_steps: int) -> Trainer:
        return Trainer(
            config.model_copy(
                update={
                    "job": "warm",
                    "storage": str(new),
                    "train": config.train.model_copy(update={"max_steps": max_steps}),
                }
            )
        )

    trainer = warm(30)  # a deployment's run: no command before it
    try:
        with pytest.raises(PastMaxStepsError, match="below step 40 of the warm start's"):
            trainer.restore_or_init(checkpoint_path=step)
    finally:
        trainer.close()
    assert not (new / "warm" / "attempts.json").exists()  # (refused before the lease)
    trainer = warm(60)
    try:
        assert trainer.restore_or_init(checkpoint_path=os.path.relpath(step)) == 40
    finally:
        trainer.close()
    # The command gives its flow run the path made absolute (a Retry from elsewhere reads it).
    from prefect_jax.cli.commands import _absolute

    assert (_absolute(os.path.relpath(step)), _absolute("s3://b/j/checkpoints/4")) == (
        step,
        "s3://b/j/checkpoints/4",
    )


@pytest.mark.parametrize("command", ["run", "evaluate", "export"])
def test_another_program_than_the_job_s_is_named_as_such_before_any_flow_runs(
    trained, mlflow_uri, command
):
    """The byte LM given for a digits job: one line that says it is another program (it listed
    every one of the byte LM's fields as '<unset>' when saved), from `export` too (whose
    preflight did not read the job's steps: its flow run failed with a traceback first)."""
    _, storage = trained
    before = _tree_digest(storage)
    proc = run_cli(
        command,
        *("--program", "prefect_jax.examples.bytelm:program", "--program-param", "preset=tiny"),
        *("--job", "j", "--storage", str(storage), "--mlflow-tracking-uri", mlflow_uri),
    )
    assert proc.returncode == 2
    line = _one_error_line(proc, command)
    assert (
        "job 'j' was trained to step 40 by a program with no program params, and the program "
        "given takes program params ByteLMParams (" in line
    ), line
    assert "it is not the program the job was trained with (--program)" in line, line
    assert "'<unset>'" not in line, line
    assert _tree_digest(storage) == before


def _read_only(path) -> tuple[str, ...]:
    """Make `path` read-only for the command; returns the prefix that runs it without root's
    override of file permissions (as root, DAC_OVERRIDE would let it write anyway)."""
    for folder, _, files in os.walk(path):
        for name in files:
            os.chmod(os.path.join(folder, name), 0o444)
        os.chmod(folder, 0o555)
    if os.geteuid() != 0:
        return ()
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.fail(
            "running as root needs setpriv (util-linux) to drop CAP_DAC_OVERRIDE for this test"
        )
    caps = "-dac_override,-dac_read_search,-fowner"
    return (setpriv, f"--bounding-set={caps}", f"--inh-caps={caps}")


@pytest.mark.parametrize("command", ["run", "evaluate"])
def test_read_only_storage_is_one_clear_error_and_nothing_changes(
    trained, tmp_path, mlflow_uri, command
):
    _, storage = trained
    copy = tmp_path / "read-only"
    shutil.copytree(storage, copy)
    prefix = _read_only(copy)
    before = _tree_digest(copy)
    try:
        proc = run_cli(
            command,
            "--program",
            TINY,
            "--job",
            "j",
            "--storage",
            str(copy),
            "--max-steps",
            "60",
            "--mlflow-tracking-uri",
            mlflow_uri,
            "--no-progress",
            prefix=prefix,
        )
        assert proc.returncode == 1, proc.stderr[-3000:]
        line = _one_error_line(proc, command)
        assert (
            f"storage {copy} is not writable" in line
            and "PermissionError" in line
            and "--storage" in line
        ), line
        assert _tree_digest(copy) == before
    finally:
        for folder, _, _ in os.walk(copy):
            os.chmod(folder, 0o755)


@pytest.mark.parametrize(
    ("program", "expected"),
    [
        ("prefect_jax.examples.digitz:tiny", "cannot import module 'prefect_jax.examples.digitz'"),
        ("prefect_jax.examples.digits:tinyy", "has no attribute 'tinyy'"),
        ("prefect_jax.examples.digits", "is not of the form 'package.module:attribute'"),
        (
            "prefect_jax/examples/digits.py:tiny",
            "(a module by its dotted name: prefect_jax.examples.digits:tiny?)",
        ),
    ],
)
def test_a_bad_program_is_one_clear_line_before_any_flow_runs(tmp_path, program, expected):
    proc = run_cli("run", "--program", program, "--job", "j", "--storage", str(tmp_path / "s"))
    assert proc.returncode == 2
    assert expected in _one_error_line(proc, "run")
    assert not (tmp_path / "s").exists()


@pytest.mark.parametrize("command", ["run", "train"])
def test_a_new_jobs_serve_that_cannot_be_exported_is_one_clear_line_before_any_flow_runs(
    tmp_path, command
):
    """The wall of issue 52, an int() on serve's symbolic batch: the trainer refuses it as it
    starts, inside a failed flow run; a new job's command refuses it in its preflight, in one
    line, before its compile begins and before anything of the job is written (a trainer alone
    too: its evaluator would export)."""
    here = os.path.dirname(__file__)
    storage = tmp_path / "s"
    program = "programs:int_on_symbolic_dim"
    run = (command, "--program", program, "--job", "j", "--storage", str(storage))
    proc = run_cli(*run, PYTHONPATH=os.pathsep.join([here, os.getcwd()]))
    assert proc.returncode == 2
    said = _one_error_line(proc, command)
    assert f"program {program!r}: serve(state, inputs) does not trace on serving_input()" in said
    assert "Fix serve (a symbolic dimension has no int() value" in said
    assert not storage.exists()


def test_an_eval_step_of_means_is_refused_before_training_and_never_retried(tmp_path):
    """An eval_step returning means (not (sum, count) pairs) was refused only at the first
    evaluation, a checkpoint interval in, and retried: the command's preflight traces it (to
    check --best-metric) and refuses it in one line, before anything is written (found by an
    evaluation alone: tests/test_retries.py)."""
    here = os.path.dirname(__file__)
    storage = tmp_path / "s"
    run = ("run", "--program", "programs:mean_eval", "--job", "j", "--storage", str(storage))
    proc = run_cli(*run, PYTHONPATH=os.pathsep.join([here, os.getcwd()]))
    assert proc.returncode == 2
    said = _one_error_line(proc, "run")
    assert "eval_step returned 'accuracy'=ShapeDtypeStruct(shape=(), dtype=float32)" in said
    assert "each metric must be a (sum, count) pair" in said
    assert not storage.exists()


@pytest.mark.parametrize(
    ("task_type", "expected"),
    [
        ("local", "TF_CONFIG: task type 'local' is not a cluster task"),
        ("gpu", "TF_CONFIG: task type 'gpu' is not supported; supported task types are ['chief'"),
    ],
)
def test_a_tf_config_task_type_tf_refuses_is_one_clear_line_and_nothing_is_written(
    tmp_path, monkeypatch, task_type, expected
):
    """TF's train_and_evaluate raises for task type `local` and for a type it has no run_<type>
    for, naming the supported ones; a job ported with its TF_CONFIG is refused the same way."""
    tf_config = {"cluster": {"worker": ["w0:2222", "w1:2222"]}, "task": {"type": task_type}}
    monkeypatch.setenv("TF_CONFIG", json.dumps(tf_config))
    proc = run_cli("run", "--program", TINY, "--job", "j", "--storage", str(tmp_path / "s"))
    assert proc.returncode == 2
    assert expected in _one_error_line(proc, "run")
    assert not (tmp_path / "s").exists()


def test_status_of_a_job_that_does_not_exist_names_the_jobs_there(trained, tmp_path):
    _, storage = trained
    proc = run_cli("status", "--job", "jj", "--storage", str(storage))
    assert proc.returncode == 2
    line = _one_error_line(proc, "status")
    assert f"no job 'jj' in storage {storage} (jobs there: j)" in line and "--job" in line, line
    nowhere = run_cli("status", "--job", "j", "--storage", str(tmp_path / "nowhere"))
    assert nowhere.returncode == 2 and "(no job there at all)" in _one_error_line(nowhere, "status")
    # A file where the storage's folder would be: that file is named, not "no job there".
    a_file = tmp_path / "a-file"
    a_file.write_text("not storage")
    for under, job in ((a_file, "j"), (a_file / "sub", "j"), (tmp_path, "a-file")):
        proc = run_cli("status", "--job", job, "--storage", str(under), "--json")
        line = _one_error_line(proc, "status")
        assert proc.returncode == 2 and f"{a_file} is a file, not a folder" in line, line
        assert "--storage" in line and "Traceback" not in proc.stderr, proc.stderr
    assert run_cli("status", "--job", "j", "--storage", str(storage)).returncode == 0


def test_an_export_with_nothing_to_export_is_one_line_before_any_flow_runs(trained, mlflow_uri):
    """`export --step` of a step with no evaluation, and an export of a job that is not there,
    are refused by the command in one line (not a failed flow run with Prefect's traceback in
    front): naming the steps there are, or the jobs; nothing is written, no job folder made."""
    _, storage = trained
    before = _tree_digest(storage)
    export = ("export", "--program", TINY, "--storage", str(storage), "--max-steps", "40")
    flags = ("--mlflow-tracking-uri", mlflow_uri)
    proc = run_cli(*export, "--job", "j", "--step", "30", *flags)
    line = _one_error_line(proc, "export")
    assert proc.returncode == 2 and "step 30 of job 'j' is not committed" in line, line
    assert "committed: [20, 40]" in line and "--wait-for-checkpoint" in line, line
    proc = run_cli(*export, "--job", "jj", *flags)
    line = _one_error_line(proc, "export")
    assert proc.returncode == 2 and "job 'jj' has no committed checkpoint" in line, line
    assert f"storage {storage} has no job 'jj'; jobs there: j" in line, line
    assert sorted(os.listdir(storage)) == [".j.lease.lock", "j"]  # (nothing of "jj")
    proc = run_cli(*export, "--job", "j", "--eval-name", "evl", *flags)  # (a probe's finding)
    line = _one_error_line(proc, "export")
    assert proc.returncode == 2 and "has no evaluated step yet (eval name 'evl')" in line, line
    assert line.endswith(
        "give the eval name of its evaluations (eval: --eval-name, a flow's eval_spec.name)"
    ), line
    assert _tree_digest(storage) == before


def test_an_evaluated_step_that_cannot_be_exported_is_one_line_before_any_flow_runs(
    trained, mlflow_uri, tmp_path
):
    """An evaluated step whose checkpoint retention removed, or whose eval record is damaged, is
    refused by the command in one line too (the flow refused both after its start)."""
    _, storage = trained
    copy = tmp_path / "storage"
    shutil.copytree(storage, copy)
    shutil.rmtree(copy / "j" / "checkpoints" / "20")
    (copy / "j" / "evals" / "eval" / "40.json").write_text('{"step": 4')
    before = _tree_digest(copy)
    export = ("export", "--program", TINY, "--job", "j", "--storage", str(copy))
    flags = ("--max-steps", "40", "--mlflow-tracking-uri", mlflow_uri)
    proc = run_cli(*export, "--step", "20", *flags)
    line = _one_error_line(proc, "export")
    assert proc.returncode == 2 and "step 20 of job 'j' was evaluated, but its checkpoint" in line
    proc = run_cli(*export, *flags)  # (the newest evaluated step: 40)
    warning, line = proc.stderr.strip().splitlines()  # (the records' warning, then the refusal)
    assert "40.json is damaged" in warning and line.startswith("prefect-jax export: error: ")
    assert proc.returncode == 2 and "step 40 of job 'j': its evaluation record" in line, line
    assert "cannot be read (damaged" in line and "another evaluated step ([20])" in line, line
    assert _tree_digest(copy) == before


def test_an_evaluator_of_a_job_that_is_not_there_names_the_jobs_there_and_makes_none(
    trained, mlflow_uri
):
    """An evaluator may start before its trainer, so it waits for the first checkpoint; where
    none came and the job has no folder at all, its last line names the jobs there (a mistyped
    --job), without a traceback, and it leaves no empty job folder for `status` to list."""
    _, storage = trained
    proc = run_cli(
        "evaluate",
        *("--program", TINY, "--job", "jj", "--storage", str(storage), "--max-steps", "40"),
        *("--once", "--wait-for-first-checkpoint-secs", "1", "--mlflow-tracking-uri", mlflow_uri),
    )
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 1 and last.startswith("prefect-jax evaluate: error: "), last
    assert "no committed checkpoint of job 'jj'" in last, last
    assert f"(storage {storage} has no job 'jj'; jobs there: j)" in last, last
    assert "--wait-for-first-checkpoint-secs" in last and "Traceback" not in proc.stderr
    assert sorted(os.listdir(storage)) == [".j.lease.lock", "j"]  # (nothing of "jj")


def test_these_refusals_are_not_retried():
    """A flow's task retries transient errors only: these need the user, not a retry (an eval
    hook's failure in a train task: its step is recorded, a retry would not call it again)."""
    from prefect_jax.training.errors import (
        EvalHookError,
        PastMaxStepsError,
        StorageNotWritableError,
        is_transient,
    )

    assert not is_transient(EvalHookError("Hook.after_eval", 20, KeyError("x")))

    assert not is_transient(
        StorageNotWritableError("/data", PermissionError(13, "Permission denied"))
    )
    assert not is_transient(PastMaxStepsError("/data/j", 40, 30))
    assert is_transient(PermissionError(13, "Permission denied"))  # unchanged for other I/O


def test_out_of_memory_is_not_transient_however_wrapped_and_a_rate_limit_is():
    from prefect_jax.training.errors import RestoreFailedError, is_transient

    oom = RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1.13GiB")
    assert not is_transient(oom) and not is_transient(MemoryError())
    wrapped = OSError("restore failed")
    wrapped.__cause__ = oom
    assert not is_transient(wrapped)
    assert not is_transient(RestoreFailedError("/data/j/checkpoints/20", oom, "the run's"))
    tpu = RuntimeError("RESOURCE_EXHAUSTED: Ran out of memory in memory space hbm. Used 17G")
    assert not is_transient(tpu)
    # a storage's RESOURCE_EXHAUSTED is a rate limit: retried, whatever its path says
    assert is_transient(RuntimeError("RESOURCE_EXHAUSTED: HTTP 429 for gs://b/memory-exp/7"))


@pytest.mark.parametrize("value", ["soon", "inf"])
def test_a_bad_ui_refresh_setting_is_one_clear_line_before_any_flow_runs(
    tmp_path, monkeypatch, value
):
    monkeypatch.setenv("PREFECT_JAX_UI_REFRESH_SECS", value)
    proc = run_cli("run", "--program", TINY, "--job", "j", "--storage", str(tmp_path / "s"))
    assert proc.returncode == 2
    line = _one_error_line(proc, "run")
    assert f"PREFECT_JAX_UI_REFRESH_SECS={value!r}" in line and "set it to e.g. 2" in line, line
    assert not (tmp_path / "s").exists()


@pytest.mark.parametrize("where", ["no-parent", "file-in-the-way"])
def test_a_storage_root_that_cannot_be_made_names_the_flag_the_value_and_the_fix(tmp_path, where):
    if where == "no-parent":
        storage = "/proc/nope"
    else:
        (tmp_path / "a-file").write_text("")
        storage = str(tmp_path / "a-file" / "s")
    proc = run_cli("run", "--program", TINY, "--job", "j", "--storage", storage)
    assert proc.returncode == 2
    line = _one_error_line(proc, "run")
    assert f"--storage {storage}" in line and "give --storage a directory" in line, line
    assert not os.path.exists(storage)


def test_an_unknown_storage_protocol_names_the_flag_and_the_fix(tmp_path):
    proc = run_cli("run", "--program", TINY, "--job", "j", "--storage", "nosuchproto://b/p")
    assert proc.returncode == 2
    line = _one_error_line(proc, "run")
    assert "--storage nosuchproto://b/p" in line and "knows no protocol 'nosuchproto'" in line
    assert "spelling" in line, line


def test_a_storage_url_whose_colon_slash_slash_is_mistyped_is_refused_not_trained_locally(
    tmp_path,
):
    """``s3//bucket/prefix`` was a local folder ``s3`` under the working directory: a deployment's
    run trained into the worker's git checkout with no word said (a walkthrough's finding)."""
    from prefect_jax.training.storage import normalize_root

    in_tmp = ("env", f"--chdir={tmp_path}")
    proc = run_cli("run", "--program", TINY, "--job", "j", "--storage", "s3//b/p", prefix=in_tmp)
    assert proc.returncode == 2
    line = _one_error_line(proc, "run")
    assert "storage 's3//b/p' is a local path, not a s3:// URL" in line, line
    assert "did you mean 's3://b/p'?" in line and "give './s3//b/p'" in line, line
    assert os.listdir(tmp_path) == []
    for typo in ("gs:/bucket/p", "S3:bucket"):
        with pytest.raises(ValueError, match="is a local path, not a"):
            normalize_root(typo)
    for local in ("./s3//bucket", "runs:2026/x", "checkpoints", "data//runs", "local:runs"):
        assert normalize_root(local) == os.path.abspath(local)


def test_a_trainer_made_from_python_names_an_unknown_storage_protocol_and_the_fix(job_config):
    """The Python API does not come through the command's checks: the trainer's own check of its
    storage gives the same line, not fsspec's ``Protocol not known`` traceback."""
    from prefect_jax.training.remote_errors import RemoteConfigError
    from prefect_jax.training.trainer import Trainer

    config = job_config(max_steps=10).model_copy(update={"storage": "nosuchproto://b/p"})
    with pytest.raises(RemoteConfigError, match="knows no protocol 'nosuchproto'.*spelling") as e:
        Trainer(config)
    assert str(e.value).startswith("storage nosuchproto://b/p: "), e.value  # (no CLI flag here)


def test_a_storage_folder_named_with_brackets_is_refused_before_anything_is_written(tmp_path):
    """Orbax would save steps there that do not restore (docs/upstream.md 6)."""
    storage = str(tmp_path / "runs[1]")
    proc = run_cli("run", "--program", TINY, "--job", "j", "--storage", storage)
    assert proc.returncode == 2
    line = _one_error_line(proc, "run")
    assert repr(storage) in line and "without '[' and ']'" in line, line
    assert not os.path.exists(storage)
    from prefect_jax.training.storage import JobStorage

    assert JobStorage(str(tmp_path / "runs[1"), "j").orbax_native  # (a pattern of itself: fine)
    assert JobStorage("s3://bucket/runs[1]", "j").protocol == "s3"  # (staged: not Orbax's glob)


def test_several_processes_on_storage_orbax_does_not_write_are_refused_before_they_start():
    """Each process would fail in its flow run, and JAX's distributed service abort the others
    with a stack trace: one line instead, before any process or server starts."""
    proc = run_cli(
        "run", "--program", TINY, "--job", "j", "--storage", "s3://bucket/jobs", "--processes", "2"
    )
    assert proc.returncode == 2
    line = _one_error_line(proc, "run")
    assert "'s3://bucket/jobs': 2 JAX processes write one checkpoint together" in line, line
    assert "a shared file system" in line and "or train this job in one process" in line, line


def test_a_checkpoint_path_that_is_no_committed_step_is_refused_before_the_job_starts(
    trained, tmp_path, mlflow_uri
):
    _, storage = trained
    steps = storage / "j" / "checkpoints"
    newest = f"the step to start from, e.g. the newest, '{steps}/40'"
    for path, expected in [
        (tmp_path / "nowhere", "does not exist"),
        (steps / "20" / "state", "is not a committed checkpoint step directory"),
        (steps, f"is a directory of checkpoint steps ([20, 40]), not one step: give {newest}"),
        (storage / "j", "is a directory of checkpoint steps ([20, 40])"),  # (a job: TF's model_dir)
    ]:
        proc = run_cli(
            "run",
            "--program",
            TINY,
            "--job",
            "k",
            "--storage",
            str(tmp_path / "s"),
            "--checkpoint-path",
            str(path),
            "--mlflow-tracking-uri",
            mlflow_uri,
        )
        assert proc.returncode == 2
        line = _one_error_line(proc, "run")
        assert f"--checkpoint-path {str(path)!r} {expected}" in line, line
        assert "'<storage>/<job>/checkpoints/<step>'" in line or newest in line, line
        assert not (tmp_path / "s").exists()  # no job directory made


@pytest.mark.parametrize("command", ["run", "evaluate"])
def test_a_best_metric_the_eval_does_not_produce_is_refused_naming_those_it_does(
    tmp_path, mlflow_uri, command
):
    proc = run_cli(
        command,
        "--program",
        TINY,
        "--job",
        "j",
        "--storage",
        str(tmp_path / "s"),
        "--best-metric",
        "acc",
        "--mlflow-tracking-uri",
        mlflow_uri,
    )
    assert proc.returncode == 2
    line = _one_error_line(proc, command)
    assert "--best-metric (exporter 'best') 'acc' is not a metric" in line, line
    assert "['accuracy', 'loss']; set it to one of those" in line, line
    assert not (tmp_path / "s").exists()


def test_a_best_metric_from_python_is_refused_as_a_new_job_restores(job_config):
    """No command's preflight ran (a flow, a deployment's run, the engine called from Python):
    a new job's restore refuses it before any step and before its lease, not at the first
    evaluation an interval in."""
    from prefect_jax.training import BestExporter, Trainer
    from prefect_jax.training.preflight import BadInputError

    config = job_config(exporters=[BestExporter(metric="acc")])
    trainer = Trainer(config)
    with pytest.raises(BadInputError) as refused:
        trainer.restore_or_init()
    trainer.close()
    assert str(refused.value) == (
        "BestExporter 'best' metric 'acc' is not a metric the evaluation produces (its eval_step "
        "and derive_metrics): it produces ['accuracy', 'loss']; set it to one of those"
    )
    # Keras's name for it (MLflow's too): the name eval_step returns is said
    keras = Trainer(job_config(job="keras", exporters=[BestExporter(metric="val_accuracy")]))
    with pytest.raises(BadInputError, match=r"one of those \('accuracy': the names eval_step"):
        keras.restore_or_init()
    keras.close()
    job_dir = os.path.join(config.storage, config.job)
    assert not os.path.exists(os.path.join(job_dir, "attempts.json"))  # no rerun budget spent
    checkpoints = os.path.join(job_dir, "checkpoints")
    assert not os.path.exists(checkpoints) or os.listdir(checkpoints) == []  # no step trained


def test_a_best_metric_is_checked_where_the_role_evaluates_and_a_preflight_did_not(job_config):
    """A train-only role leaves the eval metrics to its evaluator (as `prefect-jax train` does),
    in its retries' restores too; an evaluate flow's recover checks them before it restores a
    step; a `facade.preflight` given no eval spec checked none, so its head start's trainer
    does."""
    from prefect_jax.training import BestExporter, Trainer
    from prefect_jax.training.facade import preflight
    from prefect_jax.training.preflight import BadInputError

    config = job_config(max_steps=20, exporters=[BestExporter(metric="acc")])
    trainer = Trainer(config)
    assert trainer.restore_or_init(evaluates=False) == 0  # the train role: not its to refuse
    trainer.forget_live_state()  # (a failed interval: its task's retry restores again)
    assert trainer.restore_or_init() == 0
    trainer.train_until_checkpoint()
    trainer.finish()
    trainer.close()
    evaluator = Trainer(config)
    assert evaluator.recover() == (True, 20)  # (an export's recover: not its to check)
    evaluator.close()
    evaluator = Trainer(config)
    with pytest.raises(BadInputError, match="^BestExporter 'best' metric 'acc' is not a metric"):
        evaluator.recover(evaluates=True)
    assert evaluator.state is None  # refused before the step was restored
    evaluator.close()

    fresh = config.model_copy(update={"job": "fresh"})
    from prefect_jax.training import head_start

    preflight(fresh.program, fresh.job, fresh.storage, 20, train_spec=fresh.train)
    begun = head_start._begun
    trainer = Trainer(fresh)
    assert begun is not None and trainer.loop is begun.loop  # (it adopted the head start)
    with pytest.raises(BadInputError, match="^BestExporter 'best' metric 'acc' is not a metric"):
        trainer.restore_or_init()
    trainer.close()


def test_evaluate_with_max_steps_below_the_committed_step_follows_its_trainer(trained, mlflow_uri):
    """It was refused as a trainer is ("nothing to train"); it now follows the max_steps its
    trainer recorded and finds the final step evaluated."""
    _, storage = trained
    before = _tree_digest(storage)
    proc = run_cli(
        "evaluate",
        "--program",
        TINY,
        "--job",
        "j",
        "--storage",
        str(storage),
        "--max-steps",
        "30",
        "--once",
        "--mlflow-tracking-uri",
        mlflow_uri,
        "--json",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout)["evaluated"] == []
    # No step evaluated again (its exporters, which the job did not have, export the newest).
    after = _tree_digest(storage)
    kept = [k for k in before if "/exports/" not in k and not k.endswith("registry.json")]
    assert {k: after.get(k) for k in kept} == {k: before[k] for k in kept}


def _s3_preflight(url: str, options: dict) -> None:
    from prefect_jax.training.facade import preflight

    preflight(TINY, "j", url, resolve=lambda given: (given, options))


def test_storage_options_the_filesystem_rejects_are_named_with_the_fix(s3_server):
    from prefect_jax.training.remote_errors import RemoteConfigError

    url = s3_server.create_bucket("preflight-options") + "/p"
    options = {**s3_server.storage_options, "bogus_option": 1}
    with pytest.raises(RemoteConfigError) as refused:
        _s3_preflight(url, options)
    message = str(refused.value)
    assert message.startswith(f"--storage {url}: "), message
    assert "storage option 'bogus_option' is not one the s3:// filesystem accepts" in message
    assert "Remove it or correct its name" in message and "testing" not in message  # no secret
    assert isinstance(refused.value, ValueError)  # the command's exit 2
    assert s3_server.filesystem().ls("preflight-options") == []  # nothing written


def test_a_bucket_that_does_not_exist_is_named(s3_server):
    from prefect_jax.training.remote_errors import RemoteConfigError

    with pytest.raises(RemoteConfigError) as refused:
        _s3_preflight("s3://no-such-bucket/p", s3_server.storage_options)
    message = str(refused.value)
    assert "--storage s3://no-such-bucket/p: bucket 'no-such-bucket' does not exist" in message
    assert "create the bucket 'no-such-bucket' first" in message, message
    assert not s3_server.filesystem().exists("no-such-bucket")  # and it was not created


def _on_s3_with(command: str, with_credentials: bool, mlflow_uri: str):
    """`command` of a job on S3 whose endpoint refuses connections, with AWS's credential chain
    pointed at nothing but (`with_credentials`) a made-up key. `mlflow_uri`: a store whose
    tables exist (MLflow logs their creation on stderr)."""
    from s3_server import ISOLATED_AWS_ENV, UNSET_AWS_ENV, closed_port

    env = {**ISOLATED_AWS_ENV, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{closed_port()}"}
    if with_credentials:
        env.update(AWS_ACCESS_KEY_ID="AKIAEXAMPLE", AWS_SECRET_ACCESS_KEY="not-a-secret")
    program = [] if command == "status" else ["--program", TINY]
    program += [] if command == "status" else ["--mlflow-tracking-uri", mlflow_uri]
    where = ["--job", "j", "--storage", "s3://bucket/p"]
    return run_cli(command, *program, *where, unset=UNSET_AWS_ENV, **env)


@pytest.mark.parametrize("command", ["status", "export", "run"])
def test_s3_storage_without_credentials_is_one_clear_line_in_every_command(
    trained, mlflow_uri, command
):
    """Each command's first reads of the storage say what is wrong with it, as the trainer's
    do: botocore's NoCredentialsError is not an OSError (status and export printed it as a
    traceback). (`trained`: its job made `mlflow_uri`'s tables.)"""
    proc = _on_s3_with(command, False, mlflow_uri)
    assert proc.returncode == 2
    line = _one_error_line(proc, command)
    assert "--storage s3://bucket/p: no usable credentials for s3://bucket/p" in line, line
    assert "AWS_ACCESS_KEY_ID" in line, line


def test_status_errors_name_the_storage_block_as_typed_and_its_url(
    prefect_server, tmp_path, trained
):
    """(They named the block's URL only: a user who typed a block's name did not find it.)"""
    from s3_server import ISOLATED_AWS_ENV, UNSET_AWS_ENV

    from prefect_jax.blocks import CheckpointStorage

    _, storage = trained
    CheckpointStorage(url=str(storage)).save("status-here", overwrite=True)
    CheckpointStorage(url="s3://bucket/p").save("status-no-credentials", overwrite=True)
    server = {"PREFECT_API_URL": prefect_server}
    here = run_cli(
        "status", "--job", "jj", "--storage", "jax-checkpoint-storage/status-here", **server
    )
    assert here.returncode == 2
    assert (
        f"no job 'jj' in storage jax-checkpoint-storage/status-here ({storage}) (jobs there: j)"
    ) in _one_error_line(here, "status")
    s3 = run_cli(
        *("status", "--job", "j", "--storage", "jax-checkpoint-storage/status-no-credentials"),
        unset=UNSET_AWS_ENV,
        **ISOLATED_AWS_ENV,
        **server,
    )
    assert s3.returncode == 2
    line = _one_error_line(s3, "status")
    assert (
        "--storage jax-checkpoint-storage/status-no-credentials: no usable credentials for "
        "s3://bucket/p"
    ) in line, line


@pytest.mark.parametrize("command", ["status", "run"])
def test_an_s3_endpoint_that_does_not_answer_is_one_clear_line_exit_1(trained, mlflow_uri, command):
    """Not bad input (the service may come back): exit 1, the error line without a traceback."""
    proc = _on_s3_with(command, True, mlflow_uri)
    assert proc.returncode == 1
    line = _one_error_line(proc, command)
    assert "--storage s3://bucket/p: cannot reach s3://bucket/p" in line, line
    assert "check the endpoint URL" in line and "run a command again" in line, line


@pytest.mark.parametrize("flag", ["--workdir", "--compilation-cache"])
def test_the_other_path_flags_that_cannot_be_made_name_the_flag_and_the_fix(
    tmp_path, mlflow_uri, flag
):
    if flag == "--workdir":
        proc = run_cli("demo", "--workdir", "/proc/nope", "--no-progress")
        command = "demo"
    else:
        command = "run"
        proc = run_cli(
            "run",
            "--program",
            TINY,
            "--job",
            "j",
            "--storage",
            str(tmp_path / "s"),
            "--compilation-cache",
            "/proc/nope",
            "--mlflow-tracking-uri",
            mlflow_uri,
        )
    assert proc.returncode == 2
    line = _one_error_line(proc, command)
    assert f"{flag} /proc/nope: the directory cannot be made" in line, line
    assert f"give {flag} a directory this user can create" in line, line


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (
            ["--train-hook", "nope.module:hook"],
            "train hook path 'nope.module:hook': cannot import module 'nope.module'",
        ),
        (
            ["--best-compare-fn", "nope.module:better"],
            "BestExporter compare_fn path 'nope.module:better': cannot import module",
        ),
        (  # (it failed at its first call, after an interval's training, as a TypeError)
            ["--train-hook", "os:getcwd"],
            "train hook 'os:getcwd' takes 0 required positional arguments (at most 0), and is "
            "called with 1: define it as fn(view)",
        ),
        (  # (it failed at the first export, after two intervals)
            ["--best-compare-fn", "os:getcwd"],
            "BestExporter compare_fn 'os:getcwd' takes 0 required positional arguments (at most "
            "0), and is called with 2: define it as compare_fn(best_eval_result, "
            "current_eval_result)",
        ),
    ],
)
def test_a_part_of_the_job_that_cannot_be_loaded_is_one_clear_line_before_any_flow_runs(
    tmp_path, flags, expected
):
    """What the trainer refuses as it is made, the command refuses in its preflight: before its
    compile begins (it would wait for it) and before any flow run (one line, no run's logs)."""
    proc = run_cli("run", "--program", TINY, "--job", "j", "--storage", str(tmp_path / "s"), *flags)
    assert proc.returncode == 2
    assert expected in _one_error_line(proc, "run")
    assert not (tmp_path / "s" / "j").exists()
