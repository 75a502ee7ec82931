"""Issue 53: every record the project writes is rebuilt from what it summarises or named in a
clear error, never silently replaced; each metric lands in MLflow once."""

from __future__ import annotations

import json
import logging
import os
import re

from conftest import train_and_close, train_to_end
from mlflow.tracking import MlflowClient
from process_helpers import status

from prefect_jax.training.trainer import Trainer


def test_a_rerun_of_a_finished_job_logs_each_goodput_metric_once(job_config, mlflow_uri):
    config = job_config(max_steps=20, every_steps=10)
    first = train_and_close(config)
    train_and_close(config)  # finished: it restores step 20, trains nothing, finishes again
    client = MlflowClient(mlflow_uri)
    run_id = first.job.tracker.run_id
    keys = [k for k in client.get_run(run_id).data.metrics if k.startswith("goodput/")]
    assert "goodput/goodput" in keys
    for key in keys:
        assert [m.step for m in client.get_metric_history(run_id, key)] == [20], key


def _trained_and_evaluated(config):
    trainer = Trainer(config)
    trainer.restore_or_init()
    while trainer.step < config.train.max_steps:
        trainer.train_until_checkpoint()
        trainer.evaluate_if_new(trainer.step)
    trainer.finish()
    trainer.close()
    return trainer


