"""The `prefect-jax` command in real subprocesses: JSON output, reruns, status, the demo."""

import contextlib
import json
import os
import re
import signal
import socket
import time

import pytest
from process_helpers import run_cli

from prefect_jax.training.checkpoint_dirs import committed_steps

TINY = "prefect_jax.examples.digits:tiny"


def _last_json(proc):
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("terminal", [False, True])
def test_the_progress_bar_is_drawn_only_where_stderr_is_a_terminal(terminal, monkeypatch, capsys):
    """Where stderr is no terminal (a worker's or a CI's captured log) rich would draw the bar once,
    as the command ends, cut to 80 columns: it is left out there (each interval's log line says
    the same). On a terminal (here rich's ``TTY_COMPATIBLE=1``) it follows the steps."""
    from prefect_jax.cli import console
    from prefect_jax.training.progress import listening, notify_progress

    monkeypatch.setenv("COLUMNS", "200")
    monkeypatch.delenv("FORCE_COLOR", raising=False)
    if terminal:
        monkeypatch.setenv("TTY_COMPATIBLE", "1")
    else:
        monkeypatch.delenv("TTY_COMPATIBLE", raising=False)
    with console.progress_bar(True, 120):
        assert listening() is terminal
        notify_progress(120, 120, {"loss": 2.639, "tokens_per_sec": 2323.0})
    assert not listening()
    err = capsys.readouterr().err
    if terminal:
        assert "training" in err and "120/120" in err and "loss=2.639" in err, err
    else:
        assert err == ""


def test_bad_input_is_a_clear_error_and_nothing_runs(tmp_path):
    proc = run_cli(
        "run",
        "--program",
        TINY,
        "--job",
        "j",
        "--storage",
        str(tmp_path),
        "--max-steps",
        "0",
        "--json",
    )
    assert proc.returncode == 2
    said = proc.stderr.strip().splitlines()[-1]
    assert said.startswith("prefect-jax run: error: --max-steps 0: max_steps=0 must be a positive")
    # with --json, a script reading stdout's last line gets the error too
    answer = json.loads(proc.stdout.strip().splitlines()[-1])
    assert answer == {"error": said[len("prefect-jax run: error: ") :], "exit_code": 2}
    assert not (tmp_path / "j").exists()


@pytest.mark.slow
def test_the_collector_is_on_once_the_command_has_started_and_after_a_refused_command(
    tmp_path, prefect_server, mlflow_uri, monkeypatch
):
    """The command turns Python's garbage collector off through its start-up's imports (a large
    part of its start-up) and on again, with the imports frozen, before the flow runs: a job of
    hours must not run without it. A command refused before it starts turns it back on too."""
    log = tmp_path / "gc.jsonl"
    proc = run_cli(
        "run",
        "--program",
        "tests.programs:gc_watching",
        "--job",
        "gc",
        "--storage",
        str(tmp_path / "s"),
        "--max-steps",
        "20",
        "--checkpoint-every-steps",
        "10",
        "--mlflow-tracking-uri",
        mlflow_uri,
        "--json",
        "--no-progress",
        PREFECT_API_URL=prefect_server,
        PREFECT_JAX_TEST_GC_LOG=str(log),
    )
    assert _last_json(proc)["final_step"] == 20
    seen = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(seen) >= 2 and all(s["enabled"] for s in seen), seen
    assert all(s["frozen"] > 100_000 for s in seen), (
        seen
    )  # Prefect's, JAX's and the program's objects

    import gc

    from prefect_jax import cli

    for name in ("PREFECT_SERVER_ANALYTICS_ENABLED", "TF_CPP_MIN_LOG_LEVEL", "GIT_PYTHON_REFRESH"):
        monkeypatch.setenv(
            name, os.environ.get(name, "")
        )  # what main() sets is undone after the test
    monkeypatch.chdir(tmp_path)
    import signal

    handler = signal.getsignal(signal.SIGTERM)
    # A command refused before it trains (max_steps 0): exit code 2.
    refused = ["run", "--program", TINY, "--job", "j", "--storage", str(tmp_path / "r")]
    refused += ["--max-steps", "0", "--mlflow-tracking-uri", mlflow_uri]
    try:
        assert gc.isenabled()
        assert cli.main(refused) == 2
        assert gc.isenabled()
        gc.disable()  # a caller's choice is left as it was
        assert cli.main(refused) == 2
        assert not gc.isenabled()
    finally:
        gc.enable()
        signal.signal(signal.SIGTERM, handler)


@pytest.mark.slow
def test_run_json_rerun_and_status(tmp_path, prefect_server, mlflow_uri):
    env = {"PREFECT_API_URL": prefect_server}
    args = [
        "run",
        "--program",
        TINY,
        "--job",
        "cli-job",
        "--storage",
        str(tmp_path / "s"),
        "--max-steps",
        "40",
        "--checkpoint-every-steps",
        "20",
        "--mlflow-tracking-uri",
        mlflow_uri,
        "--json",
        "--no-progress",
    ]
    first = _last_json(run_cli(*args, **env))
    expected_keys = {
        "job",
        "final_step",
        "eval",
        "checkpoint_dir",
        "mlflow_tracking_uri",
        "mlflow_run_id",
        "exports",
        "state_fingerprint",
    }
    assert expected_keys <= set(first)
    assert first["final_step"] == 40 and first["job"] == "cli-job"
    assert first["exports"] == {"best": first["exports"]["best"], "final": [40], "latest": [20, 40]}

    second = _last_json(run_cli(*args, **env))
    assert second["state_fingerprint"] == first["state_fingerprint"]
    assert second["mlflow_run_id"] == first["mlflow_run_id"]

    status = _last_json(
        run_cli("status", "--job", "cli-job", "--storage", str(tmp_path / "s"), "--json")
    )
    assert status["committed_steps"] == [20, 40]
    assert status["evaluated_steps"] == {"eval": [20, 40]}
    assert status["exports"]["latest"] == [20, 40]
    from prefect_jax.deployments import job_resource_id

    assert status["event_resource_id"] == job_resource_id(
        "cli-job", str(tmp_path / "s")
    )  # what its events carry


