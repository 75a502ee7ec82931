"""The publisher's refresh policy, on its own (the flows' use of it: tests/test_flow.py)."""

from __future__ import annotations

import threading

import pytest

from prefect_jax.tasks.publish import _Publisher


@pytest.mark.parametrize(("refresh_secs", "expected"), [("0", [0, 1, 2]), ("3600", [2])])
def test_refreshes_queued_behind_a_slow_call_run_each_only_with_refresh_0(
    prefect_server, monkeypatch, refresh_secs, expected
):
    """With PREFECT_JAX_UI_REFRESH_SECS=0 every change is shown, even when the publisher falls
    behind (a slow round trip to a busy server) and newer ones of the key queue up behind it;
    otherwise only the newest of those runs (they show the latest state only)."""
    monkeypatch.setenv("PREFECT_JAX_UI_REFRESH_SECS", refresh_secs)
    publisher, gate, ran = _Publisher(), threading.Event(), []
    publisher.submit(gate.wait, 30)  # the slow call ahead
    for version in range(3):
        publisher.refresh("results-table", ran.append, version)
    gate.set()
    assert publisher.flush(30)
    assert ran == expected


def test_a_going_process_waits_a_round_trip_at_most_for_an_api_that_does_not_answer(
    prefect_server,
):
    """After a SIGTERM's notice (`hurry`: checkpoint, MLflow run and lease are done), a flush
    behind a call the Prefect API never answers gives up after `HURRIED_FLUSH_SECS`, not after
    its own timeout: the machine's grace period is not spent on the UI's cards."""
    import time

    from prefect_jax.tasks.publish import HURRIED_FLUSH_SECS

    publisher, gate = _Publisher(), threading.Event()
    publisher.submit(gate.wait, 60)  # (an API that does not answer)
    assert not publisher.flush(0.1)
    publisher.hurry()
    began = time.monotonic()
    assert not publisher.flush(60)
    assert time.monotonic() - began < HURRIED_FLUSH_SECS + 5
    gate.set()
    assert publisher.flush(30)  # (the call did run, late)


def test_two_jobs_of_one_name_on_two_storages_have_their_own_artifact_keys(tmp_path):
    """Keyed artifacts keep one history per key in Prefect's Artifacts page: a second `digits`
    on another storage must not show as a version of the first's results or goodput."""
    from prefect_jax.tasks.publish import job_artifact_key
    from prefect_jax.training.registry import default_registered_model

    here, there = str(tmp_path / "a"), "s3://bucket/runs"
    assert job_artifact_key("digits", here, "goodput") != job_artifact_key(
        "digits", there, "goodput"
    )
    long = "j" * 120  # (names up to 128: the digits and the part stay, the name is cut)
    keys = {job_artifact_key(long, here, part) for part in ("goodput", "mlflow-run", "e-results")}
    assert len(keys) == 3 and all(len(k) <= 100 for k in keys), keys
    # the same job on the same root named another way: one key (its registered model's name)
    assert job_artifact_key("Digits", here + "/", "eval-results") == (
        default_registered_model("Digits", here).lower() + "-eval-results"
    )