def _truncate(path):
    data = open(path, "rb").read()
    open(path, "wb").write(data[: len(data) // 2])


def test_a_truncated_eval_record_is_named_moved_aside_and_its_step_evaluated_again(
    job_config, caplog
):
    config = job_config(max_steps=20, every_steps=10)
    first = _trained_and_evaluated(config)
    evals = first.job.storage.eval_dir(config.eval.name)
    metrics = first.job.records.get(20).metrics
    _truncate(os.path.join(evals, "20.json"))
    job = status(config.job, config.storage)
    (damaged,) = job["damaged_records"]
    assert (
        damaged["path"].endswith("evals/eval/20.json") and "evaluates that step" in damaged["fix"]
    )

    with caplog.at_level(logging.WARNING):
        rerun = Trainer(config)
        assert rerun.restore_or_init() == 20
    assert re.search(r"the record \S+/evals/eval/20\.json is damaged", caplog.text), caplog.text
    assert [n for n in os.listdir(evals) if n.startswith("20.json.damaged-")]
    result = rerun.evaluate_if_new(20)  # redone: the step is committed
    assert result.metrics == metrics
    rerun.finish()
    rerun.close()
    assert "damaged_records" not in status(config.job, config.storage)


def test_a_truncated_goodput_ledger_is_kept_aside_not_written_over(job_config, caplog):
    config = job_config(max_steps=20, every_steps=10)
    first = _trained_and_evaluated(config)
    ledger = os.path.join(config.storage, config.job, "goodput.json")
    _truncate(ledger)
    damaged = open(ledger, "rb").read()
    assert status(config.job, config.storage)["damaged_records"][0]["path"].endswith("goodput.json")
    with caplog.at_level(logging.WARNING):
        train_and_close(
            config.model_copy(update={"train": config.train.model_copy(update={"max_steps": 30})})
        )
    assert "goodput.json is damaged" in caplog.text and "moved aside" in caplog.text
    (kept,) = [n for n in os.listdir(os.path.dirname(ledger)) if ".damaged-" in n]
    assert open(os.path.join(os.path.dirname(ledger), kept), "rb").read() == damaged
    assert json.load(open(ledger))["attempts"], "a new ledger, started by the rerun"
    del first


def test_a_truncated_registry_record_is_named_by_status(job_config):
    config = job_config(max_steps=10, every_steps=10)
    train_and_close(config)
    path = os.path.join(config.storage, config.job, "registry.json")
    open(path, "w").write('{"name": "tiny", "trac')
    job = status(config.job, config.storage)
    (damaged,) = job["damaged_records"]
    assert damaged["path"].endswith("registry.json") and "next export" in damaged["fix"]
    assert "registered_model" not in job


def test_status_lists_registered_versions_in_step_order(tmp_path, capsys):
    """registry.json keys versions by step as JSON strings; ``status`` (text and ``--json``)
    lists them by step, not as text ("100" before "20"). MLflow cannot be reached here, so both
    show the copy the job recorded."""
    import argparse

    from prefect_jax.cli.status import cmd_status
    from prefect_jax.training.storage import JobStorage

    js = JobStorage(str(tmp_path / "storage"), "reg")
    js.write_json(  # as the job writes it (keys sorted, as text)
        js.path("registry.json"),
        {
            "name": "reg-model",
            "tracking_uri": f"sqlite:///{tmp_path}/no-such-dir/mlflow.db",
            "versions": {"20": "1", "40": "2", "100": "5"},
            "aliases": {"newest": "5"},
        },
    )
    args = argparse.Namespace(job="reg", storage=js.root, json=True)
    assert cmd_status(args) == 0
    registry = json.loads(capsys.readouterr().out.splitlines()[-1])["registered_model"]
    assert list(registry["versions"]) == ["20", "40", "100"] and "not reachable" in registry["note"]
    assert cmd_status(argparse.Namespace(job="reg", storage=js.root, json=False)) == 0
    assert "v1 (step 20), v2 (step 40), v5 (step 100)" in capsys.readouterr().out


def _best_exports_of_a_finished_job(job_config):
    """A job trained to step 60 that evaluated and exported (BestExporter on loss) every 20 steps,
    its trainer closed: its config, storage and exporter."""
    from prefect_jax.training.specs import BestExporter

    exporter = BestExporter(metric="loss", mode="min", keep=5)
    config = job_config(max_steps=60, every_steps=20, exporters=[exporter], keep_last=5)
    trainer = Trainer(config)
    trainer.restore_or_init()
    train_to_end(trainer)
    trainer.finish()
    trainer.close()
    return config, trainer.job.storage, exporter


def test_a_truncated_best_record_is_rebuilt_from_the_exports_and_kept_aside(job_config, caplog):
    """``best.json`` read as absent would let the next evaluation take @best from a better step:
    a damaged one is rebuilt from the kept exports' ``export.json`` (their steps and metrics)."""
    from prefect_jax.training.exporters import read_best

    _, storage, exporter = _best_exports_of_a_finished_job(job_config)
    path = f"{storage.export_dir('best')}/best.json"
    saved = json.load(open(path))
    _truncate(path)
    with caplog.at_level(logging.WARNING, logger="prefect_jax.trainer"):
        rebuilt = read_best(storage, exporter)
    assert rebuilt == saved
    assert json.load(open(path)) == saved  # written back whole
    assert [p for p in os.listdir(os.path.dirname(path)) if p.startswith("best.json.damaged-")]
    assert re.search(r"best\.json is damaged .*rebuilt from the exports", caplog.text), caplog.text


def test_a_damaged_export_record_is_named_left_out_of_the_rebuilt_best_and_listed(
    job_config, caplog
):
    """A kept export's ``export.json`` that is not JSON raised the raw JSON error where it was
    read (the rebuild of a damaged ``best.json``): that export is left out with a warning naming
    the file, and ``status`` lists it with what becomes of it."""
    from prefect_jax.training.exporters import exported_steps, read_best

    config, storage, exporter = _best_exports_of_a_finished_job(job_config)
    steps = exported_steps(storage, "best")
    assert len(steps) >= 2, steps
    best_path = f"{storage.export_dir('best')}/best.json"
    saved = json.load(open(best_path))
    damaged = f"{storage.export_dir('best', saved['step'])}/export.json"
    _truncate(damaged)
    _truncate(best_path)
    with caplog.at_level(logging.WARNING, logger="prefect_jax.trainer"):
        rebuilt = read_best(storage, exporter)
    assert rebuilt is not None and rebuilt["step"] != saved["step"] and rebuilt["step"] in steps
    assert re.search(
        rf"{re.escape(damaged)} is damaged .*leaves step {saved['step']} out", caplog.text
    ), caplog.text
    job = status(config.job, config.storage)
    (listed,) = job["damaged_records"]
    assert listed["path"].endswith(f"/{saved['step']}/export.json"), listed
    assert "left out" in listed["fix"], listed


def test_a_damaged_stop_request_still_stops_the_job_and_names_the_file(tmp_path):
    """A torn ``stop.json`` says somebody asked to stop: it is not read as no request (the job
    would run on against the request), and its reason names the file and the fix."""
    from prefect_jax.training.control import request_stop, stop_path, stop_requested
    from prefect_jax.training.storage import JobStorage

    storage = JobStorage(str(tmp_path / "s"), "j")
    request_stop(storage, "enough", step=10, by="a person")
    _truncate(stop_path(storage))
    stop = stop_requested(storage)
    assert stop is not None and "stop.json is damaged" in stop["reason"], stop
    assert "delete the file" in stop["reason"]


def test_a_damaged_rerun_count_is_kept_aside_and_counted_anew(tmp_path, caplog):
    from prefect_jax.training.control import record_attempt
    from prefect_jax.training.storage import JobStorage

    storage = JobStorage(str(tmp_path / "s"), "j")
    assert record_attempt(storage, 10, 3) == 0
    assert record_attempt(storage, 10, 3) == 1
    _truncate(storage.path("attempts.json"))
    with caplog.at_level(logging.WARNING, logger="prefect_jax.trainer"):
        assert record_attempt(storage, 10, 3) == 0
    assert "attempts.json is damaged" in caplog.text and "counting reruns anew" in caplog.text
    kept = [p for p in os.listdir(os.path.dirname(storage.path("attempts.json"))) if "damaged" in p]
    assert kept and kept[0].startswith("attempts.json.damaged-")


def test_a_damaged_export_record_still_registers_its_model_and_names_the_file(
    tmp_path, mlflow_uri, caplog
):
    """Registering an export read its ``export.json`` for the model's metadata and raised the raw
    JSON error: the model (whole, beside it) is logged without that metadata, and the file named."""
    import jax
    import numpy as np

    from prefect_jax.training.registry import log_export_model

    w = np.linspace(-1, 1, 8, dtype=np.float32).reshape(4, 2)
    batch = jax.export.symbolic_shape("b")[0]
    export = tmp_path / "export"
    export.mkdir()
    exported = jax.export.export(jax.jit(lambda x: x @ w))(
        jax.ShapeDtypeStruct((batch, 4), np.float32)
    )
    (export / "model.jax_export").write_bytes(exported.serialize())
    (export / "export.json").write_text('{"program": "tiny", "metr')
    client = MlflowClient(mlflow_uri)
    experiment = client.create_experiment("damaged-export-record")
    run = client.create_run(experiment)
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    with caplog.at_level(logging.WARNING, logger="prefect_jax.registry"):
        model_id = log_export_model(
            client, mlflow_uri, experiment, run.info.run_id, "j", "j-key", 1, str(export), x
        )
    assert model_id
    assert re.search(
        rf"{re.escape(str(export / 'export.json'))} is damaged .*registered without its metadata",
        caplog.text,
    ), caplog.text


def test_an_uncounted_attempt_leaves_the_record_as_it_was_and_a_task_retry_counts_nothing(
    tmp_path,
):
    """`Job.uncounted_if` puts back what `count_attempt` replaced: a run refused for its input."""
    from prefect_jax.training.control import count_attempt, uncount_attempt
    from prefect_jax.training.storage import JobStorage

    storage = JobStorage(str(tmp_path / "s"), "j")
    path = storage.path("attempts.json")
    assert count_attempt(storage, 10, 3) == (0, {})  # the first: there was no record
    uncount_attempt(storage, {})
    assert not os.path.exists(path)
    count_attempt(storage, 10, 3)
    before = storage.read_json(path)
    same, replaced = count_attempt(storage, 10, 3)
    assert same == 1 and replaced == before
    uncount_attempt(storage, replaced)
    assert storage.read_json(path) == before
    # a task retry (the flow run and process that counted it) writes nothing: nothing to put back
    count_attempt(storage, 20, 3, "flow-run-1", "host:1")
    assert count_attempt(storage, 20, 3, "flow-run-1", "host:1") == (0, None)
    uncount_attempt(storage, None)
    assert storage.read_json(path)["step"] == 20
