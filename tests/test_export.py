"""Latest, Best and Final exporters: real jax.export artifacts on disk, durable best value."""

import json

import numpy as np
import pytest

from prefect_jax.examples.digits import load_digits_split
from prefect_jax.training.evaluation import EvalResult, EvalStatus
from prefect_jax.training.exporters import is_the_final_export, list_exports, load_export
from prefect_jax.training.program import ProgramError
from prefect_jax.training.specs import BestExporter, FinalExporter, LatestExporter
from prefect_jax.training.trainer import Trainer
from conftest import train_to_end


def test_exports_run_without_the_program_and_match_serve(job_config):
    trainer = Trainer(job_config(max_steps=20, exporters=[FinalExporter()]))
    trainer.restore_or_init()
    train_to_end(trainer)
    path = trainer.storage.export_dir("final", 20)
    info = json.load(open(f"{path}/export.json"))
    assert info["step"] == 20 and set(info["metrics"]) == {"accuracy", "loss"}
    _, _, x, _ = load_digits_split()
    served = load_export(path)(x[:7])  # symbolic batch dimension: any batch size
    expected = trainer.program.serve(trainer.state, x[:7])
    np.testing.assert_allclose(np.asarray(served), np.asarray(expected), rtol=1e-6)


def test_latest_keeps_the_newest_n(job_config):
    trainer = Trainer(job_config(max_steps=80, every_steps=20, exporters=[LatestExporter(keep=2)]))
    trainer.restore_or_init()
    train_to_end(trainer)
    assert list_exports(trainer.storage) == {"latest": [60, 80]}


def test_best_exports_only_improvements_and_remembers_across_restarts(job_config):
    config = job_config(max_steps=40, exporters=[BestExporter(metric="loss", mode="min", keep=5)])
    trainer = Trainer(config)
    trainer.restore_or_init()
    train_to_end(trainer)
    best = json.load(open(trainer.storage.export_dir("best") + "/best.json"))
    exported = list_exports(trainer.storage)["best"]
    assert best["step"] == exported[-1]
    trainer.close()

    # A new process sees the durable best value: a worse result exports nothing, a better one does.
    again = Trainer(config)
    worse = EvalResult(status=EvalStatus.EVALUATED, step=41, metrics={"loss": best["value"] + 1, "accuracy": 0.0})
    assert again.export(worse) == {}
    again.restore_or_init()
    better = EvalResult(status=EvalStatus.EVALUATED, step=40, metrics={"loss": best["value"] - 1, "accuracy": 1.0})
    if best["step"] != 40:
        assert again.export(better) == {"best": again.storage.export_dir("best", 40)}
        assert json.load(open(again.storage.export_dir("best") + "/best.json"))["step"] == 40


def test_best_with_unknown_metric_names_the_metrics(job_config):
    trainer = Trainer(job_config(max_steps=20, exporters=[BestExporter(metric="f1")]))
    trainer.restore_or_init()
    trainer.train_until_checkpoint()
    with pytest.raises(ValueError, match=r"compares metric 'f1', but the eval results hold \['accuracy', 'loss'\]"):
        trainer.export(trainer.evaluate_if_new())


def test_final_exports_only_at_max_steps(job_config):
    trainer = Trainer(job_config(max_steps=40, exporters=[FinalExporter()]))
    trainer.restore_or_init()
    results = train_to_end(trainer)
    assert [r.step for r in results] == [20, 40]
    assert [is_the_final_export(r, 40) for r in results] == [False, True]
    assert list_exports(trainer.storage) == {"final": [40]}


def test_exporters_need_a_serving_function(job_config):
    class NoServe:
        def __init__(self):
            from prefect_jax.examples.digits import tiny

            self._p = tiny

        def __getattr__(self, name):
            if name in ("serve", "serving_input"):
                raise AttributeError(name)
            return getattr(self._p, name)

    with pytest.raises(ProgramError, match="no serve\\(state, inputs\\) and serving_input\\(\\)"):
        Trainer(job_config(exporters=[LatestExporter()]), program=NoServe())
