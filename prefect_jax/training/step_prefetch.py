"""The newest committed step of a job on object storage, downloaded before its restore asks.

On storage Orbax cannot write (``s3://``, ``az://``, ...: `prefect_jax.training.remote`), a restore
first downloads the step into the job's local stage, after the flow run has started and its
restore task has taken the lease. A rerun on a new machine (a preempted spot node's
replacement) has nothing staged, so that download is on its way back to training. A
``prefect-jax run`` that begins its head start (`prefect_jax.training.head_start`) `begin`s the
same download there, on a thread of its own, so that it runs beside Prefect's import of the flow
run's modules, the flow run's start and the restore task's set-up, as the compile does. The
restore then finds the copy in place: `RemoteSteps.download` reuses a copy of the same upload.

It only reads the storage: it lists the committed steps and copies the newest into the local
stage (into a hidden sibling, then one rename), which is what the restore would do; no lease is
needed for that. Every download into the local stage of this process waits for the prefetch
there to end first (`wait`, from `JobCheckpoints.fetch`): two downloads of one step must not run
at once. (Another process's download of the same upload, a second command of the job started
beside this one, is left in place: `RemoteSteps.download`.) A failure is logged at debug level
and left to the restore, which meets it again and reports it. A step that is not the one
restored after all (it fails its checks, the job was finished) costs its download and its disk in
the stage, as a restore's own download of it would. The thread does not hold the process's exit:
a command refused before its restore does not wait for a step it will not read (what a cut
download leaves is its hidden sibling, never a step).
"""

from __future__ import annotations

import logging
import os
import threading
from typing import TYPE_CHECKING

from prefect_jax.training.redaction import redact_url

if TYPE_CHECKING:
    from prefect_jax.training.storage import JobStorage

logger = logging.getLogger("prefect_jax.trainer")

THREAD_NAME = "prefect-jax-step-prefetch"
_running: dict[str, threading.Thread] = {}  # a local stage -> the download into it
_lock = threading.Lock()


def begin(storage: JobStorage) -> bool:
    """Start downloading the newest committed step of `storage`'s job into its local stage, where
    its steps live on storage Orbax cannot write; whether a download began (none for local disk
    or ``gs://``, which Orbax reads itself, nor beside one already under way)."""
    url = storage.remote_checkpoint_url
    if url is None:
        return False
    stage = os.path.abspath(storage.checkpoint_dir)
    thread = threading.Thread(
        target=_download,
        args=(url, dict(storage.storage_options), stage),
        name=THREAD_NAME,
        daemon=True,
    )
    with _lock:
        if stage in _running and _running[stage].is_alive():
            return False
        _running[stage] = thread
        try:
            thread.start()
        except RuntimeError:  # (no thread to be had: the restore downloads, as without one)
            del _running[stage]
            raise
    return True


def wait(stage: str) -> None:
    """Return once no prefetch of this process is downloading into local stage `stage`."""
    key = os.path.abspath(stage)
    with _lock:
        thread = _running.get(key)
    if thread is None:
        return
    thread.join()
    with _lock:
        if _running.get(key) is thread:
            del _running[key]


def _download(url: str, storage_options: dict, stage: str) -> None:
    from prefect_jax.training.remote import RemoteSteps

    try:
        RemoteSteps(url, storage_options).download_latest(stage)
    except Exception:  # noqa: BLE001 - the restore downloads again and reports what fails
        logger.debug("no step prefetched from %s", redact_url(url), exc_info=True)


__all__ = ["begin", "wait"]
