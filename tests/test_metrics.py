"""Metrics users read: train metrics logged as means over the steps since the previous log point
(summed on the device, exact across resumes and steps_per_dispatch), the engine's throughput,
and eval metrics the program derives from the aggregated means (perplexity)."""

import json
import math
from pathlib import Path

import jax
import numpy as np
import pytest
from mlflow.tracking import MlflowClient

from prefect_jax.training.exporters import BestExporter, list_exports
from prefect_jax.training.loop import Loop, iterate
from prefect_jax.training.program import load_program
from prefect_jax.training.specs import TrainSpec
from prefect_jax.training.train_means import train_rows
from prefect_jax.training.trainer import Trainer

TINY = "prefect_jax.examples.digits:tiny"


@pytest.fixture
def tests_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parent))


def _with_log_every(config, log_every: int):
    return config.model_copy(
        update={"train": config.train.model_copy(update={"log_every_steps": log_every})}
    )


def _bare_losses(program_path: str, seed: int, steps: int) -> list[float]:
    """Each step's loss from a bare loop: jit(train_step) over the program's own data."""
    program = load_program(program_path)
    loop = Loop(program, TrainSpec(max_steps=steps, seed=seed))
    state = loop.place(loop.init_state())
    it = iterate(program.train_data(seed), getattr(program, "read_options", None))
    step = jax.jit(program.train_step)
    losses = []
    for _ in range(steps):
        state, metrics = step(state, next(it))
        losses.append(float(metrics["loss"]))
    return losses


def _history(trainer, key: str) -> list[tuple[int, float]]:
    client = MlflowClient(trainer.config.mlflow_tracking_uri)
    return sorted(
        (m.step, m.value) for m in client.get_metric_history(trainer.job.tracker.run_id, key)
    )


def _train(config) -> Trainer:
    trainer = Trainer(config)
    trainer.restore_or_init()
    while trainer.step < config.train.max_steps:
        trainer.train_until_checkpoint()
    trainer.job.checkpoints.wait()
    trainer.finish()
    return trainer


@pytest.mark.parametrize("per_dispatch", [1, 3])
def test_logged_train_loss_is_the_mean_of_the_steps_since_the_last_log_point(
    job_config, per_dispatch
):
    # log_every=4, checkpoints every 10: log points 4, 8, 10 (the checkpoint), 12, 16, 20.
    config = _with_log_every(
        job_config(
            max_steps=20, every_steps=10, job=f"k{per_dispatch}", steps_per_dispatch=per_dispatch
        ),
        4,
    )
    trainer = _train(config)
    losses = _bare_losses(TINY, config.train.seed, 20)
    logged = _history(trainer, "train/loss")
    assert [s for s, _ in logged] == [4, 8, 10, 12, 16, 20]
    expected = [
        np.mean(losses[a:b]) for a, b in [(0, 4), (4, 8), (8, 10), (10, 12), (12, 16), (16, 20)]
    ]
    np.testing.assert_allclose([v for _, v in logged], expected, rtol=1e-4)
    # The throughput is logged beside them, at the same steps.
    rates = _history(trainer, "train/steps_per_sec")
    assert [s for s, _ in rates] == [4, 8, 10, 12, 16, 20]
    assert all(v > 0 for _, v in rates)
    assert _history(trainer, "train/tokens_per_sec") == []  # (the tiny program declares none)
    trainer.close()


def test_a_resumed_job_logs_the_means_an_uninterrupted_one_does(job_config):
    straight = _train(_with_log_every(job_config(max_steps=20, every_steps=10, job="straight"), 4))
    config = _with_log_every(job_config(max_steps=20, every_steps=10, job="resumed"), 4)
    first = Trainer(config)
    first.restore_or_init()
    first.train_until_checkpoint()  # to step 10
    # It trains on past its checkpoint, and dies before logging: the rerun restores step 10.
    first.loop.run(first.state, first.step, first.data_iter, 13, lambda: False)
    first.job.checkpoints.wait()
    first.close()
    resumed = _train(config)
    logged, expected = _history(resumed, "train/loss"), _history(straight, "train/loss")
    assert [s for s, _ in logged] == [s for s, _ in expected] == [4, 8, 10, 12, 16, 20]
    np.testing.assert_allclose([v for _, v in logged], [v for _, v in expected], rtol=1e-5)
    losses = _bare_losses(TINY, config.train.seed, 20)
    means = [
        np.mean(losses[a:b]) for a, b in [(0, 4), (4, 8), (8, 10), (10, 12), (12, 16), (16, 20)]
    ]
    np.testing.assert_allclose([v for _, v in logged], means, rtol=1e-4)
    straight.close()
    resumed.close()


def test_a_job_resumed_from_a_checkpoint_between_log_points_logs_the_same_means(job_config):
    # A preemption (or backup) checkpoint at step 6, between the log points 4 and 8: it carries
    # the sums of steps 5 and 6, so the rerun's mean at step 8 is over steps 5..8, as an
    # uninterrupted job's is.
    config = _with_log_every(job_config(max_steps=20, every_steps=10, job="preempted"), 4)
    first = Trainer(config)
    first.restore_or_init()
    first.job.acquire_lease()
    calls = iter([False] * 5 + [True])  # the loop asks after each step: stop after step 6
    interval = first.loop.run(first.state, 0, first.data_iter, 10, lambda: next(calls))
    first.state, first.step = interval.state, interval.step
    assert first.step == 6
    first.intervals.save(train_rows(interval.logged), preemption=True)
    first.job.checkpoints.wait()
    first.close()
    resumed = _train(config)
    assert resumed.started_from == 6
    losses = _bare_losses(TINY, config.train.seed, 20)
    logged = _history(resumed, "train/loss")
    assert [s for s, _ in logged] == [4, 8, 10, 12, 16, 20]
    windows = [(0, 4), (4, 8), (8, 10), (10, 12), (12, 16), (16, 20)]
    np.testing.assert_allclose(
        [v for _, v in logged], [np.mean(losses[a:b]) for a, b in windows], rtol=1e-4
    )
    resumed.close()


