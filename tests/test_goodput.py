"""The goodput ledger: each attempt's time by phase, what the next attempt keeps, the summary.

The kill-and-rerun path (real processes, MLflow, the Prefect artifact) is in test_preemption.
"""

import json
import os

import pytest

from prefect_jax.training.goodput import as_rows, describe, mlflow_metrics, process_start_time, summarize
from prefect_jax.training.specs import CheckpointSpec, JobConfig, TrainSpec
from prefect_jax.training.trainer import Trainer


def _attempt(start, updated, from_step, step, tail, ended, **seconds):
    return {"host": "h", "pid": 1, "process_start": start, "updated": updated, "from_step": from_step, "step": step,
            "tail": tail, "ended": ended, "seconds": seconds}  # fmt: skip


def test_summary_splits_kept_and_recomputed_steps_and_counts_the_gaps():
    ledger = {"attempts": [
        # Trained 0 -> 300 (saves at 100, 200, 300) in 30 s of train time, killed after its last record.
        _attempt(1000.0, 1050.0, 0, 300, [[0, 0.0], [100, 10.0], [200, 20.0], [300, 30.0]], None,
                 startup=5.0, restore=2.0, compile=3.0, train=30.0, checkpoint=1.0, eval=2.0),
        # Restored 200 (300 never committed): 10 s of its predecessor's training were lost.
        # It started 4 s after its predecessor's last record; finished 200 -> 400.
        _attempt(1054.0, 1090.0, 200, 400, [[200, 0.0], [400, 20.0]], "finished",
                 startup=5.0, restore=1.0, compile=1.0, train=20.0, checkpoint=1.0, eval=2.0),
    ]}  # fmt: skip
    s = summarize(ledger)
    assert s["wall_s"] == pytest.approx(90.0)
    assert s["productive_s"] == pytest.approx(20.0 + 20.0)
    assert s["goodput"] == pytest.approx(40.0 / 90.0)
    lost = s["lost_s"]
    assert lost["recomputed"] == pytest.approx(10.0)
    assert lost["between_attempts"] == pytest.approx(4.0)
    assert lost["startup"] == 10.0 and lost["restore"] == 3.0 and lost["compile"] == 4.0
    assert lost["checkpoint"] == 2.0 and lost["eval"] == 4.0
    assert lost["other"] == pytest.approx((50 - 43) + (36 - 30))  # each attempt's time outside the phases
    # Every second of the wall is either productive or lost for a named cause.
    assert s["productive_s"] + sum(lost.values()) == pytest.approx(s["wall_s"])
    assert (s["attempts"], s["interrupted"], s["steps"]) == (2, 1, [0, 400])
    assert sum(r["seconds"] for r in as_rows(s)) == pytest.approx(90.0, abs=0.1)
    assert dict((k, v) for k, v, _ in mlflow_metrics(s, 400))["goodput/lost_s/recomputed"] == pytest.approx(10.0)
    assert describe(s).startswith("44.4% of 90.0s wall") and "1 interrupted" in describe(s)
    assert summarize({}) == {} and describe({}) == "no attempt recorded"


def test_a_rerun_that_restores_an_older_step_than_any_recorded_counts_its_predecessor_as_lost():
    ledger = {"attempts": [
        _attempt(0.0, 10.0, 100, 300, [[200, 5.0], [300, 8.0]], None, train=8.0),
        _attempt(11.0, 20.0, 100, 200, [[100, 0.0], [200, 6.0]], "finished", train=6.0),
    ]}  # fmt: skip
    s = summarize(ledger)
    assert s["lost_s"]["recomputed"] == pytest.approx(8.0) and s["productive_s"] == pytest.approx(6.0)


