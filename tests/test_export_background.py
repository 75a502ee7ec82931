"""Exports lowered and written on a thread while training goes on (`Trainer.export_in_background`,
the train flows' way): of the evaluated step's state, not the live one training moved on from;
joined before the next export and at the job's end; a failure fails the job, never silently."""

from __future__ import annotations

import os

import numpy as np
import pytest

from prefect_jax.examples.digits import load_digits_split
from prefect_jax.training.checkpoint_dirs import committed_steps
from prefect_jax.training.errors import ExportFailedError, is_transient
from prefect_jax.training.exporters import list_exports, load_export
from prefect_jax.training.specs import BestExporter, FinalExporter, LatestExporter
from prefect_jax.training.trainer import Trainer

EXPORTERS = [LatestExporter(), BestExporter(metric="accuracy", mode="max"), FinalExporter()]


def test_a_background_export_is_of_its_step_while_training_goes_on(job_config):
    trainer = Trainer(job_config(max_steps=40, exporters=EXPORTERS, program="programs:slow_export"))
    trainer.restore_or_init()
    _, _, x, _ = load_digits_split()
    done: list[dict] = []
    trainer.train_until_checkpoint()
    at_20 = np.asarray(trainer.program.serve(trainer.state, x[:5]))
    assert trainer.export_in_background(trainer.evaluate_if_new(), on_done=done.append) is None
    trainer.train_until_checkpoint()  # donates the step-20 buffers: the export has its own copy
    storage = trainer.job.storage
    # the step-40 save waited for it: a rerun from step 40 needs no export of step 20
    assert os.path.exists(storage.export_dir("latest", 20)) and len(done) == 1
    written = trainer.join_exports()
    assert done == [written] and set(written) == {"latest", "best"}
    np.testing.assert_allclose(
        np.asarray(load_export(storage.export_dir("latest", 20))(x[:5])), at_20, rtol=1e-6
    )
    trainer.export_in_background(trainer.evaluate_if_new(), on_done=done.append)
    trainer.finish()  # waits for the final export
    assert list_exports(storage)["final"] == [40] and len(done) == 2
    trainer.close()


def test_a_failed_background_export_fails_the_job_loudly(job_config):
    trainer = Trainer(
        job_config(max_steps=40, exporters=[LatestExporter()], program="programs:fails_at_export")
    )
    trainer.restore_or_init()
    trainer.train_until_checkpoint()
    trainer.export_in_background(trainer.evaluate_if_new(), on_done=lambda written: None)
    message = r"the export of step 20 \(in the background.*RuntimeError: serve\(\) refuses"
    with pytest.raises(ExportFailedError, match=message):
        # tried once more on the training thread, then the step-40 save refuses to commit over
        # an evaluated step whose export failed: the rerun resumes from 20 and exports it
        trainer.train_until_checkpoint()
    trainer.job.checkpoints.wait()
    assert committed_steps(trainer.job.checkpoints.directory) == [20]
    assert not is_transient(ExportFailedError("x"))  # no task retry trains an interval again
    with pytest.raises(ExportFailedError, match=message):
        trainer.export(trainer.evaluate_if_new())  # nor does a later export go on
    with pytest.raises(ExportFailedError, match=message):
        trainer.finish()  # and the job does not end as if it had exported
    trainer.close()
    assert list_exports(trainer.job.storage) == {}


def test_a_background_export_that_fails_once_is_tried_again_and_the_job_goes_on(job_config):
    trainer = Trainer(
        job_config(
            max_steps=40, exporters=[LatestExporter()], program="programs:fails_once_at_export"
        )
    )
    trainer.restore_or_init()
    trainer.train_until_checkpoint()
    trainer.export_in_background(trainer.evaluate_if_new(), on_done=lambda written: None)
    trainer.train_until_checkpoint()  # the save waits: it failed, and tried once more it did not
    trainer.job.checkpoints.wait()
    assert committed_steps(trainer.job.checkpoints.directory) == [20, 40]
    assert os.path.exists(trainer.job.storage.export_dir("latest", 20))
    trainer.export(trainer.evaluate_if_new())
    trainer.finish()
    trainer.close()
    assert list_exports(trainer.job.storage) == {"latest": [20, 40]}