def _port_open(port):
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.mark.slow
def test_demo_on_embedded_defaults_reaches_accuracy_and_ends_cleanly(tmp_path):
    workdir = tmp_path / "demo"
    proc = run_cli(
        "demo",
        "--workdir",
        str(workdir),
        "--max-steps",
        "200",
        "--checkpoint-every-steps",
        "100",
        "--json",
        PREFECT_LOGGING_LEVEL="INFO",
    )
    summary = _last_json(proc)
    assert summary["eval"]["accuracy"] >= 0.95
    assert summary["final_step"] == 200
    assert summary["mlflow_tracking_uri"] == f"sqlite:///{workdir}/mlflow.db"
    assert summary["checkpoint_dir"] == f"{workdir}/storage/digits/checkpoints"
    assert "Traceback" not in proc.stderr and "Error flushing" not in proc.stderr
    # One server: none started again by Prefect for a thread outside the command's settings (the
    # checkpoint events are sent from one: they go to this server too).
    assert proc.stderr.count("Starting temporary server") == 1, proc.stderr[-3000:]
    port = int(
        re.search(r"Starting temporary server on http://127.0.0.1:(\d+)", proc.stderr).group(1)
    )
    assert not _port_open(port), "the embedded Prefect server outlived the command"
    assert any("mlflow ui --backend-store-uri" in line for line in summary["browse"])


@pytest.mark.slow
def test_a_job_out_of_its_rerun_budget_is_refused_in_one_line(tmp_path, mlflow_uri):
    """Rerun once too often without getting past a step (preempted before each first checkpoint),
    a job is refused as the others a user must act on are: one error line that says what to do,
    exit 1, and nothing of the job lost."""
    from prefect_jax.training.control import record_attempt
    from prefect_jax.training.storage import JobStorage

    storage = JobStorage(str(tmp_path), "stuck")
    for _ in range(4):  # four runs that started at step 0 (the default budget is 3 reruns)
        record_attempt(storage, 0, None)
    before = (tmp_path / "stuck" / "attempts.json").read_bytes()
    proc = run_cli(
        "run",
        "--program",
        TINY,
        "--job",
        "stuck",
        "--storage",
        str(tmp_path),
        "--max-steps",
        "20",
        "--mlflow-tracking-uri",
        mlflow_uri,
        "--json",
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    # (the flow run's failure is in Prefect's log above it, with its traceback)
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("prefect-jax run: error: job "), proc.stderr[-3000:]
    assert "without getting past step 0" in last and "attempts.json to reset" in last
    assert (tmp_path / "stuck" / "attempts.json").read_bytes() == before


def test_an_mlflow_tracking_block_names_the_store_and_experiment_of_a_job(tmp_path, prefect_server):
    """``--mlflow-tracking-uri prefect-jax-mlflow-tracking/<block>``: the job's records go to the
    block's store, in its experiment (the flow resolves it, as a deployment's run does); a block
    that does not exist is one error line, and nothing runs."""
    from mlflow.tracking import MlflowClient

    from prefect_jax.blocks import MlflowTracking

    uri = f"sqlite:///{tmp_path}/team.db"
    MlflowTracking(tracking_uri=uri, experiment="team-digits").save("cli-team", overwrite=True)
    args = ["run", "--program", TINY, "--storage", str(tmp_path / "s"), "--max-steps", "20"]
    args += ["--checkpoint-every-steps", "20", "--json", "--no-progress"]
    env = {"PREFECT_API_URL": prefect_server}
    summary = _last_json(
        run_cli(
            *args,
            "--job",
            "blocked",
            "--mlflow-tracking-uri",
            "prefect-jax-mlflow-tracking/cli-team",
            **env,
        )
    )
    assert summary["mlflow_tracking_uri"] == uri
    run = MlflowClient(uri).get_run(summary["mlflow_run_id"])
    assert MlflowClient(uri).get_experiment(run.info.experiment_id).name == "team-digits"

    missing = run_cli(
        *args,
        "--job",
        "unblocked",
        "--mlflow-tracking-uri",
        "prefect-jax-mlflow-tracking/nope",
        **env,
    )
    assert missing.returncode == 2, missing.stderr[-3000:]
    assert missing.stderr.strip().splitlines()[-1] == (
        "prefect-jax run: error: MLflow tracking block 'prefect-jax-mlflow-tracking/nope' was not "
        "found on the Prefect server: create it with MlflowTracking(tracking_uri=...).save('nope'),"
        " or pass a tracking URI instead"
    )
    assert not (tmp_path / "s" / "unblocked").exists()


def test_early_stopping_eval_hooks_and_exports_to_keep_from_the_command_line(
    tmp_path, prefect_server, mlflow_uri
):
    """The rest of TF's EvalSpec from the command: `--early-stopping-*` (its
    `stop_if_no_decrease_hook`) stops the job when its metric has not improved for N steps (an
    accuracy that must gain a whole 1.0 never does: stopped at 40 of 100, 20 steps after its best
    at 20), and says why; `--eval-hook` (its listeners) hears each evaluation; `--exports-to-keep`
    (its exporters' exports_to_keep) keeps that many. A hook or a metric that cannot be is one
    error line before anything runs."""
    (tmp_path / "listeners.py").write_text(
        "import os\n"
        "class Heard:\n"
        "    def after_eval(self, result):\n"
        "        with open(os.environ['HEARD'], 'a') as f:\n"
        "            f.write(f'{result.step}\\n')\n"
        "        return True\n"
    )
    storage = tmp_path / "s"
    args = ["run", "--program", TINY, "--job", "early", "--storage", str(storage)]
    args += ["--max-steps", "100", "--checkpoint-every-steps", "20", "--exporters", "latest"]
    args += ["--mlflow-tracking-uri", mlflow_uri, "--json", "--no-progress"]
    args += ["--early-stopping-steps", "20", "--early-stopping-mode", "max"]
    env = dict(PREFECT_API_URL=prefect_server, HEARD=str(tmp_path / "heard"))
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), os.getcwd()])

    typo = run_cli(*args, "--early-stopping-metric", "acuracy", **env)
    assert typo.returncode == 2 and "--early-stopping-metric" in typo.stderr, typo.stderr[-3000:]
    assert "'acuracy'" in typo.stderr and not (storage / "early").exists()
    missing = run_cli(*args, "--eval-hook", "listeners:Nobody", **env)
    assert missing.returncode == 2 and "listeners:Nobody" in missing.stderr, missing.stderr[-3000:]
    assert not (storage / "early").exists()

    args += ["--early-stopping-metric", "accuracy", "--early-stopping-min-delta", "1.0"]
    proc = run_cli(*args, "--eval-hook", "listeners:Heard", "--exports-to-keep", "1", **env)
    summary = _last_json(proc)
    assert summary["final_step"] == 40, summary
    assert "early stopping: accuracy has not improved" in summary["stopped"], summary
    assert (tmp_path / "heard").read_text().split() == ["20", "40"]
    assert sorted(os.listdir(storage / "early" / "exports" / "latest")) == ["40"]
    shown = run_cli("status", "--job", "early", "--storage", str(storage))
    assert shown.returncode == 0, shown.stderr[-3000:]
    assert "  stopped: asked at step 40 by its evaluation 'eval': early stopping: " in shown.stdout
    assert f"until {storage / 'early' / 'stop.json'} is deleted\n" in shown.stdout


