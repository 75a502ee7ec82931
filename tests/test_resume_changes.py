"""A job resumed with a retention that keeps fewer steps than the one its steps were saved with
(``--keep-last 10``, then a rerun without the flag): its next save deletes them, as TF's
CheckpointManager restarted with a smaller max_to_keep does, but the trainer says so first,
naming the steps and the flags that keep them; on local storage (Orbax's retention) and on S3
(the uploads')."""

from __future__ import annotations

import pytest

from prefect_jax.training.resume_changes import deleted_by_the_change
from prefect_jax.training.specs import CheckpointSpec, JobConfig, TrainSpec
from prefect_jax.training.trainer import Trainer

RECORDED = {"keep_last": 3, "keep_every_steps": None, "keep_every_secs": None}


def _deleted(steps, spec, recorded=RECORDED, backups=(), saved_at=None):
    return deleted_by_the_change(
        steps,
        recorded,
        CheckpointSpec(**spec),
        None,
        lambda s: s in backups,
        saved_at or (lambda s: None),
    )


def test_only_what_the_new_retention_deletes_and_the_recorded_one_keeps_is_named():
    assert _deleted([10, 20, 30], {"keep_last": 1}) == [20, 30]  # (10 goes at the next save anyway)
    # a process killed between a commit and its deletions left one more: not the change's
    assert _deleted([10, 20, 30, 40], {"keep_last": 3}) == []
    assert _deleted([10, 20, 30, 40], {"keep_last": 2}) == [30]
    assert _deleted([10, 20, 30], {"keep_last": 5}) == []  # keeps more
    assert _deleted([10, 20, 30], {"keep_last": 1, "keep_every_steps": 10}) == []
    # a backup is kept only while newest, whatever the retention
    assert _deleted([10, 20, 25], {"keep_last": 1}, {"keep_last": None}, backups={25}) == [10, 20]
    every_100 = {**RECORDED, "keep_last": 1, "keep_every_steps": 100}
    assert _deleted([100, 200, 250], {"keep_last": 1, "keep_every_steps": 50}, every_100) == []
    assert _deleted([100, 200, 250], {"keep_last": 1}, every_100) == [100, 200]
    hourly = {**RECORDED, "keep_last": 1, "keep_every_secs": 3600.0}
    at = {10: 0.0, 20: 100.0, 30: 4000.0, 40: 4100.0}.get
    assert _deleted([10, 20, 30, 40], {"keep_last": 1}, hourly, saved_at=at) == [10, 30]
    assert _deleted([], {"keep_last": 1}) == []


def test_the_fix_named_is_only_what_keeps_more_than_the_run_asks_for(caplog):
    """(A review: a keep_last grown from 3 to 10, beside a keep_every_steps dropped, was named
    as part of the fix: "--keep-last 3", fewer recent steps than asked for.)"""
    from types import SimpleNamespace

    from prefect_jax.training.resume_changes import warn_if_retention_narrowed

    job = SimpleNamespace(
        is_primary=True,
        config=SimpleNamespace(job="j"),
        committed_steps=lambda: list(range(100, 310, 10)),
        retention_reads=lambda: (None, lambda s: False, lambda s: None),
    )
    config = JobConfig(
        program="p:q",
        job="j",
        storage="/s",
        train=TrainSpec(max_steps=1000),
        checkpoint=CheckpointSpec(keep_last=10),
    )
    recorded = {"retention": {**RECORDED, "keep_every_steps": 100}}
    with caplog.at_level("WARNING", logger="prefect_jax.trainer"):
        warn_if_retention_narrowed(job, config, recorded, 300)
    [said] = [r.getMessage() for r in caplog.records]
    assert "deletes 2 committed steps the job's retention kept (100, 200)" in said, said
    assert said.endswith("give --keep-every-steps 100 again (CheckpointSpec(keep_every_steps=100))")


def _config(where, tmp_path, s3_server, mlflow_uri, max_steps, keep_last):
    storage = {"storage": str(tmp_path / "storage")}
    if where == "s3":
        s3_server.create_bucket("retention-change")
        storage = {
            "storage": "s3://retention-change/j",
            "storage_options": s3_server.storage_options,
        }
    return JobConfig(
        program="prefect_jax.examples.digits:tiny",
        job="j",
        train=TrainSpec(max_steps=max_steps, log_every_steps=10),
        checkpoint=CheckpointSpec(every_steps=10, keep_last=keep_last),
        eval={"exporters": []},
        mlflow_tracking_uri=mlflow_uri,
        **storage,
    )


