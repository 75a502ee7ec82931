"""Latest, Best and Final exporters: real jax.export artifacts on disk, durable best value."""

import json
import shutil

import numpy as np
import pytest
from conftest import train_to_end

from prefect_jax.examples.digits import load_digits_split
from prefect_jax.training.evaluation import EvalResult, EvalStatus
from prefect_jax.training.exporters import is_the_final_export, list_exports, load_export
from prefect_jax.training.program import ProgramError
from prefect_jax.training.specs import BestExporter, FinalExporter, LatestExporter
from prefect_jax.training.trainer import Trainer


def test_exports_run_without_the_program_and_match_serve(job_config):
    trainer = Trainer(job_config(max_steps=20, exporters=[FinalExporter()]))
    trainer.restore_or_init()
    train_to_end(trainer)
    path = trainer.job.storage.export_dir("final", 20)
    info = json.load(open(f"{path}/export.json"))
    assert info["step"] == 20 and set(info["metrics"]) == {"accuracy", "loss"}
    _, _, x, _ = load_digits_split()
    served = load_export(path)(x[:7])  # symbolic batch dimension: any batch size
    expected = trainer.program.serve(trainer.state, x[:7])
    np.testing.assert_allclose(np.asarray(served), np.asarray(expected), rtol=1e-6)


def test_latest_keeps_the_newest_n(job_config):
    """Once MLflow registered them (an export it has not registered yet is held for it), the
    newest `keep`: as the job ends, which waits for the registration and what follows it."""
    trainer = Trainer(job_config(max_steps=80, every_steps=20, exporters=[LatestExporter(keep=2)]))
    trainer.restore_or_init()
    train_to_end(trainer)
    trainer.finish()
    assert list_exports(trainer.job.storage) == {"latest": [60, 80]}
    trainer.close()


def test_best_exports_only_improvements_and_remembers_across_restarts(job_config):
    config = job_config(max_steps=40, exporters=[BestExporter(metric="loss", mode="min", keep=5)])
    trainer = Trainer(config)
    trainer.restore_or_init()
    train_to_end(trainer)
    best = json.load(open(trainer.job.storage.export_dir("best") + "/best.json"))
    exported = list_exports(trainer.job.storage)["best"]
    assert best["step"] == exported[-1]
    trainer.close()

    # A new process sees the durable best value: a worse result exports nothing, a better one does.
    again = Trainer(config)
    worse = EvalResult(
        status=EvalStatus.EVALUATED, step=41, metrics={"loss": best["value"] + 1, "accuracy": 0.0}
    )
    assert again.export(worse) == {}
    again.restore_or_init()
    better = EvalResult(
        status=EvalStatus.EVALUATED, step=40, metrics={"loss": best["value"] - 1, "accuracy": 1.0}
    )
    if best["step"] != 40:
        assert again.export(better) == {"best": again.job.storage.export_dir("best", 40)}
        assert json.load(open(again.job.storage.export_dir("best") + "/best.json"))["step"] == 40


def test_best_with_unknown_metric_names_the_metrics(job_config):
    """Where the job could not be checked as it restored (here the program's declared names are
    wrong; a sharded program of several processes), the export says so."""

    class DeclaresF1:
        eval_metric_names = ("accuracy", "f1", "loss")

        def __init__(self):
            from prefect_jax.examples.digits import tiny

            self._p = tiny

        def __getattr__(self, name):
            return getattr(self._p, name)

    config = job_config(max_steps=20, exporters=[BestExporter(metric="f1")])
    trainer = Trainer(config, program=DeclaresF1())
    trainer.restore_or_init()
    trainer.train_until_checkpoint()
    with pytest.raises(
        ValueError, match=r"compares metric 'f1', but the eval results hold \['accuracy', 'loss'\]"
    ):
        trainer.export(trainer.evaluate_if_new())