def test_early_stopping_flags_without_its_steps_or_out_of_range_are_refused_naming_the_flag():
    from prefect_jax.training.specs import EarlyStopping

    assert _run_specs()[1].early_stopping is None
    (_, evaluation, _) = _run_specs(
        "--early-stopping-steps", "500", "--early-stopping-min-steps", "9"
    )
    assert evaluation.early_stopping == EarlyStopping(
        max_steps_without_improvement=500, min_steps=9
    )
    with pytest.raises(ValueError) as refused:
        _run_specs("--early-stopping-metric", "accuracy", "--early-stopping-mode", "max")
    assert str(refused.value) == (
        "--early-stopping-metric accuracy --early-stopping-mode max without "
        "--early-stopping-steps: early stopping needs how many steps the best value may age; "
        "give --early-stopping-steps N (e.g. 1000), or drop the others"
    )
    with pytest.raises(ValueError, match=r"^--early-stopping-steps 0: max_steps_without_imp"):
        _run_specs("--early-stopping-steps", "0")
    with pytest.raises(ValueError, match=r"^--early-stopping-min-delta -0.01: min_delta=-0.01 is "):
        _run_specs("--early-stopping-steps", "5", "--early-stopping-min-delta", "-0.01")
    with pytest.raises(ValueError, match=r"^--throttle-secs -1.0: .*; --early-stopping-min-steps"):
        _run_specs(
            "--throttle-secs",
            "-1",
            "--early-stopping-steps",
            "5",
            "--early-stopping-min-steps",
            "-1",
        )


