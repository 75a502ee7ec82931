"""Evaluation: exact aggregation, durable records, statuses, across restarts."""

import jax
import numpy as np
import pytest
from pydantic import ValidationError

from prefect_jax.examples.digits import DigitsProgram, load_digits_split
from prefect_jax.training.evaluation import EvalResult, EvalStatus
from prefect_jax.training.trainer import Trainer


def _tiny(**kw):
    return DigitsProgram(**{"hidden": (32, 32), "learning_rate": 3e-3, "batch_size": 32, **kw})


def test_metrics_are_exact_over_uneven_batches(job_config):
    program = _tiny(eval_batch_size=100)  # 359 eval examples: batches of 100, 100, 100, 59
    trainer = Trainer(job_config(), program=program)
    trainer.restore_or_init()
    trainer.train_until_checkpoint()
    result = trainer.evaluate_if_new()
    _, _, x, y = load_digits_split()
    logits = np.asarray(program.apply(trainer.state["params"], x))
    assert result.status is EvalStatus.EVALUATED
    assert result.num_batches == 4 and result.num_examples == 359
    assert result.metrics["accuracy"] == pytest.approx(float((logits.argmax(-1) == y).mean()), abs=1e-7)
    expected_loss = float(np.mean(-jax.nn.log_softmax(logits)[np.arange(len(y)), y]))
    assert result.metrics["loss"] == pytest.approx(expected_loss, rel=1e-5)


def test_eval_steps_limits_the_batches(job_config):
    trainer = Trainer(job_config(eval_steps=2), program=_tiny(eval_batch_size=100))
    trainer.restore_or_init()
    result = trainer.evaluate_if_new(0)
    assert result.num_batches == 2 and result.num_examples == 200


def test_each_step_is_evaluated_once_across_restarts(job_config):
    config = job_config(max_steps=40)
    trainer = Trainer(config)
    trainer.restore_or_init()
    trainer.train_until_checkpoint()
    first = trainer.evaluate_if_new()
    assert first.status is EvalStatus.EVALUATED and first.step == 20
    again = trainer.evaluate_if_new()
    assert again.status is EvalStatus.NO_NEW_CHECKPOINT and again.metrics == first.metrics
    trainer.checkpoints.wait()
    trainer.close()

    restarted = Trainer(config)
    assert restarted.restore_or_init() == 20
    assert restarted.evaluate_if_new().status is EvalStatus.NO_NEW_CHECKPOINT
    assert restarted.records.steps() == [20]
    history = restarted.tracker.metric_history("eval/accuracy")
    assert history == [(20, first.metrics["accuracy"])]


def test_missing_checkpoint_status(job_config):
    trainer = Trainer(job_config())
    result = trainer.evaluate_if_new()
    assert result.status is EvalStatus.MISSING_CHECKPOINT


def test_evaluating_a_committed_step_from_storage(job_config):
    config = job_config(max_steps=40)
    writer = Trainer(config)
    writer.restore_or_init()
    writer.train_until_checkpoint()
    writer.checkpoints.wait()
    reader = Trainer(config.model_copy(update={"eval": config.eval.model_copy(update={"name": "other"})}))
    result = reader.evaluate_if_new()  # no live state: restores the newest committed step
    assert result.status is EvalStatus.EVALUATED and result.step == 20 and result.name == "other"
    assert reader.state is None


def test_throttle_skips_but_never_the_final_step(job_config):
    config = job_config(max_steps=40)
    config = config.model_copy(update={"eval": config.eval.model_copy(update={"throttle_secs": 3600})})
    trainer = Trainer(config)
    trainer.restore_or_init()
    trainer.train_until_checkpoint()
    assert trainer.evaluate_if_new().status is EvalStatus.EVALUATED
    assert trainer.evaluate_if_new().status is EvalStatus.NO_NEW_CHECKPOINT
    trainer.train_until_checkpoint()
    final = trainer.evaluate_if_new()
    assert final.status is EvalStatus.EVALUATED and final.is_final and final.step == 40


def test_eval_result_validation():
    with pytest.raises(ValidationError, match="needs the global step"):
        EvalResult(status=EvalStatus.EVALUATED, metrics={"a": 1.0})
    with pytest.raises(ValidationError, match="has no metrics"):
        EvalResult(status=EvalStatus.EVALUATED, step=3, metrics={})
    assert EvalResult(status=EvalStatus.NO_NEW_CHECKPOINT).step is None


def test_eval_step_must_return_sum_count_pairs(job_config):
    class NoCounts(DigitsProgram):
        def eval_step(self, state, batch):
            return {"accuracy": batch["y"].sum()}

    trainer = Trainer(job_config(), program=NoCounts(hidden=(32, 32)))
    trainer.restore_or_init()
    with pytest.raises(ValueError, match=r"must be a \(sum, count\) pair"):
        trainer.evaluate_if_new(0)