def test_final_exports_only_at_max_steps(job_config):
    trainer = Trainer(job_config(max_steps=40, exporters=[FinalExporter()]))
    trainer.restore_or_init()
    results = train_to_end(trainer)
    assert [r.step for r in results] == [20, 40]
    assert [is_the_final_export(r, 40) for r in results] == [False, True]
    assert list_exports(trainer.job.storage) == {"final": [40]}


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

    class NoServingInput(NoServe):  # (it said that serve was missing too)
        def serve(self, state, inputs):
            return inputs

    with pytest.raises(ProgramError, match="has no serving_input\\(\\) \\(exports need both") as e:
        Trainer(job_config(exporters=[LatestExporter()]), program=NoServingInput())
    assert "--exporters with no names" in str(e.value)


def test_an_evaluation_that_exports_nothing_does_not_wait_for_its_steps_commit(
    job_config, monkeypatch
):
    """With exporters, the export of the live step's evaluation waits for the step's commit
    (exports are of recorded steps), unless no exporter would write anything for it (a best
    that it does not beat, the final exporter before the last step): then training goes on at
    once and the step is recorded once it commits, as without exporters."""
    from conftest import hold_commit

    commit = hold_commit(monkeypatch, 200)
    # The highest loss is the best here: once step 100 is exported, later
    # (trained) steps do not beat it.
    exporters = [BestExporter(metric="loss", mode="max"), FinalExporter()]
    trainer = Trainer(job_config(max_steps=300, every_steps=100, exporters=exporters))
    trainer.restore_or_init()
    trainer.train_until_checkpoint()
    first = trainer.evaluate_if_new()
    assert trainer.export(first) == {"best": trainer.job.storage.export_dir("best", 100)}
    trainer.train_until_checkpoint()
    second = trainer.evaluate_if_new()
    assert (
        second.step == 200
        and second.pending_commit
        and second.metrics["loss"] < first.metrics["loss"]
    )
    assert trainer.export(second) == {}  # (waiting for the commit here would hang for 60 s)
    assert not commit.is_set() and 200 not in trainer.committed_steps()
    assert trainer.job.records.steps() == [100]

    commit.set()
    # to 300: step 200 is recorded (from the loop, or by this save) first
    trainer.train_until_checkpoint()
    assert trainer.job.records.get(200).metrics == second.metrics
    final = trainer.evaluate_if_new()
    assert final.step == 300 and not final.pending_commit
    assert trainer.export(final) == {"final": trainer.job.storage.export_dir("final", 300)}
    assert list_exports(trainer.job.storage) == {"best": [100], "final": [300]}
    trainer.finish()


def test_an_evaluation_that_exports_waits_for_its_steps_commit(job_config, monkeypatch):
    """The other side: an evaluation that a `BestExporter` exports (it beats the best) is recorded,
    its commit waited for, before the export is written."""
    import threading

    from conftest import hold_commit

    commit = hold_commit(monkeypatch, 20)
    trainer = Trainer(
        job_config(max_steps=40, exporters=[BestExporter(metric="accuracy", mode="max")])
    )
    trainer.restore_or_init()
    trainer.train_until_checkpoint()
    result = trainer.evaluate_if_new()
    assert result.step == 20 and result.pending_commit
    threading.Timer(0.5, commit.set).start()
    assert trainer.export(result) == {"best": trainer.job.storage.export_dir("best", 20)}
    assert commit.is_set() and 20 in trainer.committed_steps()
    assert trainer.job.records.steps() == [20]
    trainer.finish()


def _evaluated(step: int, loss: float, accuracy: float) -> EvalResult:
    metrics = {"loss": loss, "accuracy": accuracy}
    return EvalResult(status=EvalStatus.EVALUATED, step=step, metrics=metrics)


# Step 20 has the lowest loss, step 30 the highest accuracy: loss and accuracy disagree.
_RESULTS = [_evaluated(10, 0.5, 0.7), _evaluated(20, 0.4, 0.6), _evaluated(30, 0.6, 0.9)]