def test_a_failed_export_ends_the_command_in_one_line_after_its_one_traceback(tmp_path, mlflow_uri):
    """An export that fails (the program's serve refuses the trained weights) ends the job: the
    command's last line says so and what a rerun does, exit 1. The program's own error keeps
    its traceback once, in the flow run's log; the command does not print it again."""
    proc = run_cli(
        "run",
        "--program",
        "programs:fails_at_export",
        "--job",
        "export-fails",
        "--storage",
        str(tmp_path),
        "--max-steps",
        "40",
        "--checkpoint-every-steps",
        "20",
        "--exporters",
        "latest",
        "--mlflow-tracking-uri",
        mlflow_uri,
        PYTHONPATH=os.pathsep.join([os.path.dirname(__file__), os.getcwd()]),
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("prefect-jax run: error: the export of step 20 "), last
    assert "serve() refuses these weights" in last and "a rerun exports" in last
    assert proc.stderr.count('raise RuntimeError("serve() refuses these weights")') == 1


@pytest.mark.slow
def test_a_sigterm_while_the_command_waits_for_its_threads_ends_it_143(
    tmp_path, prefect_server, mlflow_uri
):
    """A command that has done its work waits for its threads (a background compile, a copy of
    the compilation cache); a SIGTERM then ends the wait: exit 143 at once, through the command's
    own exit, without the interpreter's teardown. Through the interpreter's exit, the teardown
    ran beside whatever still ran (an XLA compile: SIGABRT)."""
    from process_helpers import start_run, wait_until

    mark, log = tmp_path / "torn-down", tmp_path / "run.log"
    args = ["--program", "programs:leaves_a_thread", "--job", "j", "--storage", str(tmp_path)]
    args += ["--max-steps", "20", "--mlflow-tracking-uri", mlflow_uri, "--json"]
    proc = start_run(args, prefect_server, log, PREFECT_JAX_TEST_TEARDOWN_MARK=str(mark))
    try:
        # the summary: the job is done
        wait_until(lambda: '"final_step": 20' in log.read_text(), 300, "the summary", proc)
        time.sleep(1.0)  # (now waiting for the program's thread)
        assert proc.poll() is None, "the command did not wait for its thread"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 143, log.read_text()[-3000:]
        assert not mark.exists(), "the interpreter's teardown ran"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_misspelt_flag_is_refused_with_the_subcommands_usage(tmp_path):
    proc = run_cli(
        "run", "--program", TINY, "--job", "j", "--storage", str(tmp_path), "--max-step", "40"
    )
    assert proc.returncode == 2
    assert "usage: prefect-jax run" in proc.stderr  # the subcommand's usage, not the top-level one
    assert "prefect-jax run: error: unrecognized arguments: --max-step 40" in proc.stderr
    assert not (tmp_path / "j").exists(), (
        "no prefix matching: nothing ran as if --max-steps had been given"
    )


def test_a_mistyped_value_is_its_error_under_one_usage_line_not_the_whole_usage(tmp_path):
    """argparse printed the subcommand's whole usage (about 30 lines for `run`) before the line
    that names the value and the fix (a walkthrough's finding)."""
    proc = run_cli(
        "run", "--program", TINY, "--job", "j", "--storage", str(tmp_path), "--max-steps", "3OO"
    )
    assert proc.returncode == 2
    usage, error = proc.stderr.splitlines()
    assert usage.startswith("usage: prefect-jax run ") and "--help" in usage, usage
    assert error.startswith("prefect-jax run: error: argument --max-steps: '3OO'"), error


@pytest.mark.slow
def test_the_roles_from_the_command_line(tmp_path, prefect_server, mlflow_uri):
    """`train` (with --steps-per-dispatch), then `evaluate --once`, then
    `export`: TF's chief and evaluator."""
    env = {"PREFECT_API_URL": prefect_server}
    job = [
        "--program",
        TINY,
        "--job",
        "roles",
        "--storage",
        str(tmp_path / "s"),
        "--max-steps",
        "40",
        "--checkpoint-every-steps",
        "20",
        "--mlflow-tracking-uri",
        mlflow_uri,
        "--json",
        "--no-progress",
    ]
    trained = _last_json(run_cli("train", *job, "--steps-per-dispatch", "5", **env))
    assert trained["final_step"] == 40 and trained["exports"] == {}
    evaluated = _last_json(run_cli("evaluate", *job, "--once", "--poll-secs", "0.2", **env))
    assert evaluated["evaluated"] == [20, 40] and evaluated["exports"]["final"] == [40]
    exported = _last_json(run_cli("export", *job, "--step", "20", "--exporters", "latest", **env))
    assert exported["exports"] == {
        "latest": str(tmp_path / "s" / "roles" / "exports" / "latest" / "20")
    }


def test_the_embedded_server_starts_early_only_where_no_setting_names_a_server(
    tmp_path, monkeypatch
):
    # Started before Prefect is imported, the embedded server must not be started for a user whose
    # profile names one (`prefect cloud login` writes PREFECT_API_URL there), nor where a settings
    # file in the working directory may.
    from prefect_jax.cli.server import api_url_may_be_set_elsewhere

    for name in ("PREFECT_API_URL", "PREFECT_PROFILE", "PREFECT_PROFILES_PATH"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PREFECT_HOME", str(tmp_path / "home"))
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    assert not api_url_may_be_set_elsewhere()  # no profiles file at all
    (tmp_path / "home").mkdir()
    profiles = tmp_path / "home" / "profiles.toml"
    profiles.write_text(
        'active = "local"\n[profiles.local]\nPREFECT_LOGGING_LEVEL = "INFO"\n'
        '[profiles.cloud]\nPREFECT_API_URL = "https://api.prefect.cloud/api/accounts/a/workspaces/w"\n'
    )
    assert not api_url_may_be_set_elsewhere()
    monkeypatch.setenv("PREFECT_PROFILE", "cloud")
    assert api_url_may_be_set_elsewhere()
    monkeypatch.delenv("PREFECT_PROFILE")
    profiles.write_text(profiles.read_text().replace('active = "local"', 'active = "cloud"'))
    assert api_url_may_be_set_elsewhere()
    profiles.write_text(profiles.read_text().replace('active = "cloud"', 'active = "local"'))
    (work / "pyproject.toml").write_text('[project]\nname = "x"\n')
    assert not api_url_may_be_set_elsewhere()
    (work / "pyproject.toml").write_text('[tool.prefect.api]\nurl = "http://elsewhere:4200/api"\n')
    assert api_url_may_be_set_elsewhere()
    (work / "pyproject.toml").unlink()
    (work / "prefect.toml").write_text('[api]\nurl = "http://elsewhere:4200/api"\n')
    assert api_url_may_be_set_elsewhere()
    (work / "prefect.toml").unlink()
    # No PREFECT_HOME and no ~/.prefect/profiles.toml: Prefect reads the profiles it ships.
    monkeypatch.delenv("PREFECT_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "empty-home"))
    assert not api_url_may_be_set_elsewhere()
    monkeypatch.setenv(
        "PREFECT_PROFILE", "local"
    )  # the shipped "local" profile names http://127.0.0.1:4200/api
    assert api_url_may_be_set_elsewhere()


def _run_specs(*flags):
    """The (train, eval, checkpoint) specs of ``prefect-jax run`` with `flags`."""
    from prefect_jax.cli import build_parser
    from prefect_jax.cli.spec_flags import specs_from_args

    args = build_parser().parse_args(
        [
            "run",
            "--program",
            "prefect_jax.examples.digits:tiny",
            "--job",
            "j",
            "--storage",
            "/tmp/s",
            *flags,
        ]
    )
    return specs_from_args(args)


def test_every_training_flag_reaches_its_spec_or_is_read_by_the_command_and_defaults_as_it():
    """A flag for a spec field left out of `SPEC_FLAGS` would be parsed and silently ignored;
    a default written again in the flag would drift from the spec's."""
    import argparse
    import pathlib

    from prefect_jax.cli import arguments, build_parser, commands, spec_flags
    from prefect_jax.training import specs

    parser = argparse.ArgumentParser()
    arguments.add_training_args(parser, max_steps=1000, every=200)
    flags = {a.dest for a in parser._actions if a.dest != "help"}
    to_specs = {attr for fields in spec_flags.SPEC_FLAGS.values() for attr in fields.values()}
    early = set(spec_flags.EARLY_STOPPING_FLAGS.values())  # (None unless given: no EarlyStopping)
    assert early <= flags and not any(getattr(parser.parse_args([]), a) for a in early)
    to_specs |= early
    assert to_specs <= flags, to_specs - flags
    cli = "".join(p.read_text() for p in pathlib.Path(commands.__file__).parent.glob("*.py"))
    unread = [f for f in sorted(flags - to_specs) if f"args.{f}" not in cli]
    assert unread == [], f"flags neither in SPEC_FLAGS nor read as args.<flag>: {unread}"
    parsed, _ = parser.parse_known_args([])
    differ = {
        (spec, field)
        for spec, fields in spec_flags.SPEC_FLAGS.items()
        for field, attr in fields.items()
        if getattr(parsed, attr)
        != getattr(specs, spec).model_fields[field].get_default(call_default_factory=True)
    }
    # the two the command sets its own way (docs/program.md): a demo's length and cadence
    assert differ == {("TrainSpec", "max_steps"), ("CheckpointSpec", "every_steps")}
    # the roles' waits: the flows' defaults (specs.py's constants)
    roles = build_parser()._subparsers._group_actions[0].choices
    waits = {
        "evaluate": {
            "wait_for_first_checkpoint_secs": specs.FIRST_CHECKPOINT_WAIT_SECS,
            "poll_secs": specs.EVAL_POLL_SECS,
        },
        "export": {
            "max_wait_secs": specs.MAX_WAIT_SECS,
            "recovery_wait_secs": specs.RECOVERY_WAIT_SECS,
        },
    }
    for role, defaults in waits.items():
        parsed = roles[role].parse_args(["--program", "p:q", "--job", "j", "--storage", "/s"])
        if role == "evaluate":  # (none given: the flow's; with --once, no wait)
            parsed.wait_for_first_checkpoint_secs = commands._first_checkpoint_wait(parsed)
            once = roles[role].parse_args(["--program", "p:q", "--job", "j", "--storage", "/s"])
            once.once = True
            assert commands._first_checkpoint_wait(once) == 0.0
        assert {k: getattr(parsed, k) for k in defaults} == defaults, role


def test_backups_are_on_unless_the_command_says_no_backups():
    assert _run_specs()[2].backups is True and _run_specs("--no-backups")[2].backups is False


def test_a_value_the_specs_refuse_is_one_line_naming_its_flag():
    with pytest.raises(ValueError) as refused:
        _run_specs("--checkpoint-every-steps", "0")
    said = str(refused.value)
    assert said.startswith("--checkpoint-every-steps 0: every_steps=0 must be a positive number")
    assert "\n" not in said and "pydantic" not in said
    with pytest.raises(ValueError, match=r"^--sigterm-grace-secs -1\.0: sigterm_grace_secs=-1\.0"):
        _run_specs("--sigterm-grace-secs", "-1")
    # a flag whose dest is another name is named as typed (it said --train-hooks)
    with pytest.raises(ValueError, match=r"^--train-hook 'pkg\.mod:fn@every=0': train hook"):
        _run_specs("--train-hook", "pkg.mod:fn@every=0")
    # what the spec's refusal suggests, None, is typed 'none' (refused as no int before)
    assert _run_specs("--keep-last", "none")[2].keep_last is None
    assert _run_specs("--eval-steps", "None")[1].steps is None
    # MLflow's rule for a registered model's name (it refused it at the first export's
    # registration, with a warning: a job with exports and no versions)
    for name, fixed in (("a/b:c", "a-b-c"), ("../x", "x"), ("..x", "x"), (" ", "my-model")):
        with pytest.raises(ValueError) as refused:
            _run_specs("--registered-model", name)
        said = str(refused.value)
        assert said.startswith(f"--registered-model {name!r}: registered model name {name!r}: "), (
            said
        )
        assert f"give one such as {fixed!r}, or '' to register none" in said, said
    assert _run_specs("--registered-model", "team.digits_v2")[1].registered_model == (
        "team.digits_v2"
    )


def test_checkpoints_and_retention_by_time_from_the_command_as_tf_s_run_config(capsys):
    by_time = _run_specs(
        "--checkpoint-every-steps", "none", "--checkpoint-every-secs", "600",
        "--keep-every-secs", "7200",
    )[2]  # fmt: skip
    assert (by_time.every_steps, by_time.every_secs, by_time.keep_every_secs) == (None, 600, 7200)
    with pytest.raises(ValueError, match="every_steps=None and every_secs=None: no checkpoint"):
        _run_specs("--checkpoint-every-steps", "None")
    with pytest.raises(SystemExit):
        _run_specs("--checkpoint-every-steps", "never")
    assert "'never' is not a number of steps: give one, e.g. 1000, or 'none' to checkpoint by " in (
        capsys.readouterr().err
    )


def test_a_word_for_a_number_flag_is_refused_naming_what_it_is_with_an_example(capsys):
    for flag, word, said in [
        ("--checkpoint-every-secs", "ten", "'ten' is not a number of seconds: give one, e.g. 600"),
        ("--keep-every-steps", "1e4", "'1e4' is not a whole number of steps: give one"),
        ("--seed", "x", "'x' is not a seed (a whole number): give one, e.g. 0"),
    ]:
        with pytest.raises(SystemExit):
            _run_specs(flag, word)
        assert f"argument {flag}: {said}" in capsys.readouterr().err
    assert _run_specs("--checkpoint-every-secs", "1.5")[2].every_secs == 1.5


def test_export_platforms_come_from_the_command_and_default_to_none():
    assert _run_specs()[1].export_platforms is None
    assert _run_specs("--export-platforms", "cuda, cpu")[1].export_platforms == ["cuda", "cpu"]


def test_the_browse_lines_open_a_tracking_servers_own_ui_and_start_one_for_a_store():
    from prefect_jax.cli.console import browse_lines

    def mlflow_line(uri: str) -> str:
        summary = {"mlflow_tracking_uri": uri, "job": "j", "storage": "/s"}
        summary["mlflow_run_url"] = "http://mlflow.example:5000/#/experiments/1/runs/r"
        return next(line for line in browse_lines(summary) if "MLflow:" in line)

    served = mlflow_line("http://mlflow.example:5000")
    assert (
        "mlflow ui" not in served and "http://mlflow.example:5000/#/experiments/1/runs/r" in served
    )
    assert "mlflow ui --backend-store-uri sqlite:////tmp/m.db" in mlflow_line("sqlite:////tmp/m.db")


def test_the_browse_lines_offer_a_model_to_serve_only_where_the_job_exported_one():
    """A `train` role's job names its registered model but exports nothing itself (its evaluator
    does): the Serve line pointed at a model that did not exist (a walkthrough's finding)."""
    from prefect_jax.cli.console import browse_lines

    summary = {"mlflow_tracking_uri": "sqlite:////tmp/m.db", "job": "j", "storage": "/s"}
    summary["registered_model"] = "j-12345678"
    assert not [line for line in browse_lines(dict(summary, exports={})) if "Serve:" in line]
    served = browse_lines(dict(summary, exports={"best": [100], "latest": [100]}))
    assert any("models:/j-12345678@best" in line for line in served), served
    newest = browse_lines(dict(summary, exports={"best": [], "latest": [100]}))
    assert any("models:/j-12345678@newest" in line for line in newest), newest  # (MLflow's name)


@pytest.mark.slow
# The command spawns its server before it imports JAX; in this test process JAX may be running.
@pytest.mark.filterwarnings(r"ignore:os\.fork\(\) was called:RuntimeWarning")
def test_the_embedded_server_starts_without_registering_block_types_and_blocks_still_work(
    tmp_path, monkeypatch
):
    """The command's embedded server skips Prefect's block type registration at its start (to
    decide on it, even memoized, Prefect imports every installed Prefect collection: a large part
    of its start with the dev group's). A block saved through it registers its own type and loads
    back; a user's own registration setting (environment or profile) is kept."""
    import httpx
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from prefect_jax.blocks import CheckpointStorage
    from prefect_jax.cli.server import (
        BLOCK_REGISTRATION_ALIASES,
        BLOCK_REGISTRATION_SETTINGS,
        EmbeddedServer,
        drain_prefect_workers,
    )

    def block_types(api_url):
        response = httpx.post(f"{api_url}/block_types/filter", json={}, timeout=30)
        response.raise_for_status()
        return {t["slug"] for t in response.json()}

    monkeypatch.setenv("PREFECT_HOME", str(tmp_path / "home"))  # a new database, no profiles file
    for name in (
        *BLOCK_REGISTRATION_SETTINGS,
        *BLOCK_REGISTRATION_ALIASES,
        "PREFECT_PROFILE",
        "PREFECT_PROFILES_PATH",
    ):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)  # no settings file of the working directory
    server = EmbeddedServer()
    try:
        api_url = server.wait(timeout=120)
        assert "secret" not in block_types(
            api_url
        )  # Prefect's own block types: not registered at the start
        with temporary_settings(updates={PREFECT_API_URL: api_url}):
            CheckpointStorage(url=str(tmp_path / "ckpt")).save("nightly")
            assert CheckpointStorage.load("nightly").url == str(tmp_path / "ckpt")
            drain_prefect_workers()  # (the save's events go to this server before it stops)
    finally:
        server.stop()

    # The user's own setting is kept, here in their active profile
    # (`prefect config set` writes it there).
    (tmp_path / "home" / "profiles.toml").write_text(
        'active = "mine"\n[profiles.mine]\nPREFECT_SERVER_REGISTER_BLOCKS_ON_START = "true"\n'
    )
    server = EmbeddedServer()
    try:
        assert "secret" in block_types(server.wait(timeout=120))
    finally:
        server.stop()


def test_the_embedded_server_is_a_background_job_that_a_tostop_terminal_cannot_stop(tmp_path):
    """The embedded server runs in its own process group (a terminal's Ctrl-C is the command's
    to handle), so to the terminal it is a background job: under ``stty tostop`` its first write
    there (an error) would stop it with SIGTTOU while the command waits on it, and a read of the
    terminal would at any setting. It ignores SIGTTOU and reads no terminal."""
    from prefect_jax.cli.server import EmbeddedServer

    server = EmbeddedServer({"PREFECT_HOME": str(tmp_path / "home")})
    try:
        pid = server.process.pid
        assert os.getpgid(pid) == pid  # (its own group)
        status = dict(
            line.split(":\t", 1) for line in open(f"/proc/{pid}/status").read().splitlines()
        )
        assert int(status["SigIgn"], 16) & (1 << (signal.SIGTTOU - 1)), status["SigIgn"]
        assert os.readlink(f"/proc/{pid}/fd/0") == os.devnull
    finally:
        server.stop()


def test_the_device_copy_is_the_spec_s_default_unless_the_command_says_which():
    assert [
        _run_specs(*flags)[2].device_copy
        for flags in ((), ("--device-copy",), ("--no-device-copy",))
    ] == [None, True, False]


def test_the_console_script_imports_a_program_from_its_working_directory_and_json_says_a_failure(
    tmp_path, prefect_server, mlflow_uri
):
    """``prefect-jax`` (the console script, whose path starts at its own folder) finds
    ``myprog.model`` in the folder it runs in, as ``python -m`` would; a job that fails with an
    error the command does not know (a train hook raising) still ends ``--json`` with an object."""
    import subprocess
    import sys

    (tmp_path / "myprog").mkdir()
    (tmp_path / "myprog" / "__init__.py").write_text("")
    (tmp_path / "myprog" / "model.py").write_text(
        "from prefect_jax.examples.digits import tiny as program  # noqa: F401\n\n\n"
        "def boom(view):\n"
        "    raise RuntimeError(f'boom at step {view.step}')\n"
    )
    script = os.path.join(os.path.dirname(sys.executable), "prefect-jax")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PREFECT_API_URL"] = prefect_server
    proc = subprocess.run(
        [script, "run", "--program", "myprog.model:program", "--job", "mine"]
        + ["--storage", str(tmp_path / "s"), "--max-steps", "20", "--no-progress", "--json"]
        + ["--train-hook", "myprog.model:boom@every=10", "--mlflow-tracking-uri", mlflow_uri],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=600,
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    last = json.loads(proc.stdout.strip().splitlines()[-1])
    assert last["exit_code"] == 1 and "boom at step 10" in last["error"], last
    assert "Traceback" in proc.stderr  # (an error the command does not know keeps its traceback)


def _ctrl_c_mid_training(
    storage, mlflow_uri, job: str, env: dict, group: bool, mid_interval: bool = False
):
    """`prefect-jax run` of an endless job in a terminal's foreground group of its own, sent
    Ctrl-C (SIGINT: to its whole group where `group`, as a terminal does) once a checkpoint
    committed (`mid_interval`: 0.3 s into the next interval's 1 s of paced steps, once it logged
    that it trains it); its exit code, stderr, the seconds from the signal to its exit, and its
    checkpoint folder."""
    import subprocess
    import sys
    import threading

    from process_helpers import TESTS_DIR, wait_until

    program, every = ("programs:paced", 100) if mid_interval else (TINY, 500)
    proc = subprocess.Popen(
        [sys.executable, "-m", "prefect_jax.cli", "run", "--program", program, "--job", job]
        + ["--storage", str(storage), "--max-steps", "1000000", "--checkpoint-every-steps"]
        + [str(every), "--mlflow-tracking-uri", mlflow_uri, "--no-progress", "--exporters"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env={**env, "PYTHONPATH": os.pathsep.join([TESTS_DIR, env.get("PYTHONPATH", "")])},
        cwd=TESTS_DIR,
        start_new_session=True,  # (not the test's own group)
        # (a child inherits an ignored SIGINT from a shell's background job)
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    lines: list[str] = []

    def read() -> None:
        for line in proc.stderr:
            lines.append(line)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    ckpt = os.path.join(storage, job, "checkpoints")
    try:
        wait_until(lambda: committed_steps(ckpt), 300, "a committed checkpoint", proc, poll=0.1)
        if mid_interval:  # (on a slow machine its evaluation and next task take a while)
            training = f"training from step {every} to {2 * every}"
            wait_until(lambda: any(training in line for line in lines), 120, training, proc)
            time.sleep(0.3)
        (os.killpg if group else os.kill)(proc.pid, signal.SIGINT)
        sent = time.monotonic()
        proc.wait(timeout=120)
        took = time.monotonic() - sent
        reader.join(30)
        return proc.returncode, "".join(lines), took, ckpt
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


def test_a_ctrl_c_ends_the_command_in_one_line_saying_how_to_resume(
    tmp_path, prefect_server, mlflow_uri
):
    """Ctrl-C (SIGINT) mid-training: the step in flight checkpointed, exit 130, and a last line
    that says the same command resumes, not a traceback ending in a progress bar's frame."""
    from process_helpers import cli_env

    env = cli_env(prefect_server)
    code, err, _, ckpt = _ctrl_c_mid_training(
        tmp_path / "s", mlflow_uri, "intr", env, False, mid_interval=True
    )
    assert code == 130, err[-3000:]
    at = committed_steps(ckpt)[-1]
    assert at % 100 != 0, err[-3000:]  # the step in flight, checkpointed
    assert err.strip().splitlines()[-1] == (
        f"prefect-jax run: interrupted (Ctrl-C); step {at} is committed: run the same command "
        "again to resume there"
    ), err[-3000:]
    assert "KeyboardInterrupt" not in err, err[-3000:]


@pytest.mark.slow
def test_a_ctrl_c_in_a_terminal_leaves_the_embedded_server_to_the_command(tmp_path, mlflow_uri):
    """A terminal's Ctrl-C signals the whole foreground process group: the command's embedded
    Prefect server stopped at once, and the command, checkpointing its step, retried the dead
    server for about 75 s before it exited (a walkthrough's finding)."""
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}  # its own server
    code, err, took, _ = _ctrl_c_mid_training(tmp_path / "s", mlflow_uri, "tty", env, True)
    assert code == 130, err[-3000:]
    assert "interrupted (Ctrl-C); step " in err.strip().splitlines()[-1], err[-3000:]
    assert "Unable to connect" not in err and "Error logging to API" not in err, err[-3000:]
    assert took < 45, f"{took:.0f}s from Ctrl-C to the exit: {err[-3000:]}"


def test_a_stopped_commands_last_line_names_the_step_its_rerun_resumes_at():
    """The step committed on a notice was only in WARNING lines above the last one, which said
    "the newest committed step is kept" (a walkthrough's finding)."""
    from prefect_jax import cli
    from prefect_jax.training import facade, preemption

    try:
        preemption.note_resumes_at(227)
        assert cli._how_to_go_on().startswith("step 227 is committed: run the same command again")
        preemption.note_resumes_at(None)  # a notice before any step was committed
        assert cli._how_to_go_on().startswith("no step was committed yet")
    finally:
        facade.forget_resumes_at()
    assert facade.resumes_at() is None
    assert cli._how_to_go_on("run").startswith("the newest committed step is kept")
    # an evaluator commits no step (it said so of a job with none, waiting for its first)
    assert cli._how_to_go_on("evaluate").startswith("the evaluations and exports recorded are kept")


def test_automations_create_refuses_a_brake_and_no_brake_together(capsys):
    """(--no-brake silently won over --max-crashes.)"""
    from prefect_jax.cli import build_parser

    with pytest.raises(SystemExit) as refused:
        build_parser().parse_args(
            ["automations", "create", "--deployment", "d/x", "--no-brake", "--max-crashes", "3"]
        )
    assert refused.value.code == 2
    assert "argument --max-crashes: not allowed with argument --no-brake" in (
        capsys.readouterr().err
    )
    with pytest.raises(SystemExit):  # the default's value too (argparse compared the objects)
        build_parser().parse_args(
            ["automations", "create", "--deployment", "d/x", "--no-brake", "--max-crashes", "10"]
        )
    assert "not allowed with argument --no-brake" in capsys.readouterr().err
    proc = run_cli(
        "automations", "create", "--deployment", "d/x", "--no-brake", "--crash-window-secs", "60"
    )
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        "prefect-jax automations: error: --no-brake with --crash-window-secs 60: --no-brake makes "
        "no brake, so it has no window; drop one of them"
    ), proc.stderr


def test_automations_create_refuses_a_deployment_name_prefect_cannot_read_before_a_server(capsys):
    """(Prefect said "Invalid deployment name format" after the command started a server.)"""
    from prefect_jax.cli import build_parser
    from prefect_jax.deployments.automations import create_rerun_automation

    for bad in ["nope", "/x", "train/", "a/b/c", " /x", "train/x "]:
        with pytest.raises(SystemExit) as refused:
            build_parser().parse_args(["automations", "create", "--deployment", bad])
        assert refused.value.code == 2
        assert (
            f"argument --deployment: deployment {bad!r} is not 'flow-name/deployment-name': name "
            "it by its flow's name and its own, as `uv run prefect deployment ls` lists it"
        ) in capsys.readouterr().err
    with pytest.raises(ValueError, match="deployment 'nope' is not 'flow-name/deployment-name'"):
        create_rerun_automation("nope")  # (from Python: before the client is opened)
    args = build_parser().parse_args(["automations", "create", "--deployment", "train/x"])
    assert args.deployment == "train/x"


def test_a_roles_help_lists_only_the_flags_it_reads():
    """`export --help` listed the trainer's checkpoint and retention flags and the evaluator's
    throttle; a role's help now leaves out what it does not read (still accepted: one command
    line serves every role of a job)."""
    import contextlib
    import io

    from prefect_jax.cli import build_parser

    for command, shown, hidden in (
        ("run", ["--keep-last", "--throttle-secs", "--checkpoint-path"], []),
        ("train", ["--keep-last", "--train-hook"], ["--early-stopping-steps", "--eval-hook"]),
        ("evaluate", ["--throttle-secs", "--eval-steps"], ["--keep-last", "--train-hook"]),
        ("export", ["--step", "--exporters"], ["--keep-last", "--throttle-secs", "--eval-steps"]),
    ):
        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
            build_parser().parse_args([command, "--help"])
        text = out.getvalue()
        assert all(flag in text for flag in shown), (command, text)
        assert not [flag for flag in hidden if flag in text], (command, text)
    args = build_parser().parse_args(
        ["export", "--program", "p:q", "--job", "j", "--storage", "s", "--keep-last", "5"]
    )
    assert args.keep_last == 5


def test_every_spec_flag_is_placed_with_the_roles_that_read_it():
    """A new spec flag is shown in every role's --help, and accepted there without a warning,
    unless it is listed as a trainer's (`_TRAINING_ONLY`) or an evaluator's (`_EVALUATION_ONLY`):
    a newcomer's flag landed in `evaluate --help` unnoticed. Each flag is placed on purpose,
    the ones every role reads named here."""
    from prefect_jax.cli import build_parser
    from prefect_jax.cli.arguments import _EVALUATION_ONLY, _TRAINING_ONLY
    from prefect_jax.cli.spec_flags import EARLY_STOPPING_FLAGS, EXPORTER_FLAGS, SPEC_FLAGS

    every_role = {
        "--max-steps",  # the trainer's horizon; the others' final step
        "--seed",
        "--sigterm-grace-secs",
        "--lease-timeout-secs",
        "--eval-name",  # whose records the export role reads
        "--registered-model",
        "--export-platforms",  # the train role checks its exporters' serve for them
        "--exports-to-keep",
    }
    args = build_parser().parse_args(["run", "--program", "p:q", "--job", "j", "--storage", "s"])
    dests = [d for flags in SPEC_FLAGS.values() for d in flags.values()]
    dests += [d for flags in EXPORTER_FLAGS.values() for d in flags.values()]
    dests += list(EARLY_STOPPING_FLAGS.values())
    flags = {args.flag_of_dest[d] for d in dests}
    assert flags - _TRAINING_ONLY - _EVALUATION_ONLY == every_role
    assert not _TRAINING_ONLY & _EVALUATION_ONLY


def test_a_flag_the_role_does_not_read_is_warned_of_naming_the_roles_that_do():
    """A porter puts TF's early stopping on the trainer (`stop_if_no_decrease_hook` was the
    chief's hook); `train` accepted it and ignored it without a word. It still accepts it (one
    command line serves every role of a job) and says where it acts."""
    from prefect_jax.cli import build_parser
    from prefect_jax.cli.spec_flags import unread_flags_given

    job = ["--program", "p:q", "--job", "j", "--storage", "s"]
    given = ["--early-stopping-steps", "100", "--eval-hook", "m:H", "--keep-last", "5"]
    assert unread_flags_given(build_parser().parse_args(["train", *job, *given])) == (
        "prefect-jax train: warning: train does not read --early-stopping-steps, --eval-hook "
        "(read by run, evaluate): no effect here; give them to the job's role that reads them (its "
        "trainer stops when its evaluator asks)"
    )
    said = unread_flags_given(build_parser().parse_args(["export", *job, *given]))
    assert "--keep-last (read by run, train); --early-stopping-steps, --eval-hook (read by" in said
    assert unread_flags_given(build_parser().parse_args(["run", *job, *given])) is None
    assert unread_flags_given(build_parser().parse_args(["train", *job])) is None
    # Typed with its default's value, it is given too (the command keeps what was typed).
    for typed in (["--throttle-secs", "0"], ["--throttle-secs=0"]):
        args = build_parser().parse_args(["train", *job, *typed])
        assert unread_flags_given(args) is None  # (nothing says what was typed)
        args.argv = ["train", *job, *typed]
        said = unread_flags_given(args) or ""
        assert "train does not read --throttle-secs (read by run, evaluate)" in said, typed
        # (the trainer stopping when asked is said only of early stopping's flags: the TF porter
        # read it beside --throttle-secs)
        assert said.endswith("give them to the job's role that reads them"), said


def test_an_unknown_flag_says_what_it_likely_meant_and_is_json_under_json(capsys):
    """TF's names (`--model_dir`, `--save_checkpoints_steps`), underscores for hyphens and near
    misses get their meaning here; with --json the refusal is also the error object, as any
    refused command's is."""
    from prefect_jax.cli import main

    job = ["run", "--program", "p:q", "--job", "j", "--storage", "s"]
    with pytest.raises(SystemExit) as exited:
        main([*job, "--save_checkpoints_steps", "5", "--max_steps", "9", "--json"])
    assert exited.value.code == 2
    out, err = capsys.readouterr()
    said = (
        "unrecognized arguments: --save_checkpoints_steps 5 --max_steps 9; "
        "--save_checkpoints_steps is --checkpoint-every-steps here; --max_steps is --max-steps here"
    )
    assert json.loads(out.strip().splitlines()[-1]) == {"error": said, "exit_code": 2}
    assert err.strip().splitlines()[-1] == f"prefect-jax run: error: {said}"
    with pytest.raises(SystemExit):
        main([*job, "--early-stoping-steps", "3", "--model_dir", "/x"])
    out, err = capsys.readouterr()
    assert out == "" and err.strip().splitlines()[-1].endswith(
        "--early-stoping-steps: did you mean --early-stopping-steps?; --model_dir is --storage "
        "and --job (the job's directory is <storage>/<job>) here"
    )
    # Keras's fit: --epochs was "did you mean --processes?"
    with pytest.raises(SystemExit):
        main([*job, "--epochs", "5", "--patience", "2"])
    assert (
        capsys.readouterr()
        .err.strip()
        .endswith(
            "--epochs is --max-steps (epochs x batches per epoch) here; --patience is "
            "--early-stopping-steps (patience x batches per epoch) here"
        )
    )
    # another subcommand's flag; and a required flag missing beside (argparse names only that)
    with pytest.raises(SystemExit):
        main(["export", *job[1:], "--once"])
    assert capsys.readouterr().err.strip().endswith("--once is a flag of evaluate, not export")
    with pytest.raises(SystemExit):
        main(["train", "--program", "p:q", "--model_dir", "/x", "--json"])
    out, err = capsys.readouterr()
    assert json.loads(out)["error"] == (
        "the following arguments are required: --job, --storage; --model_dir is --storage and "
        "--job (the job's directory is <storage>/<job>) here"
    )
