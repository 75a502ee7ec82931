"""The cluster a job trains on: TensorFlow's ``TF_CONFIG``, for JAX processes.

One JAX process per host (or per GPU), all running the same program in lockstep (SPMD):
`jax.distributed.initialize` joins them, `Loop` trains data-parallel over every process's
devices, Orbax writes each process's part of a checkpoint and Grain's iterator state is saved
per process, in the same step. Process 0 is the chief: it alone holds the job's lease, writes
eval records and exports and talks to MLflow (`Job.is_primary`).

Where the cluster comes from, first match wins (`from_env`):

1. ``PREFECT_JAX_NUM_PROCESSES`` (> 1) with ``PREFECT_JAX_COORDINATOR_ADDRESS`` (``host:port``
   of process 0) and the process id in ``PREFECT_JAX_PROCESS_ID``, or else
   ``JOB_COMPLETION_INDEX`` (a Kubernetes Indexed Job or JobSet sets it per pod).
2. ``CLUSTER_SPEC`` (Vertex AI custom jobs with several replicas) or ``TF_CONFIG`` (what
   TensorFlow jobs already carry): the first host of the first pool (``workerpool0`` or
   ``chief``) coordinates; processes are numbered pool by pool.
3. ``PREFECT_JAX_NUM_PROCESSES=auto``: JAX's own cluster detection (``jax.distributed.initialize()``
   with no arguments: SLURM's ``srun`` tasks, Open MPI, a Cloud TPU slice). Opt-in: a single run
   started inside a SLURM allocation of several tasks stays one process.
4. Nothing: one process.

Example:
    ```python
    cluster = from_env({"PREFECT_JAX_NUM_PROCESSES": "2", "PREFECT_JAX_PROCESS_ID": "1",
                        "PREFECT_JAX_COORDINATOR_ADDRESS": "10.0.0.5:8476"})
    print(cluster)  # 2 processes, this is process 1, coordinator 10.0.0.5:8476 (PREFECT_JAX_*)
    ```

This module imports nothing of JAX: a process reads its cluster before JAX starts.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass

NUM_PROCESSES = "PREFECT_JAX_NUM_PROCESSES"
PROCESS_ID = "PREFECT_JAX_PROCESS_ID"
COORDINATOR = "PREFECT_JAX_COORDINATOR_ADDRESS"
DEFAULT_PORT = 8476  # JAX's documented default coordinator port


class ClusterConfigError(ValueError):
    """The environment describes a cluster that cannot be joined (the message names the
    variable)."""


@dataclass(frozen=True)
class ClusterConfig:
    """Who trains a job together: `num_processes` JAX processes, this one `process_id`.

    `coordinator_address` is process 0's ``host:port``. `auto` leaves the three to JAX's own
    detection (SLURM, Open MPI, Cloud TPU). `source` says where they came from.
    """

    num_processes: int | None
    process_id: int | None
    coordinator_address: str | None
    source: str
    auto: bool = False

    def __str__(self) -> str:
        if self.auto:
            return f"a cluster JAX detects itself ({self.source})"
        return (
            f"{self.num_processes} processes, this is process {self.process_id}, coordinator "
            f"{self.coordinator_address} ({self.source})"
        )


def _int(env: Mapping[str, str], name: str, fix: str) -> int:
    raw = env.get(name, "")
    try:
        return int(raw)
    except ValueError:
        raise ClusterConfigError(f"{name}={raw!r} is not an integer: {fix}") from None


def _address(value: str, name: str) -> str:
    host, _, port = value.rpartition(":")
    if not host:
        return f"{value}:{DEFAULT_PORT}"
    if not port.isdigit():
        raise ClusterConfigError(
            f"{name}={value!r} is not host:port (for example 10.0.0.5:{DEFAULT_PORT})"
        )
    return value


def _checked(n: int, pid: int, coordinator: str, source: str, pid_name: str) -> ClusterConfig:
    if n < 1:
        raise ClusterConfigError(
            f"{NUM_PROCESSES}={n}: the number of JAX processes must be at least 1"
        )
    if not 0 <= pid < n:
        raise ClusterConfigError(
            f"{pid_name}={pid} is outside 0..{n - 1} for {n} processes: number the processes 0 to "
            f"{n - 1} (process 0 coordinates and writes MLflow, eval records and exports)"
        )
    return ClusterConfig(n, pid, coordinator, source)


# TF's task types (its executor's run_<type>) and Vertex AI's worker pools.
TASK_TYPES = (
    "chief",
    "master",
    "worker",
    "ps",
    "evaluator",
    "workerpool0",
    "workerpool1",
    "workerpool2",
    "workerpool3",
)


def _from_spec(raw: str, name: str) -> ClusterConfig | None:
    """``CLUSTER_SPEC`` (Vertex AI) or ``TF_CONFIG``: ``{"cluster": {pool: [host:port, ...]},
    "task": {"type", "index"}}``."""
    try:
        spec = json.loads(raw)
        cluster, task = spec["cluster"], spec["task"]
        # The training pools only: Vertex's workerpool2 (parameter or reduction servers) and
        # workerpool3 (evaluators), TF's ps and evaluator tasks are not JAX training processes.
        pools = [
            p for p in ("chief", "master", "workerpool0", "worker", "workerpool1") if cluster.get(p)
        ]
        kind, index = task["type"], int(task.get("index", 0))
    except (ValueError, KeyError, TypeError) as exc:
        raise ClusterConfigError(
            f"{name} is not a cluster spec with 'cluster' and 'task' ({exc!r}): {raw[:200]!r}"
        ) from None
    if kind == "local":  # as TF's train_and_evaluate refuses it
        raise ClusterConfigError(
            f"{name}: task type 'local' is not a cluster task; for one process, leave 'cluster' "
            f"and 'task' out of {name} (or unset it)"
        )
    if kind not in TASK_TYPES:
        raise ClusterConfigError(
            f"{name}: task type {kind!r} is not supported; supported task types are "
            f"{list(TASK_TYPES)}"
        )
    if not pools or kind not in pools:
        return None  # an evaluator or parameter server: trains alone, if at all
    hosts = [h for p in pools for h in cluster[p]]
    if len(hosts) < 2:
        return None
    pid = sum(len(cluster[p]) for p in pools[: pools.index(kind)]) + index
    return _checked(len(hosts), pid, _address(hosts[0], name), name, f"{name} task index")


def from_env(env: Mapping[str, str] | None = None) -> ClusterConfig | None:
    """The cluster this process belongs to, from its environment (see the module); None: one
    process.

    Raises:
        ClusterConfigError: a variable is malformed or inconsistent; the message names it.
    """
    env = os.environ if env is None else env
    if env.get(NUM_PROCESSES, "").strip().lower() == "auto":
        return ClusterConfig(
            None, None, None, "JAX's cluster detection (SLURM, Open MPI, Cloud TPU)", auto=True
        )
    if env.get(NUM_PROCESSES):
        n = _int(
            env,
            NUM_PROCESSES,
            "set it to the number of JAX processes that train the job together, or 'auto'",
        )
        if n == 1:
            return None
        if env.get(PROCESS_ID):
            pid, pid_name, source = (
                _int(env, PROCESS_ID, "set it to this process's index, 0 to N-1"),
                PROCESS_ID,
                "PREFECT_JAX_*",
            )
        elif env.get("JOB_COMPLETION_INDEX"):
            pid_name, source = "JOB_COMPLETION_INDEX", "Kubernetes indexed job"
            pid = _int(env, pid_name, "it is set by Kubernetes for completionMode: Indexed")
        else:
            raise ClusterConfigError(
                f"{NUM_PROCESSES}={n} but this process's index is unknown: set {PROCESS_ID} (0 to "
                f"{n - 1}), or run it as a pod of a Kubernetes Indexed Job (JOB_COMPLETION_INDEX)"
            )
        if not env.get(COORDINATOR):
            raise ClusterConfigError(
                f"{NUM_PROCESSES}={n} but {COORDINATOR} is not set: set it to process 0's "
                f"host:port, for example localhost:{DEFAULT_PORT} on one machine, or "
                f"<job>-0.<headless service>:{DEFAULT_PORT} on Kubernetes"
            )
        return _checked(n, pid, _address(env[COORDINATOR], COORDINATOR), source, pid_name)
    for name in ("CLUSTER_SPEC", "TF_CONFIG"):
        if env.get(name):
            found = _from_spec(env[name], name)
            if found is not None:
                return found
    return None


def leads_from_env(env: Mapping[str, str] | None = None) -> bool:
    """Whether this process is process 0 of its job (or its only one), from the environment alone
    (no JAX): the process that writes the job's MLflow run. True when JAX would have to tell
    (``auto``) or a variable is malformed (the trainer's own start reports that)."""
    try:
        cluster = from_env(env)
    except ClusterConfigError:
        return True
    return cluster is None or cluster.process_id in (None, 0)


def pod_process_id(
    environ: MutableMapping[str, str],
    processes: int | None = None,
    service: str | None = None,
    coordinator_port: int = DEFAULT_PORT,
) -> int | None:
    """This pod's process index in a multi-process job, from its environment; None: one process.

    Completes `environ` first: ``PREFECT_JAX_NUM_PROCESSES`` from `processes` (unless set), and,
    for more than one process with no coordinator set, process 0's address in a Kubernetes
    indexed job, ``<JOB_NAME>-0.<service>:<coordinator_port>``.

    Raises:
        ValueError: `processes` is below 1, no coordinator can be found, or the environment asks
            JAX to find the cluster (``auto``), which must not be left to it here.
        ClusterConfigError: A variable is malformed (a ``ValueError``).
    """
    if processes is not None and processes < 1:
        raise ValueError(f"--processes={processes}: the number of JAX processes must be 1 or more")
    if processes is not None:
        environ.setdefault(NUM_PROCESSES, str(processes))
    if not environ.get(COORDINATOR) and (processes or 1) > 1:
        if not environ.get("JOB_NAME") or not service:
            raise ValueError(
                f"no coordinator address: set {COORDINATOR} (process 0's host:port), or "
                "run in an indexed job's pod with JOB_NAME (the job's name, from the downward "
                "API) and --service (its headless service)"
            )
        environ[COORDINATOR] = f"{environ['JOB_NAME']}-0.{service}:{coordinator_port}"
    found = from_env(environ)
    if found is not None and found.auto:
        raise ValueError(
            f"{NUM_PROCESSES}=auto: 'prefect-jax process' must know before JAX starts "
            "which process runs the flow run; set PREFECT_JAX_PROCESS_ID, or run "
            "'prefect-jax run' in each task (as with srun) instead"
        )
    return None if found is None else found.process_id
