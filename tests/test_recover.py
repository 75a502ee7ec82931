"""The `recover` task (TF's `SessionManager.recover_session`: restore only, never init) and the
flows that must never make a fresh state: the evaluator and the export."""

from __future__ import annotations

import logging
import os

import pytest
from prefect import flow

from prefect_jax.flows import export_flow
from prefect_jax.tasks import recover
from prefect_jax.training.live import get_trainer
from prefect_jax.training.specs import CheckpointSpec, EvalSpec, JobConfig, TrainSpec
from prefect_jax.training.storage import JobStorage
from prefect_jax.training.trainer import Trainer

pytestmark = pytest.mark.usefixtures("prefect_server")


def _config(tmp_path, mlflow_uri, job: str, experiment: str = "prefect-jax") -> JobConfig:
    return JobConfig(
        program="prefect_jax.examples.digits:tiny",
        job=job,
        storage=str(tmp_path / "storage"),
        train=TrainSpec(max_steps=40, log_every_steps=10),
        checkpoint=CheckpointSpec(every_steps=20, keep_last=None),
        mlflow_tracking_uri=mlflow_uri,
        mlflow_experiment=experiment,
    )


@flow
def _recover(config: JobConfig, step: int | None = None):
    return recover(config, step=step)


def test_recover_restores_the_newest_committed_step(tmp_path, mlflow_uri):
    """TF's `recover_session`: the newest committed checkpoint is restored, and says so; the
    trainer's lease is not taken (a recover runs beside the job's trainer)."""
    config = _config(tmp_path, mlflow_uri, "recovered")
    trainer = Trainer(config)
    trainer.restore_or_init()
    trainer.train_until_checkpoint()
    trainer.train_until_checkpoint()
    trained = trainer.fingerprint()
    trainer.finish()
    trainer.close()

    assert _recover(config) == {
        "restored": True,
        "step": 40,
        "checkpoint_dir": JobStorage(config.storage, config.job).checkpoint_dir,
    }
    recovered = get_trainer(config)
    assert recovered.step == 40 and recovered.fingerprint() == trained
    assert not recovered.job.lease.held
    assert _recover(config, step=20)["restored"] is True  # the step asked for
    assert recovered.step == 20
    with pytest.raises(RuntimeError, match="recovered for evaluation and export.*restore_or_init"):
        recovered.train_until_checkpoint()


def test_recover_without_a_checkpoint_initialises_nothing(tmp_path, mlflow_uri):
    """TF's `recover_session` returns False where there is no checkpoint: no state is made, no
    checkpoint written, no MLflow run started."""
    from mlflow import MlflowClient

    config = _config(tmp_path, mlflow_uri, "never-trained", experiment="recover-nothing")
    assert _recover(config) == {
        "restored": False,
        "step": None,
        "checkpoint_dir": JobStorage(config.storage, config.job).checkpoint_dir,
    }
    trainer = get_trainer(config)
    assert trainer.state is None and trainer.step is None
    assert trainer.job.committed_steps() == []
    checkpoints = JobStorage(config.storage, config.job).checkpoint_dir
    assert not os.path.isdir(checkpoints) or os.listdir(checkpoints) == []
    assert not trainer.job.tracker.started
    assert MlflowClient(mlflow_uri).get_experiment_by_name("recover-nothing") is None


def test_the_export_flow_on_a_job_without_checkpoints_says_so(tmp_path, mlflow_uri):
    """An export of a job that never trained ends at once, naming the job and where its
    checkpoints would be, and makes nothing."""
    storage = tmp_path / "storage"
    state = export_flow(
        program="prefect_jax.examples.digits:tiny",
        job="untrained",
        storage=str(storage),
        train_spec=TrainSpec(max_steps=40),
        mlflow_tracking_uri=mlflow_uri,
        return_state=True,
    )
    assert state.is_failed()
    where = JobStorage(str(storage), "untrained").checkpoint_dir
    with pytest.raises(
        ValueError,
        match=rf"job 'untrained' has no committed checkpoint in {where} \(storage {storage} has "
        r"no job 'untrained'; no job there at all\): nothing to export; train it first",
    ):
        state.result()