def test_a_finished_job_is_not_waiting_and_a_rerun_that_trains_nothing_is_left_out():
    ledger = {"attempts": [
        _attempt(0.0, 10.0, 0, 100, [[0, 0.0], [100, 8.0]], "finished", startup=1.0, train=8.0),
        # Rerun from the UI an hour later: restored 100, trained nothing, finished (twice).
        _attempt(3600.0, 3605.0, 100, 100, [[100, 0.0]], "finished", startup=4.0, restore=1.0),
        _attempt(3700.0, 3704.0, 100, 100, [[100, 0.0]], "finished", startup=4.0),
    ]}  # fmt: skip
    alone = summarize({"attempts": ledger["attempts"][:1]})
    assert summarize(ledger) == alone and alone["wall_s"] == 10.0 and alone["goodput"] == pytest.approx(0.8)
    # A day later max_steps is raised: the new attempt's own time counts, the day between does not.
    ledger["attempts"].append(_attempt(90000.0, 90012.0, 100, 200, [[100, 0.0], [200, 9.0]], None,
                                       startup=2.0, train=9.0))  # fmt: skip
    s = summarize(ledger)
    assert s["wall_s"] == pytest.approx(10.0 + 12.0) and s["productive_s"] == pytest.approx(17.0)
    assert s["lost_s"]["between_attempts"] == 0.0 and s["lost_s"]["startup"] == 3.0
    assert s["productive_s"] + sum(s["lost_s"].values()) == pytest.approx(s["wall_s"])
    assert (s["attempts"], s["interrupted"], s["steps"]) == (2, 0, [0, 200])  # the newest, still running, is not interrupted


def test_process_start_time_is_this_process_to_the_tick():
    import time

    import psutil

    start = process_start_time()
    assert start <= time.time()
    assert abs(start - psutil.Process(os.getpid()).create_time()) < 1.5  # psutil's is whole boot seconds off


def test_the_engine_accounts_every_phase_of_an_attempt_and_a_rerun_continues_the_ledger(tmp_path, mlflow_uri):
    def config(max_steps):
        return JobConfig(program="prefect_jax.examples.digits:tiny", job="gp", storage=str(tmp_path),
                         train=TrainSpec(max_steps=max_steps), checkpoint=CheckpointSpec(every_steps=20),
                         mlflow_tracking_uri=mlflow_uri)  # fmt: skip

    trainer = Trainer(config(40))
    trainer.restore_or_init()
    while trainer.step < 40:
        trainer.train_until_checkpoint()
        trainer.evaluate_if_new()
    trainer.finish()
    run_id = trainer.tracker.run_id
    trainer.close()
    with open(tmp_path / "gp" / "goodput.json") as f:
        (attempt,) = json.load(f)["attempts"]
    assert attempt["ended"] == "finished" and (attempt["from_step"], attempt["step"]) == (0, 40)
    assert [s for s, _ in attempt["tail"]] == [0, 20, 40]
    assert set(attempt["seconds"]) == {"startup", "restore", "compile", "train", "checkpoint", "eval"}
    assert all(v >= 0 for v in attempt["seconds"].values())
    assert sum(attempt["seconds"].values()) <= attempt["updated"] - attempt["process_start"] + 1e-6

    # The same process training on (as a notebook would) is a second attempt, counted from when
    # its trainer was made (not from the process start again: no second counted twice).
    trainer = Trainer(config(60))
    trainer.restore_or_init()
    trainer.train_until_checkpoint()
    trainer.finish()
    trainer.close()
    summary = trainer.goodput()
    assert summary["attempts"] == 2 and summary["interrupted"] == 0 and summary["steps"] == [0, 60], summary
    # Run again with nothing left to train: the account does not change (no attempt, no wall added).
    trainer = Trainer(config(60))
    assert trainer.restore_or_init() == 60
    trainer.finish()
    trainer.close()
    with open(tmp_path / "gp" / "goodput.json") as f:
        assert len(json.load(f)["attempts"]) == 3  # the ledger keeps every attempt; the summary leaves it out
    assert trainer.goodput() == summary
    assert summary["productive_s"] + sum(summary["lost_s"].values()) == pytest.approx(summary["wall_s"], rel=0.01)
    assert 0 < summary["goodput"] < 1
    from mlflow.tracking import MlflowClient

    metrics = MlflowClient(mlflow_uri).get_run(run_id).data.metrics
    assert metrics["goodput/goodput"] == pytest.approx(summary["goodput"]) and metrics["goodput/attempts"] == 2