@pytest.mark.parametrize("where", ["local", "s3"])
def test_a_resume_that_keeps_fewer_steps_names_them_before_its_next_save_deletes_them(
    where, tmp_path, request, mlflow_uri, caplog
):
    s3_server = request.getfixturevalue("s3_server") if where == "s3" else None

    def config(max_steps, keep_last):
        return _config(where, tmp_path, s3_server, mlflow_uri, max_steps, keep_last)

    first = Trainer(config(40, None))
    first.restore_or_init()
    while first.step < 40:
        first.train_until_checkpoint()
    first.close()

    def resume(keep_last):
        trainer = Trainer(config(60, keep_last))
        caplog.clear()
        with caplog.at_level("WARNING", logger="prefect_jax.trainer"):
            assert trainer.restore_or_init() == 40
        return trainer, [r.getMessage() for r in caplog.records if "was saved keeping" in r.message]

    same, said = resume(None)
    assert said == []
    same.close()
    fewer, said = resume(2)
    assert said == [
        "job j: its step 40 was saved keeping keep_last=None, and this run keeps keep_last=2: its "
        "next checkpoint deletes 3 committed steps the job's retention kept (10, 20, 30), and "
        "later checkpoints more, as TF's CheckpointManager restarted with a smaller max_to_keep "
        "would. To keep them, stop it before that save and give --keep-last none again "
        "(CheckpointSpec(keep_last=None))"
    ]
    assert fewer.job.committed_steps() == [10, 20, 30, 40]  # said before any is deleted
    assert fewer.train_until_checkpoint() == 50
    fewer.close()
    assert fewer.job.committed_steps() == [40, 50]  # then deleted, as the warning said


_PROGRAM = """
from prefect_jax.examples.digits import DigitsProgram

program = DigitsProgram(hidden=(32, 32), learning_rate={lr}, batch_size=32, dropout=0.1)
"""


def test_a_resume_by_another_program_or_config_with_the_same_tree_is_said(
    job_config, tmp_path, monkeypatch, caplog
):
    """(A probe of the Python API: another program with the same state tree, another learning
    rate and batch size, resumed the job silently; TF restores into any graph with the same
    variables, so it is allowed, and said.)"""
    import importlib
    import sys

    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "prog_v.py").write_text(_PROGRAM.format(lr=3e-3))
    (tmp_path / "prog_w.py").write_text(_PROGRAM.format(lr=3e-3))

    def resume(program, max_steps, job="tiny"):
        sys.modules.pop(program.split(":")[0], None)
        trainer = Trainer(job_config(max_steps=max_steps, every_steps=10, program=program, job=job))
        caplog.clear()
        with caplog.at_level("WARNING", logger="prefect_jax.trainer"):
            trainer.restore_or_init()
        trainer.train_until_checkpoint()
        trainer.close()
        return [
            r.getMessage() for r in caplog.records if "trains on from the restored" in r.message
        ]

    assert resume("prog_v:program", 10) == []  # a new job
    assert resume("prog_v:program", 20) == []  # the same program and config
    (tmp_path / "prog_v.py").write_text(_PROGRAM.format(lr=0.5))
    [said] = resume("prog_v:program", 30)
    assert said.startswith(
        "job tiny: program prog_v:program's config differs from the one step 20 was trained with"
    ), said
    assert "it trains on from the restored state with the new config" in said
    [said] = resume("prog_w:program", 40)
    assert said.startswith(
        "job tiny: step 30 was trained by program prog_v:program, and this run's is "
        "prog_w:program: it trains on from the restored state with this program"
    ), said
    assert "(--program prog_v:program)" in said
    # A program with a params type: its params are what is checked; its config follows them (a
    # filled max_steps here, as the byte LM's schedule horizon), and a longer job says nothing.
    (tmp_path / "prog_t.py").write_text(_TYPED)
    importlib.invalidate_caches()  # (the folder was listed before the file was written)
    assert resume("prog_t:program", 10, job="typed") == []
    assert resume("prog_t:program", 20, job="typed") == []


_TYPED = """
from pydantic import BaseModel
from prefect_jax.examples.digits import DigitsProgram

class Params(BaseModel):
    max_steps: int | None = None

class Horizon(DigitsProgram):
    def __init__(self, params):
        super().__init__(hidden=(32, 32), learning_rate=3e-3, batch_size=32, dropout=0.1)
        self.horizon = params.max_steps

    @property
    def config(self):
        return {**super().config, "horizon": self.horizon}

def program(params: Params):
    return Horizon(params)
"""