def test_the_export_flow_refuses_a_step_whose_checkpoint_is_gone(tmp_path, mlflow_uri):
    """An evaluated step whose checkpoint retention removed is not exported from a fresh state:
    the export says the checkpoint is gone."""
    import shutil

    from prefect_jax.training.specs import LatestExporter

    config = _config(tmp_path, mlflow_uri, "pruned").model_copy(
        update={"eval": EvalSpec(exporters=[LatestExporter()])}
    )
    trainer = Trainer(config)
    trainer.restore_or_init()
    trainer.train_until_checkpoint()
    trainer.evaluate_if_new()
    trainer.finish()
    trainer.close()
    shutil.rmtree(os.path.join(JobStorage(config.storage, config.job).checkpoint_dir, "20"))
    state = export_flow(
        program=config.program,
        job=config.job,
        storage=config.storage,
        train_spec=config.train,
        eval_spec=config.eval,
        checkpoint_spec=config.checkpoint,
        mlflow_tracking_uri=mlflow_uri,
        return_state=True,
    )
    assert state.is_failed()
    with pytest.raises(
        ValueError, match="step 20 of job 'pruned' was evaluated, but its checkpoint"
    ):
        state.result()
    assert not os.path.exists(JobStorage(config.storage, config.job).export_dir("latest", 20))


def test_recover_refuses_a_step_trained_with_other_program_params(tmp_path, mlflow_uri):
    """The evaluator and export roles restore with `recover`: given other params than the job's
    (here a learning rate: the same shapes, so nothing else would notice), they would evaluate and
    export another model as the job's. Refused, naming the key, as a trainer's resume is."""
    from prefect_jax.training.program_params import ProgramParamsMismatchError

    config = _config(tmp_path, mlflow_uri, "params").model_copy(
        update={"program": "programs:typed_digits", "program_params": {"learning_rate": 0.01}}
    )
    trainer = Trainer(config)
    trainer.restore_or_init()
    trainer.train_until_checkpoint()
    trainer.finish()
    trainer.close()
    other = config.model_copy(update={"program_params": {"learning_rate": 0.02}})
    with pytest.raises(ProgramParamsMismatchError, match="learning_rate"):
        Trainer(other).recover()
    assert Trainer(config).recover() == (True, 20)


def test_a_resume_to_another_max_steps_warns_that_a_schedule_tied_to_it_changes(
    tmp_path, mlflow_uri, caplog
):
    """A params field the engine fills with max_steps (a decay's horizon) is not compared on
    restore: a job extended from 20 to 40 steps stretches it from step 20 on. Said, naming the
    param that keeps the horizon it trained with; given so, nothing is said."""
    config = _config(tmp_path, mlflow_uri, "horizon").model_copy(
        update={"program": "programs:typed_digits", "program_params": {"width": 16}}
    )
    config = config.model_copy(update={"train": config.train.model_copy(update={"max_steps": 20})})
    trainer = Trainer(config)
    trainer.restore_or_init()
    trainer.train_until_checkpoint()
    trainer.finish()
    trainer.close()
    longer = config.model_copy(update={"train": config.train.model_copy(update={"max_steps": 40})})
    with caplog.at_level(logging.WARNING, logger="prefect_jax.trainer"):
        extended = Trainer(longer)
        assert extended.restore_or_init() == 20
        extended.close()
    (said,) = [r.getMessage() for r in caplog.records if "was filled with" in r.getMessage()]
    assert "program param max_steps was filled with 20 (the job's max_steps) when step 20" in said
    assert "is 40 now" in said and "--program-param max_steps=20" in said, said
    caplog.clear()
    forever = config.model_copy(
        update={"train": config.train.model_copy(update={"max_steps": None})}
    )
    with caplog.at_level(logging.WARNING, logger="prefect_jax.trainer"):
        until_stopped = Trainer(forever)  # (nothing filled now: the horizon changes too)
        assert until_stopped.restore_or_init() == 20
        until_stopped.close()
    assert "was filled with 20 (the job's max_steps) when step 20 was saved, and is None" in (
        caplog.text
    )
    caplog.clear()
    kept = longer.model_copy(update={"program_params": {"width": 16, "max_steps": 20}})
    with caplog.at_level(logging.WARNING, logger="prefect_jax.trainer"):
        again = Trainer(kept)
        assert again.restore_or_init() == 20
        again.close()
    assert not [r for r in caplog.records if "was filled with" in r.getMessage()]