def _best_exports(tmp_path, exporter) -> tuple[list[int], dict]:
    """Run `exporter` on `_RESULTS` in order, as an evaluator would; the exported steps and the
    best record it left."""
    from prefect_jax.training.exporters import run_exporter
    from prefect_jax.training.storage import JobStorage

    storage = JobStorage(str(tmp_path / "storage"), "best")
    for result in _RESULTS:
        run_exporter(exporter, storage, result, 100, lambda: b"model", {})
    best = json.load(open(storage.export_dir(exporter.name) + "/best.json"))
    return list_exports(storage)[exporter.name], best


def test_a_compare_fn_decides_which_step_is_best(tmp_path):
    """TF's `BestExporter(compare_fn=...)`: `compare_fn(best_eval_result, current_eval_result)`
    True exports the current one. Higher accuracy exports 10 and 30 (the default, lower loss,
    would export 10 and 20); the best is remembered beside the exports, and the registry's
    `@best` alias follows the same comparison."""
    from prefect_jax.training.best import best_of

    exporter = BestExporter(compare_fn="programs:higher_accuracy", keep=None)
    exported, best = _best_exports(tmp_path, exporter)
    assert exported == [10, 30]
    assert best == {
        "step": 30,
        "metrics": {"loss": 0.6, "accuracy": 0.9},
        "compare_fn": "programs:higher_accuracy",
    }
    assert best_of(exporter, _RESULTS).step == 30
    # a worse result after a restart (the best read back from best.json) exports nothing
    from prefect_jax.training.exporters import run_exporter
    from prefect_jax.training.storage import JobStorage

    storage = JobStorage(str(tmp_path / "storage"), "best")
    assert run_exporter(exporter, storage, _evaluated(40, 0.1, 0.8), 100, bytes, {}) is None


def test_a_compare_fn_is_called_by_tf_s_parameter_names_in_any_order():
    """TF's BestExporter calls compare_fn(best_eval_result=..., current_eval_result=...): one
    that declares them the other way round judged backwards when called by position."""
    from prefect_jax.training.best import beats

    best = {"step": 10, "metrics": {"loss": 0.5, "accuracy": 0.7}}
    named = ("programs:higher_accuracy", "programs:higher_accuracy_current_first")
    for fn in (*named, "programs:higher_accuracy_positional"):
        exporter = BestExporter(compare_fn=fn)
        assert beats(exporter, {"loss": 0.9, "accuracy": 0.8}, 20, best), fn
        assert not beats(exporter, {"loss": 0.1, "accuracy": 0.6}, 20, best), fn


def test_the_default_best_is_tf_s_lower_loss(tmp_path):
    """TF's default `BestExporter` compares `loss`, lower is better: unchanged by compare_fn."""
    from prefect_jax.training.best import best_of

    exporter = BestExporter(keep=None)
    assert (exporter.metric, exporter.mode, exporter.compare_fn) == ("loss", "min", None)
    exported, best = _best_exports(tmp_path, exporter)
    assert exported == [10, 20]
    assert (best["step"], best["metric"], best["value"], best["mode"]) == (20, "loss", 0.4, "min")
    assert best_of(exporter, _RESULTS).step == 20


def test_a_best_exporter_added_to_an_evaluated_job_must_beat_the_evaluations_before_it(tmp_path):
    """TF's BestExporter reads the eval history it finds: added to a job already evaluated, its
    first export is of a step better than every earlier evaluation, not of the next step."""
    from prefect_jax.training.evaluation import EvalRecords
    from prefect_jax.training.exporters import exports_nothing, run_exporter
    from prefect_jax.training.storage import JobStorage

    storage = JobStorage(str(tmp_path / "storage"), "added")
    records = EvalRecords(storage, "eval", writer=True)
    for result in _RESULTS:  # evaluated before the exporter was added (best loss: step 20, 0.4)
        records.put(result.model_copy(update={"name": "eval"}))
    exporter = BestExporter(keep=None)
    worse = _evaluated(40, 0.45, 0.8).model_copy(update={"name": "eval"})
    # Not certain until best.json holds it: the export runs once, keeps it, and from then on
    # no evaluation reads the history again (a local job skips an export that exports nothing).
    assert not exports_nothing(exporter, storage, worse, 100)
    assert run_exporter(exporter, storage, worse, 100, bytes, {}) is None
    assert list_exports(storage) == {"best": []}
    best = json.load(open(storage.export_dir("best") + "/best.json"))
    assert (best["step"], best["value"]) == (20, 0.4)
    records.put(worse)
    worse_again = _evaluated(45, 0.5, 0.8).model_copy(update={"name": "eval"})
    shutil.rmtree(records.dir)  # (the history is not read again: best.json holds its best)
    assert exports_nothing(exporter, storage, worse_again, 100)
    better = _evaluated(50, 0.3, 0.8).model_copy(update={"name": "eval"})
    assert not exports_nothing(exporter, storage, better, 100)
    dest = storage.export_dir("best", 50)
    assert run_exporter(exporter, storage, better, 100, bytes, {}) == (dest, True)
    assert list_exports(storage) == {"best": [50]}


