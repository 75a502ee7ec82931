"""What the MLflow registry already holds for a job, found again by tags: its versions, the
model logged for a step, and one survivor where a resent create made two.

MLflow's client sends a request again when its answer is lost (a 5xx, a read timeout), so one
create can make two: two versions of a step, or two logged models. Each create here is followed
by a search that keeps the first and deletes the other, which is empty or unaliased.

Searches filter by tag in the store and read every page: many jobs may share a registered
model's name, and one run logs a model per exported step (thousands on a long job).
"""

from __future__ import annotations

import logging
from typing import Any

from prefect_jax.training.mlflow_client import filter_literal
from prefect_jax.training.names import CREATE_TAG, JOB_TAG, STEP_TAG

logger = logging.getLogger("prefect_jax.registry")


def _every_page(search, page_size: int) -> list:
    found, token = [], None
    while True:
        page = search(max_results=page_size, page_token=token)
        found.extend(page)
        token = page.token
        if not token:
            return found


def job_versions(client, name: str, job_key: str) -> dict[int, Any]:
    """``{step: ModelVersion}`` of the registered model's versions made by this job."""
    found: dict[int, Any] = {}
    for v in versions_of_job(client, name, job_key):
        found.setdefault(int(v.tags[STEP_TAG]), v)  # a step's first (see `one_version`)
    return found


def versions_of_job(client, name: str, job_key: str, page_size: int = 1000) -> list:
    """The versions of `name` this job registered, oldest first. A search that fails raises:
    read as "none registered", every step would be registered again."""
    query = f"name = {filter_literal(name)} AND tags.`{JOB_TAG}` = {filter_literal(job_key)}"
    versions = _every_page(
        lambda **page: client.search_model_versions(query, **page), page_size=page_size
    )
    mine = [v for v in versions if STEP_TAG in v.tags]
    return sorted(mine, key=lambda v: int(v.version))


def one_version(client, name: str, job_key: str, step: int, made):
    """The version of `step` after `made` was created for it: the step's first version is kept,
    later ones without an alias deleted. (A search's versions carry no aliases on a SQL store:
    they are read from the model.)"""
    from mlflow.exceptions import MlflowException

    of_step = [v for v in versions_of_job(client, name, job_key) if v.tags[STEP_TAG] == str(step)]
    if len(of_step) < 2:
        return of_step[0] if of_step else made
    aliased = {str(v) for v in (client.get_registered_model(name).aliases or {}).values()}
    for extra in of_step[1:]:
        if str(extra.version) in aliased:
            continue
        try:
            client.delete_model_version(name, extra.version)
        except MlflowException as exc:  # (EDIT without MANAGE, say): a twin, left as it is
            logger.warning("%s version %s, a twin, not deleted: %r", name, extra.version, exc)
    return of_step[0]


def _logged_models(client, experiment_id: str, run_id: str, tags: dict[str, str]) -> list:
    """The run's logged models carrying `tags`, oldest first."""
    query = " AND ".join(
        [f"source_run_id = {filter_literal(run_id)}"]
        + [f"tags.`{k}` = {filter_literal(v)}" for k, v in tags.items()]
    )
    found = _every_page(
        lambda **page: client.search_logged_models([experiment_id], filter_string=query, **page),
        page_size=100,
    )
    return sorted(found, key=lambda m: (m.creation_timestamp or 0, m.model_id))


def logged_model_of_step(client, experiment_id: str, run_id: str, step: int):
    """The MLflow Model of `step` already logged to the run (by a process that died before
    registering it): one with its files."""
    for model in _logged_models(client, experiment_id, run_id, {STEP_TAG: str(step)}):
        if model.status.name in ("READY", "PENDING") and _has_artifacts(client, model):
            return model
    return None


def one_logged_model(client, experiment_id: str, run_id: str, create_key: str, made):
    """The logged model to fill after `made` was created with ``{CREATE_TAG: create_key}``: the
    first that create made. A resend's twin (the same key, still empty) is deleted."""
    from mlflow.exceptions import MlflowException

    twins = _logged_models(client, experiment_id, run_id, {CREATE_TAG: create_key})
    if len(twins) < 2:
        return made
    for extra in twins[1:]:
        try:
            client.delete_logged_model(extra.model_id)
        except MlflowException as exc:  # (permissions, say): an empty twin, left as it is
            logger.warning("logged model %s, a twin, not deleted: %r", extra.model_id, exc)
    return twins[0]


def _has_artifacts(client, model) -> bool:
    try:
        return any(f.path == "MLmodel" for f in client.list_logged_model_artifacts(model.model_id))
    except Exception:  # noqa: BLE001
        return False
