"""Which evaluated step an export (the `export` flow, ``prefect-jax export``) writes, or why there
is none: one home for those refusals, so that the command refuses in one line before its flow
run starts (a refusal raised inside a flow run comes with Prefect's traceback in front of it)
and the flow, which a deployment's runs reach without the command, refuses the same way.

Example:
    ```python
    from prefect_jax.training.evaluation import EvalRecords
    from prefect_jax.training.export_choice import export_refusal
    from prefect_jax.training.storage import JobStorage

    storage = JobStorage("/tmp/prefect-jax", "digits")
    records = EvalRecords(storage, "eval")
    print(export_refusal(storage, records, 30, records.steps()))   # (evaluated: [20, 40])
    # step 30 of job 'digits' is not committed (...): nothing to export; ...
    ```
"""

from __future__ import annotations

from prefect_jax.training.steps import job_committed_steps, step_meta

WAIT_HINT = "--wait-for-checkpoint; a flow's wait_for_checkpoint"
LONGER_HINT = "--max-wait-secs; a flow's max_wait_secs"


def export_refusal(storage, records, step: int | None, evaluated: list[int], waited: str = ""):
    """Why an export of `step` (None: the newest evaluated one) of a job (`JobStorage`) has
    nothing to export, with the fix; None where the step has an evaluation that reads and a
    committed checkpoint to export. `records`: the job's `EvalRecords` of its eval name;
    `evaluated`: the steps they list; `waited`: what the caller waited, for the message."""
    job, eval_name = storage.job, records.name
    if step is None and not evaluated:
        wait = f"wait longer ({LONGER_HINT})" if waited else f"wait for it ({WAIT_HINT})"
        if not job_committed_steps(storage):  # (a listing: nothing is restored, nothing made)
            where = _checkpoints(storage)
            missing = storage.no_such_job_said()  # (a mistyped name: the names there)
            where += f" ({missing})" if missing else ""
            return (
                f"job {job!r} has no committed checkpoint in {where}{waited}: nothing to export; "
                "train it first (the train or train_and_evaluate flow, with the same storage and "
                f"job), then evaluate it; or {wait}"
            )
        others = [
            name
            for name in storage.eval_names()
            if name != eval_name and storage.list_int_names(storage.eval_dir(name))
        ]
        if others:  # (a mistyped --eval-name: the names evaluated)
            wait += (
                f"; or give the eval name of its evaluations ({', '.join(others)}: --eval-name, "
                "a flow's eval_spec.name)"
            )
        return (
            f"job {job!r} has no evaluated step yet (eval name {eval_name!r}){waited}: evaluate "
            f"it first, or {wait}"
        )
    chosen = evaluated[-1] if step is None else step
    if chosen not in evaluated:
        return why_not_exportable(storage, job, chosen, eval_name, evaluated)
    if records.get(chosen) is None:  # (listed, not read: damaged, or gone since)
        others = [s for s in evaluated if s != chosen]
        return (
            f"step {chosen} of job {job!r}: its evaluation record in {_shown(records.dir)} cannot "
            "be read (damaged: the warning above says what becomes of it; `prefect-jax status` "
            f"lists it): nothing to export; export another evaluated step ({others or 'none'})"
        )
    if chosen not in job_committed_steps(storage):
        return checkpoint_gone(storage, chosen)
    return None


def checkpoint_gone(storage, step: int) -> str:
    """An evaluated step whose checkpoint is no longer committed: nothing to export (an export is
    of the step's own state, never of a fresh one, as TF's `recover_session`)."""
    return (
        f"step {step} of job {storage.job!r} was evaluated, but its checkpoint is no longer "
        f"committed in {_checkpoints(storage)} (retention removed it?): nothing to export; "
        "export a step that still has its checkpoint, or keep evaluated steps "
        "(CheckpointSpec.keep_last, keep_until_evaluated)"
    )


def _checkpoints(storage) -> str:
    return _shown(storage.remote_checkpoint_url or storage.checkpoint_dir)


def _shown(url: str) -> str:
    from prefect_jax.training.redaction import redact_url

    return redact_url(url)


def why_not_exportable(storage, job: str, step: int, eval_name: str, evaluated: list[int]) -> str:
    """Why `step` of a job (`JobStorage`) has no evaluation to export (`evaluated`: the steps
    that have one), with the fix that applies: a step not committed, one kept only to resume
    from (a preemption's checkpoint, a backup: never evaluated), or one to evaluate first."""
    have = f"{eval_name!r} has {evaluated}"
    committed = job_committed_steps(storage)
    if step not in committed:
        return (
            f"step {step} of job {job!r} is not committed (not yet, or retention removed it; "
            f"committed: {committed or 'none'}): nothing to export; export an evaluated step "
            f"({have}), or wait for it ({WAIT_HINT})"
        )
    meta = step_meta(storage, step) or {}
    if meta.get("backup") or meta.get("preemption"):
        kind = "a backup" if meta.get("backup") else "a preemption's checkpoint"
        return (
            f"step {step} of job {job!r} is {kind}, kept to resume from: never evaluated or "
            f"exported; export an evaluated step ({have})"
        )
    return f"step {step} of job {job!r} was not evaluated ({have}): evaluate it first"


def refuse_empty_export(storage, eval_name: str, step: int | None, shown: str) -> None:
    """Refuse, before the export's flow run starts, an export of a job (`JobStorage`) that the
    flow would refuse for want of an evaluated step (`facade.check_export`; reads the storage
    only). `shown`: the storage as the user gave it, for a storage error's message.

    Raises:
        BadInputError: There is nothing to export (`export_refusal` says why and what to do).
    """
    from prefect_jax.training.evaluation import EvalRecords
    from prefect_jax.training.preflight import BadInputError, storage_errors

    with storage_errors(storage, shown):
        records = EvalRecords(storage, eval_name)
        refusal = export_refusal(storage, records, step, records.steps())
    if refusal is not None:
        raise BadInputError(refusal)


def why_not_exported(exporter, storage, result, max_steps: int | None) -> str:
    """Why `exporter` (an `ExporterSpec`) holds no export of `result`'s step after the export
    ran (an export asked for by step that writes nothing said nothing of why). Reads the best
    exporter's ``best.json`` as it is (one written before it recorded every metric too), and
    changes nothing."""
    from prefect_jax.training.exporters import best_path
    from prefect_jax.training.records import DamagedRecordError, read_record
    from prefect_jax.training.specs import BestExporter, FinalExporter

    step = int(result.step)
    if isinstance(exporter, FinalExporter):
        if max_steps is None:
            return "the job trains until stopped (no max_steps): it has no final step"
        return f"step {step} is not the job's final step (max_steps={max_steps})"
    if isinstance(exporter, BestExporter):
        try:
            best = read_record(storage, best_path(storage, exporter.name))
        except DamagedRecordError:
            best = None
        if best is None or best.get("step") == step:
            return f"step {step} does not beat the job's other evaluations"
        if exporter.compare_fn:
            judged = f"by {exporter.compare_fn}"
        else:
            m = exporter.metric
            theirs = best.get("value") if best.get("metric") == m else None
            theirs = theirs if theirs is not None else (best.get("metrics") or {}).get(m)
            mine = result.metrics.get(m)
            judged = f"by {m} ({exporter.mode}): {_number(mine)} against {_number(theirs)}"
        return f"step {step} does not beat the best so far, step {best.get('step')}, {judged}"
    keep = getattr(exporter, "keep", None)
    return f"its keep={keep} pruned it (the newest steps' are kept)" if keep else "not known"


def _number(value) -> str:
    return f"{value:.4g}" if isinstance(value, int | float) else str(value)