def test_an_older_step_exported_on_demand_is_not_best_where_a_later_evaluation_beats_it(
    tmp_path,
):
    """`prefect-jax export --step 20` with the best exporter and no best.json (a job evaluated
    without it): step 20 beats the evaluations before it, but a later one (step 30: accuracy
    0.9 against 0.6) beats it: it is not exported (@best would have moved to a worse model), and
    best.json is left for step 30's own export, which then exports it. A tie goes to the earlier
    step, as exports in step order would."""
    from prefect_jax.training.evaluation import EvalRecords
    from prefect_jax.training.exporters import best_path, run_exporter
    from prefect_jax.training.storage import JobStorage

    storage = JobStorage(str(tmp_path / "storage"), "asked")
    records = EvalRecords(storage, "eval", writer=True)
    for result in _RESULTS:
        records.put(result.model_copy(update={"name": "eval"}))
    by_accuracy = BestExporter(metric="accuracy", mode="max", keep=None)
    older, newest = (r.model_copy(update={"name": "eval"}) for r in (_RESULTS[0], _RESULTS[2]))
    assert run_exporter(by_accuracy, storage, older, 100, bytes, {}) is None
    assert not storage.fs.exists(best_path(storage, "best"))
    dest = storage.export_dir("best", 30)
    assert run_exporter(by_accuracy, storage, newest, 100, bytes, {}) == (dest, True)
    assert list_exports(storage) == {"best": [30]}

    tied = JobStorage(str(tmp_path / "storage"), "tied")
    records = EvalRecords(tied, "eval", writer=True)
    for step in (10, 20):
        records.put(_evaluated(step, 0.5, 1.0).model_copy(update={"name": "eval"}))
    first = _evaluated(10, 0.5, 1.0).model_copy(update={"name": "eval"})
    assert run_exporter(by_accuracy, tied, first, 100, bytes, {}) == (
        tied.export_dir("best", 10),
        True,
    )


def test_a_best_exporter_added_to_a_trained_job_keeps_the_historys_best_from_its_first_eval(
    job_config,
):
    """Through the trainer, exporting in the background as the flow does (which skips an export
    when no exporter certainly writes anything, before the step is recorded): the
    best of the records is kept in best.json at the first evaluation, and no step worse than it
    is exported or becomes @best."""
    first = Trainer(job_config(max_steps=40, exporters=[LatestExporter()]))
    first.restore_or_init()
    train_to_end(first)
    first.close()
    storage = first.job.storage
    record = f"{storage.eval_dir('eval')}/20.json"
    lucky = json.load(open(record))
    lucky["metrics"]["loss"] = 1e-9  # no later step beats it
    json.dump(lucky, open(record, "w"))
    again = Trainer(job_config(max_steps=80, exporters=[BestExporter(keep=None)]))
    again.restore_or_init()
    while again.step < 80:  # as the flow does: each export in the background
        again.train_until_checkpoint()
        again.export_in_background(again.evaluate_if_new(), lambda written: None)
    again.join_exports()
    again.close()
    best = json.load(open(storage.export_dir("best") + "/best.json"))
    assert (best["step"], best["value"]) == (20, 1e-9)
    assert list_exports(storage)["best"] == []