def test_a_run_that_stops_off_a_log_point_carries_its_sums_to_the_next_call():
    # A backup or a stop request ends `Loop.run` between log points: the next call from that step
    # goes on summing, so the log point after it still holds the mean of all its steps.
    program = load_program(TINY)
    loop = Loop(program, TrainSpec(max_steps=12, log_every_steps=4, seed=0))
    state, it = loop.place(loop.init_state()), loop.fresh_iter()
    calls = iter([False, False, False, False, False, True])  # stops after step 6
    first = loop.run(state, 0, it, 12, lambda: next(calls))
    assert first.step == 6
    second = loop.run(first.state, 6, it, 12, lambda: False)
    rows = [(s, v) for k, v, s in train_rows(first.logged + second.logged) if k == "loss"]
    losses = _bare_losses(TINY, 0, 12)
    assert [s for s, _ in rows] == [4, 8, 12]
    np.testing.assert_allclose(
        [v for _, v in rows],
        [np.mean(losses[0:4]), np.mean(losses[4:8]), np.mean(losses[8:12])],
        rtol=1e-5,
    )


def test_derived_eval_metric_reaches_mlflow_the_records_and_the_best_exporter(
    job_config, tests_on_path
):
    config = job_config(
        max_steps=40,
        every_steps=20,
        program="programs:DigitsWithPerplexity",
        exporters=[BestExporter(metric="perplexity", mode="min")],
    )
    trainer = Trainer(config)
    trainer.restore_or_init()
    results = []
    while trainer.step < config.train.max_steps:
        trainer.train_until_checkpoint()
        result = trainer.evaluate_if_new()
        trainer.export(result)
        results.append(result)
    trainer.job.checkpoints.wait()
    trainer.finish()
    for result in results:
        assert result.metrics["perplexity"] == pytest.approx(math.exp(result.metrics["loss"]))
    # MLflow, the durable record (what `status` and the summary read), the best export.
    logged = _history(trainer, "eval/perplexity")
    assert [s for s, _ in logged] == [r.step for r in results] == [20, 40]
    np.testing.assert_allclose([v for _, v in logged], [r.metrics["perplexity"] for r in results])
    assert trainer.job.records.get(40).metrics["perplexity"] == results[-1].metrics["perplexity"]
    best = json.load(open(trainer.job.storage.export_dir("best") + "/best.json"))
    assert best["metric"] == "perplexity"
    best_step = min(results, key=lambda r: r.metrics["perplexity"]).step
    assert best["step"] == best_step and best_step in list_exports(trainer.job.storage)["best"]
    # tokens/s: the throughput times the program's tokens_per_step.
    steps, tokens = (
        _history(trainer, "train/steps_per_sec"),
        _history(trainer, "train/tokens_per_sec"),
    )
    assert [s for s, _ in tokens] == [s for s, _ in steps] == [10, 20, 30, 40]
    np.testing.assert_allclose([t for _, t in tokens], [32 * s for _, s in steps])
    trainer.close()


def test_a_derived_metric_named_like_an_aggregated_one_is_refused(job_config, tests_on_path):
    trainer = Trainer(job_config(max_steps=20, program="programs:clashing_derived"))
    trainer.restore_or_init()
    trainer.train_until_checkpoint()
    with pytest.raises(ValueError, match=r"derive_metrics returned \['loss'\], already aggregated"):
        trainer.evaluate_if_new()
    trainer.job.checkpoints.wait()
    assert trainer.job.checkpoints.committed_steps() == [20]  # nothing saved is lost
    trainer.close()


def test_the_byte_lm_logs_perplexity_and_its_extra_train_metrics_as_means(job_config):
    config = job_config(max_steps=10, every_steps=10, program="prefect_jax.examples.bytelm:tiny")
    trainer = Trainer(config)
    trainer.restore_or_init()
    trainer.train_until_checkpoint()
    result = trainer.evaluate_if_new()
    trainer.job.checkpoints.wait()
    trainer.finish()
    assert result.metrics["perplexity"] == pytest.approx(math.exp(result.metrics["loss"]))
    assert _history(trainer, "eval/perplexity") == [
        (10, pytest.approx(result.metrics["perplexity"]))
    ]
    # The program's own extra metrics, as means of the logged steps (the warmup's learning
    # rates 0..9 steps in), and the tokens it learnt from per second.
    program = trainer.loop.program
    lr = _history(trainer, "train/learning_rate")
    assert [s for s, _ in lr] == [10]
    assert lr[0][1] == pytest.approx(np.mean([float(program.schedule(i)) for i in range(10)]))
    assert [s for s, _ in _history(trainer, "train/grad_norm")] == [10]
    (steps,) = _history(trainer, "train/steps_per_sec")
    (tokens,) = _history(trainer, "train/tokens_per_sec")
    assert tokens[1] == pytest.approx(steps[1] * program.tokens_per_step)
    trainer.close()


def test_the_progress_card_shows_train_means_and_eval_metrics():
    from prefect_jax.flows.progress_card import _progress, shown_metrics

    shown = shown_metrics({"loss": 2.5, "steps_per_sec": 40.0}, {"perplexity": 12.18}, "eval")
    assert _progress(10, 40, "job", shown)["description"] == (
        "training job: step 10 of 40 | train/loss 2.5, train/steps_per_sec 40, "
        "eval/perplexity 12.18"
    )
