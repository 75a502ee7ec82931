"""The final state's fingerprint and evaluation, computed while its checkpoint commits
(`Intervals._ahead_of_the_end`), and the memo that keeps them for that very state
(`StateMemo`)."""

import gc

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from prefect_jax.examples.digits import DigitsProgram
from prefect_jax.training.evaluation import EvalStatus, EvaluationAbandoned
from prefect_jax.training.state_memo import StateMemo
from prefect_jax.training.trainer import Trainer
from prefect_jax.training.trees import state_fingerprint


def _not_again():
    raise AssertionError("computed again")


def test_a_value_is_computed_once_for_the_same_arrays_and_again_for_new_ones():
    memo, calls = StateMemo(), []
    state = {"w": jnp.ones(3), "b": jnp.zeros(2)}
    assert memo.get(state, "k", lambda: calls.append(1) or 7) == 7
    assert memo.get({"b": state["b"], "w": state["w"]}, "k", _not_again) == 7  # (same tree)
    assert memo.get(state, "other", lambda: 8) == 8 and memo.get(state, "k", _not_again) == 7
    # the same values in new arrays (a step, a restore), or another tree of the same arrays
    assert memo.get(jax.tree.map(jnp.copy, state), "k", lambda: 9) == 9
    assert memo.get([state["w"], state["b"]], "k", lambda: 10) == 10
    assert calls == [1]


def test_take_gives_what_get_computed_ahead_once_then_computes():
    memo, state = StateMemo(), {"w": jnp.ones(3)}
    assert memo.take(state, "eval", lambda: "fresh") == "fresh"  # nothing ahead: not kept
    memo.get(state, "eval", lambda: "ahead")
    assert memo.take(jax.tree.map(jnp.copy, state), "eval", lambda: "other") == "other"
    memo.get(state, "eval", lambda: "ahead")
    assert memo.take(state, "eval", _not_again) == "ahead"
    assert memo.take(state, "eval", lambda: "fresh again") == "fresh again"


def test_states_that_may_change_in_place_or_have_no_arrays_are_not_kept():
    memo, calls = StateMemo(), []
    host = {"w": np.ones(3)}  # a NumPy array can be written in place: never kept
    for state in (host, host, {}, {}, {"n": 3}, {"n": 3}):
        memo.get(state, "k", lambda: calls.append(1))
    assert len(calls) == 6


def test_the_memo_keeps_no_state_alive():
    memo = StateMemo()
    state = {"w": jnp.ones((256, 256))}
    memo.get(state, "k", lambda: 1)
    ref = memo._leaves[0]
    del state
    gc.collect()
    assert ref() is None


class _CountsEvalPasses(DigitsProgram):
    """Digits, counting its eval passes (each derives its metrics once, at its end); the first
    `fail` of them raise."""

    passes = fail = 0
    events: list[str] = []

    def derive_metrics(self, means):
        cls = type(self)
        cls.passes += 1
        cls.events.append("eval")
        if cls.fail:
            cls.fail -= 1
            raise RuntimeError("an eval that fails once")
        return {}


@pytest.fixture
def counting():
    _CountsEvalPasses.passes = _CountsEvalPasses.fail = 0
    _CountsEvalPasses.events = []
    return _CountsEvalPasses(hidden=(32, 32), batch_size=32, eval_batch_size=100)


def test_the_final_step_is_evaluated_and_fingerprinted_while_its_checkpoint_commits(
    job_config, counting
):
    trainer = Trainer(job_config(max_steps=40, every_steps=20), program=counting)
    trainer.evaluations.of_live_steps = True  # (as train_and_evaluate's loop sets it)
    trainer.restore_or_init()
    assert trainer.train_until_checkpoint() == 20 and counting.passes == 0  # not the final step
    trainer.evaluate_if_new()
    assert counting.passes == 1
    checkpoints = trainer.job.checkpoints
    wait = checkpoints.wait
    checkpoints.wait = lambda: counting.events.append("wait") or wait()
    assert trainer.train_until_checkpoint() == 40 and counting.passes == 2  # ahead of the end
    assert counting.events[-2:] == ["eval", "wait"]  # made before the final commit's wait
    assert trainer.job.save_landed()  # (the final commit was waited for in the training)

    result = trainer.evaluate_if_new()
    assert result.status is EvalStatus.EVALUATED and counting.passes == 2  # the one ahead
    copy = jax.tree.map(jnp.copy, trainer.state)  # new arrays: evaluated afresh, the same
    assert trainer.loop.evaluate(copy, None)[0] == result.metrics and counting.passes == 3
    assert trainer.loop.memo.get(trainer.state, "fingerprint", _not_again) == state_fingerprint(
        copy
    )
    assert trainer.fingerprint() == state_fingerprint(copy)
    assert trainer.job.records.get(40).metrics == result.metrics
    trainer.finish()


def test_a_trainer_that_does_not_evaluate_its_steps_only_fingerprints_ahead(job_config, counting):
    trainer = Trainer(job_config(max_steps=20, every_steps=20), program=counting)
    trainer.restore_or_init()
    assert trainer.train_until_checkpoint() == 20
    assert counting.passes == 0  # the `train` flow's trainer: an evaluator process evaluates
    trainer.loop.memo.get(trainer.state, "fingerprint", _not_again)
    trainer.finish()


def test_an_evaluation_ahead_is_given_up_at_a_notice_and_made_again_when_asked(
    job_config, counting
):
    trainer = Trainer(job_config(max_steps=20, every_steps=20), program=counting)
    trainer.restore_or_init()
    trainer.train_until_checkpoint()
    asked = []
    # (a SIGTERM deferred during the final save: asked before each batch)
    with pytest.raises(EvaluationAbandoned):
        trainer.loop.evaluate_ahead(trainer.state, None, lambda: asked.append(1) or len(asked) > 2)
    assert len(asked) == 3 and counting.passes == 0  # given up at its third batch
    trainer.loop.evaluate_ahead(trainer.state, None, lambda: False)
    assert counting.passes == 1
    trainer.loop.evaluate(trainer.state, None)
    assert counting.passes == 1
    trainer.finish()


def test_an_evaluation_ahead_that_fails_is_made_again_by_the_evaluation(job_config, counting):
    type(counting).fail = 1  # (the class counts: the program may be copied)
    trainer = Trainer(job_config(max_steps=20, every_steps=20), program=counting)
    trainer.evaluations.of_live_steps = True
    trainer.restore_or_init()
    assert trainer.train_until_checkpoint() == 20 and counting.passes == 1  # failed, not raised
    result = trainer.evaluate_if_new()
    assert result.status is EvalStatus.EVALUATED and counting.passes == 2
    assert trainer.job.records.get(20).metrics == result.metrics
    trainer.finish()


def test_no_evaluation_ahead_where_eval_hooks_may_stop_or_change_it(job_config, counting):
    config = job_config(max_steps=20, every_steps=20)
    config = config.model_copy(
        update={"eval": config.eval.model_copy(update={"hooks": ["programs:StopAfterTwo"]})}
    )
    trainer = Trainer(config, program=counting)
    trainer.evaluations.of_live_steps = True
    trainer.restore_or_init()
    trainer.train_until_checkpoint()
    assert counting.passes == 0
    assert trainer.evaluate_if_new().status is EvalStatus.EVALUATED and counting.passes == 1
    trainer.finish()