def test_a_best_judged_by_another_metric_is_judged_again_from_the_eval_records(tmp_path, caplog):
    """A job that exported by `--best-metric accuracy --best-mode max`, resumed with the default
    (loss, min): the new loss is compared with the losses evaluated before, never with the stored
    best's accuracy (0.9 would beat any loss below it, and no loss would beat it under max)."""
    from prefect_jax.training.evaluation import EvalRecords
    from prefect_jax.training.exporters import run_exporter
    from prefect_jax.training.storage import JobStorage

    storage = JobStorage(str(tmp_path / "storage"), "rejudged")
    records = EvalRecords(storage, "eval", writer=True)
    by_accuracy = BestExporter(metric="accuracy", mode="max", keep=None)
    for result in _RESULTS:  # exports 10 and 30 (accuracy 0.7, 0.9); the best loss is 20's, 0.4
        records.put(result)
        run_exporter(by_accuracy, storage, result, 100, bytes, {})
    assert list_exports(storage) == {"best": [10, 30]}
    by_loss = BestExporter(keep=None)
    with caplog.at_level("INFO"):
        assert run_exporter(by_loss, storage, _evaluated(40, 0.45, 0.1), 100, bytes, {}) is None
    said = [r for r in caplog.records if r.levelname == "WARNING" and "best.json" in r.message]
    assert said and "best.json was judged by accuracy (max), the exporter now judges by loss " in (
        said[0].message
    )
    assert said[0].message.endswith(
        "give --best-metric accuracy --best-mode max (BestExporter(metric='accuracy', mode='max'))"
    ), said
    best = json.load(open(storage.export_dir("best") + "/best.json"))
    assert (best["step"], best["metric"], best["value"]) == (20, "loss", 0.4)
    dest = storage.export_dir("best", 50)
    assert run_exporter(by_loss, storage, _evaluated(50, 0.35, 0.1), 100, bytes, {}) == (dest, True)
    # A compare_fn judging the history leaves out records from before a metric it reads was
    # produced (it would fail on them at every evaluation): here, records without accuracy.
    by_accuracy_fn = BestExporter(name="fn", compare_fn="programs:higher_accuracy", keep=None)
    records.put(EvalResult(status=EvalStatus.EVALUATED, name="eval", step=5, metrics={"loss": 0.1}))
    result = _evaluated(60, 0.5, 0.5)
    assert run_exporter(by_accuracy_fn, storage, result, 100, bytes, {}) is None  # 30's 0.9 wins
    assert json.load(open(storage.export_dir("fn") + "/best.json"))["step"] == 30


def test_compare_fn_and_metric_together_are_refused_naming_both():
    with pytest.raises(
        ValueError,
        match=r"both compare_fn='programs:higher_accuracy' and metric='accuracy', mode='max'",
    ):
        BestExporter(compare_fn="programs:higher_accuracy", metric="accuracy", mode="max")
    with pytest.raises(ValueError, match=r"compare_fn='higher_accuracy' is not an import path"):
        BestExporter(compare_fn="higher_accuracy")
    # what a flow parameter or a deployment carries round-trips
    spec = BestExporter(compare_fn="programs:higher_accuracy")
    assert BestExporter.model_validate(spec.model_dump(mode="json")) == spec


def test_a_compare_fn_that_does_not_load_is_refused_at_job_start_naming_it(job_config):
    with pytest.raises(
        ProgramError,
        match=r"compare_fn path 'programs:lower_f1': module 'programs' has no attribute "
        r"'lower_f1' \(names it defines: ",
    ):
        Trainer(job_config(exporters=[BestExporter(compare_fn="programs:lower_f1")]))


