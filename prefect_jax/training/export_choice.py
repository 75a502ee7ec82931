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
    evaluated = EvalRecords(storage, "eval").steps()       # [20, 40]
    print(export_refusal(storage, "digits", "eval", 30, evaluated))
    # step 30 of job 'digits' is not committed (...): nothing to export; ...
    ```
"""

from __future__ import annotations

from prefect_jax.training.steps import job_committed_steps, step_meta

WAIT_HINT = "--wait-for-checkpoint; a flow's wait_for_checkpoint"
LONGER_HINT = "--max-wait-secs; a flow's max_wait_secs"


def export_refusal(
    storage, job: str, eval_name: str, step: int | None, evaluated: list[int], waited: str = ""
) -> str | None:
    """Why an export of `step` (None: the newest evaluated one) of a job (`JobStorage`) has
    nothing to export, with the fix; None where the step has an evaluation. `evaluated`: the
    steps evaluated under `eval_name`; `waited`: what the caller waited, for the message."""
    if step is not None:
        if step in evaluated:
            return None
        return why_not_exportable(storage, job, step, eval_name, evaluated)
    if evaluated:
        return None
    wait = f"wait longer ({LONGER_HINT})" if waited else f"wait for it ({WAIT_HINT})"
    if not job_committed_steps(storage):  # (a listing: nothing is restored, nothing made)
        from prefect_jax.training.redaction import redact_url

        where = redact_url(storage.remote_checkpoint_url or storage.checkpoint_dir)
        missing = storage.no_such_job_said()  # (a mistyped name: the names there)
        where += f" ({missing})" if missing else ""
        return (
            f"job {job!r} has no committed checkpoint in {where}{waited}: nothing to export; "
            "train it first (the train or train_and_evaluate flow, with the same storage and "
            f"job), then evaluate it; or {wait}"
        )
    return (
        f"job {job!r} has no evaluated step yet (eval name {eval_name!r}){waited}: evaluate it "
        f"first, or {wait}"
    )


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
        evaluated = EvalRecords(storage, eval_name).steps()
        refusal = export_refusal(storage, storage.job, eval_name, step, evaluated)
    if refusal is not None:
        raise BadInputError(refusal)