def test_an_export_mlflow_has_not_registered_is_kept_past_keep_up_to_a_bound(tmp_path, caplog):
    """MLflow's worker registers exports behind the training: `keep` pruned the older ones first,
    and a fast cadence with a slow MLflow lost them (a walkthrough: v1 was step 225, steps 25-200
    never versions). Where the job registers, an unregistered export stays, up to
    `HELD_UNREGISTERED`; once registered (``registry.json``), `keep` applies again. A job that
    does not register keeps `keep` exactly."""
    import logging

    from prefect_jax.training.export_retention import (
        HELD_UNREGISTERED,
        prune_registered,
        registered_steps,
    )
    from prefect_jax.training.exporters import read_best, run_exporter
    from prefect_jax.training.storage import JobStorage

    def export_steps(storage, steps, registers):
        for step in steps:
            result = _evaluated(step, 0.5, 0.5)
            run_exporter(LatestExporter(keep=2), storage, result, 10_000, bytes, {}, registers)

    held = JobStorage(str(tmp_path / "held"), "j")
    steps = [10 * (i + 1) for i in range(HELD_UNREGISTERED + 4)]
    with caplog.at_level(logging.WARNING, logger="prefect_jax.trainer"):
        export_steps(held, steps, registers=True)
    # the newest 2, and the 10 unregistered before them; the oldest 2 lost, and said
    assert list_exports(held)["latest"] == steps[-(2 + HELD_UNREGISTERED) :]
    assert "the exports of steps [10] are pruned before MLflow registered them" in caplog.text
    assert "the exports of steps [20] are pruned before MLflow registered them" in caplog.text
    registry = {"versions": {str(s): str(i) for i, s in enumerate(steps)}}
    held.write_json(held.path("registry.json"), registry)
    export_steps(held, [steps[-1] + 10], registers=True)
    assert list_exports(held)["latest"] == [steps[-1], steps[-1] + 10]

    # Pruned back once registered, a best exporter's best stays, though older than its newest
    # export (another process of the job exported it after): here step 90, best after 100.
    best = JobStorage(str(tmp_path / "best"), "j")
    by_loss = BestExporter(metric="loss", mode="min", keep=1)
    for step, loss in ((100, 0.5), (90, 0.4)):
        run_exporter(by_loss, best, _evaluated(step, loss, 0.5), 10_000, bytes, {}, True)
    best.write_json(best.path("registry.json"), {"versions": {"90": "2", "100": "1"}})
    prune_registered(best, [by_loss], lambda e: read_best(best, e)["step"])
    assert list_exports(best)["best"] == [90, 100]
    run_exporter(by_loss, best, _evaluated(110, 0.3, 0.5), 10_000, bytes, {}, True)
    best.write_json(best.path("registry.json"), {"versions": {"90": "2", "100": "1", "110": "3"}})
    prune_registered(best, [by_loss], lambda e: read_best(best, e)["step"])
    assert list_exports(best)["best"] == [110]

    plain = JobStorage(str(tmp_path / "plain"), "j")
    export_steps(plain, steps, registers=False)
    assert list_exports(plain)["latest"] == steps[-2:]
    assert registered_steps(plain) == set()


def test_why_an_exporter_wrote_nothing_is_said_from_any_best_json(tmp_path):
    """The export flow's explanation of an exporter that wrote nothing for the step asked for:
    from a best.json written before it recorded every metric (its metric and value only), a job
    without max_steps (no final step), an exporter's keep; never an error of its own."""
    from prefect_jax.training.export_choice import why_not_exported
    from prefect_jax.training.exporters import best_path
    from prefect_jax.training.storage import JobStorage

    storage = JobStorage(str(tmp_path), "j")
    result = EvalResult(name="eval", step=20, metrics={"loss": 0.5}, status=EvalStatus.EVALUATED)
    best = BestExporter()
    assert why_not_exported(best, storage, result, 40) == (
        "step 20 does not beat the job's other evaluations"
    )
    storage.write_json(best_path(storage, best.name), {"step": 40, "metric": "loss", "value": 0.25})
    assert why_not_exported(best, storage, result, 40) == (
        "step 20 does not beat the best so far, step 40, by loss (min): 0.5 against 0.25"
    )
    final = FinalExporter()
    assert why_not_exported(final, storage, result, 40) == (
        "step 20 is not the job's final step (max_steps=40)"
    )
    assert "no final step" in why_not_exported(final, storage, result, None)
    assert why_not_exported(LatestExporter(keep=2), storage, result, 40) == (
        "its keep=2 pruned it (the newest steps' are kept)"
    )
